"""Outputs, clipping and loss_parallel across ranks for `tests/pipeline/test_outputs_dist.py` (issue 24,
cases 14-17): run inside the shared launches -- `pp_cases`, `loss_parallel_refusals` and
`clip_failure` by `tests/support/trust_dist_worker.py`
(2 ranks, pp=2), `mesh_cases` by `tests/support/dp_worker.py` (4 ranks, dp=2 x pp=2). Each returns a
JSON-able record; references are the unsplit functions under `torch.func` in float64.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

import fpipe

BATCH, D, CLASSES = 16, 4, 3


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w0": torch.randn(D, 6, generator=g, dtype=torch.float64),
        "w1": torch.randn(6, CLASSES, generator=g, dtype=torch.float64),
    }


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, D, generator=g, dtype=torch.float64), torch.randint(
        0, CLASSES, (BATCH,), generator=g
    )


def accuracy(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
    """A loss and an accuracy count (an int64 scalar) as aux; two stages."""
    logits = fpipe.stage_boundary(torch.tanh(x @ p["w0"])) @ p["w1"]
    return F.cross_entropy(logits, y), (logits.argmax(-1) == y).sum()


def with_decay(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> Any:
    """A sum loss plus a weight decay (`scale` divides the decay: the warning's advice)."""
    logits = fpipe.stage_boundary(torch.tanh(x @ p["w0"])) @ p["w1"]
    return F.cross_entropy(logits, y, reduction="sum") + p["w1"].pow(2).sum() / scale


def _counts(piped: fpipe.Pipelined, x: torch.Tensor, y: torch.Tensor, want: int) -> dict[str, Any]:
    """The count a plain call and value_and_grad return on this rank, against the whole batch's."""
    _, count = piped(_params(), x, y)
    (loss, vg_count), _ = fpipe.value_and_grad(piped, has_aux=True)(_params(), x, y)
    ref_loss = accuracy(_params(), *_data())[0]
    return {
        "counts": [count.item(), vg_count.item()],
        "dtypes": [str(count.dtype), str(vg_count.dtype)],
        "want": want,
        "loss_err": abs(float(loss) - float(ref_loss)),
    }


def pp_cases() -> dict[str, Any]:
    """2 ranks, pp=2: the count at 1 and 2 microbatches on both ranks (rank 0 read float32
    bits as int64; the last stage averaged the count)."""
    x, y = _data()
    want = int(accuracy(_params(), x, y)[1])
    return {
        f"m{m}": _counts(fpipe.pipeline(accuracy, microbatches=m, timeout=60), x, y, want) for m in (1, 2)
    }


def mesh_cases(mesh: Any) -> dict[str, Any]:
    """4 ranks, dp=2 x pp=2, each replica passing its half: the count summed over microbatches
    and replicas; the sum-plus-decay warning and its advice; the inf-norm of a gradient whose
    Shard(0) parameter has one row (dp rank 1 holds an empty shard)."""
    x, y = _data()
    dp = mesh.get_local_rank("dp")
    half = (x.chunk(2)[dp], y.chunk(2)[dp])
    want = int(accuracy(_params(), x, y)[1])
    rec: dict[str, Any] = {"count": _counts(fpipe.pipeline(accuracy, mesh=mesh, microbatches=2), *half, want)}
    rec["decay"] = _decay_advice(mesh, half)
    rec["inf_clip"] = _inf_clip(mesh, half)
    return rec


def _decay_advice(mesh: Any, half: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fpipe.pipeline(with_decay, mesh=mesh, microbatches=2)(_params(), *half)
    fixed = fpipe.pipeline(
        lambda p, x, y: with_decay(p, x, y, 4.0), mesh=mesh, microbatches=2, out_axes="sum"
    )
    loss, grads = fpipe.value_and_grad(fixed)(_params(), *half)
    ref_grads, ref_loss = torch.func.grad_and_value(with_decay)(_params(), *_data())
    return {
        "messages": [str(w.message) for w in caught],
        "loss_err": abs(float(loss) - float(ref_loss)),
        "grad_err": max(float((g - ref_grads[k]).abs().max()) for k, g in grads.items()),
    }


def _scaled(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = fpipe.stage_boundary(torch.tanh(x @ p["w0"]) * p["scale"])
    return F.cross_entropy(h @ p["w1"], y)


def _inf_clip(mesh: Any, half: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    params = {**_params(), "scale": torch.full((1,), 1.5, dtype=torch.float64)}  # 1 row: shards 1, 0
    sharded = {k: distribute_tensor(v, mesh["dp"], [Shard(0)]) for k, v in params.items()}
    piped = fpipe.pipeline(_scaled, mesh=mesh, microbatches=2, timeout=60)
    _, grads = fpipe.value_and_grad(piped)(sharded, *half)
    ref = torch.func.grad(_scaled)(params, *_data())
    norm = fpipe.clip_grad_norm_(grads, 1e9, pipeline=piped, norm_type=math.inf)
    return {
        "err": abs(float(norm) - max(float(g.abs().max()) for g in ref.values())),
        "shard_rows": grads["scale"].to_local().shape[0] if "scale" in grads else None,
    }


def clip_failure() -> dict[str, Any]:
    """Rank 1 passes clip_grad_norm_ a list (refused: a TypeError) while rank 0 goes into the
    norm's all-reduce: rank 0 must stop at once naming rank 1, not wait forever. On a group of
    its own (rank 0's all-reduce stays unmatched), so it leaves the launch's group usable."""
    mesh = DeviceMesh.from_group(dist.new_group([0, 1]), "cpu", mesh_dim_names=("pp",))
    piped = fpipe.pipeline(accuracy, mesh=mesh, microbatches=2, timeout=60)
    (_, _), grads = fpipe.value_and_grad(piped, has_aux=True)(_params(), *_data())
    start = time.monotonic()
    try:
        fpipe.clip_grad_norm_(grads if dist.get_rank() == 0 else list(grads.values()), 1.0, pipeline=piped)
        out: dict[str, Any] = {"error_type": None}
    except Exception as err:
        out = {"error_type": type(err).__name__, "error": str(err)}
    out["seconds"] = time.monotonic() - start
    return out


def loss_parallel_refusals() -> dict[str, str]:
    """Case 16: torch's loss_parallel() inside the loss, and around the pipelined call, on a
    (pp=1, tp=2) mesh: refused by name on every rank (DTensor's raw "mixed torch.Tensor and
    DTensor", and a false "captured a tensor of shape ()", before)."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "tp"))
    model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 6))
    head = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)  # torchtitan's, for it
    fn, params = fpipe.functionalize(parallelize_module(model, mesh["tp"], {"2": head}))
    x, y = torch.randn(8, D), torch.randint(0, 6, (8,))

    def inside(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with loss_parallel():
            return F.cross_entropy(fn(p, x), y)

    def around(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fn(p, x), y)

    out = {}
    for name, f in (("inside", inside), ("around", around)):
        step = fpipe.value_and_grad(fpipe.pipeline(f, mesh=mesh, microbatches=2, timeout=60))
        try:
            with loss_parallel() if f is around else contextlib.nullcontext():
                step(params, x, y)
            out[name] = "no error"
        except Exception as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out
