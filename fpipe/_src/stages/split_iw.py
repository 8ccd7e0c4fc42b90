"""Split a stage's backward program B into I (input gradients) and W (weight gradients).

Zero-bubble schedules run I as soon as it can (the previous stage waits for its outputs) and W
in idle time later. `split_backward` rewrites a `Staged` so chosen stages have I and W programs
instead of B; `backward_parts` gives a B's two halves for a runtime that runs them back to back.
Built on staged.py only; split.py re-exports both names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch.fx as fx

from ..tracing import is_mutating
from .staged import Place, Program, Staged

__all__ = ["backward_parts", "split_backward"]


# NOTE [splitting the backward for zero-bubble schedules]
# A stage's backward program B computes two kinds of output: gradients that other stages wait
# for (the input gradients, on the critical path) and the gradients of its own weights (which
# nothing waits for until the step ends). Dead-code elimination per output set splits B into
# I (everything the input gradients need) and W (the rest of what the weight gradients need).
# The intermediates both need are computed once, in I, and handed to W as saved values: no
# recomputation, at the price of holding them from I until W runs -- the memory a zero-bubble
# schedule trades for its smaller bubble. No per-layer custom autograd is involved: any function
# that traces splits this way.


def split_backward(staged: Staged, stages: Iterable[int]) -> Staged:
    """Replace B of each stage in `stages` by an I (input-gradient) and a W (weight) program."""
    programs = dict(staged.programs)
    producer = dict(staged.producer)
    consumers = {k: list(v) for k, v in staged.consumers.items()}
    for s in stages:
        prog = programs.pop(("B", s), None)
        if prog is None:
            continue
        i_prog, w_prog = _split_program(prog, staged)
        for sub in (i_prog, w_prog):
            programs[sub.place] = sub
            for name in sub.outputs:
                producer[name] = sub.place
        for name, places in consumers.items():
            if ("B", s) in places:
                places.remove(("B", s))
                places.extend(p.place for p in (i_prog, w_prog) if name in p.inputs)
        for name in i_prog.outputs:
            if name in w_prog.inputs:
                consumers.setdefault(name, []).append(w_prog.place)
    return dataclasses.replace(staged, programs=programs, producer=producer, consumers=consumers)


def backward_parts(staged: Staged, place: Place) -> tuple[Program, Program] | None:
    """The B program at `place` as its I and W parts (see the NOTE above), or None when the W
    part would be empty. The runtime can run them back to back and send I's outputs in between."""
    i_prog, w_prog = _split_program(staged.programs[place], staged)
    if not w_prog.outputs or not any(n.op == "call_function" for n in w_prog.gm.graph.nodes):
        return None
    return i_prog, w_prog


def _split_program(prog: Program, staged: Staged) -> tuple[Program, Program]:
    """I and W of `prog` (compiled alike)."""
    s = prog.place[1]
    grads = set(staged.out_names[staged.n_outs :])
    graph = prog.gm.graph
    out_nodes = list(graph.find_nodes(op="output")[0].args[0])  # type: ignore[arg-type]
    by_name = dict(zip(prog.outputs, out_nodes))
    elsewhere = {n for n in prog.outputs if any(c != prog.place for c in staged.consumers.get(n, []))}
    w_outs = [n for n in prog.outputs if n in grads and n not in elsewhere]
    i_outs = [n for n in prog.outputs if n not in w_outs]
    need_i = _ancestors([by_name[n] for n in i_outs] + [n for n in graph.nodes if is_mutating(n)])
    need_w = _ancestors([by_name[n] for n in w_outs])
    w_nodes = [n for n in graph.nodes if n in need_w and n not in need_i and n.op != "placeholder"]
    handed = [
        n for n in graph.nodes if n in need_i and n.op != "placeholder" and any(u in w_nodes for u in n.users)
    ]
    i_prog = _subprogram(
        ("I", s), [n for n in graph.nodes if n in need_i], i_outs + [n.name for n in handed], by_name
    )
    w_prog = _subprogram(("W", s), w_nodes, w_outs, by_name)
    i_prog.compile = w_prog.compile = prog.compile
    return i_prog, w_prog


def _ancestors(roots: list[Any]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _subprogram(place: Place, nodes: list[fx.Node], outputs: list[str], by_name: dict[str, Any]) -> Program:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[str] = []

    def arg(d: fx.Node) -> fx.Node:
        if d not in env:
            env[d] = graph.placeholder(d.name)
            env[d].meta.update(d.meta)
            inputs.append(d.name)
        return env[d]

    for node in nodes:
        if node.op == "placeholder":
            arg(node)
        else:
            env[node] = graph.node_copy(node, arg)
    local = {n.name: n for n in nodes}
    graph.output([env[local[o]] if o in local else env[by_name[o]] for o in outputs])
    return Program(place, fx.GraphModule({}, graph), inputs, outputs)
