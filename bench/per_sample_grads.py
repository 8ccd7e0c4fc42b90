"""Per-sample gradients of a batch of 32 through a 2-stage pipeline: one vmapped call against 32.

    torchrun --standalone --nproc-per-node 2 bench/per_sample_grads.py

Three ways to every example's gradient of a small MLP (4 layers of width --width, a stage
boundary in the middle, float32), timed side by side, alternating round by round (median of
--rounds rounds, after one warm-up call each):

- "vmap(grad(piped))": `torch.func.vmap(torch.func.grad(piped), in_dims=(None, 0, 0))` under
  torchrun -- ONE pipelined call (NOTE [transforms in a group]: the vmapped batch is cut into
  --microbatches microbatches);
- "32 x fpipe.grad": one `fpipe.grad(piped)` call per example (32 pipelined calls);
- "one process vmap(grad(f))": `torch.func.vmap(torch.func.grad(f))` of the unsplit function on
  rank 0 alone (no pipeline; the other rank waits).

Rank 0 checks the three agree (max abs difference) and prints the times and ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import fpipe


def mlp(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = x
    for i in range(4):
        h = torch.tanh(h @ p[f"w{i}"])
        h = fpipe.stage_boundary(h) if i == 1 else h
    return ((h - y) ** 2).mean()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    w = args.width
    p = {f"w{i}": torch.randn(w, w, generator=g) / w**0.5 for i in range(4)}
    x, y = torch.randn(args.batch, w, generator=g), torch.randn(args.batch, w, generator=g)
    piped = fpipe.pipeline(mlp, microbatches=args.microbatches)
    per_example = fpipe.pipeline(mlp, microbatches=1)  # one example per call: nothing to cut
    vmapped = torch.func.vmap(torch.func.grad(piped), in_dims=(None, 0, 0))

    def one_call() -> dict[str, torch.Tensor]:
        return vmapped(p, x, y)

    def many_calls() -> dict[str, torch.Tensor]:
        grads = [fpipe.grad(per_example)(p, x[i : i + 1], y[i : i + 1]) for i in range(args.batch)]
        return {k: torch.stack([gr[k] for gr in grads]) for k in grads[0]}

    def local() -> dict[str, torch.Tensor] | None:
        out = torch.func.vmap(torch.func.grad(mlp), in_dims=(None, 0, 0))(p, x, y) if rank == 0 else None
        dist.barrier()
        return out

    ways = {"vmap(grad(piped))": one_call, f"{args.batch} x fpipe.grad": many_calls, "one process": local}
    results = {name: fn() for name, fn in ways.items()}  # warm-up (traces) and the values
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, fn in ways.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    if rank == 0:
        ref = results["one process"]
        assert ref is not None
        for name in list(ways)[:2]:
            got = results[name]
            err = max((got[k] - ref[k]).abs().max().item() for k in got)  # (fpipe.grad: this rank's)
            print(f"{name}: max |difference| from one process {err:.2g}")
        med = {name: statistics.median(ts) for name, ts in times.items()}
        base = med["vmap(grad(piped))"]
        print(
            f"per-sample gradients of {args.batch} examples, width {w}, 2 ranks, microbatches={args.microbatches}"
        )
        for name, t in med.items():
            print(f"  {name:24s} {t * 1e3:8.1f} ms   {t / base:5.2f} x vmap(grad(piped))")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
