"""Rematerialisation: a backward program recomputes values instead of reading them saved.

# NOTE [recomputing in the backward]
A stage's forward program F hands the values its backward needs (the saved activations) to the
backward programs of the same stage (B, or the zero-bubble halves I and W); I hands W the
intermediates both need (split_iw.py). Each such value is held from its producer until its
last reader, once per microbatch in flight. A *drop* `(P, v)` has program P compute `v` itself:
`v`'s producing operations are copied from the producer Q's graph into P, each just before
its first reader there, back to values P has anyway -- Q's own inputs (the stage's input, the
parameters, the data), values P reads and does not drop, for P = B or I, values a later
backward program of the stage reads (held that long anyway), and the values of F the caller
asks to keep (`apply`'s `keep`: the chooser's anchors, F returns them if it did not). Q no
longer returns `v` when
nothing else reads it. This is the mechanism the I/W split uses (a program is a set of
operations cut out of the joint graph), run the other way.

The copies are the traced operations themselves, so the recomputed values are bit-identical:
a random operation (dropout) is a `rng.seeded` call keyed by (step, microbatch, its index in
the joint graph), and its copy in P draws the same mask (NOTE [random-number policy] in
rng.py). Whether an operation may run again, and what a copy may read, is the effects
analysis's answer (NOTE [effects] in effects.py; the walk is remat_walk.py): an operation that
writes is never copied, except BatchNorm in training, copied without its running statistics
(the same outputs, no second update); a copy never reads an input the step writes (a buffer
`self.step.add_(1)` updates) -- the walk stops at the value of F computed from it before the
write, which F returns; collectives and anything not an aten/prims operation are never
copied: a value that needs one is not dropped (`recomputable`).

Regions the user wrapped in `torch.utils.checkpoint` (NOTE [checkpointed regions] in
captured.py) arrive with `meta["recompute"]` on their forward operations: every saved value
such an operation makes is dropped, and a walk that leaves the region stops at the value it
leaves by -- the region's inputs are kept (a new output of F if F did not return it), as
checkpoint keeps them. Which further values to drop under `memory_limit` is remat_choose.py.

The copies go in just before their first readers (`_just_in_time`): a backward reads a
segment's values where it differentiates that segment, so each segment is recomputed right
before its backward and its values die with it (NOTE [recomputing segment by segment] in
remat_segments.py). A process group's runner may run a B program that sends as two halves, the
input gradients (sent at once) and then the weight gradients (run_dist.py, split_iw.py); the I
half would then hand the W half every recomputed value the weight gradients read -- the whole
recomputed forward alive at once. A program that recomputes is marked (`RECOMPUTES` in its
graph module's `meta`) and run whole.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule  # code made at its first run

from ..stages import Place, Program, Staged
from ..tracing import is_mutating
from .remat_walk import copy_node, node_of, recompute_nodes, tagged, value_names, written_names

__all__ = [
    "Drop",
    "Keep",
    "apply",
    "candidates",
    "checkpointed",
    "node_of",
    "recompute_nodes",
    "stops",
    "tagged",
    "written_names",
]

Drop = tuple[Place, str]  # program P recomputes value v
RECOMPUTES = "fpipe_recomputes"  # in the `meta` of a program that recomputes
_BACKWARD = ("B", "I", "W")


def stops(st: Staged, p: Place, dropped: set[str], drops: set[Drop]) -> set[str]:
    """Values P may read instead of recomputing: what it reads and keeps, and (P = B or I)
    what a later backward program of the stage reads and keeps."""
    later = [p] + ([("W", p[1])] if p[0] in ("B", "I") else [])
    out = set()
    for place in later:
        if place in st.programs:
            out |= {n for n in st.programs[place].inputs if (place, n) not in drops}
    return out - dropped


def candidates(st: Staged, stages: Iterable[int]) -> list[Drop]:
    """Every (P, v) a backward program of `stages` could recompute: v made by the stage's F (or
    I, for W) and not a step output, all of its operations recomputable."""
    returned, written = set(st.out_names), written_names(st)
    out = []
    for s in stages:
        for kind in _BACKWARD:
            prog = st.programs.get((kind, s))
            if prog is None:
                continue
            for v in prog.inputs:
                q = st.producer.get(v)
                if q is None or q[1] != s or q == prog.place or v in returned:
                    continue
                if q[0] == "F" or (q[0] == "I" and kind == "W"):
                    walk = recompute_nodes(
                        st.programs[q], [v], stops(st, prog.place, {v}, set()), written=written
                    )
                    if walk.ok and walk.copy:
                        out.append((prog.place, v))
    return out


def checkpointed(st: Staged) -> list[Drop]:
    """The drops `torch.utils.checkpoint` asks for: saved values made inside a region."""
    out = []
    for (kind, s), prog in st.programs.items():
        if kind not in _BACKWARD:
            continue
        f = st.programs.get(("F", s))
        if f is None:
            continue
        nodes = node_of(f)
        for v in prog.inputs:
            n = nodes.get(v) if st.producer.get(v) == ("F", s) else None
            if n is not None and n.op == "call_function" and tagged(n):
                out.append((prog.place, v))
    return out


Memo = dict[Any, Any]
Keep = dict[int, frozenset[str]]  # per stage: values of its F a recomputation stops at


def apply(base: Staged, drops: Iterable[Drop], memo: Memo | None = None, keep: Keep | None = None) -> Staged:
    """`base` with each drop's value recomputed in its program (NOTE [recomputing in the
    backward]), back to the nearest values kept: `keep[s]` names values of stage s's F the
    recomputation stops at (F returns them if it did not). Drops whose value needs an operation
    that cannot run again are left out. `memo` (one per `base`) keeps each stage's rewrite by
    its drops and keeps: they change only the stage's own programs (and who reads its inputs),
    so a choice that changes one stage rewrites one."""
    memo = {} if memo is None else memo
    drops, keep = set(drops), keep or {}
    programs = dict(base.programs)
    consumers = {k: list(v) for k, v in base.consumers.items()}
    producer = dict(base.producer)
    for s in sorted({p[1] for p, _ in drops}):
        key = (s, frozenset(d for d in drops if d[0][1] == s), keep.get(s, frozenset()))
        if key not in memo:
            memo[key] = _stage_rewrite(base, set(key[1]), key[2])
        progs, added, removed, made = memo[key]
        programs.update(progs)
        producer.update(made)
        for name, place in removed:
            consumers[name] = [c for c in consumers.get(name, []) if c != place]
        for name, place in added:
            consumers.setdefault(name, []).append(place)
    returned = set(base.out_names)
    for q, prog in list(programs.items()):  # a value nobody reads any more is not returned
        gone = frozenset(n for n in prog.outputs if not consumers.get(n) and n not in returned)
        if gone:
            out_key = ("outputs", id(prog), gone)
            if out_key not in memo:
                memo[out_key] = (prog, _without_outputs(prog, set(gone)))  # (prog: keeps its id)
            programs[q] = memo[out_key][1]
            for n in gone:
                consumers.pop(n, None)
                producer.pop(n, None)
    return dataclasses.replace(base, programs=programs, consumers=consumers, producer=producer)


def _stage_rewrite(
    base: Staged, drops: set[Drop], keep: frozenset[str]
) -> tuple[dict[Place, Program], list[Any], list[Any], dict[str, Place]]:
    """One stage's drops applied: its new programs, the (value, reader) pairs added and removed,
    and the values its programs newly return."""
    st = dataclasses.replace(
        base,
        programs=dict(base.programs),
        consumers={k: list(v) for k, v in base.consumers.items()},
        producer=dict(base.producer),
    )
    by_p: dict[Place, set[str]] = defaultdict(set)
    for p, v in drops:
        by_p[p].add(v)
    order = {"B": 0, "I": 0, "W": 1}
    for p in sorted(by_p, key=lambda p: order[p[0]]):  # W after I: it may read I's new values
        _recompute_in(st, p, by_p[p], drops, keep)
    progs = {k: v for k, v in st.programs.items() if base.programs.get(k) is not v}
    added, removed = [], []
    for name in {*st.consumers, *base.consumers}:
        old, new = base.consumers.get(name, []), st.consumers.get(name, [])
        added += [(name, c) for c in new if c not in old]
        removed += [(name, c) for c in old if c not in new]
    made = {k: v for k, v in st.producer.items() if k not in base.producer}
    return progs, sorted(added), sorted(removed), made


def _recompute_in(st: Staged, p: Place, names: set[str], drops: set[Drop], keep: frozenset[str]) -> None:
    """Rewrite P (and Q, where it must return a region input) in `st`'s dicts, in place."""
    prog = st.programs[p]
    by_q: dict[Place, list[str]] = defaultdict(list)
    for v in sorted(names):
        by_q[st.producer[v]].append(v)
    g, val_map = _placeholders_first(prog.gm)
    phs = {name: val_map[n] for name, n in zip(prog.inputs, prog.gm.graph.find_nodes(op="placeholder"))}
    inputs = list(prog.inputs)
    stop = stops(st, p, names, drops)
    for q, vs in by_q.items():
        qprog = st.programs[q]
        walk = recompute_nodes(qprog, vs, stop, keep if q[0] == "F" else frozenset(), written_names(st))
        if not walk.ok:
            continue
        qnames = dict(value_names(qprog))
        env: dict[fx.Node, fx.Node] = {}
        kept = []  # region inputs Q must now return, named as in the joint graph (Q is an F:
        for n in walk.read:  # its graph is never rewritten, so its node names are the joint's)
            if n not in qnames:
                assert q[0] == "F" and n.name in st.meta, n
                qnames[n] = n.name
                kept.append(n)
                st.producer[n.name] = q
            env[n] = _input(g, phs, inputs, qnames[n], n)
            if p not in st.consumers.setdefault(qnames[n], []):
                st.consumers[qnames[n]].append(p)
        if kept:
            st.programs[q] = _with_outputs(qprog, kept, [qnames[n] for n in kept])
        qorder = {n: i for i, n in enumerate(qprog.gm.graph.nodes)}
        first = min((u for v in vs for u in phs[v].users), key=_position(g), default=None)
        if first is None:  # nothing reads them
            walk.copy.clear()
            first = out_node(g)
        copies = []
        with g.inserting_before(first):
            for n in sorted(walk.copy, key=lambda n: qorder.get(n, -1)):
                env[n] = copy_node(g, n, env)
                copies.append(env[n])
        for v in vs:
            if node_of(qprog)[v] in walk.read:  # a region's input as well: kept (and read)
                continue
            ph = phs.pop(v)
            ph.replace_all_uses_with(env[node_of(qprog)[v]])  # qprog: the walked graph
            g.erase_node(ph)
            inputs.remove(v)
            st.consumers[v] = [c for c in st.consumers.get(v, []) if c != p]
        _just_in_time(g, copies)
    g.lint()
    gm = _LazyGraphModule({}, g)
    gm.meta[RECOMPUTES] = True  # NOTE [recomputing in the backward]: not split at run time
    st.programs[p] = dataclasses.replace(prog, gm=gm, inputs=inputs)


def _just_in_time(g: fx.Graph, copies: list[fx.Node]) -> None:
    """Move each copied operation (`copies`, in their order) to just before its first reader:
    P's backward of a segment then recomputes that segment only, right before it, and the
    recomputed values live from there to their last reader, not all from P's first one."""
    pos = _position(g)
    mine = set(copies)
    anchor: dict[fx.Node, fx.Node] = {}
    for n in reversed(copies):
        users = [anchor[u] if u in mine else u for u in n.users]
        anchor[n] = min(users, key=pos, default=out_node(g))
    for n in copies:  # in order: copies before the same reader keep their order
        anchor[n].prepend(n)


def out_node(g: fx.Graph) -> fx.Node:
    return g.find_nodes(op="output")[0]


def _position(g: fx.Graph) -> Any:
    index = {n: i for i, n in enumerate(g.nodes)}
    return lambda n: index[n]


def _input(g: fx.Graph, phs: dict[str, fx.Node], inputs: list[str], name: str, like: fx.Node) -> fx.Node:
    """P's input `name`, a new placeholder (after the others, all at the front) if P did not
    read it."""
    if name in phs:
        return phs[name]
    last = [n for n in g.nodes if n.op == "placeholder"][-1]
    with g.inserting_after(last):
        ph = g.placeholder(name)
    ph.meta.update(like.meta)
    phs[name] = ph
    inputs.append(name)
    return ph


def _placeholders_first(gm: fx.GraphModule) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """A copy of `gm`'s graph with its placeholders (interleaved with the work, split.py) moved
    to the front, in their order: a copied operation may then read any input."""
    g = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    nodes = list(gm.graph.nodes)
    for n in nodes:
        if n.op == "placeholder":
            val_map[n] = g.node_copy(n)
    for n in nodes:
        if n.op == "call_function":
            val_map[n] = g.node_copy(n, lambda d: val_map[d])
    g.output(fx.map_arg(nodes[-1].args[0], lambda d: val_map[d]))
    return g, val_map


def _with_outputs(prog: Program, nodes: list[fx.Node], names: list[str]) -> Program:
    """A copy of `prog` also returning `nodes` (region inputs its backward reads) as `names`."""
    g = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    out = g.graph_copy(prog.gm.graph, val_map)
    g.output([*out, *(val_map[n] for n in nodes)])  # type: ignore[misc]
    return dataclasses.replace(prog, gm=_LazyGraphModule({}, g), outputs=[*prog.outputs, *names])


def _without_outputs(prog: Program, gone: set[str]) -> Program:
    g = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    out = g.graph_copy(prog.gm.graph, val_map)
    keep = [i for i, n in enumerate(prog.outputs) if n not in gone]
    g.output([out[i] for i in keep])  # type: ignore[index]
    g.eliminate_dead_code(is_impure_node=lambda n: n.op in ("placeholder", "output") or is_mutating(n))
    return dataclasses.replace(prog, gm=_LazyGraphModule({}, g), outputs=[prog.outputs[i] for i in keep])
