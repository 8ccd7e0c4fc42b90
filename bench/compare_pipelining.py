"""fpipe side by side with torch.distributed.pipelining: the same model, weights, split, schedule
and microbatches, trained step by step in one run, alternating the two libraries.

    torchrun --standalone --nproc-per-node 2 bench/compare_pipelining.py                 # all schedules
    torchrun --standalone --nproc-per-node 2 bench/compare_pipelining.py --schedule 1f1b --steps 10
    torchrun --standalone --nproc-per-node 2 bench/compare_pipelining.py --model heavy-head

Setup: each rank runs with one torch thread. The model is `bench/models.py`'s GPT (8 blocks,
d_model 256, 8 heads, sequence 128, vocabulary 1024; `--model heavy-head`: vocabulary 8192),
batch 32 in 8 microbatches, AdamW after every step. Schedules with one stage per rank cut the
model into 2 stages of 4 blocks; looped and V schedules into 4 stages of 2 blocks, placed as
torch places them (looped: stage s on rank s % p; V: rank r holds r and 2p-1-r). fpipe gets the
cut through `fpipe.stage_boundary` at the same block; torch gets `PipelineStage`s built from a
copy of the same reference model. Both libraries hold only their own rank's parameters.

`--schedule NAME+auto` adds a row where fpipe cuts the model itself (no `stage_boundary`: its
partitioner splits by each operation's measured time, `partition="measure"`) against torch's
equal split: fpipe's own best, not a like-for-like comparison.

Every round runs, for each schedule, one fpipe step and one torch step (which goes first
alternates by round), then one unpipelined step: `torch.func.grad_and_value` of the same loss
plus AdamW in one process with one thread (rank 0 computes; rank 1 waits in a barrier), so
machine noise hits all of them alike. Each timed step sits between two barriers and is timed on
rank 0 (the closing barrier makes that the slowest rank's end).

Reported per schedule: median step time of each library, fpipe/torch, tokens/s, the peak RSS
growth per rank during a step (VmHWM reset through /proc/self/clear_refs after malloc_trim, so
memory the other library freed does not hide it), the bubble per rank (1 - compute/step: fpipe
from `piped.timeline`; torch by timing its stages' forward/backward/loss calls), and a
breakdown of each step (compute / waits / runtime overhead / optimizer). The first step checks
that fpipe, torch and the unpipelined reference give the same loss and gradients (before the
optimizer moves them apart). Efficiency = (unpipelined step) / (ranks x pipelined step).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import dataclasses
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as _torch_schedules

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import CONFIGS, GPT, GPTConfig, cuts_for, fpipe_revision, lm_loss, make_batch, stage_modules  # noqa: E402

import fpipe  # noqa: E402
from fpipe._src.runtime import run as _run  # noqa: E402  (instrumented below)

# fpipe schedule -> (torch schedule class, stages per rank, placement)
PAIRS: dict[str, tuple[str, int, str]] = {
    "gpipe": ("ScheduleGPipe", 1, "one"),
    "1f1b": ("Schedule1F1B", 1, "one"),
    "zb-h1": ("ScheduleInterleavedZeroBubble", 1, "one"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2, "looped"),
    "looped-bfs": ("ScheduleLoopedBFS", 2, "looped"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}
AUTO = "+auto"  # a schedule name ending so: fpipe chooses its own split (torch keeps the equal one)
ADAMW = dict(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))


# -- memory --------------------------------------------------------------------------------------
_LIBC = ctypes.CDLL("libc.so.6")


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak(trim: bool) -> int:
    """Reset the peak-RSS mark (`trim`: after returning freed heap to the OS); return RSS (KiB)."""
    if trim:
        _LIBC.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS")


# -- the three ways to train -----------------------------------------------------------------------
class Timer:
    """Accumulates wall and thread-CPU seconds spent in wrapped calls (each library's compute)."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def reset(self) -> None:
        self.wall = self.cpu = 0.0

    def wrapped(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - t0
                self.cpu += time.thread_time() - c0

        return timed

    def wrap(self, obj: Any, name: str) -> None:
        setattr(obj, name, self.wrapped(getattr(obj, name)))


# fpipe's compute: every program run goes through run.execute (the timeline's "action"
# events); wrapping it adds the thread-CPU time, measured as for torch's stage calls.
FPIPE_COMPUTE = Timer()
_run.execute = FPIPE_COMPUTE.wrapped(_run.execute)
# torch's waits for its p2p transfers (receives, and sends: torch waits for those too).
TORCH_WAIT = Timer()
_torch_schedules._wait_batch_p2p = TORCH_WAIT.wrapped(_torch_schedules._wait_batch_p2p)


class FpipeTrainer:
    lib = "fpipe"

    def __init__(
        self, cfg: GPTConfig, ref: GPT, schedule: str, n_stages: int, m: int, x, y, auto: bool
    ) -> None:
        with torch.device("meta"):  # auto: no boundaries, fpipe's partitioner cuts n_stages by cost
            model = GPT(cfg, frozenset() if auto else cuts_for(cfg, n_stages))
        fn, _ = fpipe.functionalize(model)

        def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return lm_loss(fn(params, x), y)

        self.piped = fpipe.pipeline(
            loss_fn, microbatches=m, schedule=schedule, partition="measure" if auto else "estimate"
        )
        self.params = self.piped.materialize(model, x, y, state_dict=ref.state_dict())
        local = [v for v in self.params.values() if not v.is_meta]
        self.opt = torch.optim.AdamW(local, **ADAMW)
        self.vg = fpipe.value_and_grad(self.piped)

    def step(self, x: torch.Tensor, y: torch.Tensor, keep: bool = False) -> dict[str, Any]:
        FPIPE_COMPUTE.reset()
        t0 = time.perf_counter()
        loss, grads = self.vg(self.params, x, y)
        t1 = time.perf_counter()
        fpipe.set_grads(self.params, grads)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        events = self.piped.timeline.events
        busy = sum(e - s for _, _, s, e, k in events if k == "action")  # the timeline's compute
        wait = sum(e - s for _, _, s, e, k in events if k == "wait")
        return dict(
            loss=loss.detach(), grads=grads if keep else None, pipe=t1 - t0, opt=t2 - t1, busy=busy,
            wait=wait, compute_cpu=FPIPE_COMPUTE.cpu, span=max((e for _, _, _, e, _ in events), default=0.0),
        )  # fmt: skip


class TorchTrainer:
    lib = "torch"

    def __init__(
        self, cfg: GPTConfig, ref: GPT, cls_name: str, per_rank: int, placement: str, m: int
    ) -> None:
        from torch.distributed import pipelining

        rank, p = dist.get_rank(), dist.get_world_size()
        n = p * per_rank
        ids = {"one": [rank], "looped": [rank, rank + p], "v": [rank, 2 * p - 1 - rank]}[placement]
        mods = stage_modules(ref, n)
        self.stages = [pipelining.PipelineStage(mods[i], i, n, torch.device("cpu")) for i in ids]
        self.params = {k: v for i in ids for k, v in mods[i].named_parameters()}
        del mods
        self.opt = torch.optim.AdamW(self.params.values(), **ADAMW)
        cls = getattr(pipelining, cls_name)
        multi = per_rank > 1 or "Interleaved" in cls_name  # multi-stage schedule classes take a list
        self.sched = cls(self.stages if multi else self.stages[0], n_microbatches=m, loss_fn=lm_loss)
        self.first, self.last = 0 in ids, n - 1 in ids
        self.compute = Timer()
        for st in self.stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                self.compute.wrap(st, name)
        self.compute.wrap(self.sched, "_maybe_compute_loss")  # the loss is outside forward_one_chunk

    def step(self, x: torch.Tensor, y: torch.Tensor, keep: bool = False) -> dict[str, Any]:
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = dict(target=y, losses=losses) if self.last else {}
        self.compute.reset()
        TORCH_WAIT.reset()
        t0 = time.perf_counter()
        self.sched.step(*((x,) if self.first else ()), return_outputs=False, **kwargs)
        t1 = time.perf_counter()
        grads = {k: v.grad.clone() for k, v in self.params.items() if v.grad is not None} if keep else None
        t1b = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        loss = torch.stack(losses).mean().detach() if losses else None
        return dict(
            loss=loss, grads=grads, pipe=t1 - t0, opt=t2 - t1b, busy=self.compute.wall, wait=TORCH_WAIT.wall,
            compute_cpu=self.compute.cpu, span=t1 - t0,
        )  # fmt: skip


class SingleTrainer:
    """The unpipelined reference: torch.func.grad_and_value of the whole loss + AdamW."""

    lib = "single"

    def __init__(self, ref: GPT) -> None:
        self.fn, params = fpipe.functionalize(copy.deepcopy(ref))
        self.params = {k: v.detach() for k, v in params.items()}
        self.opt = torch.optim.AdamW(self.params.values(), **ADAMW)
        self.gv = torch.func.grad_and_value(lambda p, x, y: lm_loss(self.fn(p, x), y))

    def step(self, x: torch.Tensor, y: torch.Tensor, keep: bool = False) -> dict[str, Any]:
        t0, c0 = time.perf_counter(), time.thread_time()
        grads, loss = self.gv(self.params, x, y)
        t1, c1 = time.perf_counter(), time.thread_time()
        fpipe.set_grads(self.params, grads)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return dict(
            loss=loss, grads=grads if keep else None, pipe=t1 - t0, opt=time.perf_counter() - t1,
            busy=t1 - t0, wait=0.0, compute_cpu=c1 - c0, span=t1 - t0,
        )  # fmt: skip


class _Idle:
    """The other ranks' part in an unpipelined step: the two barriers."""

    def step(self, x: torch.Tensor, y: torch.Tensor, keep: bool = False) -> dict[str, Any]:
        return dict(pipe=0.0, opt=0.0, busy=0.0, wait=0.0, compute_cpu=0.0, span=0.0)


def timed(step: Callable[[], dict[str, Any]], trim: bool = False) -> dict[str, Any]:
    """One step between barriers: wall time and process CPU time (this rank), RSS growth.

    `trim`: first hand freed heap back to the OS, so the RSS growth is this step's own (what the
    other library freed cannot hide it); it also makes the step fault its pages in afresh, so
    memory rounds are not timed."""
    rss0 = reset_peak(trim)
    dist.barrier()
    t0, c0, u0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
    out = step()
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    dist.barrier()
    out["time"], out["cpu"] = time.perf_counter() - t0, time.process_time() - c0
    out["sys_cpu"], out["minflt"] = u1.ru_stime - u0.ru_stime, u1.ru_minflt - u0.ru_minflt
    out["rss_peak_mib"] = _status_kib("VmHWM") / 1024
    out["rss_growth_mib"] = (_status_kib("VmHWM") - rss0) / 1024
    return out


# -- checks -----------------------------------------------------------------------------------------
def rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max |a - b| / max |b| over the shared keys (a norm-wise check, fp32 sums in other orders)."""
    keys = sorted(set(a) & set(b))
    if not keys:
        return float("nan")
    num = max((a[k] - b[k]).abs().max().item() for k in keys)
    den = max(b[k].abs().max().item() for k in keys)
    return num / den


def first_step_check(
    name: str, fp: dict[str, Any], tc: dict[str, Any], ref: dict[str, Any], tol: float
) -> dict[str, Any]:
    """Compare loss and this rank's gradients of fpipe, torch and the unpipelined reference."""
    rank = dist.get_rank()
    # torch's loss lives on the last stage's rank: share it
    have = tc["loss"] is not None
    both = torch.tensor([tc["loss"].item() if have else 0.0, 1.0 if have else 0.0])
    gathered = [torch.zeros(2) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, both)
    tloss = next(g[0] for g in gathered if g[1] > 0)
    fl, rl = fp["loss"].item(), ref["loss"].item()
    fp_g = {k: v for k, v in fp["grads"].items() if v is not None}
    res = dict(
        schedule=name,
        rank=rank,
        loss_fpipe=fl,
        loss_torch=tloss.item(),
        loss_single=rl,
        grad_keys=len(fp_g),
        grad_keys_torch=len(tc["grads"]),
        grad_err_fpipe_vs_torch=rel_err(fp_g, tc["grads"]),
        grad_err_fpipe_vs_single=rel_err(fp_g, ref["grads"]),
        grad_err_torch_vs_single=rel_err(tc["grads"], ref["grads"]),
    )
    same_split = not name.endswith(AUTO)  # with fpipe's own split, the ranks hold other parameters
    res["ok"] = (
        (set(fp_g) == set(tc["grads"]) or not same_split)
        and abs(fl - rl) <= tol * abs(rl)
        and abs(res["loss_torch"] - rl) <= tol * abs(rl)
        and res["grad_err_fpipe_vs_single"] <= tol
        and (res["grad_err_fpipe_vs_torch"] <= tol or not same_split)
    )
    return res


# -- main ---------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--schedule",
        default="all",
        help=f"a comma list of {list(PAIRS)} or 'all'; NAME{AUTO}: fpipe splits the model itself (by its cost "
        "model) while torch keeps the equal split",
    )
    p.add_argument("--model", default="base", choices=list(CONFIGS))
    p.add_argument("--d-model", type=int, default=None, help="override the model's width (smoke tests)")
    p.add_argument("--steps", type=int, default=6, help="timed rounds (after the warm-up rounds)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds; the first one checks results")
    p.add_argument("--mem-rounds", type=int, default=1, help="untimed rounds that measure RSS growth")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--no-single", action="store_true", help="skip the unpipelined reference steps")
    p.add_argument("--tol", type=float, default=1e-4, help="relative tolerance of the first-step check")
    p.add_argument("--json", default=None, help="write all per-step measurements here (rank 0)")
    return p.parse_args()


def log(*a: Any) -> None:
    if dist.get_rank() == 0:
        print(*a, file=sys.stderr, flush=True)


def build(args: argparse.Namespace, names: list[str], cfg: GPTConfig, ref: GPT, x, y) -> dict[str, list[Any]]:
    from torch.distributed import pipelining

    p = dist.get_world_size()
    runs: dict[str, list[Any]] = {}
    for name in names:
        base = name.removesuffix(AUTO)
        cls_name, per_rank, placement = PAIRS[base]
        if not hasattr(pipelining, cls_name):
            log(f"skip {name}: this torch has no {cls_name}")
            continue
        t0 = time.perf_counter()
        fp = FpipeTrainer(cfg, ref, base, p * per_rank, args.microbatches, x, y, auto=name != base)
        tc = TorchTrainer(cfg, ref, cls_name, per_rank, placement, args.microbatches)
        runs[name] = [fp, tc]
        log(
            f"built {name}: fpipe + torch {cls_name}, {p * per_rank} stages ({time.perf_counter() - t0:.1f} s)"
        )
    return runs


def _public(o: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in o.items() if k not in ("loss", "grads")}


def run_rounds(args, runs, single, ref0, x, y) -> tuple[dict[str, dict[str, list[dict]]], list[dict]]:
    """Warm-up rounds (the first checks results), then timed rounds; returns this rank's records."""
    rec: dict[str, dict[str, list[dict]]] = {n: {"fpipe": [], "torch": []} for n in runs}
    if single is not None:
        rec["single"] = {"single": []}
    mem: dict[str, dict[str, list[dict]]] = {n: {"fpipe": [], "torch": []} for n in runs}
    checks: list[dict] = []
    n_rounds = args.warmup + args.steps + args.mem_rounds
    for rnd in range(n_rounds):
        check, memory = rnd == 0, rnd >= args.warmup + args.steps
        for name, (fp, tc) in runs.items():
            order = [fp, tc] if rnd % 2 == 0 else [tc, fp]
            outs = {t.lib: timed(lambda t=t, k=check: t.step(x, y, keep=k), memory) for t in order}
            if check:
                checks.append(first_step_check(name, outs["fpipe"], outs["torch"], ref0, args.tol))
                print(format_check(checks[-1]), file=sys.stderr, flush=True)
            if rnd >= args.warmup:
                for lib, o in outs.items():
                    (mem if memory else rec)[name][lib].append(_public(o))
        if single is not None and not memory:
            o = timed(lambda: single.step(x, y))
            if rnd >= args.warmup:
                rec["single"]["single"].append(_public(o))
        what = " (warm-up)" if rnd < args.warmup else " (memory)" if memory else ""
        log(f"round {rnd + 1}/{n_rounds} done{what}")
    rec["memory rounds"] = mem  # type: ignore[assignment]
    return rec, checks


def format_check(c: dict[str, Any]) -> str:
    return (
        f"check rank {c['rank']} {c['schedule']:<17} loss fpipe/torch/1-proc {c['loss_fpipe']:.6f}/"
        f"{c['loss_torch']:.6f}/{c['loss_single']:.6f}; grad rel err fpipe-torch "
        f"{c['grad_err_fpipe_vs_torch']:.1e} fpipe-1proc {c['grad_err_fpipe_vs_single']:.1e} torch-1proc "
        f"{c['grad_err_torch_vs_single']:.1e}; keys {c['grad_keys']}/{c['grad_keys_torch']} "
        f"{'OK' if c['ok'] else 'MISMATCH'}"
    )


def main() -> None:
    args = parse_args()
    args.revision = fpipe_revision()
    args.started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    names = [n for part in args.schedule.split(",") for n in (list(PAIRS) if part == "all" else [part])]
    for n in names:
        if n.removesuffix(AUTO) not in PAIRS:
            raise SystemExit(
                f"--schedule {n!r}: known schedules are {list(PAIRS)}, each optionally + {AUTO!r}, or 'all'"
            )
    cfg = CONFIGS[args.model]
    if args.d_model:
        cfg = dataclasses.replace(cfg, d_model=args.d_model, heads=min(cfg.heads, args.d_model))
    torch.manual_seed(0)
    ref = GPT(cfg)
    x, y = make_batch(cfg, args.batch, seed=1)
    log(f"model {args.model}: {sum(v.numel() for v in ref.parameters()):,} parameters; {p} ranks x 1 thread; "
        f"batch {args.batch} x {cfg.seq} tokens in {args.microbatches} microbatches")  # fmt: skip

    # The reference loss and gradients at the initial weights, on every rank (untimed); rank 0
    # then goes on timing the same trainer as the unpipelined baseline.
    st = SingleTrainer(ref)
    out = st.step(x, y, keep=True)
    ref0 = dict(loss=out["loss"], grads=out["grads"])
    single = None if args.no_single else (st if rank == 0 else _Idle())

    runs = build(args, names, cfg, ref, x, y)
    del ref, out
    rec, checks = run_rounds(args, runs, single, ref0, x, y)

    all_rec: list[Any] = [None] * p
    all_checks: list[Any] = [None] * p
    dist.all_gather_object(all_rec, rec)
    dist.all_gather_object(all_checks, checks)
    if rank == 0:
        print(report(args, cfg, all_rec, [c for cs in all_checks for c in cs]), flush=True)
        if args.json:
            Path(args.json).write_text(
                json.dumps(dict(args=vars(args), records=all_rec, checks=all_checks), indent=1)
            )
    dist.barrier()
    dist.destroy_process_group()


# -- the report ---------------------------------------------------------------------------------------
def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def per_rank(all_rec: list[dict], name: str, lib: str, key: str) -> list[float]:
    """The median of `key` over the timed rounds, for each rank."""
    return [med([o[key] for o in rec[name][lib] if o[key] is not None]) for rec in all_rec]


def _slash(xs: list[float], f: str) -> str:
    return "/".join(f.format(v) for v in xs)


def report(args, cfg: GPTConfig, all_rec: list[dict], checks: list[dict]) -> str:
    p, tokens, r0 = len(all_rec), args.batch * cfg.seq, all_rec[0]
    out: list[str] = []
    w = out.append
    names = [n for n in r0 if n not in ("single", "memory rounds")]
    w(f"model {args.model} (vocab {cfg.vocab}, d_model {cfg.d_model}); {p} ranks x 1 thread; batch {args.batch}, "
      f"{args.microbatches} microbatches; {args.steps} timed rounds; medians over rounds (rank 0's clock)")  # fmt: skip
    w(
        f"fpipe {getattr(args, 'revision', '?')}, torch {torch.__version__}; started {getattr(args, 'started', '?')}"
    )
    singles = [o["time"] for o in r0["single"]["single"]] if "single" in r0 else []
    single, single_min = (med(singles), min(singles)) if singles else (None, None)
    if single:
        w(f"unpipelined, 1 process x 1 thread (grad_and_value + AdamW): {single:.3f} s/step (min {single_min:.3f}), "
          f"{tokens / single:,.0f} tok/s; {p}-rank ideal {single / p:.3f} s/step")  # fmt: skip
    w("")
    w(f"{'schedule':<17}{'lib':<6}{'step s':>8}{'min s':>8}{'tok/s':>8}{'eff':>6}{'eff min':>8}"
      f"{'f/t':>7}{'f/t min':>8}{'f/t pair':>9}  {'bubble/rank':<12}{'RSS+ MiB/rank':<15}{'proc peak MiB':<14}")  # fmt: skip
    summary: dict[str, dict[str, float]] = {}
    for name in names:
        times = {lib: [o["time"] for o in r0[name][lib]] for lib in ("fpipe", "torch")}
        pair = med([f / t for f, t in zip(times["fpipe"], times["torch"])])
        summary[name] = {lib: med(ts) for lib, ts in times.items()}
        summary[name].update({f"{lib} min": min(ts) for lib, ts in times.items()}, pair=pair)
        for lib, ts in times.items():
            t = med(ts)
            bubble = [1 - b / t for b in per_rank(all_rec, name, lib, "busy")]
            mem = [{name: rec["memory rounds"][name]} for rec in all_rec]
            rss = per_rank(mem, name, lib, "rss_growth_mib")
            peak = [max(o["rss_peak_mib"] for o in rec[name][lib]) for rec in all_rec]
            sm = summary[name]
            ratio = f"{sm['fpipe'] / sm['torch']:.3f}" if lib == "torch" else ""
            ratio_min = f"{sm['fpipe min'] / sm['torch min']:.3f}" if lib == "torch" else ""
            pr = f"{pair:.3f}" if lib == "torch" else ""
            eff = f"{single / (p * t):.2f}" if single else "-"
            eff_min = f"{single_min / (p * min(ts)):.2f}" if single_min else "-"
            w(f"{name:<17}{lib:<6}{t:>8.3f}{min(ts):>8.3f}{tokens / t:>8,.0f}{eff:>6}{eff_min:>8}{ratio:>7}"
              f"{ratio_min:>8}{pr:>9}  "
              f"{_slash(bubble, '{:.2f}'):<12}{_slash(rss, '{:.0f}'):<15}{_slash(peak, '{:.0f}'):<14}")  # fmt: skip
    w(
        "(eff: unpipelined step / (ranks x step), of the medians; eff min: of the fastest rounds; f/t: fpipe/torch "
        "of the medians; f/t min: of the fastest rounds; f/t pair: median over rounds of that round's "
        "fpipe/torch; bubble: 1 - compute/step; RSS+: peak RSS growth during a step, in the memory rounds; proc "
        "peak: highest RSS of the process, which holds every schedule's models of both libraries)"
    )
    w("")
    w("seconds per step, per rank (rank0/rank1), medians:")
    w(f"{'schedule':<17}{'lib':<6}{'compute':<14}{'compute cpu':<14}{'process cpu':<14}{'of it sys':<14}"
      f"{'waits':<14}{'gaps':<14}{'outside run':<14}{'optimizer':<14}{'page faults/rank'}")  # fmt: skip
    for name in names:
        for lib in ("fpipe", "torch"):
            for rec in all_rec:
                for o in rec[name][lib]:
                    o["gaps"] = o["span"] - o["busy"] - o["wait"]
                    o["outside"] = o["pipe"] - o["span"]
            cols = [
                per_rank(all_rec, name, lib, k)
                for k in ("busy", "compute_cpu", "cpu", "sys_cpu", "wait", "gaps", "outside", "opt")
            ]
            faults = _slash(per_rank(all_rec, name, lib, "minflt"), "{:.0f}")
            w(f"{name:<17}{lib:<6}" + "".join(f"{_slash(c, '{:.3f}'):<14}" for c in cols) + faults)
    w(
        "(compute: the library's stage programs / forward, backward and loss calls, wall; compute cpu: their "
        "thread CPU; process cpu: all threads over the whole step, user + sys; waits: fpipe's timeline waits "
        "for receives, torch's waits for p2p works (receives and sends); gaps: the rest of the action loop "
        "(fpipe: runner start to last action end; torch: schedule.step); outside run: fpipe's value_and_grad "
        "around the runner (splitting inputs, send drain, loss broadcast, gradient sums; the last rank's is "
        "on the critical path); page faults: minor faults during the step)"
    )
    w("")
    same = [n for n in summary if not n.endswith(AUTO)]
    for stat, key in (("medians", ""), ("fastest rounds", " min")):
        w(f"fpipe/torch by {stat}:")
        t_best = min(same, key=lambda n: summary[n]["torch" + key])
        tb = summary[t_best]["torch" + key]
        for label, pool in (("best", same), (f"best incl. its own split ({AUTO})", list(summary))):
            if label != "best" and pool == same:
                continue
            f_best = min(pool, key=lambda n: summary[n]["fpipe" + key])
            fb = summary[f_best]["fpipe" + key]
            if label == "best" and "1f1b" in summary:
                s1 = summary["1f1b"]
                w(f"  {s1['fpipe' + key] / s1['torch' + key]:.3f}  1F1B on both")
            if "1f1b" in summary:
                w(f"  {fb / summary['1f1b']['torch' + key]:.3f}  fpipe's {label} ({f_best}) / torch's 1F1B")
            w(f"  {fb / tb:.3f}  fpipe's {label} ({f_best}) / torch's best ({t_best})")
    w("")
    out += [format_check(c) for c in sorted(checks, key=lambda c: (c["schedule"], c["rank"]))]
    return "\n".join(out)


if __name__ == "__main__":
    main()
