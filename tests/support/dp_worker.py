"""Data x pipeline parallel worker for `tests/parallel/test_dp.py`: 4 ranks under torchrun, a ("dp", "pp")
mesh of 2 x 2. Every rank draws the same global batch and passes its dp slice; each case compares
the loss and this rank's gradients with `torch.func.grad_and_value` of the unsplit function over
the *global* batch (fp64), and gathers them over dp to compare the replicas bitwise. Writes
`rank{R}.json` into `--out`. Run by `tests/support/four_ranks_worker.py` (`run`: one 4-rank launch shared
with other test modules); `main` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import outputs_worker
import precision_worker
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import fpipe

D, BATCH, M = 6, 16, 2  # global batch 16: 8 per replica, 2 microbatches of 4


def mlp(
    params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, sum_loss: bool = False
) -> torch.Tensor:
    """Four layers with a boundary after each but the last (four stages)."""
    h = x
    for i in range(4):
        h = torch.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
        if i < 3:
            h = fpipe.stage_boundary(h)
    return F.mse_loss(h, y, reduction="sum" if sum_loss else "mean")


def tied(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """An embedding-like first layer and a head sharing one weight, on different pipeline ranks.
    The shared matrix has 7 rows, so sharded over dp=2 its shards are 4 and 3 rows."""
    h = torch.tanh(x @ params["emb"].t())
    h = fpipe.stage_boundary(h)
    h = torch.tanh(h @ params["w"])
    return F.mse_loss(h @ params["emb"], y)


def uneven(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Parameters whose first dimension dp=2 does not divide (5 rows: shards of 3 and 2; 1 row:
    shards of 1 and 0), so sharded collectives pad."""
    h = torch.tanh(x @ params["w0"] + params["b0"]) * params["scale"]
    h = fpipe.stage_boundary(h)
    return F.mse_loss(torch.tanh(h @ params["w1"] + params["b1"]), y)


def params_for(case: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if case == "uneven":
        shapes = {"w0": (D, 5), "b0": (5,), "scale": (1,), "w1": (5, D), "b1": (D,)}
        return {k: torch.randn(s, generator=g, dtype=torch.float64) * 0.5 for k, s in shapes.items()}
    if case == "tied":
        return {
            n: torch.randn(7, s, generator=g, dtype=torch.float64) * 0.5 for n, s in (("emb", D), ("w", 7))
        }
    out = {}
    for i in range(4):
        out[f"w{i}"] = torch.randn(D, D, generator=g, dtype=torch.float64) * 0.5
        out[f"b{i}"] = torch.randn(D, generator=g, dtype=torch.float64) * 0.1
    return out


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, D, generator=g, dtype=torch.float64), torch.randn(
        BATCH, D, generator=g, dtype=torch.float64
    )


def gathered(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    every = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, t.contiguous(), group=group)
    return every


CASES = {  # name -> (function, schedule, stages, out_axes); "sharded-": DTensor parameters
    "1f1b": (mlp, "1f1b", 2, None),
    "gpipe": (mlp, "gpipe", 2, None),
    "interleaved": (mlp, "interleaved-1f1b", 4, None),
    "zbv": (mlp, "zbv", 4, None),
    "sum": (mlp, "1f1b", 2, "sum"),
    "tied": (tied, "1f1b", 2, None),
    "sharded-1f1b": (mlp, "1f1b", 2, None),
    "sharded-zbv": (mlp, "zbv", 4, None),
    "sharded-tied": (tied, "1f1b", 2, None),
    "sharded-uneven": (uneven, "1f1b", 2, None),
}
ADAMW = ("1f1b", "tied", "sharded-1f1b", "sharded-tied", "sharded-uneven")


def shard(params: dict[str, torch.Tensor], mesh: Any) -> dict[str, torch.Tensor]:
    """The parameters as DTensors placed Shard(0) on the "dp" sub-mesh (fully_shard's layout)."""
    return {k: distribute_tensor(v, mesh["dp"], [Shard(0)]) for k, v in params.items()}


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def stage_fn(fn: Any, stages: int, sum_loss: bool) -> Any:
    """`fn` with 4 stages merged into `stages` (mlp: drop boundaries after layers 0 and 2)."""
    if fn in (tied, uneven) or stages == 4:
        return (lambda p, x, y: fn(p, x, y, sum_loss)) if fn is mlp else fn

    def two(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x
        for i in range(4):
            h = torch.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
            if i == 1:
                h = fpipe.stage_boundary(h)
        return F.mse_loss(h, y, reduction="sum" if sum_loss else "mean")

    return two


def sum_read_with_one_microbatch(mesh: Any) -> dict[str, float]:
    """A sum loss, no out_axes, one microbatch per replica: fpipe reads the sum from the graph
    and adds the replicas' values (it once read nothing at microbatches=1 and averaged them:
    half the loss and half the gradients, without a word)."""
    f = stage_fn(mlp, 2, True)
    params, (x, y) = params_for("mlp"), data()
    dp_rank = mesh.get_local_rank("dp")
    piped = fpipe.pipeline(f, mesh=mesh, microbatches=1)
    loss, grads = fpipe.value_and_grad(piped)(params, x.chunk(2)[dp_rank], y.chunk(2)[dp_rank])
    ref_grads, ref_loss = torch.func.grad_and_value(f)(params, x, y)
    return {
        "loss_err": float((loss - ref_loss).abs()),
        "grad_err": max(float((grads[k] - ref_grads[k]).abs().max()) for k in grads),
    }


def run_case(name: str, mesh: Any) -> dict[str, Any]:
    fn, schedule, stages, out_axes = CASES[name]
    f = stage_fn(fn, stages, out_axes == "sum")
    params = params_for(name.removeprefix("sharded-"))
    given = shard(params, mesh) if name.startswith("sharded-") else params
    x, y = data()
    dp_rank = mesh.get_local_rank("dp")
    xs, ys = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
    piped = fpipe.pipeline(f, mesh=mesh, microbatches=M, schedule=schedule, out_axes=out_axes)
    loss, grads = fpipe.value_and_grad(piped)(given, xs, ys)
    ref_grads, ref_loss = torch.func.grad_and_value(f)(params, x, y)
    rec: dict[str, Any] = {"loss_err": abs(float(loss) - float(ref_loss)), "keys": sorted(grads)}
    rec["placements"] = sorted({str(getattr(g, "placements", "plain")) for g in grads.values()})
    rec["grad_err"] = {k: float((whole(g) - ref_grads[k]).abs().max()) for k, g in grads.items()}
    dp_group = mesh.get_group("dp")
    values = [loss.reshape(1), *(whole(grads[k]) for k in sorted(grads))]
    rec["replicas_equal"] = all(torch.equal(*gathered(v, dp_group)) for v in values)
    ref_norm = float(torch.sqrt(sum((g**2).sum() for g in ref_grads.values())))
    rec["norm_err"] = abs(float(fpipe.clip_grad_norm_(grads, 1e9, pipeline=piped)) - ref_norm)
    rec["adamw"] = (
        adamw_steps(f, params, (x, y), (xs, ys), mesh, schedule, out_axes, name) if name in ADAMW else None
    )
    return rec


def adamw_steps(
    f: Any,
    params: dict[str, torch.Tensor],
    glob: Any,
    local: Any,
    mesh: Any,
    schedule: str,
    out_axes: Any,
    name: str,
) -> dict[str, float]:
    """Three AdamW steps through the pipeline against three in one process: the largest
    difference of a parameter this rank holds, and the fraction of the optimizer state it keeps."""
    ref = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ref_opt = torch.optim.AdamW(list(ref.values()), lr=1e-2)
    for _ in range(3):
        ref_opt.zero_grad()
        f(ref, *glob).backward()
        ref_opt.step()
    mine = shard(params, mesh) if name.startswith("sharded-") else {k: v.clone() for k, v in params.items()}
    piped = fpipe.pipeline(f, mesh=mesh, microbatches=M, schedule=schedule, out_axes=out_axes)
    opt, grads = None, {}
    for _ in range(3):
        _, grads = fpipe.value_and_grad(piped)(mine, *local)
        held = {k: mine[k] for k in grads}
        if opt is None:
            opt = torch.optim.AdamW(list(held.values()), lr=1e-2)
        fpipe.set_grads(held, grads)
        opt.step()
    assert opt is not None
    state = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim()]
    kept = sum(t.to_local().numel() if isinstance(t, DTensor) else t.numel() for t in state)
    errs = [float((whole(mine[k]) - ref[k].detach()).abs().max()) for k in sorted(grads)]
    held_params = [mine[k] for k in grads]
    shards = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in held_params)
    return {
        "err": max(errs),
        "state_fraction": kept / sum(t.numel() for t in state),
        "shard_fraction": shards / sum(p.numel() for p in held_params),
    }


def error_of(mesh: Any, params: Any, x: torch.Tensor, y: torch.Tensor, microbatches: int = M) -> str:
    """The ValueError a dp step on these inputs raises (before any transfer), or "no error"."""
    piped = fpipe.pipeline(stage_fn(mlp, 2, False), mesh=mesh, microbatches=microbatches)
    try:
        fpipe.value_and_grad(piped)(params, x, y)
    except ValueError as err:
        return str(err)
    return "no error"


def halves(mesh: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's half of the global batch."""
    x, y = data()
    dp_rank = mesh.get_local_rank("dp")
    return x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]


def mismatch(mesh: Any) -> str:
    """Replicas passing slices of different sizes: a ValueError on every rank, before any transfer."""
    x, y = data()
    n = 8 if mesh.get_local_rank("dp") == 0 else 4
    return error_of(mesh, params_for("1f1b"), x[:n], y[:n])


def wrong_placement(mesh: Any) -> str:
    """Parameters replicated (not Shard(0)) on the "dp" sub-mesh: a ValueError before any transfer."""
    params = {k: distribute_tensor(v, mesh["dp"], [Replicate()]) for k, v in params_for("1f1b").items()}
    return error_of(mesh, params, *halves(mesh))


def not_the_whole_world() -> str:
    """A mesh over ranks 0 and 1 of 4: refused at the first call, before any transfer."""
    mesh = DeviceMesh("cpu", torch.tensor([[0], [1]]), mesh_dim_names=("dp", "pp"))
    return error_of(mesh, params_for("1f1b"), *data())


def no_replicas() -> str:
    """DTensor parameters on a mesh whose "dp" dimension has size 1: refused, saying why."""
    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "pp"))
    params = {k: distribute_tensor(v, mesh["dp"], [Shard(0)]) for k, v in params_for("1f1b").items()}
    piped = fpipe.pipeline(stage_fn(mlp, 4, False), mesh=mesh, microbatches=M)
    try:
        fpipe.value_and_grad(piped)(params, *data())
    except ValueError as err:
        return str(err)
    return "no error"


def indivisible(mesh: Any) -> str:
    """Each replica's slice of 8 rows in 3 microbatches: refused, naming dp x microbatches."""
    return error_of(mesh, params_for("1f1b"), *halves(mesh), microbatches=3)


def gather_log(mesh: Any) -> dict[str, Any]:
    """Sharded parameters on a schedule with two stages per rank (zbv), over two steps: when each
    is gathered, made whole and dropped, by this rank's action index (NOTE [gathered stage by
    stage] in fpipe/_src/parallel/sharding.py)."""
    from fpipe._src.parallel import sharding

    events: list[tuple[str, str, int]] = []  # (event, parameter, action index)
    where = {"k": -1}
    before, after, launch = sharding.Gatherer.before, sharding.Gatherer.after, sharding.launch_gather

    def spy_before(self: Any, a: Any) -> None:
        where["k"] += 1
        before(self, a)
        events.extend(("whole", n, where["k"]) for n in self.first.get(a, ()))

    def spy_after(self: Any, a: Any, *results: Any) -> None:
        after(self, a, *results)
        events.extend(("dropped", n, where["k"]) for n in self.last.get(a, ()))

    def spy_launch(dp: Any, params: list[Any]) -> Any:
        events.append(("gathered", str(len(params)), where["k"]))
        return launch(dp, params)

    sharding.Gatherer.before, sharding.Gatherer.after = spy_before, spy_after  # type: ignore[method-assign]
    sharding.launch_gather = spy_launch
    try:
        x, y = data()
        dp_rank = mesh.get_local_rank("dp")
        piped = fpipe.pipeline(stage_fn(mlp, 4, False), mesh=mesh, microbatches=M, schedule="zbv")
        vg = fpipe.value_and_grad(piped)
        for _ in range(2):
            where["k"] = -1
            vg(shard(params_for("1f1b"), mesh), x.chunk(2)[dp_rank], y.chunk(2)[dp_rank])
        actions = [str(a) for a in piped._last.runner.local_actions]
        readers = {
            name: sorted(
                {k for k, a in enumerate(piped._last.runner.local_actions) if (a.kind, a.stage) in places}
            )
            for name, places in piped._last.staged.consumers.items()
            if name in piped._last.staged.param_inputs
        }
    finally:
        sharding.Gatherer.before, sharding.Gatherer.after, sharding.launch_gather = before, after, launch  # type: ignore[method-assign]
    return {"events": events, "actions": actions, "readers": {n: r for n, r in readers.items() if r}}


def unknown_dimension() -> str:
    """A mesh dimension fpipe does not know: a ValueError at the first call, before a transfer."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    return error_of(mesh, params_for("1f1b"), *data())


class MatmulFlops(TorchDispatchMode):
    """Counts the FLOPs of matrix products (mm, addmm and the in-place addmm_ fpipe accumulates
    weight gradients with, which torch's FlopCounterMode does not count)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_"):
            a, b = (args[0], args[1]) if name == "mm" else (args[1], args[2])
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


def matmul_share(mesh: Any) -> float:
    """This rank's matrix-multiply FLOPs in a dp=2 x pp=2 step over those of the unsplit step
    over the global batch (one process, autograd): about a quarter."""
    f, params, (x, y) = stage_fn(mlp, 2, False), params_for("1f1b"), data()
    dp_rank = mesh.get_local_rank("dp")
    vg = fpipe.value_and_grad(fpipe.pipeline(f, mesh=mesh, microbatches=M))
    vg(params, x.chunk(2)[dp_rank], y.chunk(2)[dp_rank])  # compiles
    with MatmulFlops() as mine:
        vg(params, x.chunk(2)[dp_rank], y.chunk(2)[dp_rank])
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    with MatmulFlops() as whole_step:
        f(leaves, x, y).backward()
    return mine.flops / whole_step.flops


def plain(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`mlp` without boundaries: fpipe.plan chooses the cuts."""
    h = x
    for i in range(4):
        h = torch.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
    return F.mse_loss(h, y)


def planned() -> dict[str, Any]:
    """fpipe.plan on the job's 4 ranks (a small budget: the layouts not timed in it are dropped),
    its 2 best predicted candidates timed as real steps, and `pipeline(plan=p)` run on the
    replica's share of the batch against the global batch's gradients."""
    params, (x, y) = params_for("mlp"), data()
    p = fpipe.plan(plain, params, x, y, world_size=4, optimizer="sgd", budget_s=6.0, verify=2)
    i, n = dist.get_rank() // p.pp, BATCH // p.dp
    loss, grads = fpipe.value_and_grad(fpipe.pipeline(plain, plan=p))(
        params, x[i * n : (i + 1) * n], y[i * n : (i + 1) * n]
    )
    want_grads, want_loss = torch.func.grad_and_value(plain)(params, x, y)
    verified = p.candidates[: p.verified]
    again = fpipe.plan(plain, params, x, y, world_size=4, optimizer="sgd", budget_s=6.0, verify=2)
    return {
        "again": [again.measure_s, again.measured_step_s == p.measured_step_s, again.layout == p.layout],
        "layout": [p.layout, p.stages, list(p.cuts)],
        "verified": [[c.layout, c.predicted_step_s, c.measured_step_s] for c in verified],
        "measured": p.measured_step_s,
        "loss_err": float((loss - want_loss).abs()),
        "grad_err": max(float((grads[k] - want_grads[k]).abs().max()) for k in grads),
        "keys": sorted(grads),
    }


def run(out: str) -> None:
    """Every case, on 4 ranks (the default process group, initialised here if it is not yet);
    writes `out/rank{R}.json`."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    rank = dist.get_rank()
    rec: dict[str, Any] = {"rank": rank, "dp": mesh.get_local_rank("dp"), "pp": mesh.get_local_rank("pp")}
    only = os.environ.get("DP_WORKER_CASES")  # for running a few cases by hand
    for name in only.split(",") if only else CASES:
        try:
            rec[name] = run_case(name, mesh)
        except Exception as err:  # recorded; the test names the case
            rec[name] = {"error": f"{type(err).__name__}: {err}"}
    rec["sum_m1"] = sum_read_with_one_microbatch(mesh)
    rec["mismatch"] = mismatch(mesh)
    rec["wrong_placement"] = wrong_placement(mesh)
    rec["matmul_share"] = matmul_share(mesh)
    rec["unknown_dimension"] = unknown_dimension()
    rec["not_the_whole_world"] = not_the_whole_world()
    rec["indivisible"] = indivisible(mesh)
    rec["no_replicas"] = no_replicas()
    rec["gather_log"] = gather_log(mesh)
    rec["precision"] = precision_worker.run(mesh)  # tests/pipeline/test_precision.py
    try:  # tests/pipeline/test_outputs_dist.py
        rec["outputs"] = outputs_worker.mesh_cases(mesh)
    except Exception as err:  # recorded; the test names it
        rec["outputs"] = {"error": f"{type(err).__name__}: {err}"}
    try:
        rec["plan"] = planned()
    except Exception as err:  # recorded; the test names it
        rec["plan"] = {"error": f"{type(err).__name__}: {err}"}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    run(ap.parse_args().out)


if __name__ == "__main__":
    main()
