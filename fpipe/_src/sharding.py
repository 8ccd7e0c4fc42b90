"""Sharded parameters (ZeRO/FSDP-style): DTensors placed `Shard(0)` on the mesh's "dp" sub-mesh.

A step gathers each sharded parameter this rank's stages read once (`gathered`), runs the
programs on whole tensors, and returns its gradient reduce-scattered to the parameter's own
placement (`replicas.GradReducer`), so a stock optimizer steps 1/dp of each parameter and keeps
1/dp of its state. A parameter two pipeline ranks share (a tied embedding and head) is reduced on
the rank that sums its gradient and its shard sent to the other (`broadcast_shard`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from .dist import PPGroup


def check_sharded(call: str, dp_mesh: Any, params: list[torch.Tensor], keys: list[Any]) -> None:
    """DTensor parameters must be sharded `Shard(0)` over the mesh's "dp" sub-mesh (the layout
    torch's `fully_shard` uses): refused otherwise, before any collective."""
    for i, p in enumerate(params):
        if not isinstance(p, DTensor):
            continue
        name = repr(keys[i]) if i < len(keys) else f"leaf {i}"
        if dp_mesh is None or p.device_mesh != dp_mesh or tuple(p.placements) != (Shard(0),):
            raise ValueError(
                f"{call}: parameter {name} is a DTensor on mesh {p.device_mesh} with placements "
                f"{tuple(p.placements)}; fpipe shards parameters over data-parallel replicas only as "
                "Shard(0) on the pipeline mesh's 'dp' sub-mesh: distribute_tensor(t, mesh['dp'], "
                "[Shard(0)])."
            )


def gathered(params: list[torch.Tensor], local: set[int]) -> list[torch.Tensor]:
    """The parameters the programs read: a sharded one this rank's stages use, gathered whole
    (once per step); one they do not use, its shard (never read)."""
    out = []
    for i, p in enumerate(params):
        if isinstance(p, DTensor):
            p = p.full_tensor() if i in local else p.to_local()
        out.append(p)
    return out


def broadcast_shard(pg: PPGroup, g: Any, param: DTensor, src: int, timeout: float) -> DTensor:
    """A sharded gradient from pipeline rank `src` to this rank, as a DTensor placed like `param`
    (both ranks have the same position on their own "dp" sub-mesh, so the same shard)."""
    shard = param.to_local()
    local = g.to_local().contiguous() if g is not None else torch.empty_like(shard)
    pg.broadcast(local, src, timeout, f"receiving a sharded gradient from rank {src}")
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
