"""What a custom training loop needs across pipeline ranks: gradient norm, clipping, `.grad`."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..tracing import tree

__all__ = ["clip_grad_norm_", "set_grads"]

_Parts = tuple[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]  # plain, dp shards, tp shards


def clip_grad_norm_(
    grads: Any, max_norm: float, *, pipeline: Any = None, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip gradients in place by their global norm over all pipeline ranks; return the norm.

    Args:
        grads: the gradient pytree from `fpipe.value_and_grad` (this rank's parameters).
        max_norm: the largest allowed global norm.
        pipeline: the `Pipelined` that produced `grads`; in a process group it tells which
            rank owns a parameter that several ranks share (counted once). Not needed in one
            process.
        norm_type: the p of the p-norm (2.0 or math.inf).

    Example:
        >>> import torch, fpipe
        >>> g = {"w": torch.tensor([3.0, 4.0])}
        >>> fpipe.clip_grad_norm_(g, 1.0)
        tensor(5.)
        >>> g["w"]
        tensor([0.6000, 0.8000])
    """
    if pipeline is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            "clip_grad_norm_(grads, max_norm): a process group is running, so the global norm "
            "spans ranks; pass pipeline=piped (the Pipelined that produced grads) so every rank "
            "clips by the same factor."
        )
    leaves, _ = tree.flatten(grads)
    device = leaves[0].device if leaves else torch.device("cpu")
    groups = pipeline._groups if pipeline is not None else None
    try:  # this rank's parts first, before any collective: a failure here stops the peers at once
        parts, dtype = _local_parts(grads, leaves, pipeline, norm_type, device)
    except Exception as err:
        if groups is not None:
            groups.report_failure(err)
        raise
    total, dtype = _global(parts, dtype, pipeline, norm_type)
    total = total if norm_type == math.inf else total.pow(1.0 / norm_type)
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        for g in leaves:
            if g is not None:
                g.mul_(coef)
    return total.to(device=device, dtype=dtype)


def _local_parts(
    grads: Any, leaves: list[Any], pipeline: Any, norm_type: float, device: torch.device
) -> tuple[_Parts, torch.dtype]:
    """This rank's partial norms (`_partial_norm`) of its plain (and tp-replicated) gradients, of
    its dp shards and of its tp shards (None where it holds none), and the norm's dtype."""
    pg = pipeline.pg if pipeline is not None else None
    owned = _owned_leaves(grads, pipeline) if pg is not None else [g for g in leaves if g is not None]
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in owned) else torch.float32
    # In a group every rank reduces in float64: a rank whose stages hold no parameters has no
    # dtype of its own to go by, and the all-reduce needs the same dtype everywhere.
    acc = torch.float64 if pg is not None else dtype
    tp_mesh = pipeline._groups.tp_mesh if pipeline is not None else None
    # A DTensor on mesh["tp"] (tensor parallel) is sharded over the tp ranks, or replicated on
    # them (a norm's weight: counted once, like a plain tensor); any other is sharded over dp.
    by_tp = [g for g in owned if isinstance(g, DTensor) and g.device_mesh == tp_mesh]
    tp_shards = [g.to_local() for g in by_tp if any(p.is_shard() for p in g.placements)]
    plain = [g for g in owned if not isinstance(g, DTensor)]
    plain += [g.to_local() for g in by_tp if not any(p.is_shard() for p in g.placements)]
    dp_shards = [g.to_local() for g in owned if isinstance(g, DTensor) and g.device_mesh != tp_mesh]
    dp_part, tp_part = (
        _partial_norm(gs, norm_type, acc, device) if gs else None for gs in (dp_shards, tp_shards)
    )
    return (_partial_norm(plain, norm_type, acc, device), dp_part, tp_part), dtype


def _global(
    parts: _Parts, dtype: torch.dtype, pipeline: Any, norm_type: float
) -> tuple[torch.Tensor, torch.dtype]:
    """The global partial norm and dtype: each shard part reduced over its group (dp, tp; NOTE
    [gradients over replicas], tp.py), then everything over the pipeline ranks, each collective
    under the pipeline's deadline (`PPGroup.all_reduce`)."""
    local, dp_part, tp_part = parts
    if pipeline is None:
        return local, dtype
    g, timeout = pipeline._groups, pipeline.cfg.timeout
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    for part, group, what in ((dp_part, g.dp, "data-parallel"), (tp_part, g.tp, "tensor-parallel")):
        if part is not None and group is not None:  # add the other shards' parts
            part = group.all_reduce(part.to(group.device), timeout, f"clip_grad_norm_ over {what} shards", op)
            local = (
                torch.maximum(local, part.to(local.device))
                if norm_type == math.inf
                else local + part.to(local.device)
            )
    if g.pp is None:
        return local, dtype
    # with whether any rank's gradients are fp64: the norm's dtype on all
    both = torch.stack([local, torch.tensor(float(dtype == torch.float64), dtype=local.dtype)]).to(
        g.pp.device
    )
    g.pp.all_reduce(both, timeout, "clip_grad_norm_ over pipeline ranks", op)
    return both[0], torch.float64 if both[1].item() > 0 else torch.float32


def _partial_norm(
    gs: list[torch.Tensor], norm_type: float, acc: torch.dtype, device: torch.device
) -> torch.Tensor:
    """max |g| (norm_type inf) or the sum of |g|^p over `gs`, in dtype `acc` (an empty shard,
    where dp does not divide a first dimension, counts 0)."""
    zero = torch.zeros((), dtype=acc, device=device)
    if norm_type == math.inf:
        return max((g.abs().max().to(acc) for g in gs if g.numel()), default=zero)
    return sum((g.to(acc).pow(norm_type).sum() for g in gs), zero)


def _owned_leaves(grads: Any, pipeline: Any) -> list[torch.Tensor]:
    if not isinstance(grads, dict):
        raise TypeError(
            "clip_grad_norm_(grads, pipeline=...): in a process group, grads must be the params dict's gradients."
        )
    owner = pipeline.param_owner()
    return [
        g for k, g in grads.items() if g is not None and owner.get(k, pipeline.pg.rank) == pipeline.pg.rank
    ]


def set_grads(params: Any, grads: Any) -> None:
    """Set `.grad` of each tensor in `params` from the matching entry of `grads`, so any
    `torch.optim` optimizer built over this rank's parameters can `step()`.

    Entries of `params` without a gradient (another rank's parameters) are left alone.

    Example:
        >>> import torch, fpipe
        >>> params = {"w": torch.zeros(2)}
        >>> opt = torch.optim.SGD(params.values(), lr=0.5)
        >>> fpipe.set_grads(params, {"w": torch.ones(2)})
        >>> opt.step(); params["w"]
        tensor([-0.5000, -0.5000])
    """
    if isinstance(params, dict) and isinstance(grads, dict):
        for k, g in grads.items():
            params[k].grad = g
        return
    for p, g in zip(tree.flatten(params)[0], tree.flatten(grads)[0]):
        if g is not None:
            p.grad = g
