"""Memory of one program: which storages it allocates, how long each lives, its peak.

A liveness walk over a stage program's fx graph, with each value's size read from the fake
tensor the trace left in `node.meta["val"]` (nothing runs). Storages, not values, are what cost
memory: a view shares its base's storage, and a view of a program input costs nothing (the input
is held by whoever handed it in). Fake tensors keep the real run's aliasing (a `t` or `view` of a
value has its fake storage), so a node whose fake storage is one seen before in the program
allocates nothing; a node without a fake value (inserted after tracing, such as the runner's
in-place gradient accumulation, `run.accumulating`) aliases the argument its schema says it
writes or views.

The generated code of an fx graph drops each value after its last use, so a storage lives from
the node that creates it to the last use of any node holding it, or to the end if the program
returns it. A kernel's workspace, what it allocates and frees while it runs (a convolution's
im2col columns), is held during its node, by the rule workspace.py registers for its operation
(NOTE [kernel workspaces]).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..tracing import output_alias
from .workspace import workspace

__all__ = ["Profile", "profile", "storage_bytes"]

Part = int | tuple[str, int]  # a storage the program allocates, or ("input", index) it views


@dataclasses.dataclass(frozen=True)
class Profile:
    """A program's memory, from its graph alone.

    `peak`: the most bytes of storages the program itself allocated that are alive at once while
    it runs (outputs included, inputs not). `outputs`: per output, the storages it holds (none,
    one, or a tuple value's several), each `("input", j)` (a view of input j) or the id of a
    storage the program allocates. `sizes`: the bytes of each such storage. `fresh`: outputs
    that are their storage's own tensor, not a view of it."""

    peak: int
    outputs: list[tuple[Part, ...]]
    sizes: dict[int, int]
    fresh: frozenset[int]


def storage_bytes(t: torch.Tensor) -> int:
    """The bytes of `t`'s storage (a fake tensor's too); a view counts its whole base."""
    return int(t.untyped_storage().nbytes())


def id_of(t: torch.Tensor) -> int:
    """An identity of `t`'s storage, shared by its views (fake storages included)."""
    return int(StorageWeakRef(t.untyped_storage()).cdata)


def _tensors(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [t for v in val for t in _tensors(v)]
    return []


class _Walk:
    """The state of one walk: which storage each node holds and which storages are new."""

    def __init__(self) -> None:
        self.held: dict[fx.Node, set[int]] = {}
        self.inputs: dict[int, int] = {}  # input storage -> input index
        self.sizes: dict[int, int] = {}  # storages this program allocates -> bytes
        self.born: dict[int, int] = {}  # storage -> index of the node creating it
        self.owner: dict[int, fx.Node] = {}  # storage -> the node creating it
        self.n_inputs = 0

    def visit(self, i: int, node: fx.Node) -> None:
        val = node.meta.get("val")
        if node.op == "placeholder":
            self.held[node] = {self._as_input(t, self.n_inputs) for t in _tensors(val)}
            self.n_inputs += 1
        elif node.op == "call_function":
            self.held[node] = self._storages(i, node, val)

    def _as_input(self, t: torch.Tensor, k: int) -> int:
        sid = id_of(t)
        self.inputs.setdefault(sid, k)
        return sid

    def _storages(self, i: int, node: fx.Node, val: Any) -> set[int]:
        """A view or an in-place op holds the storage of the argument its schema names (fake
        storages can differ there: a boundary marker's fake output is a new tensor); anything
        else holds its fake tensors' storages, new unless seen before in the program."""
        parent = self._aliased(node)
        tensors = _tensors(val)
        if parent is not None:
            mine = {id_of(t) for t in tensors} & parent
            return mine or parent
        out = set()
        for t in tensors:
            sid = id_of(t)
            if sid not in self.inputs and sid not in self.sizes:
                self.sizes[sid], self.born[sid], self.owner[sid] = storage_bytes(t), i, node
            out.add(sid)
        return out

    def _aliased(self, node: fx.Node) -> set[int] | None:
        """The storages of the argument `node` views or writes (None: it allocates)."""
        arg = output_alias(node)
        if arg is False:
            return None
        return set(self.held.get(arg, ())) if isinstance(arg, fx.Node) else set()


def profile(gm: fx.GraphModule) -> Profile:
    """The memory of running `gm` once: see `Profile`."""
    nodes = list(gm.graph.nodes)
    walk = _Walk()
    for i, node in enumerate(nodes):
        walk.visit(i, node)
    end = _ends(nodes, walk)
    held = {i: workspace(n) for i, n in enumerate(nodes) if n.op == "call_function"}
    return Profile(_peak(walk, end, held), *_outputs(nodes, walk))


def _ends(nodes: list[fx.Node], walk: _Walk) -> dict[int, int]:
    """The index of the last node during which each new storage is alive."""
    index = {n: i for i, n in enumerate(nodes)}
    end = dict(walk.born)
    for node, sids in walk.held.items():
        last = max((index[u] for u in node.users), default=index[node])
        for sid in sids & end.keys():
            end[sid] = max(end[sid], last)
    return end


def _peak(walk: _Walk, end: dict[int, int], workspaces: dict[int, int]) -> int:
    """The most bytes alive at once: new storages, and each node's kernel workspace while it runs."""
    delta: dict[int, int] = {}
    for i, size in workspaces.items():
        delta[i] = delta.get(i, 0) + size
        delta[i + 1] = delta.get(i + 1, 0) - size
    for sid, size in walk.sizes.items():
        delta[walk.born[sid]] = delta.get(walk.born[sid], 0) + size
        delta[end[sid] + 1] = delta.get(end[sid] + 1, 0) - size
    live = peak = 0
    for i in sorted(delta):
        live += delta[i]
        peak = max(peak, live)
    return peak


def _outputs(nodes: list[fx.Node], walk: _Walk) -> tuple[list[Any], dict[int, int], frozenset[int]]:
    out_node = nodes[-1]
    assert out_node.op == "output"
    outs: list[tuple[Part, ...]] = []
    fresh = set()
    for k, o in enumerate(out_node.args[0]):  # type: ignore[arg-type]
        sids = sorted(walk.held.get(o, set())) if isinstance(o, fx.Node) else []
        outs.append(tuple(("input", walk.inputs[sid]) if sid in walk.inputs else sid for sid in sids))
        if len(sids) == 1 and walk.owner.get(sids[0]) is o:
            fresh.add(k)
    return outs, walk.sizes, frozenset(fresh)
