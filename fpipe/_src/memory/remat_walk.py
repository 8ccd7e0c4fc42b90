"""The walk behind a recomputation: which operations of a program Q a backward program P copies
to compute a value of Q again, and which values it reads instead (NOTE [recomputing in the
backward] in remat.py). Whether an operation may run again, and what a copy must not read, is
the effects analysis's answer (NOTE [effects] in effects.py): a write never runs again (BatchNorm
in training runs without its statistics update, `effects.replay`), and a copy never reads an
input the step writes -- the walk stops at the value of F that reads it, computed before the
write, as the split computes such a value once."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

from ..stages import Program, Staged
from ..tracing import replay, seeded, written_inputs

__all__ = [
    "copy_node",
    "node_of",
    "recomputable",
    "recompute_nodes",
    "region_inputs",
    "tagged",
    "value_names",
    "written_names",
]


def tagged(node: fx.Node) -> bool:
    """An operation inside a `torch.utils.checkpoint` region (captured.py tags them)."""
    return node.meta.get("recompute") is not None


def recomputable(node: fx.Node) -> bool:
    """May this operation run again inside a backward program? Pure aten/prims operations and
    seeded random ones; never a write (BatchNorm in training runs again without its statistics'
    update: `effects.replay`) or a collective."""
    if node.op != "call_function" or replay(node) is None:
        return False
    t = node.target
    if t is operator.getitem or t is seeded:
        return True
    return isinstance(t, torch._ops.OpOverload) and t.namespace in ("aten", "prims")


def node_of(prog: Program) -> dict[str, fx.Node]:
    """The node of each value `prog` reads or returns, by value name (by position: a node's own
    name is no value's name once a rewrite has copied nodes in, fx renumbers them). Kept on
    `prog` (a rewrite makes a new program)."""
    if "_fpipe_node_of" not in prog.__dict__:
        prog.__dict__["_fpipe_node_of"] = _node_of(prog)
    return prog.__dict__["_fpipe_node_of"]  # type: ignore[no-any-return]


def _node_of(prog: Program) -> dict[str, fx.Node]:
    out: dict[str, fx.Node] = {}
    phs = [n for n in prog.gm.graph.nodes if n.op == "placeholder"]
    out.update(zip(prog.inputs, phs))
    ret = prog.gm.graph.find_nodes(op="output")[0].args[0]
    out.update((name, n) for name, n in zip(prog.outputs, ret) if isinstance(n, fx.Node))  # type: ignore[arg-type]
    return out


def value_names(prog: Program) -> dict[fx.Node, str]:
    """The value name of each input and output node of `prog` (kept on it: do not change)."""
    if "_fpipe_names" not in prog.__dict__:
        prog.__dict__["_fpipe_names"] = {n: name for name, n in node_of(prog).items()}
    return prog.__dict__["_fpipe_names"]  # type: ignore[no-any-return]


def written_names(st: Staged) -> frozenset[str]:
    """The inputs of the step that one of its programs writes (a buffer's counter, BatchNorm's
    running statistics: NOTE [effects] in effects.py), found once per `st`."""
    got = st.__dict__.get("_fpipe_written")
    if got is None:
        names: set[str] = set()
        for prog in st.programs.values():
            mine = written_inputs(prog.gm.graph)
            phs = prog.gm.graph.find_nodes(op="placeholder")
            names.update(name for name, n in zip(prog.inputs, phs) if n in mine)
        got = st.__dict__["_fpipe_written"] = frozenset(names)
    return got  # type: ignore[no-any-return]


class _Walk:
    """What P needs to recompute value(s) of Q: the Q nodes to copy and the values to read.
    `keep`: Q's values (by node name; Q an F) the walk stops at though Q may not return them.
    `written`: the step's inputs some program writes (`written_names`): a copy reading one would
    read it after the write, so the walk stops at the value of F that reads it (F returns it,
    computed before the write, as the split computes such a value once and sends it) and fails
    where it cannot (Q is not an F, or the reader is itself not one tensor)."""

    def __init__(
        self,
        q: Program,
        stop: set[str],
        keep: frozenset[str] = frozenset(),
        written: frozenset[str] = frozenset(),
    ) -> None:
        self.q, self.stop, self.keep, self.name, self.written = q, stop, keep, value_names(q), written
        self.copy: dict[fx.Node, None] = {}  # Q nodes to copy, in Q's order once sorted
        self.read: dict[fx.Node, None] = {}  # Q nodes whose values P reads
        self.ok = True

    def visit(self, node: fx.Node) -> None:
        if node in self.copy or node in self.read:
            return
        if node.op == "placeholder" and self.name.get(node) in self.written:
            self.ok = False  # read by a reader below that could not be kept
            return
        if (
            node.op == "placeholder"
            or self.name.get(node) in self.stop
            or node.name in self.keep
            or node in region_inputs(self.q)
        ):
            self.read[node] = None
            return
        if not recomputable(node):
            self.ok = False
            return
        if self._reads_written(node):
            self.read[node] = None  # kept: computed before the write (NOTE [effects])
            return
        self.copy[node] = None
        for d in _reads(node):
            self.visit(d)

    def _reads_written(self, node: fx.Node) -> bool:
        """Does `node` read an input the step writes, and can Q (an F) return its value?"""
        reads = any(d.op == "placeholder" and self.name.get(d) in self.written for d in _reads(node))
        return reads and self.q.place[0] == "F" and isinstance(node.meta.get("val"), torch.Tensor)


def _reads(node: fx.Node) -> list[fx.Node]:
    """The values a copy of `node` reads (`effects.replay`: not the statistics BatchNorm's
    copy no longer updates)."""
    args = replay(node)
    assert args is not None, node
    out: dict[fx.Node, None] = {}
    fx.map_arg(args, out.setdefault)
    return list(out)


def copy_node(g: fx.Graph, n: fx.Node, env: dict[fx.Node, fx.Node]) -> fx.Node:
    """`n` copied into `g` as it runs again (`effects.replay`), reading `env`'s values."""
    got = replay(n)
    assert got is not None, n
    args, kwargs = fx.map_arg(got[0], env.__getitem__), fx.map_arg(got[1], env.__getitem__)
    new = g.create_node("call_function", n.target, args, kwargs)  # type: ignore[arg-type]
    new.meta = dict(n.meta)
    return new


def region_inputs(q: Program) -> set[fx.Node]:
    """The values of `q` a checkpoint region reads that it does not make (its inputs: kept, as
    `torch.utils.checkpoint` keeps them), found once per graph."""
    got = q.gm.__dict__.get("_fpipe_region_inputs")
    if got is None:
        got = q.gm.__dict__["_fpipe_region_inputs"] = {
            n for n in q.gm.graph.nodes if any(tagged(u) and _region(u) != _region(n) for u in n.users)
        }
    return got  # type: ignore[no-any-return]


def _region(n: fx.Node) -> Any:
    return n.meta.get("recompute")


def recompute_nodes(
    q: Program,
    names: Iterable[str],
    stop: set[str],
    keep: frozenset[str] = frozenset(),
    written: frozenset[str] = frozenset(),
) -> _Walk:
    """The walk back from Q's values `names` to `stop` (and Q's inputs, region inputs, `keep`),
    never copying a read of `written` (`written_names`)."""
    walk, nodes = _Walk(q, stop, keep, written), node_of(q)
    for v in names:
        walk.visit(nodes[v])
    return walk
