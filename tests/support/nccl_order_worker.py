"""Worker for `tests/runtime/test_nccl_order.py`: every case under NCCL's communication order, on gloo.

    torchrun --standalone --nproc-per-node P tests/support/nccl_order_worker.py --out DIR --cases FILE

With `FPIPE_EMULATE_NCCL_ORDER=1` (set per case here) each rank issues a group of sends and
receives only once its previous group completed, sends included: the order in which NCCL's
communication stream runs them. A plan that deadlocks on NCCL then stops here too, and the short
`timeout` turns that into an error within seconds instead of a hang. A case with
`"old_order": true` issues its transfers in the order fpipe used before (`old_order_plan`), with
the plan check that would refuse it switched off, for that case only; it must fail, so it is
the launch's last case.

Each case (schedule text or a built-in name, from FILE) runs one value_and_grad step of an MLP
with a skip connection that crosses every stage boundary, and is compared with
`torch.func.grad_and_value` of the unsplit function (fp64). Cases with `"plain": true` run once
more without the emulation, recording the timeline. Each rank writes `DIR/rank{R}.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from dist_worker import MLP

import fpipe
from fpipe._src.runtime import run_dist
from fpipe._src.runtime.run_dist import EMULATE_NCCL_ORDER
from fpipe._src.schedules import comm

TIMEOUT_S = 20.0  # a deadlocked plan fails after this, per wait (a case may set "timeout")
BATCH = 12


def schedule_of(case: dict[str, Any], p: int, m: int) -> fpipe.schedules.Schedule:
    if "text" in case:
        return fpipe.schedules.parse(case["text"], name=case["id"])
    return fpipe.schedules.build(case["schedule"], pp=p, microbatches=m)


def one_step(case: dict[str, Any], p: int, m: int, emulate: bool) -> dict[str, Any]:
    """One value_and_grad step against the unsplit reference; errors and this rank's timeline."""
    os.environ[EMULATE_NCCL_ORDER] = "1" if emulate else "0"
    sched = schedule_of(case, p, m)
    torch.manual_seed(0)
    model = MLP(stages=sched.n_stages)
    fn, params = fpipe.functionalize(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)

    def loss(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (fn(params, x) - y).pow(2).mean()

    ref_grads, ref_loss = torch.func.grad_and_value(loss)(params, x, y)
    piped = fpipe.pipeline(loss, microbatches=m, schedule=sched, timeout=case.get("timeout", TIMEOUT_S))
    t0 = time.perf_counter()
    value, grads = fpipe.value_and_grad(piped)(params, x, y)
    out: dict[str, Any] = {"seconds": time.perf_counter() - t0}
    out["loss_err"] = abs(value.item() - ref_loss.item())
    out["grad_err"] = {k: (v - ref_grads[k]).abs().max().item() for k, v in grads.items()}
    runner = next(c for key, c in piped._cache.items() if key[1] is not None).runner
    out["b_split"] = sorted(runner.b_parts)
    out["events"] = piped.timeline.events
    if case.get("signatures"):
        out.update(second_signature(piped, loss, params, torch.cat([x, x]), torch.cat([y, y])))
    return out


def reaper_threads() -> int:
    return sum(t.name == "fpipe-send-reaper" for t in threading.enumerate())


def second_signature(piped: Any, loss: Any, params: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """A second input signature (twice the batch): another runner, the same send reaper thread."""
    before = reaper_threads()
    ref_grads, _ = torch.func.grad_and_value(loss)(params, x, y)
    _, grads = fpipe.value_and_grad(piped)(params, x, y)
    runners = [c.runner for key, c in piped._cache.items() if key[1] is not None]
    return {
        "grad_err_2": max((v - ref_grads[k]).abs().max().item() for k, v in grads.items()),
        "runners": len(runners),
        "reapers": len({id(r.reaper) for r in runners}),
        "reaper_threads_added": reaper_threads() - before,
    }


def run_case(case: dict[str, Any], p: int, m: int) -> dict[str, Any]:
    with old_order(case.get("old_order", False)):
        rec: dict[str, Any] = {"emulated": one_step(case, p, m, emulate=True)}
    if case.get("plain"):
        rec["plain"] = one_step(case, p, m, emulate=False)
    return rec


@contextlib.contextmanager
def old_order(on: bool) -> Iterator[None]:
    """With `on`: fpipe's old transfer order, and no plan check (what the tier must catch by running)."""
    saved = run_dist.comm_plan, run_dist.validate_comm
    if on:
        run_dist.comm_plan = old_order_plan  # type: ignore[assignment]
        run_dist.validate_comm = lambda sched, plan: None
    try:
        yield
    finally:
        run_dist.comm_plan, run_dist.validate_comm = saved


def old_order_plan(sched: Any, sends: Any, reads: Any) -> comm.CommPlan:
    """The order fpipe used before the plan: before running action i, the receives of action
    i + 1 (one batch per peer); after it, its sends (one batch per bundle). For the
    `"old_order"` case: the tier must catch it (test_nccl_order)."""
    plan = comm.comm_plan(sched, sends, reads)
    incoming = {(t.dst, t.src, t.index): t for gs in plan.groups for g in gs for t in g.recvs}
    out: list[tuple[comm.CommGroup, ...]] = []
    for r, acts in enumerate(sched.ranks):
        posted: dict[int, int] = {}
        groups: list[comm.CommGroup] = []
        for j, a in enumerate(acts):
            for nxt in acts[: j + 2] if j == 0 else acts[j + 1 : j + 2]:  # before a runs
                for src, idx in plan.need[nxt].items():
                    new = tuple(incoming[r, src, k] for k in range(posted.get(src, 0), idx + 1))
                    posted[src] = max(posted.get(src, 0), idx + 1)
                    if new:
                        groups.append(comm.CommGroup(r, len(groups), acts[j - 1] if j else None, (), new))
            for t in plan.sends_of(a):  # after a
                groups.append(comm.CommGroup(r, len(groups), a, (t,), ()))
        out.append(tuple(groups))
    return comm.CommPlan(tuple(out), plan.need)


def barrier_first(run: Any) -> Any:
    """`DistRunner.run` behind a barrier: every rank has traced and compiled (seconds, more on a
    loaded machine) before the first transfer, so a short timeout only times communication."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        dist.barrier()
        return run(*args, **kwargs)

    return wrapped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args()
    run_dist.DistRunner.run = barrier_first(run_dist.DistRunner.run)  # type: ignore[method-assign]
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    with open(args.cases) as f:
        cases = json.load(f)
    results: dict[str, Any] = {"rank": rank, "cases": {}}
    for case in cases:
        t0 = time.perf_counter()
        try:
            rec = run_case(case, p, args.microbatches)
            rec["ok"] = True
        except Exception as err:  # recorded for the test; a failed case may leave peers stuck
            rec = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        rec["case_seconds"] = time.perf_counter() - t0
        results["cases"][case["id"]] = rec
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:  # what finished, so far
            json.dump(results, f)
        if not rec["ok"]:
            break  # after a failure the ranks no longer agree on where they are
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
