"""Tied gradients: a parameter's gradient contributions from several stages as outputs of their own.

# NOTE [tied gradients]
A parameter read on several stages (a tied embedding and head) gets one gradient contribution
per stage, and the joint graph adds them (`add(head_part, embedding_part)`), an addition that
backward placement puts on the lowest stage: the later stage's contribution would travel to it
once per microbatch. Instead, each stage's contribution becomes a step output of its own
(`Staged.partial_of`: its index -> the gradient's), summed over microbatches on that stage like
any parameter gradient -- into the gradient's own running sum where both stages run in one
process -- and the ranks holding contributions add them once per step (outputs.py). Only an
addition of two values of the gradient's shape and dtype on different stages is untied, and
the sum over microbatches of a + b is the sum of their sums, so the gradient is unchanged.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._ops import ops

from ..tracing import Joint
from .staged import Place

aten = ops.aten

__all__ = ["untie_sums"]


def untie_sums(
    graph: fx.Graph, output: fx.Node, place: dict[fx.Node, Place], live: set[fx.Node], joint: Joint
) -> dict[int, int]:
    """Split each parameter gradient that adds contributions of several stages into one output
    per contribution (NOTE [tied gradients]), given each node's `place`; returns {extra output
    index: gradient index}. Edits `graph`, `place` and `live` in place."""
    outs = list(output.args[0])  # type: ignore[arg-type]
    partial_of: dict[int, int] = {}
    dropped: list[fx.Node] = []
    for j, pos in enumerate(joint.diff):
        i = joint.n_outs + j
        if pos >= joint.n_params or not isinstance(outs[i], fx.Node) or outs.count(outs[i]) > 1:
            continue
        parts = _sum_parts(place, outs[i], output, dropped)
        outs[i] = parts[0]
        for extra in parts[1:]:
            partial_of[len(outs)] = i
            outs.append(extra)
    output.args = (outs,)
    for node in dropped:  # readers first: an addition is dropped before the additions it reads
        graph.erase_node(node)
        place.pop(node, None)
        live.discard(node)
    return partial_of


def _sum_parts(
    place: dict[fx.Node, Place], node: fx.Node, reader: fx.Node, dropped: list[fx.Node]
) -> list[fx.Node]:
    """The terms of the sum `node` whose operands sit on different stages (itself if none)."""
    args = node.args
    if node.target is not aten.add.Tensor or node.kwargs or len(node.users) != 1 or reader not in node.users:
        return [node]
    if not all(isinstance(a, fx.Node) and a in place and _same_value(a, node) for a in args):
        return [node]
    a, b = args
    if place[a][1] == place[b][1] or a is b:  # type: ignore[index]
        return [node]
    dropped.append(node)
    return _sum_parts(place, a, node, dropped) + _sum_parts(place, b, node, dropped)  # type: ignore[arg-type]


def _same_value(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (
        isinstance(va, torch.Tensor)
        and isinstance(vb, torch.Tensor)
        and (va.shape, va.dtype) == (vb.shape, vb.dtype)
    )
