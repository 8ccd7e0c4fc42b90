"""How a scalar output reduces the batch: the reduction over microbatches that reproduces it.

# NOTE [an honest reduction]
A pipeline computes a scalar output once per microbatch and combines the M values. The combination
that reproduces the unsplit function depends on how the function reduces its batch: a mean over
the batch (`F.cross_entropy`, `x.mean()`) is the mean of the microbatch means; a sum
(`x.sum()`, `reduction="sum"`) is their sum. `batch_reduction` reads that off the traced forward
graph by following where the batch lives in each value (the split axis of each data input, through
views, transposes, pointwise ops, matrix products, attention, splits and concatenations, masked
writes, and tensor-parallel collectives) to the operation that reduces it:

* "mean" / "sum": the batch is reduced by that kind of reduction, and every later operation is
  linear in the result (adding a term that does not depend on the batch keeps a mean a mean);
  a sum divided by the number of elements it reduced (`x.sum() / x.shape[0]`) is a mean.
* "mixed": a sum plus a term that does not depend on the batch, or a sum plus a mean: no
  combination of the microbatch values reproduces it.
* None: anything the analysis does not follow (a loss that is not linear in the reduced value,
  an operation it has no rule for): fpipe keeps the documented default, the mean.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from .marker import BOUNDARY, BOUNDARY_BWD
from .tp_collectives import tp_all_gather, tp_all_reduce, tp_broadcast, tp_reduce_scatter

__all__ = ["batch_reduction"]

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class _Batch:
    """The batch lives in dim `dim`, as the factor of size `size` whose stride within it is `inner`."""

    dim: int
    inner: int
    size: int


@dataclasses.dataclass(frozen=True)
class _Reduced:
    """The batch was reduced by `kind`; `counts`: divisors that turn this sum into a mean."""

    kind: str
    counts: frozenset[int] = frozenset()
    divided: bool = False  # a mean only because a sum was divided by a number equal to its count


_UNKNOWN = "unknown"
_MIXED = "mixed"
_LOSS_REDUCTION_ARG = {  # loss op -> position of its `reduction` argument (0 none, 1 mean, 2 sum)
    aten.nll_loss_forward.default: 3,
    aten.nll_loss2d_forward.default: 3,
    aten.mse_loss.default: 2,
    aten.l1_loss.default: 2,
    aten.smooth_l1_loss.default: 2,
    aten.huber_loss.default: 2,
    aten.binary_cross_entropy.default: 3,
    aten.binary_cross_entropy_with_logits.default: 4,
    aten.soft_margin_loss.default: 2,
}
_SAME = {  # ops whose first output keeps the batch where its first input has it
    aten.clone.default, aten.detach.default, aten.alias.default, aten._to_copy.default,
    aten.native_dropout.default, aten.lift_fresh_copy.default, aten.contiguous.default,
    # tensor parallel: a sum of the tp ranks' partial values (or one rank's) keeps the batch where
    # it was, and a reduced value reduced (tp_collectives.py; gathers: `_gathered`)
    tp_all_reduce, tp_broadcast,
}  # fmt: skip
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}
_ATTENTION = {  # (batch, heads, seq, d) in: the batch stays in dim 0 of the output (and of item 0)
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
}
_SUMS = {
    aten.sum.default: "sum",
    aten.sum.dim_IntList: "sum",
    aten.mean.default: "mean",
    aten.mean.dim: "mean",
}
_LINEAR = {aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar, aten.neg.default}
_SCALE = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}


def _args(node: fx.Node) -> Any:
    return node.args  # fx's Argument union is too wide to index without a cast at every use


def _target(node: fx.Node) -> Any:
    return node.target


def _shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _prod(xs: Sequence[int]) -> int:
    return math.prod(xs)


def _reshaped(b: _Batch, old: Sequence[int], new: Sequence[int]) -> Any:
    """The batch factor after a row-major reshape: in the one new dim that holds it whole."""
    after = b.inner * _prod(old[b.dim + 1 :])  # the factor's stride in the flat index
    for j in range(len(new)):
        below = _prod(new[j + 1 :])
        if after % below == 0 and after * b.size <= below * new[j]:
            return _Batch(j, after // below, b.size)
    return _UNKNOWN


# Tensor parallelism moves the batch through DTensor's collectives along dim 0: an all-gather
# stacks the tp ranks' tensors in dim 0, split back into pieces and concatenated along the
# sharded dim; a reduce-scatter keeps one of the tp chunks of dim 0. Each tp rank's tensor has the
# same batch layout, so the batch stays where it was, with the ranks as an outer factor of dim 0;
# a piece or chunk keeps it when it holds the batch factor whole.


def _gathered(node: fx.Node, states: list[Any]) -> Any:
    """tp_all_gather / tp_reduce_scatter / cat of tensors with one batch layout: the same."""
    live = [x for x in states if x is not None]
    if not live or any(x != live[0] for x in live) or not isinstance(live[0], _Batch):
        return _UNKNOWN
    b = live[0]
    if node.target is tp_reduce_scatter and b.dim == 0:
        rows = (_shape(node) or (0,))[0]
        return b if rows % (b.inner * b.size) == 0 else _UNKNOWN
    if node.target is aten.cat.default and len(live) < len(states):
        return _UNKNOWN  # a piece with no batch beside pieces with one
    return b


def _masked_write(node: fx.Node, states: list[Any]) -> bool:
    x, indices = _args(node)[:2]
    masks = [m.meta.get("val") for m in indices if isinstance(m, fx.Node)]
    bools = len(masks) == len(indices) == 1 and getattr(masks[0], "dtype", None) is torch.bool
    lead = _shape(indices[0]) if bools else None  # a mask over x's leading dims
    same = lead is not None and (_shape(x) or ())[: len(lead)] == lead
    return bool(same and states[-1] is None and len(set(states[:-1])) == 1)


def _split_dim(node: fx.Node) -> int:
    args = _args(node)
    return int(args[2]) if len(args) > 2 else int(node.kwargs.get("dim", 0))  # type: ignore[arg-type]


def _piece(b: _Batch, whole: Any, piece: Any, dim: int) -> Any:
    """A piece of a split: the batch where it was if the split leaves its factor whole."""
    if whole is None or piece is None:
        return _UNKNOWN
    dim = dim % len(whole)
    if dim != b.dim:
        return b
    return b if piece[dim] % (b.inner * b.size) == 0 else _UNKNOWN


def _combine(states: list[Any], op: Any) -> Any:
    """Pointwise combination of the inputs' states (None: does not depend on the batch)."""
    if _UNKNOWN in states or _MIXED in states:
        return _MIXED if _MIXED in states else _UNKNOWN
    live = [s for s in states if s is not None]
    if not live:
        return None
    if all(isinstance(s, _Batch) for s in live):
        return live[0] if len(set(live)) == 1 else _UNKNOWN
    if not all(isinstance(s, _Reduced) for s in live) or op not in _LINEAR:
        return _UNKNOWN
    kinds = {s.kind for s in live}
    if len(kinds) > 1 or (kinds == {"sum"} and len(live) < len(states)):
        return _MIXED  # a sum plus a constant term, or a sum plus a mean
    return live[0] if len(live) == 1 else _Reduced(kinds.pop(), divided=any(s.divided for s in live))


class _Analysis:
    def __init__(self, gm: fx.GraphModule, batch: dict[fx.Node, _Batch]) -> None:
        self.state: dict[fx.Node, Any] = dict(batch)
        for node in gm.graph.nodes:
            if node.op == "call_function":
                self.state[node] = self._rule(node)

    def of(self, x: Any) -> Any:
        return self.state.get(x) if isinstance(x, fx.Node) else None

    def _rule(self, node: fx.Node) -> Any:
        states = [self.of(a) for a in node.all_input_nodes]
        if all(s is None for s in states):
            return None
        t, args = _target(node), _args(node)
        if t is operator.getitem:
            return self._getitem(node)
        if t in _SUMS:
            return self._reduce(node, _SUMS[t])
        if t in _LOSS_REDUCTION_ARG:
            return self._loss(node)
        if t in _SCALE and isinstance(self.of(args[0]), _Reduced):
            return self._scaled(node)
        if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
            return self._pointwise(node, states)
        return self._structural(node, states)

    def _getitem(self, node: fx.Node) -> Any:
        parent, i = _args(node)
        if isinstance(parent, fx.Node) and parent.target in (BOUNDARY, BOUNDARY_BWD):
            return self.of(parent.args[0][i])  # type: ignore[index]
        s = self.of(parent)
        if isinstance(parent, fx.Node) and parent.target in _SPLITS and isinstance(s, _Batch):
            return _piece(s, _shape(parent.args[0]), _shape(node), _split_dim(parent))
        if isinstance(s, _Batch) and i != 0:  # a dropout mask, a norm's statistics: not followed
            return _UNKNOWN
        return s

    def _pointwise(self, node: fx.Node, states: list[Any]) -> Any:
        out = _shape(node)
        moved = []
        for a, s in zip(node.all_input_nodes, states):
            if isinstance(s, _Batch) and out is not None:
                shape = _shape(a) or ()
                s = _Batch(s.dim + len(out) - len(shape), s.inner, s.size)
            moved.append(s)
        return _combine(moved, _target(node))

    def _scaled(self, node: fx.Node) -> Any:
        red, other = self.of(_args(node)[0]), _args(node)[1]
        if self.of(other) is not None:
            return _UNKNOWN
        if red.kind == "sum" and _divides_to_mean(_target(node), other, red.counts):
            return _Reduced("mean", divided=True)
        return _Reduced(red.kind, divided=red.divided)

    def _reduce(self, node: fx.Node, kind: str) -> Any:
        src = _args(node)[0]
        s, shape = self.of(src), _shape(src)
        if not isinstance(s, _Batch) or shape is None:
            return s if isinstance(s, _Reduced) or s in (None, _MIXED) else _UNKNOWN
        dims = _dims(node, len(shape))
        if s.dim not in dims:
            keep = bool(node.kwargs.get("keepdim", _args(node)[2] if len(_args(node)) > 2 else False))
            return s if keep else _Batch(s.dim - sum(d < s.dim for d in dims), s.inner, s.size)
        reduced = _prod([shape[d] for d in dims])
        return _Reduced(kind, frozenset({reduced, shape[s.dim], s.size}))

    def _loss(self, node: fx.Node) -> Any:
        pos = _LOSS_REDUCTION_ARG[_target(node)]
        how = _args(node)[pos] if len(_args(node)) > pos else node.kwargs.get("reduction", 1)
        s = self.of(_args(node)[0])
        if not isinstance(s, _Batch) or how not in (1, 2):
            return _UNKNOWN
        shape = _shape(_args(node)[0]) or ()
        return _Reduced("mean" if how == 1 else "sum", frozenset({_prod(shape), shape[s.dim], s.size}))

    def _structural(self, node: fx.Node, states: list[Any]) -> Any:
        t, args = _target(node), _args(node)
        if t in (tp_all_gather, tp_reduce_scatter, aten.cat.default):
            return _gathered(node, [self.of(a) for a in node.all_input_nodes])
        if t in _SPLITS:  # the pieces: `_getitem` / `_piece`
            return self.of(args[0]) if isinstance(self.of(args[0]), _Batch) else _UNKNOWN
        if t is aten.index_put.default and _masked_write(node, states):
            return states[0]  # `x[mask] = v`, a boolean mask of x's layout: pointwise
        if t in _ATTENTION:  # each example attends within itself: q, k, v share the batch in dim 0
            live = {x for x in states if x is not None}
            b = live.pop() if len(live) == 1 else None
            return b if isinstance(b, _Batch) and b.dim == 0 else _UNKNOWN
        if t is aten.embedding.default:  # the weight holds no batch; the indices' batch stays put
            return self.of(args[1]) if states[0] is None else _UNKNOWN
        if t is aten.index.Tensor and self.of(args[0]) is None and len(args[1]) == 1:  # type: ignore[arg-type]
            return self.of(args[1][0])  # a table looked up by batched indices: `emb[idx]`
        if t in _MATMUL:
            return _matmul(node, [self.of(a) for a in args])
        s = self.of(args[0]) if args else None
        if isinstance(s, _Reduced) and t in (*_SAME, aten.view.default, aten.squeeze.default):
            return s
        if not isinstance(s, _Batch) or any(x is not None for x in states[1:]):
            return _UNKNOWN
        old, new = _shape(args[0]), _shape(node)
        if t in _SAME:
            return s
        if t in _RESHAPE and old is not None and new is not None:
            return _reshaped(s, old, new)
        rule = _MOVES.get(t)
        return rule(s, node, len(old or ())) if rule else _UNKNOWN


def _dims(node: fx.Node, ndim: int) -> list[int]:
    if _target(node) in (aten.sum.default, aten.mean.default):
        return list(range(ndim))
    dims: Any = _args(node)[1] if len(_args(node)) > 1 else node.kwargs.get("dim")
    if dims is None or dims == []:
        return list(range(ndim))
    return sorted({d % ndim for d in (dims if isinstance(dims, (list, tuple)) else [dims])})


def _divides_to_mean(op: Any, other: Any, counts: frozenset[int]) -> bool:
    """Is `sum / other` the sum divided by one of the counts it reduced (a mean)?"""
    if op not in (aten.div.Tensor, aten.div.Scalar) or not isinstance(other, (int, float)):
        return False
    return any(math.isclose(other, c, rel_tol=1e-9) for c in counts)


def _matmul(node: fx.Node, states: list[Any]) -> Any:
    """A product keeps a batch that lives in the rows of its first operand (and the leading dim
    of a batched product, when both operands hold the batch there alike)."""
    operands = list(_args(node))
    if _target(node) is aten.addmm.default:
        if states[0] is not None:
            return _UNKNOWN
        states, operands = states[1:], operands[1:]
    first, second = states[0], states[1]
    ndim = len(_shape(operands[0]) or ())
    if not isinstance(first, _Batch) or first.dim >= ndim - 1:  # none, or in the contracted dim
        return _UNKNOWN
    if second is not None and (second != first or first.dim >= ndim - 2):
        return _UNKNOWN
    return first


def _move_permute(s: _Batch, node: fx.Node, ndim: int) -> Any:
    order = [d % ndim for d in _args(node)[1]]  # type: ignore[union-attr]
    return _Batch(order.index(s.dim), s.inner, s.size)


def _move_transpose(s: _Batch, node: fx.Node, ndim: int) -> Any:
    a, b = (_args(node)[1] % ndim, _args(node)[2] % ndim) if len(_args(node)) > 2 else (0, 1)  # type: ignore[operator]
    return _Batch({a: b, b: a}.get(s.dim, s.dim), s.inner, s.size)


def _move_unsqueeze(s: _Batch, node: fx.Node, ndim: int) -> Any:
    k = _args(node)[1] % (ndim + 1)  # type: ignore[operator]
    return _Batch(s.dim + (k <= s.dim), s.inner, s.size)


def _move_select(s: _Batch, node: fx.Node, ndim: int) -> Any:
    k = _args(node)[1] % ndim  # type: ignore[operator]
    if k == s.dim:
        return _UNKNOWN
    return _Batch(s.dim - (k < s.dim), s.inner, s.size) if _target(node) is aten.select.int else s


def _move_last_dim(s: _Batch, node: fx.Node, ndim: int) -> Any:
    """Softmax-like ops over one dim, norms over the trailing dims: per-example if not the batch's."""
    if _target(node) is aten.native_layer_norm.default:
        return s if s.dim < ndim - len(_args(node)[1]) else _UNKNOWN  # type: ignore[arg-type]
    return s if _args(node)[1] % ndim != s.dim else _UNKNOWN  # type: ignore[operator]


def _move_expand(s: _Batch, node: fx.Node, ndim: int) -> Any:
    return _Batch(s.dim + len(_args(node)[1]) - ndim, s.inner, s.size)  # type: ignore[arg-type]


_RESHAPE = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_MATMUL = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.mv.default}
_MOVES = {
    aten.permute.default: _move_permute,
    aten.transpose.int: _move_transpose,
    aten.t.default: _move_transpose,
    aten.unsqueeze.default: _move_unsqueeze,
    aten.select.int: _move_select,
    aten.slice.Tensor: _move_select,
    aten._log_softmax.default: _move_last_dim,
    aten._softmax.default: _move_last_dim,
    aten.native_layer_norm.default: _move_last_dim,
    aten.expand.default: _move_expand,
}


def batch_reduction(gm: fx.GraphModule, data_axes: dict[int, int], out_index: int) -> str | None:
    """How output `out_index` (a scalar) of the forward graph `gm` reduces the batch: "mean",
    "sum", "mixed", None (not followed), or "divided": a mean only because a sum is divided by
    a number equal to a count it reduced -- `x.sum() / x.shape[0]`, or a constant that happens to
    equal it; the caller tells them apart by tracing at another batch size (a count changes
    with it, a constant does not). `data_axes`: placeholder position -> split axis, for the data
    inputs split into microbatches."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    batch = {}
    for pos, axis in data_axes.items():
        shape = _shape(phs[pos])
        if shape is not None and len(shape) > axis:
            batch[phs[pos]] = _Batch(axis, 1, shape[axis])
    analysis = _Analysis(gm, batch)
    out = gm.graph.find_nodes(op="output")[0].args[0][out_index]  # type: ignore[index]
    s = analysis.of(out)
    if isinstance(s, _Reduced):
        return "divided" if s.divided else s.kind
    return "mixed" if s == _MIXED else None
