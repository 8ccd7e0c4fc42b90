"""How a scalar output reduces the batch: the reduction over microbatches that reproduces it.

# NOTE [an honest reduction]
A pipeline computes a scalar output once per microbatch and combines the M values. The combination
that reproduces the unsplit function depends on how the function reduces its batch: a mean over
the batch (`F.cross_entropy`, `x.mean()`) is the mean of the microbatch means; a sum
(`x.sum()`, `reduction="sum"`) is their sum. `read_outputs` reads that off the traced forward
graph by following where the batch lives in each value (the split axis of each data input, through
views, transposes, pointwise ops, matrix products, attention, splits and concatenations, masked
writes, and tensor-parallel collectives) to the operation that reduces it:

* "mean" / "sum": the batch is reduced by that kind of reduction, and every later operation is
  linear in the result (adding a term that does not depend on the batch keeps a mean a mean);
  a sum divided by the number of elements it reduced (`x.sum() / x.shape[0]`) is a mean.
* "mixed": a sum plus a term that does not depend on the batch, or a sum plus a mean: no
  combination of the microbatch values reproduces it.
* None: anything the analysis does not follow (a loss that is not linear in the reduced value,
  an operation it has no rule for): fpipe keeps the documented default, the mean, and warns
  (`Reading.pooled_by` names the operation that reduced the batch, where one did).

# NOTE [interacting examples]
The same walk sees where the examples of a batch meet: an operation *pools* the batch when it
reduces over the batch's dim (a sum or mean, a loss, a max, a norm, a matrix product that
contracts the batch, a softmax over it), and every value computed from a pooled one carries
that origin. (BatchNorm in training mode is the documented exception: its statistics are the
microbatch's, as in every pipeline and in gradient accumulation; the walk passes through it.)
When a pooled value and a per-example value (one whose batch the walk still
follows) meet in one operation -- `x - x.mean(0)`, the batch statistic of a normalisation, the
weights of an inner `torch.func.grad` step over the whole batch (MAML) used on the examples --
each example's result depends on the others: a pipeline, which runs each microbatch on its own,
computes the per-microbatch function (gradient accumulation's semantics), not the unsplit one.
`Reading.interaction` names the first such meeting; the compiler warns (out_reduce.py). Ops
that read only a value's shape (`ones_like`) carry no origin; a loss reduced at the end meets
no per-example value afterwards and is not an interaction.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
import torch.fx as fx

from ..tracing import BOUNDARY, BOUNDARY_BWD
from .batch_moves import (
    MATMUL,
    MOVES,
    RESHAPE,
    UNKNOWN,
    Batch,
    args_of,
    gathered,
    iota_indexed,
    masked_write,
    matmul,
    piece,
    prod,
    reshaped,
    shape_of,
    split_dim,
    target_of,
    unbound,
)
from .tp_collectives import tp_all_gather, tp_all_reduce, tp_broadcast, tp_reduce_scatter

__all__ = ["Reading", "read_outputs"]

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class _Reduced:
    """The batch was reduced by `kind`; `counts`: divisors that turn this sum into a mean."""

    kind: str
    counts: frozenset[int] = frozenset()
    divided: bool = False  # a mean only because a sum was divided by a number equal to its count


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
    # it was, and a reduced value reduced (tp_collectives.py; gathers: `gathered`)
    tp_all_reduce, tp_broadcast,
}  # fmt: skip
_BATCH_NORMS = {  # BatchNorm (documented: statistics per microbatch); output 0 keeps the batch
    aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit.no_stats,
    aten._native_batch_norm_legit_no_training.default, aten.cudnn_batch_norm.default,
    aten.miopen_batch_norm.default,
}  # fmt: skip
_SPATIAL = {  # (N, C, ...) in, (N, C', ...) out, each example on its own
    aten.convolution.default, aten._convolution.default, aten.max_pool2d_with_indices.default,
    aten.max_pool1d_with_indices.default, aten.avg_pool2d.default, aten.avg_pool1d.default,
    aten._adaptive_avg_pool2d.default, aten.adaptive_max_pool2d.default,
    aten.constant_pad_nd.default, aten.upsample_nearest2d.default,
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


def _combine(states: list[Any], op: Any) -> Any:
    """Pointwise combination of the inputs' states (None: does not depend on the batch)."""
    if UNKNOWN in states or _MIXED in states:
        return _MIXED if _MIXED in states else UNKNOWN
    live = [s for s in states if s is not None]
    if not live:
        return None
    if all(isinstance(s, Batch) for s in live):
        return live[0] if len(set(live)) == 1 else UNKNOWN
    if not all(isinstance(s, _Reduced) for s in live) or op not in _LINEAR:
        return UNKNOWN
    kinds = {s.kind for s in live}
    if len(kinds) > 1 or (kinds == {"sum"} and len(live) < len(states)):
        return _MIXED  # a sum plus a constant term, or a sum plus a mean
    return live[0] if len(live) == 1 else _Reduced(kinds.pop(), divided=any(s.divided for s in live))


class _Analysis:
    def __init__(self, gm: fx.GraphModule, batch: dict[fx.Node, Batch]) -> None:
        self.state: dict[fx.Node, Any] = dict(batch)
        self.pooled: dict[fx.Node, fx.Node] = {}  # value -> the op that pooled the batch before it
        self.interaction: tuple[fx.Node, fx.Node] | None = None  # (pooling op, where it meets)
        for node in gm.graph.nodes:
            if node.op == "call_function":
                states = [self.of(a) for a in node.all_input_nodes]
                self.state[node] = self._rule(node)
                self._pool(node, states)

    def _pool(self, node: fx.Node, states: list[Any]) -> None:
        """NOTE [interacting examples]: the origin of the pooled values `node` reads, and the
        first meeting of a pooled value and a per-example one."""
        t = target_of(node)
        if t in _SHAPE_ONLY:
            return
        if t is operator.getitem and args_of(node)[0].target in (BOUNDARY, BOUNDARY_BWD):
            origins = [self.pooled.get(args_of(args_of(node)[0])[0][args_of(node)[1]])]
        elif t in (BOUNDARY, BOUNDARY_BWD):  # values crossing a cut together: no meeting
            return
        else:
            origins = [self.pooled.get(a) for a in node.all_input_nodes]
        origin = next((o for o in origins if o is not None), None)
        if origin is None:
            if _pools(node, states, self.state[node]):
                self.pooled[node] = node
            return
        self.pooled[node] = origin
        if self.interaction is None and any(isinstance(s, Batch) for s in states):
            self.interaction = (origin, node)

    def of(self, x: Any) -> Any:
        return self.state.get(x) if isinstance(x, fx.Node) else None

    def _rule(self, node: fx.Node) -> Any:
        states = [self.of(a) for a in node.all_input_nodes]
        if all(s is None for s in states):
            return None
        t, args = target_of(node), args_of(node)
        if t is operator.getitem:
            return self._getitem(node)
        if t in _SUMS:
            return self._reduce(node, _SUMS[t])
        if t in _LOSS_REDUCTION_ARG:
            return self._loss(node)
        if t in _OTHER_REDUCTIONS:
            return self._reduce(node, UNKNOWN)
        if t in _SCALE and isinstance(self.of(args[0]), _Reduced):
            return self._scaled(node)
        if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
            return self._pointwise(node, states)
        return self._structural(node, states)

    def _getitem(self, node: fx.Node) -> Any:
        parent, i = args_of(node)
        if isinstance(parent, fx.Node) and parent.target in (BOUNDARY, BOUNDARY_BWD):
            return self.of(parent.args[0][i])  # type: ignore[index]
        s = self.of(parent)
        if isinstance(parent, fx.Node) and parent.target in _SPLITS and isinstance(s, Batch):
            return piece(s, shape_of(parent.args[0]), shape_of(node), split_dim(parent))
        if isinstance(parent, fx.Node) and parent.target is aten.unbind.int:
            return s
        if isinstance(s, Batch) and i != 0:  # a dropout mask, a norm's statistics: not followed
            return UNKNOWN
        return s

    def _pointwise(self, node: fx.Node, states: list[Any]) -> Any:
        out = shape_of(node)
        moved = []
        for a, s in zip(node.all_input_nodes, states):
            if isinstance(s, Batch) and out is not None:
                shape = shape_of(a) or ()
                s = Batch(s.dim + len(out) - len(shape), s.inner, s.size)
            moved.append(s)
        return _combine(moved, target_of(node))

    def _scaled(self, node: fx.Node) -> Any:
        red, other = self.of(args_of(node)[0]), args_of(node)[1]
        if self.of(other) is not None:
            return UNKNOWN
        if red.kind == "sum" and _divides_to_mean(target_of(node), other, red.counts):
            return _Reduced("mean", divided=True)
        return _Reduced(red.kind, divided=red.divided)

    def _reduce(self, node: fx.Node, kind: str) -> Any:
        src = args_of(node)[0]
        s, shape = self.of(src), shape_of(src)
        if not isinstance(s, Batch) or shape is None:
            kept = isinstance(s, _Reduced) and kind != UNKNOWN or s in (None, _MIXED)
            return s if kept else UNKNOWN
        dims = _dims(node, len(shape))
        if s.dim not in dims:
            keep = bool(_schema_arg(node, "keepdim", False))
            return s if keep else Batch(s.dim - sum(d < s.dim for d in dims), s.inner, s.size)
        if kind == UNKNOWN:  # a max, a norm, ...: neither a sum nor a mean (`Reading.pooled_by`)
            return UNKNOWN
        reduced = prod([shape[d] for d in dims])
        return _Reduced(kind, frozenset({reduced, shape[s.dim], s.size}))

    def _loss(self, node: fx.Node) -> Any:
        pos = _LOSS_REDUCTION_ARG[target_of(node)]
        how = args_of(node)[pos] if len(args_of(node)) > pos else node.kwargs.get("reduction", 1)
        s = self.of(args_of(node)[0])
        if how == 0 and isinstance(s, Batch):  # reduction='none': per example (a class dim leaves)
            nll = target_of(node) in (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
            others = {self.of(a) for a in node.all_input_nodes[1:]} - {None, s}
            return s if others == set() and (not nll or s.dim == 0) else UNKNOWN
        if not isinstance(s, Batch) or how not in (1, 2):
            return UNKNOWN
        shape = shape_of(args_of(node)[0]) or ()
        return _Reduced("mean" if how == 1 else "sum", frozenset({prod(shape), shape[s.dim], s.size}))

    def _structural(self, node: fx.Node, states: list[Any]) -> Any:
        t, args = target_of(node), args_of(node)
        if t in (tp_all_gather, tp_reduce_scatter, aten.cat.default):
            return gathered(node, [self.of(a) for a in node.all_input_nodes])
        if t in _SPLITS:  # the pieces: `_getitem` / `piece`
            return self.of(args[0]) if isinstance(self.of(args[0]), Batch) else UNKNOWN
        if t is aten.unbind.int:  # `q, k, v = qkv.unbind(2)`: each piece keeps the batch (`_getitem`)
            return unbound(self.of(args[0]), shape_of(args[0]), split_dim(node, 1))
        if t is aten.index_put.default and masked_write(node, states):
            return states[0]  # `x[mask] = v`, a boolean mask of x's layout: pointwise
        if t in _ATTENTION:  # each example attends within itself: q, k, v share the batch in dim 0
            live = {x for x in states if x is not None}
            b = live.pop() if len(live) == 1 else None
            return b if isinstance(b, Batch) and b.dim == 0 else UNKNOWN
        if t in _FRESH or t in _NEW and tuple(args[1]) == shape_of(args[0]):  # type: ignore[arg-type]
            return states[0] if isinstance(states[0], Batch) else None  # values: none of the batch
        if t in _BATCH_NORMS or t in _SPATIAL:  # BatchNorm: per microbatch by contract (NOTE)
            b = states[0]
            return b if isinstance(b, Batch) and b.dim == 0 and not any(states[1:]) else UNKNOWN
        if t is aten.embedding.default:  # the weight holds no batch; the indices' batch stays put
            return self.of(args[1]) if states[0] is None else UNKNOWN
        if t is aten.index.Tensor and self.of(args[0]) is None and len(args[1]) == 1:  # type: ignore[arg-type]
            return self.of(args[1][0])  # a table looked up by batched indices: `emb[idx]`
        if t in _WRITES_INTO and isinstance(states[0], Batch) and states[1] in (None, states[0]):
            dim = int(args[2]) if t is aten.slice_scatter.default and len(args) > 2 else None  # type: ignore[arg-type]
            return (
                states[0] if dim is None or dim % len(shape_of(args[0]) or (0,)) != states[0].dim else UNKNOWN
            )
        if t is aten.index.Tensor and isinstance(states[0], Batch):
            return iota_indexed(node, states[0], [self.of(i) for i in args[1]])  # type: ignore[union-attr]
        if t in MATMUL:
            return matmul(node, [self.of(a) for a in args])
        s = self.of(args[0]) if args else None
        if isinstance(s, _Reduced) and t in (*_SAME, aten.view.default, aten.squeeze.default):
            return s
        if not isinstance(s, Batch) or any(x is not None for x in states[1:]):
            return UNKNOWN
        old, new = shape_of(args[0]), shape_of(node)
        if t in _SAME:
            return s
        if t in RESHAPE and old is not None and new is not None:
            return reshaped(s, old, new)
        rule = MOVES.get(t)
        return rule(s, node, len(old or ())) if rule else UNKNOWN


def _schema_arg(node: fx.Node, name: str, default: Any) -> Any:
    """Argument `name` of an aten op's call, by its schema (positional or keyword)."""
    if name in node.kwargs:
        return node.kwargs[name]
    names = [a.name for a in target_of(node)._schema.arguments]
    k = names.index(name) if name in names else len(args_of(node))
    return args_of(node)[k] if k < len(args_of(node)) else default


def _dims(node: fx.Node, ndim: int) -> list[int]:
    """The dims a reduction reduces (all of them for a full one)."""
    dims: Any = _schema_arg(node, "dim", None) if target_of(node) not in _FULL else None
    if dims is None or dims == []:
        return list(range(ndim))
    return sorted({d % ndim for d in (dims if isinstance(dims, (list, tuple)) else [dims])})


def _pools(node: fx.Node, states: list[Any], out: Any) -> bool:
    """Does `node` reduce over (or mix) the batch's dim? (NOTE [interacting examples])"""
    t, args = target_of(node), args_of(node)
    first = states[0] if states else None
    if t in _SUMS or t in _LOSS_REDUCTION_ARG:
        return isinstance(first, Batch) and isinstance(out, _Reduced)
    if t in _OTHER_REDUCTIONS:
        return isinstance(first, Batch) and not isinstance(out, Batch)
    if t in (aten._softmax.default, aten._safe_softmax.default, aten._log_softmax.default) and isinstance(
        first, Batch
    ):
        return int(args[1]) % len(shape_of(args[0]) or (0,)) == first.dim
    if t not in MATMUL:
        return False
    operands = [a for a in args if isinstance(a, fx.Node)][-2:]  # (addmm: without the bias)
    a, b = (shape_of(o) or () for o in operands)
    sa, sb = (s for s in states[-2:]) if len(states) >= 2 else (None, None)
    contracted_a = isinstance(sa, Batch) and sa.dim == len(a) - 1
    contracted_b = isinstance(sb, Batch) and sb.dim == max(len(b) - 2, 0)
    return contracted_a or contracted_b


def _divides_to_mean(op: Any, other: Any, counts: frozenset[int]) -> bool:
    """Is `sum / other` the sum divided by one of the counts it reduced (a mean)?"""
    if op not in (aten.div.Tensor, aten.div.Scalar) or not isinstance(other, (int, float)):
        return False
    return any(math.isclose(other, c, rel_tol=1e-9) for c in counts)


_OTHER_REDUCTIONS = {  # reductions over dims that are neither a sum nor a mean
    aten.amax.default, aten.amin.default, aten.argmax.default, aten.argmin.default,
    aten.max.default, aten.min.default, aten.max.dim, aten.min.dim, aten.logsumexp.default,
    aten.var.correction, aten.std.correction, aten.prod.dim_int, aten.prod.default,
    aten.linalg_vector_norm.default, aten.any.dim, aten.all.dim,
}  # fmt: skip
_FULL = {aten.sum.default, aten.mean.default, aten.max.default, aten.min.default, aten.prod.default}
_FRESH = {  # a value of the input's shape whose values do not depend on the input's (a dropout
    # mask: empty_like, then bernoulli_): per element, in the input's layout
    aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default,
    aten.full_like.default, aten.rand_like.default, aten.randn_like.default,
    aten.bernoulli_.float, aten.bernoulli.p, aten.bernoulli.default, aten.uniform_.default,
    aten.normal_.default, aten.fill.Scalar, aten.fill.Tensor,
}  # fmt: skip
_WRITES_INTO = {aten.copy.default, aten.slice_scatter.default, aten.select_scatter.default}
_NEW = {aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default}
_SHAPE_ONLY = _FRESH | _NEW | {aten.sym_size.int}  # read only shapes, dtypes: no pooled origin


@dataclasses.dataclass
class Reading:
    """What the walk over a forward graph read (NOTE [an honest reduction], NOTE [interacting
    examples]): per output, its state and the op that pooled the batch before it."""

    states: list[Any]
    pooled_by: list[fx.Node | None]
    interaction: tuple[fx.Node, fx.Node] | None

    def kind(self, i: int) -> str | None:
        """Output `i`'s reduction: "mean", "sum", "mixed", "divided" (a sum divided by a count it reduced),
        "constant" (it does not depend on the batch), or None (not followed)."""
        s = self.states[i]
        if isinstance(s, _Reduced):
            return "divided" if s.divided else s.kind
        return "mixed" if s == _MIXED else "constant" if s is None else None


def read_outputs(gm: fx.GraphModule, data_axes: dict[int, int]) -> Reading:
    """Walk the forward graph `gm` once. `data_axes`: placeholder position -> split axis, for
    the data inputs split into microbatches."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    batch = {}
    for pos, axis in data_axes.items():
        shape = shape_of(phs[pos])
        if shape is not None and len(shape) > axis:
            batch[phs[pos]] = Batch(axis, 1, shape[axis])
    analysis = _Analysis(gm, batch)
    outs = list(gm.graph.find_nodes(op="output")[0].args[0])  # type: ignore[arg-type]
    return Reading(
        [analysis.of(o) for o in outs],
        [analysis.pooled.get(o) if isinstance(o, fx.Node) else None for o in outs],
        analysis.interaction,
    )
