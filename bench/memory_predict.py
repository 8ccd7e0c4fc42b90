"""Predicted against measured peak step memory, per rank (issue 14): `piped.memory` vs resident set.

    MALLOC_MMAP_THRESHOLD_=131072 torchrun --standalone --nproc-per-node 2 bench/memory_predict.py
    MALLOC_MMAP_THRESHOLD_=131072 python bench/memory_predict.py        # one process, all stages

For each schedule (1f1b on 2 stages, zbv on 4 stages V-placed over 2 ranks) every rank predicts
its peak with `piped.memory(params, tokens, targets)` before any step runs, then runs a warm-up
step and measures one `value_and_grad` step: the growth of its resident set (peak `VmHWM` after
the step minus `VmRSS` before it, the peak mark reset by writing 5 to /proc/self/clear_refs).
The fixed mmap threshold makes every freed tensor larger than 128 KiB leave the resident set at
once (../shared/DESIGN.md, "Measuring memory on CPU"). Rank 0 prints one row per rank and
schedule, and `piped.memory_report(...).table()` for its own stages.

Results: docs/BENCHMARKS.md, "Predicted step memory (issue 14)".
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import CONFIGS, GPT, cuts_for, fpipe_revision, lm_loss, make_batch  # noqa: E402

import fpipe  # noqa: E402

MIB = 2**20
SCHEDULES = {"1f1b": 2, "zbv": 4}  # schedule -> stages


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def rss_growth(step: Any) -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS")
    out = step()
    peak = status("VmHWM")
    del out
    return peak - before


def one(schedule: str, stages: int, batch: int, microbatches: int) -> tuple[int, int, str]:
    cfg = CONFIGS["base"]
    torch.manual_seed(0)
    fn, params = fpipe.functionalize(GPT(cfg, cuts_for(cfg, stages)))
    tokens, targets = make_batch(cfg, batch, seed=0)
    piped = fpipe.pipeline(lambda p, x, y: lm_loss(fn(p, x), y), microbatches=microbatches, schedule=schedule)
    report = piped.memory_report(params, tokens, targets)
    step = fpipe.value_and_grad(piped)
    step(params, tokens, targets)
    return report.peak, rss_growth(lambda: step(params, tokens, targets)), report.table()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    group = "RANK" in os.environ
    if group:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if group else 0
    rows, tables = [], {}
    for schedule, stages in SCHEDULES.items():
        predicted, measured, table = one(schedule, stages, args.batch, args.microbatches)
        got: list[Any] = [None] * (dist.get_world_size() if group else 1)
        if group:
            dist.all_gather_object(got, (rank, predicted, measured))
        else:
            got = [(0, predicted, measured)]
        rows += [(schedule, *g) for g in got]
        tables[schedule] = table
    if rank == 0:
        report(rows, tables, group, args)
    if group:
        dist.barrier()
        dist.destroy_process_group()


def report(rows: list[Any], tables: dict[str, str], group: bool, args: Any) -> None:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "131072":
        print("warning: run with MALLOC_MMAP_THRESHOLD_=131072, else freed memory stays resident")
    where = "rank" if group else "process"
    print(f"fpipe {fpipe_revision()}, GPT base, batch {args.batch}, {args.microbatches} microbatches")
    print(f"| schedule | {where} | predicted (MiB) | measured (MiB) | error |")
    print("|---|---:|---:|---:|---:|")
    for schedule, rank, predicted, measured in rows:
        err = (predicted - measured) / measured
        print(f"| {schedule} | {rank} | {predicted / MIB:.1f} | {measured / MIB:.1f} | {err:+.1%} |")
    for schedule, table in tables.items():
        print(f"\n{schedule}, rank 0's stages:\n{table}")


if __name__ == "__main__":
    main()
