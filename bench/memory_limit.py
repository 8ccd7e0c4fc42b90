"""`pipeline(..., memory_limit=bytes)` on 2 ranks (issue 14): measured peak under the limit,
gradients, step time against the share recomputed, and checkpointing every block.

    MALLOC_MMAP_THRESHOLD_=131072 torchrun --standalone --nproc-per-node 2 bench/memory_limit.py

For each schedule (1f1b on 2 stages, zbv on 4 stages V-placed over 2 ranks), the benchmark GPT runs
as it is (unconstrained), under limits of 75 % and 50 % of the unconstrained peak (the larger rank's
predicted peak: one limit for every rank), with `torch.utils.checkpoint` around every block (which
fpipe recomputes), and under the limit whose target is that checkpointed run's peak (fpipe's own
choice aiming at the same memory: it aims 15 % under a limit). Per rank: the predicted peak
(`piped.memory`, before anything runs), the measured one (resident-set growth of one step after a
warm-up, with a fixed mmap threshold: ../shared/DESIGN.md, "Measuring memory on CPU"), whether the
gradients equal the unconstrained run's bit for bit, the median step time of `--steps` steps (the
variants' steps interleaved, round after round, so that the host's changing load touches them
alike), and the share recomputed: the estimated cost (`partition.node_cost`) of the operations the
backward programs gained, over the cost of the rank's forward programs.

Results: docs/BENCHMARKS.md, "Meeting a memory limit (issue 14)".
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint as checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import CONFIGS, GPT, cuts_for, fpipe_revision, lm_loss, make_batch  # noqa: E402

import fpipe  # noqa: E402
import fpipe._src.memory.remat_choose as remat_choose  # noqa: E402
from fpipe._src.memory.memory import predict  # noqa: E402
from fpipe._src.memory.remat_choose import least  # noqa: E402
from fpipe._src.runtime.run import LocalRunner  # noqa: E402
from fpipe._src.runtime.run_dist import DistRunner  # noqa: E402
from fpipe._src.stages.partition import node_cost  # noqa: E402

MIB = 2**20
START = time.perf_counter()
SCHEDULES = {"1f1b": 2, "zbv": 4}  # schedule -> stages


class CheckpointedGPT(GPT):
    """The benchmark GPT with `torch.utils.checkpoint` around every block."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for i, block in enumerate(self.blocks):
            x = checkpoint.checkpoint(block, x, use_reentrant=False)
            if i in self.cuts:
                x = fpipe.stage_boundary(x)
        return self.head(self.ln(x))


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


def costs(piped: fpipe.Pipelined) -> tuple[float, float]:
    """This rank's estimated (forward, backward) cost."""
    st, mine = piped._last.staged, set(piped.local_stages)  # type: ignore[union-attr]
    out = [0.0, 0.0]
    for (kind, s), prog in st.programs.items():
        if s in mine:
            out[kind != "F"] += sum(node_cost(n) for n in prog.gm.graph.nodes)
    return out[0], out[1]


def least_limit_met(piped: fpipe.Pipelined) -> int:
    """The least memory_limit fpipe can meet on this rank: the least peak its chooser finds,
    plus its headroom (what `pipeline` would refuse, found without asking it: a refusal on one
    rank ends the group's run)."""
    c = piped._last
    assert c is not None and c.base is not None
    sched, n_mb = c.runner.schedule, piped.cfg.microbatches
    summed = frozenset(c.base.n_outs + j for j in range(len(c.diff)))  # the params: passed whole

    def predicted(st: Any) -> Any:
        runner = DistRunner(st, sched, piped.pg, piped.cfg.timeout) if piped.pg else LocalRunner(st, sched)
        return predict(st, runner, summed, n_mb)

    peak = least(c.base, predicted, piped.local_stages).peak
    return remat_choose.least_limit(peak)


def largest(value: int) -> int:
    t = torch.tensor(value)
    if dist.is_initialized():
        dist.all_reduce(t, dist.ReduceOp.MAX)
    return int(t)


def run(model: Any, schedule: str, args: Any, limit: int | None, ref: Any) -> dict[str, Any]:
    fn, params = fpipe.functionalize(model)
    tokens, targets = make_batch(CONFIGS["base"], args.batch, seed=0)
    piped = fpipe.pipeline(
        lambda p, x, y: lm_loss(fn(p, x), y), microbatches=args.microbatches, schedule=schedule,
        memory_limit=limit,
    )  # fmt: skip
    predicted = piped.memory(params, tokens, targets)
    step = fpipe.value_and_grad(piped)
    _, grads = step(params, tokens, targets)
    measured = rss_growth(lambda: step(params, tokens, targets))
    local = {k: g for k, g in grads.items() if not g.is_meta}
    diff = max((float((g - ref[k]).abs().max()) for k, g in local.items()), default=0.0) if ref else 0.0
    fwd, bwd = costs(piped)
    least = least_limit_met(piped) if limit is None else 0
    print(f"  {schedule} limit={limit}: {time.perf_counter() - START:.0f} s", file=sys.stderr, flush=True)
    return dict(predicted=predicted, measured=measured, grads=local, diff=diff, fwd=fwd, bwd=bwd,
                least=least, step=lambda: step(params, tokens, targets))  # fmt: skip


def timed(variants: list[Any], steps: int) -> None:
    """Each variant's median step time, the variants' steps interleaved (round after round: a
    change in the host's load touches them alike)."""
    times: list[list[float]] = [[] for _ in variants]
    for _ in range(steps):
        for i, (_, _, r) in enumerate(variants):
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            r["step"]()
            times[i].append(time.perf_counter() - t0)
    for (_, _, r), ts in zip(variants, times):
        r["time"] = statistics.median(ts)
        del r["step"]


def schedule_rows(schedule: str, stages: int, args: Any) -> list[tuple[Any, ...]]:
    cfg = CONFIGS["base"]
    cuts = cuts_for(cfg, stages)

    def model(cls: type = GPT) -> Any:
        torch.manual_seed(0)
        return cls(cfg, cuts)

    free = run(model(), schedule, args, None, None)
    peak = largest(free["predicted"])
    ck = run(model(CheckpointedGPT), schedule, args, None, free["grads"])
    variants = [("unconstrained", None, free), ("checkpoint every block", None, ck)]
    limits = [("limit 75 %", int(0.75 * peak)), ("limit 50 %", int(0.5 * peak))]
    aim = remat_choose.least_limit(largest(ck["predicted"]))  # target: ck's peak
    limits.append(("limit aiming at checkpoint's peak", aim))
    rows: list[tuple[Any, ...]] = []
    least = largest(free["least"])
    for label, limit in limits:
        if limit < least:  # refused by every rank alike: say so, run nothing
            rows.append((schedule, label, limit, f"the least limit met is {least / MIB:.1f} MiB"))
        else:
            variants.append((label, limit, run(model(), schedule, args, limit, free["grads"])))
    timed(variants, args.steps)
    for label, limit, r in variants:
        share = (r["bwd"] - free["bwd"]) / free["fwd"]
        rows.append((schedule, label, limit, r["predicted"], r["measured"], r["diff"], r["time"],
                     r["time"] / free["time"] - 1, share))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    group = "RANK" in os.environ
    if group:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if group else 0
    every: list[Any] = []
    for schedule, stages in SCHEDULES.items():
        mine = schedule_rows(schedule, stages, args)
        got: list[Any] = [None] * (dist.get_world_size() if group else 1)
        if group:
            dist.all_gather_object(got, mine)
        else:
            got = [mine]
        every += [(r, row) for r, rows in enumerate(got) for row in rows]
    if rank == 0:
        report(every, args)
    if group:
        dist.barrier()
        dist.destroy_process_group()


def report(rows: list[Any], args: Any) -> None:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "131072":
        print("warning: run with MALLOC_MMAP_THRESHOLD_=131072, else freed memory stays resident")
    print(f"fpipe {fpipe_revision()}, GPT base, batch {args.batch}, {args.microbatches} microbatches")
    print("| schedule | run | rank | limit (MiB) | predicted (MiB) | measured (MiB) | max abs grad diff "
          "| step (s) | step cost | recomputed (of forward) |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    order = sorted(rows, key=lambda x: (x[1][0], _ORDER.index(x[1][1]), x[0]))
    for rank, row in order:
        if len(row) == 4:
            print(f"| {row[0]} | {row[1]} | {rank} | {row[2] / MIB:.1f} | refused: {row[3]} |")
            continue
        schedule, label, limit, pred, meas, diff, t, cost, share = row
        lim = f"{limit / MIB:.1f}" if limit else "-"
        print(f"| {schedule} | {label} | {rank} | {lim} | {pred / MIB:.1f} | {meas / MIB:.1f} | {diff:.1e} "
              f"| {t:.2f} | {cost:+.0%} | {share:.0%} |")  # fmt: skip


_ORDER = [
    "unconstrained",
    "limit 75 %",
    "limit 50 %",
    "checkpoint every block",
    "limit aiming at checkpoint's peak",
]

if __name__ == "__main__":
    main()
