"""Cuts at a position in program order: one boundary marker on everything live across it.

Two things cut a forward graph at a position rather than at the values a `stage_boundary` call
names: the automatic partition (`stages=N`, partition.py) and torch.distributed.pipelining's
`pipe_split()` calls. Both end here, as ordinary markers, so that stage counting, the split, the
schedule and the gradients see one kind of cut.

# NOTE [pipe_split]
`torch.distributed.pipelining.pipe_split()` takes no tensor: it is the op `pippy::_pipe_split`,
`() -> ()`, a no-op when run (eagerly, under `torch.func.grad` and `vmap` alike), which make_fx
records in program order. Its meaning in torch.distributed.pipelining is "the work after this
call runs on the next stage". `trace_forward` turns each such node of the (functional) forward
graph into a marker on every value computed from the data before it and read after it (data
inputs read after it included), at its place, exactly as an automatic cut there would be:
`pipe_split()` after `h = block(x)` makes the stages, programs and gradients of
`h = stage_boundary(block(x))` when only `h` is read further on. Work that depends only on
parameters and constants (a buffer's copy, a weight's transpose) does not cross: each stage that
reads it computes it (NOTE [how nodes are placed] in split.py). The rewrite runs on the
functional graph, so an in-place update after the call is applied to the crossing value, as it
would be eagerly. `pipe_split()` and `stage_boundary` may be mixed (each adds one stage on the
paths it cuts); `pipe_split()` with `cuts=` is refused, like `stage_boundary` with `cuts=`.
Inside a `torch.func.grad` that the function itself takes, the cut stays where it was called in
program order: the inner backward comes after it, so it runs on the later stage, as it does
through a `stage_boundary` (forward work never flows to a lower stage). A tensor-parallel
function's joint graph is traced in one piece (tp.py), where a position is not a stage, so
`pipe_split()` there is refused.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx

from .marker import BOUNDARY

__all__ = ["activations", "insert_marker", "is_pipe_split", "pipe_splits_to_markers", "refuse_pipe_splits"]


def is_pipe_split(node: fx.Node) -> bool:
    """Is `node` a call of torch.distributed.pipelining's `pipe_split()` (NOTE [pipe_split])?"""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target.name() == "pippy::_pipe_split"
    )


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def activations(nodes: list[fx.Node], n_params: int, n_data: int) -> set[fx.Node]:
    """Nodes that depend on the data inputs (the rest can be recomputed by any stage)."""
    phs = [n for n in nodes if n.op == "placeholder"]
    act = set(phs[n_params : n_params + n_data])
    for n in nodes:
        if n.op == "call_function" and any(d in act for d in n.all_input_nodes):
            act.add(n)
    return act


def insert_marker(
    graph: fx.Graph, nodes: list[fx.Node], index: dict[fx.Node, int], act: set[fx.Node], i: int
) -> int:
    """A boundary marker before `nodes[i]` on every activation computed before it and read at or
    after it; returns how many values cross. Cuts are inserted last first (`index` holds the
    positions before any insertion; a node not in it counts as after every cut)."""
    # Data inputs read after the cut cross it too: otherwise work that reads only inputs would be
    # free to sit on an earlier stage, and parallel branches from the inputs could collapse two
    # cuts into one stage.
    crossing = [
        n
        for n in nodes[:i]
        if n in act
        and any(index.get(u, math.inf) >= i for u in n.users)
        and isinstance(_val(n), torch.Tensor)
    ]
    with graph.inserting_before(nodes[i]):
        marker = graph.call_function(BOUNDARY, ([*crossing],))
        outs = [graph.call_function(operator.getitem, (marker, j)) for j in range(len(crossing))]
    for src, out in zip(crossing, outs):
        out.meta["val"] = _val(src)
        src.replace_all_uses_with(
            out, delete_user_cb=lambda u: u is not marker and index.get(u, math.inf) >= i
        )
    return len(crossing)


def pipe_splits_to_markers(call: str, gm: fx.GraphModule, n_params: int, n_data: int) -> None:
    """Replace each `pipe_split()` node of the forward graph `gm` (over `[*params, *data, *consts]`)
    by a marker on what crosses it (NOTE [pipe_split]); refuse one that nothing crosses."""
    graph = gm.graph
    nodes = list(graph.nodes)
    splits = [i for i, n in enumerate(nodes) if is_pipe_split(n)]
    if not splits:
        return
    act = activations(nodes, n_params, n_data)
    index = {n: i for i, n in enumerate(nodes)}
    for k, i in reversed(list(enumerate(splits))):
        if insert_marker(graph, nodes, index, act, i) == 0:
            raise ValueError(
                f"{call}: pipe_split() call {k + 1} of {len(splits)} has no value computed from "
                "the inputs before it that is read after it, so it begins no stage. Call "
                "pipe_split() between two pieces of work on the data (or remove it)."
            )
    for i in splits:
        graph.erase_node(nodes[i])
    gm.recompile()


def refuse_pipe_splits(call: str, gm: fx.GraphModule, where: str) -> None:
    """Refuse `pipe_split()` calls in a graph whose positions are not stages (`where` says why)."""
    n = sum(1 for node in gm.graph.nodes if is_pipe_split(node))
    if n:
        raise ValueError(
            f"{call}: the function calls torch.distributed.pipelining's pipe_split() ({n} "
            f"call(s)), but {where}, so a position in it is not a stage. Mark the stages with "
            "fpipe.stage_boundary(x) on the values that cross, or with cuts= (module paths)."
        )
