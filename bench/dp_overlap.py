"""Data x pipeline parallelism (issue 11): overlapped gradient reduction, dp x pp against pp alone,
and gradient / optimizer-state bytes per rank. 4 ranks, gloo, one torch thread each.

    torchrun --standalone --nproc-per-node 4 bench/dp_overlap.py
    torchrun --standalone --nproc-per-node 4 bench/dp_overlap.py --dim 1024 --layers 8 --batch 16 \
        --microbatches 4 --steps 16 --schedules 1f1b,interleaved-1f1b

Model: an MLP of `--layers` layers `tanh(h @ w + b)` of width `--dim` (fp32), MSE loss, cut into
equal stages by `fpipe.stage_boundary` (one stage per pipeline rank; `interleaved-1f1b` and other
multi-stage schedules get two per rank). `--batch` is the *global* batch: with the ("dp", "pp")
mesh of 2 x 2 each replica passes its half, on the ("pp",) mesh of 4 every rank passes all of it.
Every rank holds the whole parameter dict (the model is small); the grads fpipe returns are only
those of this rank's stages.

Figures (rank 0 prints them):
1. dp=2 x pp=2, per schedule in `--schedules`: the step with `fpipe._src.parallel.replicas.OVERLAP` True
   (each stage's buckets all-reduced as soon as its last backward finishes) and False (every
   bucket launched after the last action, "at the end"). Median step time and their ratio.
2. dp=2 x pp=2 against pp=4 (one pipeline over the 4 ranks), the first schedule, same global batch.
   Also timed in the same rounds: one all-reduce of the first schedule's gradient bytes per
   rank over the dp groups, alone (the most overlapping could hide).
3. Gradient bytes and AdamW state bytes (after one `opt.step()`) per rank, max over ranks, for
   both layouts and for sharded parameters (DTensors `Shard(0)` on the "dp" sub-mesh: gathered
   stage by stage, gradients reduce-scattered); also the sharded step's time against the
   replicated one's (same schedule, timed in the same rounds).

Timing: every mode's pipeline is built once and warmed up (`--warmup` steps); then `--steps`
rounds each run one step of every mode, the order rotating by round, so the machine's noise hits
all modes alike. A step is one `fpipe.value_and_grad` call (forward, backward, the dp reduction;
no optimizer), between `dist.barrier()` and `time.perf_counter()`; its time is the max over ranks
(all_reduce MAX). Reported: medians over the rounds, and the median of per-round ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fpipe  # noqa: E402
from fpipe._src.parallel import replicas  # noqa: E402

MiB = 2**20


def make_loss(layers: int, stages: int) -> Any:
    """The MLP's loss with a stage boundary after every `layers // stages` layers."""
    per = layers // stages

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x
        for i in range(layers):
            h = torch.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
            if (i + 1) % per == 0 and i + 1 < layers:
                h = fpipe.stage_boundary(h)
        return F.mse_loss(h, y)

    return loss_fn


def make_params(d: int, layers: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(layers):
        out[f"w{i}"] = torch.randn(d, d, generator=g) / d**0.5
        out[f"b{i}"] = torch.zeros(d)
    return out


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule in ("interleaved-1f1b", "looped-bfs", "zbv", "dualpipev") else 1


class Mode:
    """One way to run the step: a pipeline, this rank's slice of the batch, the OVERLAP flag."""

    def __init__(
        self, name: str, piped: Any, x: torch.Tensor, y: torch.Tensor, overlap: bool, own: Any = None
    ) -> None:
        self.name, self.x, self.y, self.overlap = name, x, y, overlap
        self.vg = fpipe.value_and_grad(piped)
        self.times: list[float] = []
        self.own = own  # parameters of its own (the sharded mode's DTensors), else the caller's

    def step(self, params: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
        replicas.OVERLAP = self.overlap
        dist.barrier()
        t0 = time.perf_counter()
        loss, grads = self.vg(self.own if self.own is not None else params, self.x, self.y)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return float(dt), loss, grads


class AllReduceOnly(Mode):
    """The reduction alone: one all-reduce of this rank's gradient bytes over its dp group (both
    dp groups at once, as in a step): what overlapping could hide at most."""

    def __init__(self, name: str, numel: int, group: Any) -> None:
        self.name, self.group, self.times = name, group, []
        self.flat = torch.zeros(numel)

    def step(self, params: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(self.flat, group=self.group)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return float(dt), self.flat, {}


def max_over_ranks(v: float) -> float:
    t = torch.tensor([v], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def nbytes(ts: Any) -> int:
    """Bytes this rank holds (a DTensor: its local shard)."""
    ts = [t.to_local() if isinstance(t, DTensor) else t for t in ts]
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def memory(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    """(params held, grads, AdamW state after one step) in bytes on this rank, max over ranks."""
    held = {k: params[k].detach().clone() for k in grads}
    opt = torch.optim.AdamW(list(held.values()), lr=1e-3)
    fpipe.set_grads(held, grads)
    opt.step()
    state = sum(nbytes(s.values()) for s in opt.state.values())
    return (
        max_over_ranks(nbytes(held.values())),
        max_over_ranks(nbytes(grads.values())),
        max_over_ranks(state),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=1024, help="layer width d (not --d: torchrun takes that)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16, help="global batch (split over dp)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16, help="timed rounds (one step of each mode)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--schedules", default="1f1b,interleaved-1f1b", help="comma-separated, figure 1")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        raise SystemExit(f"run with 4 ranks (torchrun --nproc-per-node 4); got {world}")
    schedules = [s for s in args.schedules.split(",") if s]

    def say(*a: Any) -> None:
        if rank == 0:
            print(*a, flush=True)

    mesh_dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    mesh_pp = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
    dp_rank = mesh_dp.get_local_rank("dp")

    params = make_params(args.dim, args.layers)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.dim, generator=g)
    y = torch.randn(args.batch, args.dim, generator=g)
    xs, ys = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]

    modes: list[Mode] = []
    for s in schedules:
        piped = fpipe.pipeline(
            make_loss(args.layers, 2 * stages_per_rank(s)),
            mesh=mesh_dp,
            microbatches=args.microbatches,
            schedule=s,
        )
        modes += [
            Mode(f"dp2xpp2 {s} overlap", piped, xs, ys, True),
            Mode(f"dp2xpp2 {s} end", piped, xs, ys, False),
        ]
    s0 = schedules[0]
    piped4 = fpipe.pipeline(
        make_loss(args.layers, 4 * stages_per_rank(s0)),
        mesh=mesh_pp,
        microbatches=args.microbatches,
        schedule=s0,
    )
    modes.append(Mode(f"pp4 {s0}", piped4, x, y, True))

    say(
        f"fpipe dp_overlap: MLP {args.layers} x Linear({args.dim}, {args.dim}) fp32 "
        f"({nbytes(params.values()) / MiB:.1f} MiB), global batch {args.batch}, "
        f"{args.microbatches} microbatches, {world} ranks x 1 thread (gloo), torch {torch.__version__}, "
        f"bucket {replicas.BUCKET_BYTES / MiB:.0f} MiB"
    )

    # warm-up; the first step of each mode also gives the memory figures and the loss check
    mem: dict[str, tuple[float, float, float]] = {}
    losses: dict[str, float] = {}
    t_start = time.perf_counter()
    for m in modes:
        for i in range(args.warmup):
            _, loss, grads = m.step(params)
            if i == 0:
                losses[m.name] = float(loss)
                mem[m.name] = memory(params, grads)
    # sharded: the same pipeline, parameters as DTensors Shard(0) on the "dp" sub-mesh
    sharded = {k: distribute_tensor(v, mesh_dp["dp"], [Shard(0)]) for k, v in params.items()}
    piped_sh = fpipe.pipeline(
        make_loss(args.layers, 2 * stages_per_rank(s0)),
        mesh=mesh_dp,
        microbatches=args.microbatches,
        schedule=s0,
    )
    sharded_mode = Mode(f"dp2xpp2 {s0} sharded", piped_sh, xs, ys, True, sharded)
    for i in range(args.warmup):
        _, loss, sharded_grads = sharded_mode.step(params)
        if i == 0:
            losses[sharded_mode.name] = float(loss)
            mem["sharded"] = memory(sharded, sharded_grads)
    modes.append(sharded_mode)
    n_grad = int(mem[modes[0].name][1]) // 4  # fp32 gradient elements of the first mode
    ar = AllReduceOnly(f"dp all-reduce alone ({n_grad * 4 / MiB:.1f} MiB)", n_grad, mesh_dp.get_group("dp"))
    for _ in range(args.warmup):
        ar.step(params)
    modes.append(ar)
    say(f"warm-up {time.perf_counter() - t_start:.1f} s")

    for r in range(args.steps):
        k = r % len(modes)
        for m in modes[k:] + modes[:k]:
            m.times.append(m.step(params)[0])

    if rank != 0:
        dist.barrier()
        dist.destroy_process_group()
        return

    med = {m.name: statistics.median(m.times) for m in modes}

    def ratio(a: str, b: str) -> tuple[float, float]:
        ta = next(m.times for m in modes if m.name == a)
        tb = next(m.times for m in modes if m.name == b)
        return med[a] / med[b], statistics.median(p / q for p, q in zip(ta, tb))

    print(f"\n1. overlapped vs at-the-end reduction, dp=2 x pp=2 ({args.steps} rounds, medians)")
    print(
        "| schedule | overlap s/step | at end s/step | overlap/end (medians) | median of per-round ratios |"
    )
    print("|---|---|---|---|---|")
    for s in schedules:
        a, b = f"dp2xpp2 {s} overlap", f"dp2xpp2 {s} end"
        r1, r2 = ratio(a, b)
        print(f"| {s} | {med[a]:.4f} | {med[b]:.4f} | {r1:.3f} | {r2:.3f} |")

    a, b = f"dp2xpp2 {s0} overlap", f"pp4 {s0}"
    r1, r2 = ratio(a, b)
    print(f"\n2. dp=2 x pp=2 vs pp=4, {s0}, same global batch {args.batch}")
    print("| layout | s/step | loss (first step) |")
    print("|---|---|---|")
    print(f"| dp=2 x pp=2 (overlap) | {med[a]:.4f} | {losses[a]:.6f} |")
    print(f"| pp=4 | {med[b]:.4f} | {losses[b]:.6f} |")
    print(f"dp2xpp2/pp4: {r1:.3f} (medians), {r2:.3f} (median of per-round ratios)")

    print(
        f"\n{ar.name}: {med[ar.name]:.4f} s (median; the reduction of a {s0} step, nothing to overlap with)"
    )
    a_sh = f"dp2xpp2 {s0} sharded"
    r1, r2 = ratio(a_sh, a)
    print(
        f"sharded / replicated, dp=2 x pp=2 {s0}: {med[a_sh]:.4f} / {med[a]:.4f} s = {r1:.3f} (medians), "
        f"{r2:.3f} (per-round); first-step loss {losses[a_sh]:.6f}"
    )

    print("\n3. bytes per rank (max over ranks), after one AdamW step")
    print("| layout | params held | grads | AdamW state |")
    print("|---|---|---|---|")
    for name, label in ((a, "dp=2 x pp=2, replicated"), (b, "pp=4")):
        p, gb, st = mem[name]
        print(f"| {label} | {p / MiB:.2f} MiB | {gb / MiB:.2f} MiB | {st / MiB:.2f} MiB |")
    p, gb, st = mem["sharded"]
    print(
        f"| dp=2 x pp=2, sharded (Shard(0) on dp) | {p / MiB:.2f} MiB | {gb / MiB:.2f} MiB | {st / MiB:.2f} MiB |"
    )
    print("\nper-round step times (s):")
    for m in modes:
        print(f"  {m.name}: " + " ".join(f"{t:.4f}" for t in m.times))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
