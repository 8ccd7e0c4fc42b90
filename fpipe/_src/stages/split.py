"""Split: cut a joint graph at the boundary markers into per-stage programs.

Every node of the joint graph gets a place, a (kind, stage) pair, kind "F" (forward) or "B"
(backward); each place becomes one `Program`. Values that cross places are the boundary tensors,
the skip connections and the saved activations: explicit names that the runtime owns.

# NOTE [how nodes are placed]
* A boundary's output is one stage above its input, so a value's stage is the most boundaries on
  any path from the inputs to it (a model applied to two inputs in parallel stages both alike);
  the number of stages is one more than the highest. A backward marker's output is one stage
  below its input. The loss cotangent `ct` belongs to the last stage. Markers met on the "wrong"
  side -- a backward marker in forward work, when the function itself takes a gradient through a
  boundary (a gradient penalty) -- are identities: forward work never flows to a lower stage.
* A node that depends on `ct` is backward work, placed at the *lowest* stage of its backward
  inputs (gradients flow down). Any other node is forward work at the *highest* stage of its inputs.
* A node that depends only on inputs is "free" and placed by its readers. One that depends only
  on parameters and constants (a weight's transpose, `arange`) is copied into every program that
  reads it, so no stage waits for another to compute it (recomputing a view costs nothing).
  One that reads the data (the embedding lookup, a slice of the targets) runs once, in the
  earliest program that reads it -- for the targets, on the last stage; so does one computed from
  an input the step writes (a buffer's counter), which a later copy would read after the write.
  What feeds boundary k
  runs before it, on stage k. A node that mutates its inputs is never copied. A boundary is the
  identity on a parameter-and-constant value (a causal mask passed from block to block): each
  program that reads it on the far side computes it too (`_recomputable`).
* A node nobody reads that mutates its input (an in-place update of a BatchNorm counter) stays
  with the forward work that follows it in program order. Any other node whose value reaches no
  output (a detach the tracer left, work on a marker element nobody reads) is dropped first, so
  it neither runs nor pulls values across stages.

The data this makes (`Place`, `Program`, `Staged`) is defined in staged.py; splitting a backward
program into I and W for zero-bubble schedules (`split_backward`, `backward_parts`) is in
split_iw.py. Both are re-exported here.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch._prims_common import is_non_overlapping_and_dense_or_false

from ..tracing import BOUNDARY, BOUNDARY_BWD, Joint, is_mutating, is_random, seeded, written_inputs
from .split_iw import backward_parts, split_backward
from .split_tied import untie_sums  # re-exported: split and split_backward go together
from .staged import Place, Program, Staged

UNTIE = True  # False: tied gradients summed where the joint graph adds them (bench/tied_grads.py)

__all__ = ["Place", "Program", "Staged", "backward_parts", "count_stages", "split", "split_backward"]


def _seq(p: Place, n_stages: int) -> int:
    """Position of a place in one microbatch's order: F0 < F1 < ... < B(n-1) < ... < B0."""
    return p[1] if p[0] == "F" else 2 * n_stages - 1 - p[1]


def _marker_getitem(node: fx.Node) -> tuple[str, fx.Node] | None:
    """For `getitem(marker, i)`: the marker's kind ("F" or "B") and the source of element i."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    parent = node.args[0]
    if not isinstance(parent, fx.Node) or parent.target not in (BOUNDARY, BOUNDARY_BWD):
        return None
    src = parent.args[0][node.args[1]]  # type: ignore[index]
    assert isinstance(src, fx.Node)
    return ("F" if parent.target is BOUNDARY else "B"), src


def _is_marker(node: fx.Node) -> bool:
    return node.target in (BOUNDARY, BOUNDARY_BWD)


def live_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose value reaches an output or that mutate an input. A marker element keeps only
    its own source alive, not the marker's other elements (markers themselves are never live)."""
    live: set[fx.Node] = set()
    stack = [n for n in graph.nodes if n.op == "output" or is_mutating(n)]
    while stack:
        node = stack.pop()
        if node in live or _is_marker(node):
            continue
        live.add(node)
        mg = _marker_getitem(node)
        stack.extend([mg[1]] if mg else node.all_input_nodes)
    return live


def forward_stages(
    graph: fx.Graph, backward: set[fx.Node] | None = None, live: set[fx.Node] | None = None
) -> dict[fx.Node, int]:
    """The stage of every forward value: the most boundaries on any path from the inputs to it.

    A boundary's output is one stage above its input; any other value is at the highest stage
    of its inputs; values that depend only on inputs have no stage (absent), nor do dead ones. A *backward* marker
    met in forward work (a `torch.func.grad` inside the function differentiates through a
    boundary) is the identity: forward work never flows back to a lower stage.
    """
    backward = backward or set()
    live = live_nodes(graph) if live is None else live
    stage: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node in backward or node.op != "call_function" or node not in live:
            continue
        mg = _marker_getitem(node)
        if mg is not None and mg[0] == "F":
            stage[node] = stage.get(mg[1], 0) + 1
            continue
        ins = [stage[d] for d in ([mg[1]] if mg else node.all_input_nodes) if d in stage]
        if ins:
            stage[node] = max(ins)
    return stage


def count_stages(graph: fx.Graph) -> int:
    return max(forward_stages(graph).values(), default=0) + 1


class _Placer:
    def __init__(self, call: str, joint: Joint) -> None:
        self.call = call
        self.graph = joint.gm.graph
        self.nodes = list(self.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.place: dict[fx.Node, Place] = {}
        self.free_places: dict[fx.Node, list[Place]] = {}
        self.output = self.nodes[-1]
        self.src: dict[fx.Node, fx.Node] = {}  # marker getitem -> its source value
        self.identity: set[fx.Node] = set()  # marker getitems that do not change the stage
        self.free: set[fx.Node] = set()  # nodes placed by their readers
        self.n_outs = joint.n_outs
        self.live = live_nodes(self.graph)
        randoms = [n for n in self.nodes if is_random(n.target, n.args, n.kwargs)]
        self.random_index = {n: i for i, n in enumerate(randoms)}

    def deps(self, node: fx.Node) -> list[fx.Node]:
        if node in self.src:
            return [self.src[node]]
        return [d for d in node.all_input_nodes if not _is_marker(d)]

    def _closure(self, roots: set[fx.Node]) -> set[fx.Node]:
        """Nodes that depend on any of `roots` (through markers too)."""
        out = set(roots)
        for node in self.nodes:
            if node.op == "call_function" and not _is_marker(node) and any(d in out for d in self.deps(node)):
                out.add(node)
        return out

    def run(self, joint: Joint) -> None:
        phs = [n for n in self.nodes if n.op == "placeholder"]
        ct = phs[-1]
        for node in self.nodes:
            mg = _marker_getitem(node)
            if mg is not None:
                self.src[node] = mg[1]
        # Values computed from the data, or from an input the step writes (a buffer counter):
        # computed once, in their earliest reader, and sent -- a copy in a later program would
        # read the input after the write (NOTE [how nodes are placed]).
        written = written_inputs(self.graph)  # NOTE [effects] in effects.py
        self.data_dep = self._closure({*phs[joint.n_params : joint.n_params + joint.n_data], *written})
        backward = self._closure({ct})
        fstage = forward_stages(self.graph, backward, self.live)
        self.n_stages = max(fstage.values(), default=0) + 1
        for node, s in list(fstage.items()):
            mg = _marker_getitem(node)
            if mg is not None and mg[0] == "F" and self._recomputable(mg[1], fstage, backward):
                del fstage[node]  # its readers compute it themselves
                self.identity.add(node)
                continue
            self.place[node] = ("F", s)
            if mg is not None and mg[0] == "B":
                self.identity.add(node)
        self.place[ct] = ("B", self.n_stages - 1)
        for node in self.nodes:
            if node in backward and node is not ct and node in self.live:
                self._place_backward(node)
        free = [n for n in self.nodes if n.op == "call_function" and n in self.live and n not in self.place]
        self._place_free(free)
        self._colocate_getitems()

    def _recomputable(self, src: fx.Node, fstage: dict[fx.Node, int], backward: set[fx.Node]) -> bool:
        """A value computed from parameters and constants alone (a causal mask a model passes
        to its next block) that reaches a boundary: the boundary is the identity on it, and each
        program that reads it computes it (it may be copied into several; none sends it)."""
        return (
            src.op == "call_function"
            and src not in fstage
            and src not in backward
            and src not in self.data_dep
        )

    def _place_backward(self, node: fx.Node) -> None:
        """Backward work runs at the lowest stage of its backward inputs; a backward marker's
        output is one stage below its input (the transpose of a boundary)."""
        ins = [self.place[d][1] for d in self.deps(node) if d in self.place and self.place[d][0] == "B"]
        stage = min(ins)
        mg = _marker_getitem(node)
        if mg is not None and mg[0] == "B":
            stage -= 1
            assert stage >= 0, f"backward marker below stage 0 at {node}"
        elif mg is not None:
            self.identity.add(node)  # a forward marker in backward work: grad-of-grad
        self.place[node] = ("B", stage)

    def _colocate_getitems(self) -> None:
        """An element of a multi-output node is taken where the node runs: tuples never cross."""
        for node in self.nodes:
            if node.target is not operator.getitem or node in self.src or node not in self.live:
                continue
            parent = node.args[0]
            if parent in self.place:
                self.place[node] = self.place[parent]  # type: ignore[index]
                self.free_places.pop(node, None)
            elif parent in self.free_places:
                self.free_places[node] = self.free_places[parent]  # type: ignore[index]
                self.place.pop(node, None)

    def _consumer_places(self, node: fx.Node) -> list[Place]:
        out: list[Place] = []
        for user in node.users:
            if user not in self.live and not _is_marker(user):
                continue
            if user is self.output:
                out.append(self._output_place(node))
            elif _is_marker(user):
                out.extend(self._consumer_places_of_marker_input(user, node))
            elif user in self.place:
                out.append(self.place[user])
            else:
                out.extend(self.free_places.get(user, []))
        return out

    def _consumer_places_of_marker_input(self, marker: fx.Node, node: fx.Node) -> list[Place]:
        """What feeds a boundary is computed before it: one stage below its forward output, or
        one above its backward output; what feeds an identity marker, where that is read. An
        element nobody reads keeps nothing alive."""
        out: list[Place] = []
        for g in marker.users:
            if self.src.get(g) is not node or g not in self.live:
                continue
            if g in self.identity or g not in self.place or g in self.free:
                out.extend(self.places_of(g) or self._consumer_places(g))
            elif marker.target is BOUNDARY:
                out.append(("F", self.place[g][1] - 1))
            else:
                out.append(("B", self.place[g][1] + 1))
        return out

    def _output_place(self, node: fx.Node) -> Place:
        outs = self.output.args[0]
        positions = [i for i, v in enumerate(outs) if v is node]  # type: ignore[union-attr, arg-type]
        is_value = any(i < self.n_outs for i in positions)
        return ("F", self.n_stages - 1) if is_value else ("B", 0)

    def _place_free(self, free: list[fx.Node]) -> None:
        self.free = set(free)  # a free marker element is the identity: its source goes with it
        for node in reversed(free):
            places = sorted(set(self._consumer_places(node)), key=lambda p: _seq(p, self.n_stages))
            if not places:
                self.place[node] = self._write_place(node)
            elif len(places) == 1 or is_mutating(node) or node in self.data_dep:
                self.place[node] = places[0]
            else:
                self.free_places[node] = places

    def _write_place(self, node: fx.Node) -> Place:
        """A mutation nobody reads (a write into an input, NOTE [functional graphs] in trace.py)
        runs with the forward work that follows it, but never before a forward program that
        reads the input's old value: that read comes first in the function, so it comes first
        here."""
        places = [self._following_forward(node)]
        dst = node.args[0] if node.args else None
        if isinstance(dst, fx.Node) and dst.op == "placeholder":
            places += [p for u in dst.users if u is not node for p in self.places_of(u) if p[0] == "F"]
        return max(places, key=lambda p: _seq(p, self.n_stages))

    def _following_forward(self, node: fx.Node) -> Place:
        for later in self.nodes[self.index[node] + 1 :]:
            p = self.place.get(later)
            if p is not None and p[0] == "F":
                return p
        return ("F", 0)

    def places_of(self, node: fx.Node) -> list[Place]:
        if node in self.place:
            return [self.place[node]]
        return self.free_places.get(node, [])


def split(call: str, joint: Joint, stages: int | None) -> Staged:
    """Cut `joint` at its markers into forward and backward programs per stage."""
    placer = _Placer(call, joint)
    placer.run(joint)
    partial_of = {}
    if UNTIE:
        partial_of = untie_sums(placer.graph, placer.output, placer.place, placer.live, joint)
        placer.nodes = list(placer.graph.nodes)
    return _build(placer, joint, partial_of)


def _build(pl: _Placer, joint: Joint, partial_of: dict[int, int]) -> Staged:
    phs = [n for n in pl.nodes if n.op == "placeholder"]
    inputs = {n.name for n in phs}
    by_place: dict[Place, list[fx.Node]] = defaultdict(list)
    for node in pl.nodes:
        if node.op in ("placeholder", "output") or _is_marker(node):
            continue
        for p in pl.places_of(node):
            by_place[p].append(node)

    # Which places read each value; a free node copied into a place is local there.
    consumers: dict[str, list[Place]] = defaultdict(list)
    producer: dict[str, Place] = {}
    for node in pl.nodes:
        if node in pl.place and node.op != "placeholder":
            producer[node.name] = pl.place[node]
    for place, nodes in by_place.items():
        local = {n.name for n in nodes}
        for n in nodes:
            for d in pl.deps(n):
                if d.name not in local and place not in consumers[d.name]:
                    consumers[d.name].append(place)
    out_vals = list(pl.output.args[0])  # type: ignore[arg-type]
    for v in out_vals:
        if isinstance(v, fx.Node) and v.name not in producer and v.name not in inputs:
            # a free value that is also returned: computed by its first place
            producer[v.name] = pl.places_of(v)[0]

    programs = {}
    for place, nodes in by_place.items():
        programs[place] = _program(pl, place, nodes, consumers, producer, out_vals)
    meta, strides = {}, {}
    for node in pl.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            meta[node.name] = (val.shape, val.dtype)
            if not val.is_contiguous() and is_non_overlapping_and_dense_or_false(val):
                strides[node.name] = tuple(val.stride())
    n_p, n_d, n_c = joint.n_params, joint.n_data, joint.n_consts
    names = [n.name for n in phs]
    return Staged(
        n_stages=pl.n_stages,
        programs=programs,
        param_inputs=names[:n_p],
        data_inputs=names[n_p : n_p + n_d],
        const_inputs=names[n_p + n_d : n_p + n_d + n_c],
        ct_input=names[-1],
        out_names=[v.name if isinstance(v, fx.Node) else "" for v in out_vals],
        n_outs=joint.n_outs,
        producer=producer,
        consumers=dict(consumers),
        meta=meta,
        strides=strides,
        partial_of=partial_of,
    )


def _program(
    pl: _Placer,
    place: Place,
    nodes: list[fx.Node],
    consumers: dict[str, list[Place]],
    producer: dict[str, Place],
    out_vals: Iterable[Any],
) -> Program:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[str] = []

    def arg(d: fx.Node) -> fx.Node:
        if d in env:
            return env[d]
        ph = graph.placeholder(d.name)
        ph.meta.update(d.meta)
        inputs.append(d.name)
        env[d] = ph
        return ph

    for node in nodes:
        if node in pl.src:
            env[node] = arg(pl.src[node])
            continue
        env[node] = graph.node_copy(node, arg)
        if node in pl.random_index:  # NOTE [random-number policy] in rng.py
            new = env[node]
            new.args = (pl.random_index[node], node.target, *new.args)  # type: ignore[arg-type]
            new.target = seeded
    returned = {v.name for v in out_vals if isinstance(v, fx.Node)}
    outputs = [
        n.name
        for n in nodes
        if producer.get(n.name) == place
        and (any(c != place for c in consumers.get(n.name, [])) or n.name in returned)
    ]
    by_name = {n.name: n for n in nodes}
    graph.output([env[by_name[o]] for o in outputs])
    graph.eliminate_dead_code(is_impure_node=lambda n: n.op in ("placeholder", "output") or is_mutating(n))
    gm = fx.GraphModule({}, graph)
    return Program(place, gm, inputs, outputs)
