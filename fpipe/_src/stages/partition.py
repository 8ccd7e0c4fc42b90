"""Partition: choose stage boundaries automatically from a static cost estimate.

Used when `pipeline(f, stages=N)` is given a function without `stage_boundary` calls. The forward
graph's operations are costed (matrix products by their flops, other operations by the elements
they write, views free), and N - 1 cuts are chosen in program order so that each stage gets about
an equal share: each cut goes where the distance from the ideal share plus the cost of sending
what is live across it (`_BYTE_WEIGHT` per byte) is least, so between two nearly equal positions
the one where less crosses wins. The cuts are written into the graph as ordinary boundary markers on
everything that crosses them (data inputs read later included, so work after cut k is on stage k
or later), so from here on an automatic split is the same as a hand-written one.

With `partition="measure"` the costs are instead each operation's measured forward + backward
time on the device (`measure.py`), rescaled to the same units.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..tracing import Forward, activations, insert_marker, is_mutating
from .split import count_stages

__all__ = ["auto_partition", "node_cost"]

aten = torch.ops.aten
_VIEWS = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select",
    "unsqueeze", "squeeze", "alias", "detach", "as_strided", "split", "chunk", "unbind",
    "split_with_sizes", "clone", "contiguous",
}  # fmt: skip
_ELEMENT_WEIGHT = 4.0  # a written element costs about as much as 4 flops of a matrix product
# A byte that crosses a cut costs about 2 flops (8 per fp32 element: copied out, sent, copied
# in). Small next to compute: a cut moves off a layer boundary only where that balances better.
_BYTE_WEIGHT = 2.0


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def node_cost(node: fx.Node) -> float:
    """Estimated cost of one node, in flop-equivalents."""
    if node.op != "call_function" or node.target is operator.getitem:
        return 0.0
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    out = _val(node)
    outs = out if isinstance(out, (tuple, list)) else [out]
    numel = sum(o.numel() for o in outs if isinstance(o, torch.Tensor))
    if name in ("mm", "bmm", "matmul"):
        return 2.0 * numel * _val(node.args[0]).shape[-1]
    if name in ("addmm", "baddbmm"):
        return 2.0 * numel * _val(node.args[1]).shape[-1]
    if name == "convolution":
        w = _val(node.args[1])
        return 2.0 * numel * (w.numel() // w.shape[0])
    if "scaled_dot_product" in name:
        q, k = _val(node.args[0]), _val(node.args[1])
        return 4.0 * q.numel() * k.shape[-2]
    if name in _VIEWS:
        return 0.0
    return _ELEMENT_WEIGHT * numel


def auto_partition(
    call: str, fwd: Forward, n_stages: int, measure: Callable[[], dict[fx.Node, float]] | None = None
) -> list[float]:
    """Insert `n_stages - 1` boundary markers into `fwd.gm`; return each stage's estimated cost.

    `measure`: returns each node's measured seconds (`measure.measure_costs`), used instead of
    the static estimate (rescaled to its units, so `_BYTE_WEIGHT` keeps its meaning)."""
    graph = fwd.gm.graph
    # dead work is neither costed nor sent between stages; a write is never dead (NOTE [effects])
    graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or is_mutating(n))
    nodes = list(graph.nodes)
    act = activations(nodes, fwd.n_params, fwd.n_data)
    index = {n: i for i, n in enumerate(nodes)}
    cost = [node_cost(n) if n in act else 0.0 for n in nodes]
    if measure is not None:
        seconds = measure()
        timed = [seconds.get(n, 0.0) if n in act else 0.0 for n in nodes]
        if sum(timed) > 0:
            # An operation timed at 0 (under the clock's resolution, or the measuring overhead
            # subtracted) still exists: it keeps a thousandth of its estimate, so it counts as work
            # a stage can hold, as it does without measuring, and every rank sees the same count.
            scale = sum(cost) / sum(timed)
            cost = [max(t * scale, c * 1e-3) for t, c in zip(timed, cost)]
    cum = [0.0]
    for c in cost:
        cum.append(cum[-1] + c)
    total = cum[-1]
    n_ops = sum(1 for n in nodes if n in act and n.op == "call_function" and cost[index[n]] > 0)
    if n_ops < n_stages:
        raise ValueError(
            f"{call}: stages={n_stages} but the function has only {n_ops} operations on its data "
            f"to split; use stages<={max(n_ops, 1)}."
        )
    live_bytes, cuttable = _liveness(nodes, act, index)
    cuts: list[int] = []
    lo = 1
    for k in range(1, n_stages):
        target = total * k / n_stages
        prev = cum[cuts[-1]] if cuts else 0.0
        # every stage gets work: more cost than the previous cut, and some left after this one
        ok = [i for i in range(lo, len(nodes) - 1) if cuttable[i] and prev < cum[i] < total]
        if len(ok) < n_stages - k:
            raise ValueError(f"{call}: cannot cut the function into {n_stages} stages that each have work.")
        ok = ok[: len(ok) - (n_stages - 1 - k)] if n_stages - 1 - k else ok
        best = min(ok, key=lambda i: abs(cum[i] - target) + _BYTE_WEIGHT * live_bytes[i])
        cuts.append(best)
        lo = best + 1
    for i in reversed(cuts):
        insert_marker(graph, nodes, index, act, i)
    fwd.gm.recompile()
    made = count_stages(graph)
    if made != n_stages:  # the markers above make every cut a stage; this guards that reasoning
        raise AssertionError(f"{call}: automatic cuts made {made} stages, not {n_stages}.")
    bounds = [0, *cuts, len(nodes)]
    return [cum[b] - cum[a] for a, b in zip(bounds, bounds[1:])]


def _liveness(
    nodes: list[fx.Node], act: set[fx.Node], index: dict[fx.Node, int]
) -> tuple[list[float], list[bool]]:
    """Per position i (a cut before node i): bytes of activations alive across it, and whether
    every value alive across it is a tensor (a tuple can't cross)."""
    n = len(nodes)
    delta = [0.0] * (n + 1)
    bad = [0] * (n + 1)
    for node in nodes:
        if node not in act or not node.users:
            continue
        last = max(index[u] for u in node.users)
        val = _val(node)
        start, end = index[node] + 1, last + 1
        if isinstance(val, torch.Tensor):
            nbytes = val.numel() * val.element_size()
            delta[start] += nbytes
            delta[end] -= nbytes
        else:
            bad[start] += 1
            bad[end] -= 1
    live, cuttable = [], []
    acc, acc_bad = 0.0, 0
    for i in range(n):
        acc += delta[i]
        acc_bad += bad[i]
        live.append(acc)
        cuttable.append(acc_bad == 0 and acc > 0 and nodes[i].op == "call_function")
    return live, cuttable
