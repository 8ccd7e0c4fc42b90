"""Peak activation memory of stage 0 under 1F1B against GPipe (goal: about min(p, m)/m of GPipe's).

    python bench/activation_memory.py                                   # p=2 and p=4 stages in one process
    python bench/activation_memory.py --stages 4 --microbatches 8
    torchrun --standalone --nproc-per-node 2 bench/activation_memory.py # stage 0 alone on rank 0

Method. CPU has no allocator statistics, and torch.profiler's memory events miss frees made on
other threads (fpipe's send thread drops sent activations), so two measures are used:

1. *Live bytes of the values the runner holds* (exact, deterministic). Every program run goes
   through fpipe's `execute`; the benchmark wraps it and, for each tensor a stage-0 program
   returns, counts its storage's bytes (once per storage; storages aliasing the program's inputs,
   such as a transposed weight, are skipped) until the last Python reference to every tensor on
   that storage is gone (`weakref.finalize`). Sampling after every stage-0 action gives the
   bytes held between actions, split into *activations* (values passed to later programs: saved
   activations, boundary tensors, I->W intermediates) and *gradients + loss* (the joint graph's
   outputs; since fpipe ae27a7a each microbatch's parameter gradient is added into one running
   sum as its backward finishes, before that every microbatch's gradient was kept until the step
   ended; with several microbatches the programs now add into the sums themselves, which are
   counted here from the program's extra inputs). Transients inside one program are not included: this is the memory the schedule
   decides.
2. *RSS growth* (under torchrun, where rank 0 runs stage 0 alone): peak RSS during a step minus
   RSS before it, after `malloc_trim` and a reset of the peak mark (/proc/self/clear_refs), with
   the two schedules alternating step by step. This includes program transients, allocator
   slack, communication buffers and the gradient sum.

One process runs every stage with fpipe's local runner, which keeps each rank's action order, so
stage 0's held values follow the same order as on its own rank.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import CONFIGS, GPT, cuts_for, fpipe_revision, lm_loss, make_batch  # noqa: E402

import fpipe  # noqa: E402
from fpipe._src.runtime import run as _run  # noqa: E402  (instrumented below)

MIB = 2**20


class LiveBytes:
    """Bytes of storages returned by stage `stage`'s programs that are still referenced."""

    def __init__(self) -> None:
        self.stage = 0
        self.results: set[str] = set()
        self.live: dict[int, list[Any]] = {}  # storage ptr -> [bytes, tracked tensors alive, kind]
        self.bytes = {"act": 0, "result": 0}
        self.samples: list[tuple[str, int, int]] = []  # (action, activation bytes, result bytes)

    def start(self, stage: int, results: set[str]) -> None:
        self.stage, self.results, self.samples = stage, results, []

    def _drop(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes[entry[2]] -= entry[0]
            del self.live[ptr]

    def track(self, prog: Any, args: list[Any], outs: Any, action: Any) -> None:
        if prog.place[1] != self.stage:
            return
        n_in = len(prog.inputs)
        inputs = {t.untyped_storage().data_ptr() for t in args[:n_in] if isinstance(t, torch.Tensor)}
        # with several microbatches a program adds its gradients into running sums it is given as
        # extra inputs (`run.accumulating`) and returns None for them: count those sums instead
        kinds = [("result" if name in self.results else "act", t) for name, t in zip(prog.outputs, outs)]
        for kind, t in kinds + [("result", t) for t in args[n_in:]]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in inputs or storage.nbytes() == 0:
                continue
            entry = self.live.setdefault(ptr, [storage.nbytes(), 0, kind])
            if entry[1] == 0:
                self.bytes[kind] += entry[0]
            entry[1] += 1
            weakref.finalize(t, self._drop, ptr)
        self.samples.append((str(action), self.bytes["act"], self.bytes["result"]))

    def wrap(self, execute: Any) -> Any:
        def tracked(prog: Any, args: list[Any], action: Any, *rest: Any, **kwargs: Any) -> Any:
            outs = execute(prog, args, action, *rest, **kwargs)
            self.track(prog, args, outs, action)
            return outs

        return tracked


TRACK = LiveBytes()
_run.execute = TRACK.wrap(_run.execute)  # both runners call it through run.run_program
_LIBC = ctypes.CDLL("libc.so.6")


def _kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="base", choices=list(CONFIGS))
    p.add_argument(
        "--stages", type=int, nargs="*", default=None, help="one process: stage counts (default 2 4)"
    )
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="steps per schedule (alternating)")
    return p.parse_args()


def make_step(cfg: Any, ref: GPT, schedule: str, stages: int, m: int, x: torch.Tensor, y: torch.Tensor):
    model = GPT(cfg, cuts_for(cfg, stages))
    model.load_state_dict(ref.state_dict())
    fn, params = fpipe.functionalize(model)
    params = {k: v.detach() for k, v in params.items()}

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lm_loss(fn(p, x), y)

    piped = fpipe.pipeline(loss_fn, microbatches=m, schedule=schedule)
    vg = fpipe.value_and_grad(piped)
    vg(params, x, y)  # trace + split once

    def step() -> dict[str, float]:
        staged = next(iter(piped._cache.values())).staged  # the compiled program's value names
        TRACK.start(0, set(staged.out_names))
        _LIBC.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        rss0 = _kib("VmRSS")
        loss, grads = vg(params, x, y)
        rss = (_kib("VmHWM") - rss0) / 1024
        del loss, grads
        samples = TRACK.samples or [("", 0, 0)]  # other ranks than stage 0's have none
        act = max(s[1] for s in samples) / MIB
        both = max(s[1] + s[2] for s in samples) / MIB
        res = max(s[2] for s in samples) / MIB
        return dict(act=act, result=res, held=both, rss=rss)

    return step


def measure(args: argparse.Namespace, stages: int, dist_mode: bool) -> dict[str, dict[str, float]]:
    cfg = CONFIGS[args.model]
    torch.manual_seed(0)
    ref = GPT(cfg)
    x, y = make_batch(cfg, args.batch, seed=1)
    steps = {s: make_step(cfg, ref, s, stages, args.microbatches, x, y) for s in ("gpipe", "1f1b")}
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in steps}
    for i in range(args.steps):
        for s in list(steps)[:: 1 if i % 2 == 0 else -1]:
            runs[s].append(steps[s]())
    return {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in runs.items()}


def show(stages: int, m: int, res: dict[str, dict[str, float]], where: str) -> None:
    g, o = res["gpipe"], res["1f1b"]
    goal = min(stages, m) / m
    print(
        f"\nstage 0, p={stages} stages, m={m} microbatches ({where}); goal 1F1B/GPipe ~ min(p, m)/m = {goal:.3f}; "
        f"fpipe {fpipe_revision()}, {time.strftime('%Y-%m-%d %H:%M %Z')}"
    )
    print(f"  {'MiB':<42}{'gpipe':>9}{'1f1b':>9}{'1f1b/gpipe':>12}")
    rows = [
        ("activations held (peak)", "act"),
        ("gradients + loss held (peak)", "result"),
        ("activations + gradients + loss (peak)", "held"),
        ("RSS growth over the step" + (" (all stages)" if where == "one process" else ""), "rss"),
    ]
    for label, k in rows:
        print(f"  {label:<42}{g[k]:>9.1f}{o[k]:>9.1f}{o[k] / g[k] if g[k] else float('nan'):>12.3f}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    if "LOCAL_RANK" in os.environ:  # under torchrun: rank 0 holds stage 0 alone
        import torch.distributed as dist

        dist.init_process_group("gloo")
        res = measure(args, dist.get_world_size(), True)
        if dist.get_rank() == 0:
            show(dist.get_world_size(), args.microbatches, res, f"rank 0 of {dist.get_world_size()}")
        dist.barrier()
        dist.destroy_process_group()
        return
    for stages in args.stages or [2, 4]:
        show(stages, args.microbatches, measure(args, stages, False), "one process")


if __name__ == "__main__":
    main()
