"""What bounding the sends costs under a memory limit, and what it buys: the same plan run with
and without `DistRunner.bound_sends`.

    MALLOC_MMAP_THRESHOLD_=131072 torchrun --standalone --nproc-per-node 2 bench/bound_sends.py --rounds 9

Under `memory_limit`, a rank waits at the end of each action for the previous action's sends to
complete (gloo's send completes once the peer has received it), so sent values live as long as
the memory prediction says (NOTE [predicting memory]). This runs the benchmark GPT under a limit
of half the larger rank's unconstrained peak (1F1B on 2 stages, ZBV on 4), on one compiled plan,
its steps alternating between the runner's `bound_sends` on and off round after round (a change
in the host's load touches both alike). Per rank: the predicted peak, the largest resident-set
growth of a step over the rounds with and without the bound, and the median step time of each.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory_limit import largest, rss_growth  # noqa: E402
from models import CONFIGS, GPT, cuts_for, fpipe_revision, lm_loss, make_batch  # noqa: E402

import fpipe  # noqa: E402

MIB = 2**20
SCHEDULES = {"1f1b": 2, "zbv": 4}  # schedule -> stages


def rows_of(schedule: str, stages: int, args: Any) -> list[tuple[Any, ...]]:
    cfg = CONFIGS["base"]
    torch.manual_seed(0)
    fn, params = fpipe.functionalize(GPT(cfg, cuts_for(cfg, stages)))
    tokens, targets = make_batch(cfg, args.batch, seed=0)

    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lm_loss(fn(p, x), y)

    kw: dict[str, Any] = dict(microbatches=args.microbatches, schedule=schedule)
    limit = int(0.5 * largest(fpipe.pipeline(loss, **kw).memory(params, tokens, targets)))
    piped = fpipe.pipeline(loss, memory_limit=limit, **kw)
    predicted = piped.memory(params, tokens, targets)
    step = fpipe.value_and_grad(piped)
    step(params, tokens, targets)  # compiled, warm
    runner = piped._last.runner  # type: ignore[union-attr]
    times: dict[bool, list[float]] = {True: [], False: []}
    peaks = {True: 0, False: 0}

    def timed() -> Any:
        t0 = time.perf_counter()
        out = step(params, tokens, targets)
        times[runner.bound_sends].append(time.perf_counter() - t0)
        return out

    for _ in range(args.rounds):
        for bound in (True, False):
            runner.bound_sends = bound
            dist.barrier()
            peaks[bound] = max(peaks[bound], rss_growth(timed))
    mine = (
        predicted / MIB, peaks[True] / MIB, peaks[False] / MIB,
        statistics.median(times[True]), statistics.median(times[False]),
    )  # fmt: skip
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return [(schedule, r, limit / MIB, *m) for r, m in enumerate(every)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = [row for s, n in SCHEDULES.items() for row in rows_of(s, n, args)]
    if dist.get_rank() == 0:
        print(f"fpipe {fpipe_revision()}, GPT base, batch {args.batch}, {args.microbatches} microbatches")
        print(
            "| schedule | rank | limit (MiB) | predicted (MiB) | measured, bounded (MiB) "
            "| measured, unbounded (MiB) | step, bounded (s) | step, unbounded (s) | bounded / unbounded |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for s, r, lim, pred, mb, mu, tb, tu in rows:
            print(
                f"| {s} | {r} | {lim:.1f} | {pred:.1f} | {mb:.1f} | {mu:.1f} | {tb:.2f} | {tu:.2f} | {tb / tu:.2f} |"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
