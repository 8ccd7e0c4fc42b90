"""Loss scaling for fp16 that every rank agrees on.

NOTE [agreed loss scaling]
`torch.amp.GradScaler` skips a step whose gradients hold an inf or nan and halves the scale. In
a pipeline each rank holds other gradients (its stages', its dp shard, its tp shard): a rank that
decided alone would skip a step its peers take, and the replicas would part. `LossScaler.unscale_`
asks every rank of the job in one all-reduce of a found-inf flag over the world group, with the
pipeline's deadline, so every rank skips the same steps and changes the scale alike.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..runtime import DEFAULT_TIMEOUT, group_of
from ..tracing import tree

__all__ = ["LossScaler"]


class LossScaler:
    """Dynamic loss scaling across every pipeline, data- and tensor-parallel rank.

    Multiply the loss by `scaler.scale` inside the pipelined function (pass it as an argument:
    a 0-dim tensor is never split), then `scaler.unscale_(grads, pipeline=piped)`: False when any
    rank's gradients are not finite (skip the optimizer step); `scaler.update()` after each step.

    Args:
        init_scale: the first scale.
        growth_factor: the scale's factor after `growth_interval` finite steps in a row.
        backoff_factor: the scale's factor after a step with an inf or nan anywhere.
        growth_interval: finite steps in a row before the scale grows.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.scale = torch.tensor(float(init_scale))
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.found_inf: bool | None = None  # set by unscale_, read by update

    def unscale_(self, grads: Any, *, pipeline: Any = None) -> bool:
        """Divide `grads` by the scale in place, unless some rank's gradients hold an inf or nan;
        return whether every rank's are finite (one all-reduce over the world group)."""
        leaves = [g for g in tree.flatten(grads)[0] if g is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in leaves]
        flag = torch.tensor([float(any(not bool(torch.isfinite(g).all()) for g in local))])
        world = _world(pipeline)
        if world is not None:
            timeout = pipeline.cfg.timeout if pipeline is not None else DEFAULT_TIMEOUT
            flag = flag.to(world.device)
            world.all_reduce(flag, timeout, "agreeing whether any rank's gradients overflowed")
        self.found_inf = bool(flag.item() > 0)
        if not self.found_inf:
            inv = 1.0 / float(self.scale)
            for g in local:
                g.mul_(inv)
        return not self.found_inf

    def update(self) -> None:
        """After each step: halve the scale (backoff) if `unscale_` found an inf or nan on any
        rank, else grow it after `growth_interval` finite steps."""
        if self.found_inf is None:
            raise RuntimeError("LossScaler.update(): call unscale_(grads, pipeline=piped) first, each step.")
        if self.found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
        self.found_inf = None

    def state_dict(self) -> dict[str, Any]:
        """The scale and the count of finite steps: for `fpipe.save(..., extra=...)`."""
        return {"scale": float(self.scale), "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = torch.tensor(float(state["scale"]))
        self.good_steps = int(state["good_steps"])


def _world(pipeline: Any) -> Any:
    """The world group to agree over (None in one process); a group needs `pipeline=`."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    if pipeline is None:
        raise ValueError(
            "LossScaler.unscale_(grads): a process group is running, so whether to skip the step "
            "is agreed over every rank; pass pipeline=piped (the Pipelined that produced grads)."
        )
    return group_of(dist.group.WORLD)
