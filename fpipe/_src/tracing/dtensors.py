"""Two small DTensor helpers shared by sharding (dp), tensor parallelism, markers and materialize."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["like", "local"]


def like(local_: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`local_` as this rank's shard of a tensor laid out like `x` (`local_` itself if `x` is a
    plain tensor). The global shape is given: `from_local` alone would take mesh size x the local
    rows, wrong when the mesh does not divide the sharded dim."""
    if not isinstance(x, DTensor):
        return local_
    return DTensor.from_local(
        local_, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
    )


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t
