"""Where the batch lives as a value flows through an operation: the layout rules of the walk
in reduction.py (NOTE [an honest reduction]). A `Batch` says in which dim of a value the batch
lives (and as which factor of that dim); each rule maps it through one kind of operation --
views and reshapes, transposes and permutes, matrix products, splits, concatenations and
tensor-parallel gathers -- or answers UNKNOWN where the batch is no longer followed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from .tp_collectives import tp_reduce_scatter

aten = torch.ops.aten
UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class Batch:
    """The batch lives in dim `dim`, as the factor of size `size` whose stride within it is `inner`."""

    dim: int
    inner: int
    size: int


def args_of(node: fx.Node) -> Any:
    return node.args  # fx's Argument union is too wide to index without a cast at every use


def target_of(node: fx.Node) -> Any:
    return node.target


def shape_of(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def prod(xs: Sequence[int]) -> int:
    return math.prod(xs)


def reshaped(b: Batch, old: Sequence[int], new: Sequence[int]) -> Any:
    """The batch factor after a row-major reshape: in the one new dim that holds it whole."""
    after = b.inner * prod(old[b.dim + 1 :])  # the factor's stride in the flat index
    for j in range(len(new)):
        below = prod(new[j + 1 :])
        if after % below == 0 and after * b.size <= below * new[j]:
            return Batch(j, after // below, b.size)
    return UNKNOWN


# Tensor parallelism moves the batch through DTensor's collectives along dim 0: an all-gather
# stacks the tp ranks' tensors in dim 0, split back into pieces and concatenated along the
# sharded dim; a reduce-scatter keeps one of the tp chunks of dim 0. Each tp rank's tensor has the
# same batch layout, so the batch stays where it was, with the ranks as an outer factor of dim 0;
# a piece or chunk keeps it when it holds the batch factor whole.


def gathered(node: fx.Node, states: list[Any]) -> Any:
    """tp_all_gather / tp_reduce_scatter / cat of tensors with one batch layout: the same."""
    live = [x for x in states if x is not None]
    if not live or any(x != live[0] for x in live) or not isinstance(live[0], Batch):
        return UNKNOWN
    b = live[0]
    if node.target is tp_reduce_scatter and b.dim == 0:
        rows = (shape_of(node) or (0,))[0]
        return b if rows % (b.inner * b.size) == 0 else UNKNOWN
    empty = sum(shape_of(a) == (0,) for a in node.all_input_nodes)  # cat skips 1-d empty pieces
    if node.target is aten.cat.default and len(live) < len(states) - empty:
        return UNKNOWN  # a piece with no batch beside pieces with one
    return b


def masked_write(node: fx.Node, states: list[Any]) -> bool:
    x, indices = args_of(node)[:2]
    masks = [m.meta.get("val") for m in indices if isinstance(m, fx.Node)]
    bools = len(masks) == len(indices) == 1 and getattr(masks[0], "dtype", None) is torch.bool
    lead = shape_of(indices[0]) if bools else None  # a mask over x's leading dims
    same = lead is not None and (shape_of(x) or ())[: len(lead)] == lead
    return bool(same and states[-1] is None and len(set(states[:-1])) == 1)


def split_dim(node: fx.Node, at: int = 2) -> int:
    """The dim argument of a split (`at` 2) or an unbind (`at` 1)."""
    args = args_of(node)
    return int(args[at]) if len(args) > at else int(node.kwargs.get("dim", 0))  # type: ignore[arg-type]


def unbound(b: Any, whole: Any, dim: int) -> Any:
    """Each piece of an unbind along `dim`: the batch, one dim lower if it lived after `dim`;
    unknown if the unbind takes the batch's own dim apart (or the shape is unknown)."""
    if not isinstance(b, Batch):
        return UNKNOWN if b is not None else None
    if whole is None or dim % len(whole) == b.dim:
        return UNKNOWN
    return Batch(b.dim - (b.dim > dim % len(whole)), b.inner, b.size)


def piece(b: Batch, whole: Any, piece: Any, dim: int) -> Any:
    """A piece of a split: the batch where it was if the split leaves its factor whole."""
    if whole is None or piece is None:
        return UNKNOWN
    dim = dim % len(whole)
    if dim != b.dim:
        return b
    return b if piece[dim] % (b.inner * b.size) == 0 else UNKNOWN


def matmul(node: fx.Node, states: list[Any]) -> Any:
    """A product keeps a batch that lives in the rows of its first operand (and the leading dim
    of a batched product, when both operands hold the batch there alike)."""
    operands = list(args_of(node))
    if target_of(node) is aten.addmm.default:
        if states[0] is not None:
            return UNKNOWN
        states, operands = states[1:], operands[1:]
    first, second = states[0], states[1]
    ndim = len(shape_of(operands[0]) or ())
    if not isinstance(first, Batch) or first.dim >= ndim - 1:  # none, or in the contracted dim
        return UNKNOWN
    if second is not None and (second != first or first.dim >= ndim - 2):
        return UNKNOWN
    return first


def _move_permute(s: Batch, node: fx.Node, ndim: int) -> Any:
    order = [d % ndim for d in args_of(node)[1]]  # type: ignore[union-attr]
    return Batch(order.index(s.dim), s.inner, s.size)


def _move_transpose(s: Batch, node: fx.Node, ndim: int) -> Any:
    a, b = (args_of(node)[1] % ndim, args_of(node)[2] % ndim) if len(args_of(node)) > 2 else (0, 1)  # type: ignore[operator]
    return Batch({a: b, b: a}.get(s.dim, s.dim), s.inner, s.size)


def _move_unsqueeze(s: Batch, node: fx.Node, ndim: int) -> Any:
    k = args_of(node)[1] % (ndim + 1)  # type: ignore[operator]
    return Batch(s.dim + (k <= s.dim), s.inner, s.size)


def _move_select(s: Batch, node: fx.Node, ndim: int) -> Any:
    k = args_of(node)[1] % ndim  # type: ignore[operator]
    if k == s.dim:
        return UNKNOWN
    return Batch(s.dim - (k < s.dim), s.inner, s.size) if target_of(node) is aten.select.int else s


def _move_last_dim(s: Batch, node: fx.Node, ndim: int) -> Any:
    """Softmax-like ops over one dim, norms over the trailing dims: per-example if not the batch's."""
    if target_of(node) is aten.native_layer_norm.default:
        return s if s.dim < ndim - len(args_of(node)[1]) else UNKNOWN  # type: ignore[arg-type]
    return s if args_of(node)[1] % ndim != s.dim else UNKNOWN  # type: ignore[operator]


def _move_squeeze(s: Batch, node: fx.Node, ndim: int) -> Any:
    """Size-1 dims removed (all of them, or those named): the batch moves down past them."""
    shape = shape_of(args_of(node)[0]) or ()
    named: Any = args_of(node)[1] if len(args_of(node)) > 1 else range(ndim)
    gone = [
        d % ndim for d in (named if isinstance(named, (list, tuple, range)) else [named]) if shape[d] == 1
    ]
    return UNKNOWN if s.dim in gone else Batch(s.dim - sum(d < s.dim for d in gone), s.inner, s.size)


def _move_matrices(s: Batch, node: fx.Node, ndim: int) -> Any:
    """Batched linear algebra on the last two dims (an inverse, a Cholesky factor): per matrix."""
    return s if s.dim < ndim - 2 else UNKNOWN


def _move_expand(s: Batch, node: fx.Node, ndim: int) -> Any:
    return Batch(s.dim + len(args_of(node)[1]) - ndim, s.inner, s.size)  # type: ignore[arg-type]


RESHAPE = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
MATMUL = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.mv.default}
MOVES = {
    aten.permute.default: _move_permute,
    aten.transpose.int: _move_transpose,
    aten.t.default: _move_transpose,
    aten.unsqueeze.default: _move_unsqueeze,
    aten.squeeze.default: _move_squeeze,
    aten.linalg_inv_ex.default: _move_matrices,
    aten.linalg_cholesky_ex.default: _move_matrices,
    aten.squeeze.dim: _move_squeeze,
    aten.squeeze.dims: _move_squeeze,
    aten.select.int: _move_select,
    aten.slice.Tensor: _move_select,
    aten._log_softmax.default: _move_last_dim,
    aten._softmax.default: _move_last_dim,
    aten._safe_softmax.default: _move_last_dim,
    aten.native_layer_norm.default: _move_last_dim,
    aten.expand.default: _move_expand,
}


_THROUGH = {aten.unsqueeze.default, aten.view.default, aten.expand.default, aten._to_copy.default}


def _iota(node: Any, n: int) -> bool:
    """Is `node` `arange(n)` (0, 1, ..., n-1), through unsqueezes, views, expands, casts?"""
    while isinstance(node, fx.Node) and node.target in _THROUGH:
        node = args_of(node)[0]
    if not isinstance(node, fx.Node) or node.target not in (aten.arange.default, aten.arange.start):
        return False
    bounds = [a for a in args_of(node) if isinstance(a, (int, float))]
    return bounds in ([n], [0, n]) and "step" not in node.kwargs


def iota_indexed(node: fx.Node, b: Batch, index_states: list[Any]) -> Any:
    """`x[arange(B)[:, None, ...], j, ...]`, x's batch in dim 0 (B = its size): each example
    picks from itself (transformers' attention masks), the batch in dim 0 of the result."""
    first, *rest = args_of(node)[1]
    x_shape, index_shape = shape_of(args_of(node)[0]), shape_of(first)
    if b.dim != 0 or x_shape is None or index_shape is None or any(s is not None for s in index_states):
        return UNKNOWN
    n = x_shape[0]
    lead = [d for d, size in enumerate(index_shape) if size != 1]
    return b if lead == [0] and index_shape[0] == n and _iota(first, n) else UNKNOWN


def scattered(node: fx.Node, b: Batch, src: Any) -> Any:
    """`copy(dst, src)`, `slice_scatter` / `select_scatter(dst, src, dim, ...)` into a `dst`
    whose batch is `b`: the batch stays if `src` holds it alike (or not at all) and the write
    is not along the batch's dim."""
    if node.target is aten.copy.default:
        return b if src in (None, b) else UNKNOWN
    given: Any = args_of(node)[2] if len(args_of(node)) > 2 else node.kwargs.get("dim", 0)
    dim = int(given) % len(shape_of(args_of(node)[0]) or (1,))
    if dim == b.dim:
        return UNKNOWN
    moved = Batch(b.dim - (dim < b.dim), b.inner, b.size) if node.target is aten.select_scatter.default else b
    return b if src in (None, moved) else UNKNOWN
