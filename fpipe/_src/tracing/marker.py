"""The stage boundary marker.

`stage_boundary(x)` is the identity on a tensor or a pytree of tensors. Traced, it leaves one
`fpipe::boundary` node in the graph; differentiated, its backward leaves one
`fpipe::boundary_bwd` node on the incoming gradients -- the transpose of the boundary, as in JaxPP.
`split.py` cuts the joint graph at these two kinds of node.

# NOTE [why a custom_op inside an autograd.Function]
A `torch.library.custom_op` is opaque to make_fx (one node, not decomposed) and has a fake impl,
so tracing on fake or meta tensors works. On torch 2.13 its `register_autograd` does not compose
with `torch.func.grad`, so the differentiation rule lives in a new-style `autograd.Function`
(`setup_context`, `generate_vmap_rule=True`, a `jvp` that marks the tangents too), which
composes with grad, vjp, vmap and jvp. The op must
not alias its inputs, so the eager impl clones; the split replaces markers by their inputs, so no
stage program ever pays for that copy.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import tree
from .dtensors import like, local

__all__ = ["stage_boundary", "BOUNDARY", "BOUNDARY_BWD"]


@torch.library.custom_op("fpipe::boundary", mutates_args=())
def _boundary(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.clone() for x in xs]


@_boundary.register_fake
def _(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in xs]


@torch.library.custom_op("fpipe::boundary_bwd", mutates_args=())
def _boundary_bwd(gs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [g.clone() for g in gs]


@_boundary_bwd.register_fake
def _(gs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(g) for g in gs]


def _identity_vmap(info: Any, in_dims: Any, xs: list[torch.Tensor]) -> Any:
    return [x.clone() for x in xs], list(in_dims[0])


_boundary.register_vmap(_identity_vmap)
_boundary_bwd.register_vmap(_identity_vmap)

BOUNDARY = torch.ops.fpipe.boundary.default
BOUNDARY_BWD = torch.ops.fpipe.boundary_bwd.default


class _Boundary(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(BOUNDARY(list(xs)))

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return _BoundaryBwd.apply(*gs)

    @staticmethod
    def jvp(ctx: Any, *ts: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        # forward mode: the tangents cross the boundary with the values (one stage up)
        return _marked(BOUNDARY, ts)


class _BoundaryBwd(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(*gs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(BOUNDARY_BWD(list(gs)))

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        # The gradient of the gradient marker: a boundary again (double backward).
        return _Boundary.apply(*gs)

    @staticmethod
    def jvp(ctx: Any, *ts: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return _marked(BOUNDARY_BWD, ts)


def _marked(op: Any, ts: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
    """The tangents through the marker `op` (a zero tangent, None or a ZeroTensor, stays None)."""
    ts = tuple(None if t is None or t._is_zerotensor() else t for t in ts)
    some = [t for t in ts if t is not None]
    it = iter(op(some) if some else [])
    return tuple(None if t is None else next(it) for t in ts)


def boundary_apply(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Apply the differentiable marker to a flat list of tensors; a DTensor crosses as its local
    shard (NOTE [tensor-parallel tracing] in tp.py)."""
    if not any(isinstance(x, DTensor) for x in xs):
        return list(_Boundary.apply(*xs))
    # a Partial value stays partial; its gradient comes back replicated (DTensor's rule)
    marked = _Boundary.apply(*(local(x) for x in xs))
    return [like(m, x) for x, m in zip(xs, marked)]


def boundary_bwd_apply(gs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Apply the differentiable backward marker (replaying a graph that took a gradient)."""
    return list(_BoundaryBwd.apply(*gs))


def stage_boundary(x: Any) -> Any:
    """End one pipeline stage and begin the next.

    The identity on a tensor or a pytree of tensors. In a function traced by `fpipe.pipeline`
    each call cuts the program: what comes after it runs on the next stage. It composes with
    `torch.func.grad`, `vjp`, `vmap` and tracing, so a function with boundaries is an ordinary
    function everywhere else.

    Args:
        x: a tensor or a pytree whose leaves are tensors.

    Returns:
        `x`, unchanged in value.

    Raises:
        ValueError: a leaf of `x` is not a tensor (only tensors can cross stages).

    Example:
        >>> import torch, fpipe
        >>> def f(w, x):
        ...     h = fpipe.stage_boundary(torch.tanh(x @ w))
        ...     return (h @ w).sum()
        >>> w, x = torch.eye(2), torch.ones(3, 2)
        >>> torch.allclose(torch.func.grad(f)(w, x), torch.func.grad(lambda w, x: (torch.tanh(x @ w) @ w).sum())(w, x))
        True
    """
    leaves, spec = tree.flatten(x)
    bad = [(i, type(leaf).__name__) for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)]
    if bad:
        i, name = bad[0]
        article = "an" if name[:1].lower() in "aeiou" else "a"
        raise ValueError(
            f"stage_boundary(x): leaf {i} of x is {article} {name}, not a tensor; only tensors can cross "
            "a stage boundary. Pass the non-tensor values around the boundary (they are "
            "constants of the traced program) or convert them with torch.as_tensor."
        )
    if not leaves:
        warnings.warn("stage_boundary(x): x holds no tensors, so no boundary is made.", stacklevel=2)
        return x
    return tree.unflatten(boundary_apply(leaves), spec)
