"""fpipe's cost over torch.func on one stage in one process: the price of staging itself.

    python bench/overhead.py                      # GPT of bench/models.py, batch 4 (one microbatch of
                                                  # compare_pipelining.py), 1 thread, 30 repetitions
    python bench/overhead.py --batch 32 --reps 10
    python bench/overhead.py --profile            # also: top aten ops of each, by self CPU time

Times `fpipe.value_and_grad(fpipe.pipeline(f, stages=1))` against `torch.func.grad_and_value(f)`
on the same function and inputs, alternating the two call by call (which goes first alternates
too), so machine noise hits both alike; reports the median of the per-pair ratios (goal <= 1.03)
and each side's median, in wall time and in process CPU time (on a shared machine the CPU time is
the steadier figure: it does not count time the process waited for a core). The first call of each (fpipe traces then) is not timed. Both
results are checked equal first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import CONFIGS, GPT, fpipe_revision, lm_loss, make_batch  # noqa: E402

import fpipe  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="base", choices=list(CONFIGS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true")
    return p.parse_args()


def profile(name: str, fn, n: int = 3) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
    print(f"\n== {name}: top ops by self CPU time over {n} calls ==")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    cfg = CONFIGS[args.model]
    torch.manual_seed(0)
    model = GPT(cfg)
    fn, params = fpipe.functionalize(model)
    params = {k: v.detach() for k, v in params.items()}
    x, y = make_batch(cfg, args.batch, seed=1)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lm_loss(fn(p, x), y)

    piped = fpipe.value_and_grad(fpipe.pipeline(loss_fn, stages=1, microbatches=args.microbatches))
    ref = torch.func.grad_and_value(loss_fn)

    t0 = time.perf_counter()
    loss, grads = piped(params, x, y)
    first = time.perf_counter() - t0
    rgrads, rloss = ref(params, x, y)
    err = max((grads[k] - rgrads[k]).abs().max().item() for k in rgrads)
    scale = max(v.abs().max().item() for v in rgrads.values())
    print(f"first fpipe call (trace + split + run): {first:.2f} s; loss diff {abs(loss - rloss).item():.1e}, "
          f"grad rel err {err / scale:.1e}")  # fmt: skip

    calls = {"fpipe": lambda: piped(params, x, y), "torch.func": lambda: ref(params, x, y)}
    wall: dict[str, list[float]] = {k: [] for k in calls}
    cpu: dict[str, list[float]] = {k: [] for k in calls}
    for rep in range(args.reps):
        for name in list(calls)[:: 1 if rep % 2 == 0 else -1]:
            t0, c0 = time.perf_counter(), time.process_time()
            calls[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)

    print(
        f"{args.model}, batch {args.batch} x {cfg.seq}, microbatches {args.microbatches}, "
        f"{args.threads} thread(s), {args.reps} alternating pairs; fpipe {fpipe_revision()}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M %Z')}"
    )
    for label, xs in (("wall", wall), ("process CPU", cpu)):
        ratios = [f / t for f, t in zip(xs["fpipe"], xs["torch.func"])]
        q = statistics.quantiles(ratios, n=4)
        mf, mt = statistics.median(xs["fpipe"]), statistics.median(xs["torch.func"])
        print(
            f"  {label:<12} fpipe {mf * 1e3:8.1f} ms  torch.func {mt * 1e3:8.1f} ms  "
            f"fpipe/torch.func: median of pairs {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}), "
            f"of medians {mf / mt:.3f}, of mins {min(xs['fpipe']) / min(xs['torch.func']):.3f}"
        )
    if args.profile:
        for name, call in calls.items():
            profile(name, call)


if __name__ == "__main__":
    main()
