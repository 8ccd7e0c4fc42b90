"""Mixed precision on 4 ranks, dp=2 x pp=2, for `tests/pipeline/test_precision.py`: run inside
`tests/support/dp_worker.py`'s part of the shared 4-rank launch (`run(mesh)` returns this rank's record).

- "reduce": fp32 master weights computed in bf16 (`Precision(param_dtype=bf16)`): the dtypes the
  dp all-reduce ran in, and the gradient error against float64 next to one unsplit bf16 step's.
- "scaler": fp16 with `fpipe.LossScaler`: an inf injected into one rank's gradients (rank 3 only)
  must make every rank skip the step and halve the scale; a finite step then unscales, and
  `fpipe.clip_grad_norm_` runs after it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

import fpipe
from fpipe._src.parallel import replicas
from fpipe._src.runtime import precision as precision_

D, BATCH, M = 8, 32, 4


def mlp(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, scale: Any = 1.0) -> torch.Tensor:
    """Three layers in two stages; the loss times `scale` (a loss scaler's)."""
    h = torch.tanh(x @ p["w0"] + p["b0"])
    h = fpipe.stage_boundary(torch.tanh(h @ p["w1"] + p["b1"]))
    return ((h @ p["w2"] + p["b2"] - y) ** 2).mean() * scale


def setup() -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    p = {f"w{i}": torch.randn(D, D, generator=g) / D**0.5 for i in range(3)}
    p.update({f"b{i}": torch.randn(D, generator=g) * 0.1 for i in range(3)})
    return p, torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)


def rel_err(g: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    keys = list(g)
    num = sum(((g[k].double() - ref[k]) ** 2).sum() for k in keys)
    return float((num / sum((ref[k] ** 2).sum() for k in keys)) ** 0.5)


def reduce(mesh: Any) -> dict[str, Any]:
    """bf16 compute, fp32 masters over dp x pp: what dtype the dp all-reduce ran in."""
    p, x, y = setup()
    bf = {k: v.bfloat16() for k, v in p.items()}  # the compute point, for the float64 reference
    ref = torch.func.grad(mlp)({k: v.double() for k, v in bf.items()}, x.bfloat16().double(), y.double())
    unsplit = torch.func.grad(mlp)(bf, x.bfloat16(), y.bfloat16())
    dp_rank = mesh.get_local_rank("dp")
    seen: list[str] = []
    real = replicas.for_reduce

    def spy(*args: Any) -> torch.Tensor:  # what GradReducer hands the all-reduce
        out = real(*args)
        seen.append(str(out.dtype))
        return out

    piped = fpipe.pipeline(
        mlp, mesh=mesh, microbatches=M, precision=fpipe.Precision(param_dtype=torch.bfloat16)
    )
    replicas.for_reduce = spy
    try:
        grads = fpipe.grad(piped)(p, x.bfloat16().chunk(2)[dp_rank], y.bfloat16().chunk(2)[dp_rank])
    finally:
        replicas.for_reduce = real
    return {
        "real_casts": real_casts(mesh, piped, p, x, y),
        "reduce_dtypes": sorted(set(seen)),
        "grad_dtypes": sorted({str(g.dtype) for g in grads.values()}),
        "err": rel_err(grads, ref),
        "unsplit_err": rel_err({k: unsplit[k] for k in grads}, ref),
    }


def real_casts(
    mesh: Any, piped: Any, p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> list[int]:
    """Another step with other ranks' parameters on the meta device (as `materialize` gives
    them): [real parameters cast, this rank's stages' parameters]."""
    pp_rank = mesh.get_local_rank("pp")
    mine = {k for k, r in piped.param_owner().items() if r == pp_rank}
    given = {k: v if k in mine else torch.empty_like(v, device="meta") for k, v in p.items()}
    casts: list[int] = []
    real = precision_.cast_leaf
    precision_.cast_leaf = lambda t, d: casts.append(int(not t.is_meta)) or real(t, d)  # type: ignore[assignment]
    try:
        dp_rank = mesh.get_local_rank("dp")
        fpipe.grad(piped)(given, x.bfloat16().chunk(2)[dp_rank], y.bfloat16().chunk(2)[dp_rank])
    finally:
        precision_.cast_leaf = real
    return [sum(casts), len(mine)]


def sharded(mesh: Any) -> dict[str, Any]:
    """fp32 master weights sharded over dp (DTensors, Shard(0)) computed in bf16: each rank's
    gradients are fp32 shards of the global gradient (the shard's master copy only)."""
    p, x, y = setup()
    bf = {k: v.bfloat16() for k, v in p.items()}
    ref = torch.func.grad(mlp)({k: v.double() for k, v in bf.items()}, x.bfloat16().double(), y.double())
    given = {k: distribute_tensor(v, mesh["dp"], [Shard(0)]) for k, v in p.items()}
    dp_rank = mesh.get_local_rank("dp")
    piped = fpipe.pipeline(
        mlp, mesh=mesh, microbatches=M, precision=fpipe.Precision(param_dtype=torch.bfloat16)
    )
    grads = fpipe.grad(piped)(given, x.bfloat16().chunk(2)[dp_rank], y.bfloat16().chunk(2)[dp_rank])
    return {
        "types": sorted({f"{type(g).__name__} {g.dtype}" for g in grads.values()}),
        "err": rel_err({k: g.full_tensor() for k, g in grads.items()}, ref),
    }


def scaler(mesh: Any) -> dict[str, Any]:
    """fp16 with an agreed loss scale: an inf on rank 3 alone, then a finite step."""
    p, x, y = setup()
    dp_rank = mesh.get_local_rank("dp")
    xs, ys = x.half().chunk(2)[dp_rank], y.half().chunk(2)[dp_rank]
    piped = fpipe.pipeline(
        mlp, mesh=mesh, microbatches=M, precision=fpipe.Precision(param_dtype=torch.float16)
    )
    s = fpipe.LossScaler(init_scale=1024.0)
    rec: dict[str, Any] = {}
    for step in ("inf", "finite"):
        grads = fpipe.grad(piped)(p, xs, ys, s.scale)
        if step == "inf" and dist.get_rank() == 3:
            next(iter(grads.values())).view(-1)[0] = float("inf")
        before, scale = {k: g.clone() for k, g in grads.items()}, float(s.scale)
        ok = s.unscale_(grads, pipeline=piped)
        unscaled = all(torch.allclose(grads[k] * scale, before[k]) for k in grads)
        norm = float(fpipe.clip_grad_norm_(grads, 1e9, pipeline=piped)) if ok else None
        s.update()
        rec[step] = {"ok": ok, "scale": float(s.scale), "unscaled": unscaled, "norm": norm}
    return rec


def run(mesh: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, case in (("reduce", reduce), ("sharded", sharded), ("scaler", scaler)):
        try:
            out[name] = case(mesh)
        except Exception as err:  # recorded; the test names the case
            out[name] = {"error": f"{type(err).__name__}: {err}"}
    return out
