"""Segments of a stage's forward, and what recomputing a set of values costs.

# NOTE [recomputing segment by segment]
A dropped value is recomputed back to the nearest values the backward program has (remat.py).
Left to itself that walk goes back to the stage's inputs, and a backward that recomputes
every value of a stage that way holds the whole forward again at once. So the chooser keeps
the stage's *anchors* (`anchors`): the values after which the forward carries one value and
nothing else it made (a residual stream between two blocks or two halves of a block, the
hidden state of a layer stack) -- or, where every point carries more (a skip connection from
the embedding past every block, an attention mask made from the data), the values after which
it carries the fewest, the others carried past them kept as well. Each recomputation stops at the nearest anchor before it, so
what is dropped between two anchors is recomputed from the first one, one segment at a time,
just before that segment's backward reads it (remat.py moves each copied operation to just
before its first reader) -- what `torch.utils.checkpoint` around every block does, with the
segments found in the graph. Values that depend on no input of the stage but the parameters
and constants (a causal mask) do not count as carried: they are recomputed where read.

A drop is chosen by *units* (`units`): the drops that free one storage of the stage (a value
and the views of it that backward programs read; for a zero-bubble stage, its I and W halves'
reads of it alike), so the bytes a unit frees are the storage's. `Costs` is the estimated cost
(`partition.node_cost`) of the operations a set of drops copies into the backward programs:
a unit's cost is what it adds to those already copied (recomputing `h` after `gelu(h)` was
dropped adds only `h`'s own operations).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.fx as fx

from ..stages import Place, Program, Staged, node_cost
from .memory_graph import id_of, storage_bytes
from .remat import Drop, Keep, stops
from .remat_walk import node_of, recompute_nodes, written_names

__all__ = ["Costs", "Unit", "anchors", "storage_key", "units"]

Unit = frozenset[Drop]


def _storage(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    return id_of(val) if isinstance(val, torch.Tensor) else None


def _activations(st: Staged, f: Program) -> set[fx.Node]:
    """F's nodes that depend on an input of the stage other than the parameters and constants."""
    fixed = {*st.param_inputs, *st.const_inputs}
    act: set[fx.Node] = set()
    for name, n in zip(f.inputs, f.gm.graph.find_nodes(op="placeholder")):
        if name not in fixed:
            act.add(n)
    for n in f.gm.graph.nodes:
        if n.op == "call_function" and any(d in act for d in n.all_input_nodes):
            act.add(n)
    return act


def _returned_views(nodes: list[fx.Node]) -> set[fx.Node]:
    """The output, and the views whose readers are only those: they read nothing that has to
    be carried (a view of a saved value, made for the backward)."""
    out = {nodes[-1]}
    for n in reversed(nodes[:-1]):
        same = n.all_input_nodes and all(_storage(d) == _storage(n) for d in n.all_input_nodes[:1])
        if same and _storage(n) is not None and n.users and all(u in out for u in n.users):
            out.add(n)
    return out


def anchors(st: Staged, stage: int) -> frozenset[str]:
    """The names of stage `stage`'s anchors (NOTE [recomputing segment by segment]), and of the
    long-lived values (skips) its forward carries past them."""
    f = st.programs.get(("F", stage))
    if f is None:
        return frozenset()
    nodes = list(f.gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    act = _activations(st, f)
    born: dict[int, int] = {}
    last: dict[int, int] = {}
    first: dict[int, fx.Node] = {}
    returned = _returned_views(nodes)
    for i, n in enumerate(nodes):
        sid = _storage(n) if n in act else None  # a placeholder: carried until its last reader
        if sid is None:
            continue
        born.setdefault(sid, i)
        first.setdefault(sid, n)
        last[sid] = max([last.get(sid, i), *(index[u] for u in n.users if u not in returned)])
    width: dict[int, set[int]] = {}  # candidate position -> the other storages carried past it
    for i, n in enumerate(nodes):
        sid = _storage(n) if n in act and n.op == "call_function" else None
        if sid is not None and born[sid] == i and last[sid] > i and isinstance(n.meta["val"], torch.Tensor):
            width[i] = {s for s in born if s != sid and born[s] <= i < last[s]}
    narrowest = min((len(w) for w in width.values()), default=0)
    out = set()
    for i, others in width.items():
        if len(others) == narrowest:
            out.add(nodes[i].name)
            out |= {first[s].name for s in others if first[s].op == "call_function"}
    return frozenset(out)


def storage_key(st: Staged, stage: int, v: str) -> tuple[int, object]:
    """Which storage of stage `stage` value `v` (made there) is: its unit's key."""
    q = st.producer.get(v, ("F", stage))
    node = node_of(st.programs[q]).get(v)
    if node is None:  # not returned by its program: one of F's own values (an anchor)
        node = next(n for n in st.programs[q].gm.graph.nodes if n.name == v)
    sid = _storage(node)
    return (stage, sid if sid is not None else v)


def units(st: Staged, pool: Iterable[Drop]) -> dict[tuple[int, object], tuple[Unit, int]]:
    """The pool's drops grouped by the storage they free, each with the storage's bytes."""
    groups: dict[tuple[int, object], set[Drop]] = defaultdict(set)
    size: dict[tuple[int, object], int] = {}
    for d in pool:
        key = storage_key(st, d[0][1], d[1])
        groups[key].add(d)
        node = node_of(st.programs[st.producer[d[1]]])[d[1]]
        size[key] = storage_bytes(node.meta["val"]) if isinstance(key[1], int) else 0
    return {k: (frozenset(g), size[k]) for k, g in groups.items()}


class Costs:
    """The cost of the operations each backward program recomputes, for sets of drops."""

    def __init__(self, st: Staged, forced: set[Drop]) -> None:
        self.st, self.forced = st, forced

    def program(self, p: Place, drops: set[Drop], keep: Keep) -> float:
        """What program `p` recomputes for `drops` (all of the stage's, `forced` included)."""
        mine = {v for q, v in drops if q == p}
        if not mine:
            return 0.0
        by_q: dict[Place, list[str]] = defaultdict(list)
        for v in sorted(mine):
            by_q[self.st.producer[v]].append(v)
        stop = stops(self.st, p, mine, drops)
        total = 0.0
        for q, vs in by_q.items():
            k = keep.get(p[1], frozenset()) if q[0] == "F" else frozenset()
            walk = recompute_nodes(self.st.programs[q], vs, stop, k, written_names(self.st))
            total += sum(node_cost(n) for n in walk.copy)
        return total

    def added(self, unit: Unit, drops: set[Drop], keep: Keep) -> float:
        """What dropping `unit` adds to the cost of `drops` (at least 1: an op's worth)."""
        both = drops | unit
        places = {p for p, _ in unit}
        return 1.0 + sum(self.program(p, both, keep) - self.program(p, drops, keep) for p in places)
