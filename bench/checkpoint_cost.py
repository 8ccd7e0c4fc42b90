"""What a checkpoint costs a training loop (issue 13): `fpipe.save` against `fpipe.async_save`.

    python bench/checkpoint_cost.py
    python bench/checkpoint_cost.py --dim 1024 --layers 8 --rounds 7 --every 4 --io-rounds 5 --dir /tmp/ckpt-bench

One process (the figures are about the loop, not the layout): an MLP of `--layers` layers
`tanh(h @ w + b)` of width `--dim` (fp32), cut into 2 stages by `fpipe.stage_boundary`, 4
microbatches, AdamW. A training step is `fpipe.value_and_grad`, `set_grads`, `opt.step()`. Every
`--every` steps the loop saves the parameters and the optimizer state (3x the parameter bytes)
to `--dir`/ckpt-MODE, in one of three modes (three loops, each its own model):
  none   no checkpoint (the baseline);
  sync   `fpipe.save(...)`: the loop waits until the checkpoint is written and published;
  async  `fpipe.async_save(...)`: the loop waits only for the copy (staging) of this rank's
         tensors; the file writing runs in a thread beside the next steps, and the next save
         (or the end of the run) waits for it to be published.
Timing: the three loops are built and warmed up (`--warmup` steps); then `--rounds` rounds each
run one round of every mode, the order rotating by round, so the machine's noise hits the modes
alike. A round is `--every` steps; its first step saves (sync, async), and an async round ends
by waiting for its checkpoint to be published, so whatever the background writing costs (the
steps it slows, a residual wait) is charged to its own round. Printed: per mode, the median
round time, the median over rounds of (its round - the round without a save): the step-time
cost of one save, and the median time inside the save call (the loop blocked: for async, the
staging copy).

Then the cost per GiB of the three operations alone (issue 25: with the checksums written at save
and verified at load), `--io-rounds` times each on the "sync" loop's checkpoint, the size the
files take on disk: `fpipe.save` until published; `fpipe.async_save`'s call, then its
`.result()` (the wait until it is published); `fpipe.load` of parameters and AdamW state into fresh tensors (every
file read and checked); and the SHA-256 of every file alone (what a save computes and a load
verifies). Printed: median wall seconds, and wall and CPU seconds (the process's, all threads)
per GiB.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import fpipe
from fpipe._src.training.checkpoint_format import sha256_file


def mlp(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, layers: int) -> torch.Tensor:
    h = x
    for i in range(layers):
        h = torch.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
        if i == layers // 2 - 1:
            h = fpipe.stage_boundary(h)
    return F.mse_loss(h, y)


class Loop:
    """One training loop (its own model, pipeline and optimizer) in one checkpoint mode."""

    def __init__(self, args: argparse.Namespace, mode: str, out: Path) -> None:
        g = torch.Generator().manual_seed(0)
        self.params = {}
        for i in range(args.layers):
            self.params[f"w{i}"] = torch.randn(args.dim, args.dim, generator=g) / args.dim**0.5
            self.params[f"b{i}"] = torch.zeros(args.dim)
        self.x, self.y = torch.randn(2, args.batch, args.dim, generator=g)
        piped = fpipe.pipeline(lambda p, x, y: mlp(p, x, y, args.layers), microbatches=4)
        self.vg = fpipe.value_and_grad(piped)
        self.opt = torch.optim.AdamW(self.params.values(), lr=1e-3)
        self.mode, self.out, self.every, self.step = mode, out / f"ckpt-{mode}", args.every, 0
        self.in_call: list[float] = []  # time inside each save call (the loop is blocked)

    def one_step(self) -> None:
        _, grads = self.vg(self.params, self.x, self.y)
        fpipe.set_grads(self.params, grads)
        self.opt.step()
        self.step += 1

    def save(self) -> Any:  # None (sync) or the async save in flight
        if self.mode == "sync":
            return fpipe.save(self.out, self.params, optimizer=self.opt, extra={"step": self.step})
        return fpipe.async_save(self.out, self.params, optimizer=self.opt, extra={"step": self.step})

    def round(self) -> float:
        """`every` steps, the first one saving; the time until the checkpoint is published."""
        t0 = time.perf_counter()
        handle = None
        for i in range(self.every):
            self.one_step()
            if i == 0 and self.mode != "none":
                t1 = time.perf_counter()
                handle = self.save()
                self.in_call.append(time.perf_counter() - t1)
        if handle is not None:
            handle.result()
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--every", type=int, default=4, help="steps per round (one save each)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--io-rounds", type=int, default=5, help="rounds of save / async_save / load alone")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared CPU)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(args.dir or tempfile.mkdtemp(prefix="fpipe-ckpt-bench-"))
    n = sum(args.dim * args.dim + args.dim for _ in range(args.layers))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {n / 1e6:.1f} M parameters (fp32), "
          f"checkpoint {4 * n * 3 / 2**20:.0f} MiB (parameters + AdamW state); {args.rounds} rounds of "
          f"{args.every} steps per mode; writing to {root}")  # fmt: skip
    modes = ("none", "sync", "async")
    loops = [Loop(args, mode, root) for mode in modes]
    for loop in loops:
        for _ in range(args.warmup):
            loop.one_step()
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for k in range(len(loops)):
            loop = loops[(r + k) % len(loops)]
            times[loop.mode].append(loop.round())
    print(
        f"| mode | median round of {args.every} steps (ms) | cost of one save (ms, median) | in the save call (ms) |"
    )
    print("|---|---|---|---|")
    for loop in loops:
        m = loop.mode
        cost = statistics.median(a - b for a, b in zip(times[m], times["none"]))
        blocked = f"{statistics.median(loop.in_call) * 1e3:.0f}" if loop.in_call else "—"
        print(f"| {m} | {statistics.median(times[m]) * 1e3:.0f} | {cost * 1e3:.0f} | {blocked} |")
    per_gib(loops[1], args.io_rounds)
    if args.dir is None:
        shutil.rmtree(root)


def per_gib(loop: Loop, rounds: int) -> None:
    """save, async_save and load alone, timed `rounds` times each, per GiB of files on disk:
    wall time and this process's CPU time (all its threads; on a shared machine the steadier)."""
    path = loop.out.with_name("ckpt-io")
    target = {k: torch.empty_like(v) for k, v in loop.params.items()}
    opt = torch.optim.AdamW(target.values(), lr=1e-3)
    kw = {"optimizer": loop.opt, "extra": {"step": loop.step}}
    ops: dict[str, Any] = {
        "save": lambda: fpipe.save(path, loop.params, **kw),
        "async_save call": lambda: ops.__setitem__("handle", fpipe.async_save(path, loop.params, **kw)),
        "async_save's .result()": lambda: ops.pop("handle").result(),
        "load": lambda: fpipe.load(path, target, optimizer=opt),
        "SHA-256 of the files alone": lambda: [sha256_file(f) for f in sorted(path.iterdir())],
    }
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in ops}
    for _ in range(rounds):
        for key in times:
            w, c = time.perf_counter(), time.process_time()
            ops[key]()
            times[key].append((time.perf_counter() - w, time.process_time() - c))
    gib = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**30
    assert all(torch.equal(target[k], v) for k, v in loop.params.items())  # load read what was saved
    print(f"\n{gib * 1024:.0f} MiB on disk; {rounds} rounds; medians\n")
    print("| operation | wall (s) | wall s per GiB | CPU s per GiB |")
    print("|---|---|---|---|")
    for key, ts in times.items():
        wall, cpu = statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)
        print(f"| {key} | {wall:.3f} | {wall / gib:.2f} | {cpu / gib:.2f} |")


if __name__ == "__main__":
    main()
