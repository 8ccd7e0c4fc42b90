"""Worker for `tests/runtime/test_trust_dist.py` (torchrun, 2 ranks, gloo): cases run in order, each
rank writes `rank{R}.json` with one record per case.

* alternate: two pipelines (different functions) in one process group, called alternately,
  value_and_grad against `torch.func.grad_and_value` of the unsplit functions (fp64).
* isolation: their store namespaces; a failure reported on one is not seen by the other.
* branch: `if dist.get_rank() == 1: h = h * 2` on stage 1 -> the error every rank raises.
* constant: a rank-dependent Python constant on stage 0 -> the error every rank raises.
* transforms: torch.func transforms around a pipeline (tests/support/transforms_worker.py).
* after: the first two pipelines called once more: the group is still usable after the errors.
* tdp_zoo: tests/support/tdp_models.py's zoo (pipe_split() calls, a split_spec) against the unsplit
  functions (tests/tracing/test_from_tdp.py reads it).
* compile_fails: rank 1 raises while tracing and goes on; rank 0 learns why at once.

First, for `tests/runtime/test_timeline.py` (it shares this launch: a process group costs seconds to
start), timeline: one step of its 4-stage function with interleaved-1F1B, then ZBV, under
`FPIPE_TRACE` (the trace files hold ZBV's step, the last); each step's events to a file.

With `--mesh` (4 ranks; `tests/support/four_ranks_worker.py` runs these first in the 4-rank launch it
shares with two other modules): a (dp=2, pp=2) DeviceMesh, each replica passing its half of the
batch: the results (the whole batch's), each pipeline group's store namespace, and a failure
report on replica 0 that replica 1 must not see.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import outputs_worker
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transforms_worker

import fpipe

D, MB = 4, 2
TIMEOUT_S = 20.0  # of the compile_fails case


def _mlp(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = fpipe.stage_boundary(torch.tanh(x @ params["w0"]))
    return F.mse_loss(h @ params["w1"], y)


def _other(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = fpipe.stage_boundary(torch.sigmoid(x @ params["w0"] + params["b"]))
    return (h @ params["w1"] - y).abs().mean()


def _branch(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = fpipe.stage_boundary(torch.tanh(x @ params["w0"]))
    if dist.get_rank() == 1:
        h = h * 2
    return F.mse_loss(h @ params["w1"], y)


def _measured(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ params["w0"])  # no boundary: stages=2, partition="measure" cuts it
    if dist.get_rank() == 1:
        h = h * 2
    return F.mse_loss(h @ params["w1"], y)


def _constant(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    scale = 1.0 + 0.5 * int(os.environ["RANK"])  # e.g. read from a per-process setting
    h = fpipe.stage_boundary(torch.tanh(scale * x @ params["w0"]))
    return F.mse_loss(h @ params["w1"], y)


def _fails_on_rank_1(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 cannot trace this function")
    return _mlp(params, x, y)


def _inputs(seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(D, D, generator=g, dtype=torch.float64) for k in ("w0", "w1")}
    params["b"] = torch.randn(D, generator=g, dtype=torch.float64)
    return (
        params,
        torch.randn(4 * MB, D, generator=g, dtype=torch.float64),
        torch.randn(4 * MB, D, generator=g, dtype=torch.float64),
    )


def _max_errors(
    piped: fpipe.Pipelined, f: Callable[..., Any], seed: int, dp: int | None = None
) -> dict[str, Any]:
    """This rank's result against the unsplit function's: max abs errors, gradient keys held.
    With `dp` (a replica on a (dp, pp) mesh), the rank passes its half of the batch and the
    reference is the whole batch's (NOTE [gradients over replicas])."""
    params, x, y = _inputs(seed)
    mine = (x, y) if dp is None else (x.chunk(2)[dp], y.chunk(2)[dp])
    loss, grads = fpipe.value_and_grad(piped)(params, *mine)
    grads_ref, loss_ref = torch.func.grad_and_value(f)(params, x, y)
    errs = {k: (g - grads_ref[k]).abs().max().item() for k, g in grads.items()}
    return {"loss": abs(loss.item() - loss_ref.item()), "grads": errs, "keys": sorted(grads)}


def _alternate(a: fpipe.Pipelined, b: fpipe.Pipelined) -> dict[str, Any]:
    steps = [{"a": _max_errors(a, _mlp, k), "b": _max_errors(b, _other, 100 + k)} for k in range(3)]
    return {"steps": steps}


def _isolation(a: fpipe.Pipelined, b: fpipe.Pipelined) -> dict[str, Any]:
    """The two pipelines' store namespaces; a failure report of a (in the call both are at)
    is not b's, and b's next call runs."""
    assert a.pg is not None and b.pg is not None
    rec: dict[str, Any] = {"namespaces": [a.pg.namespace, b.pg.namespace]}
    if dist.get_rank() == 1:
        a.pg.report_failure("rank 1 failed: injected report on pipeline a")
    dist.barrier()
    rec["a_sees"], rec["b_sees"] = a.pg.failure(), b.pg.failure()
    rec["b_after"] = _max_errors(b, _other, 200)
    return rec


def _error_of(piped: fpipe.Pipelined, f: Callable[..., Any]) -> dict[str, Any]:
    params, x, y = _inputs(7)
    try:
        fpipe.value_and_grad(piped)(params, x, y)
    except Exception as err:
        return {"error_type": type(err).__name__, "error": str(err)}
    return {"error_type": None}


def _backward_of_a_call(piped: fpipe.Pipelined) -> dict[str, Any]:
    """`piped(params, x, y).backward()` in a process group: an error on every rank (it used to
    leave rank 1's gradients None, and rank 0's without stage 1's part, with no error)."""
    params, x, y = _inputs(9)
    params = {k: v.requires_grad_(True) for k, v in params.items()}
    try:
        piped(params, x, y).backward()
        return {"error_type": None, "grads": {k: v.grad is not None for k, v in params.items()}}
    except Exception as err:
        return {"error_type": type(err).__name__, "error": str(err)}


def _compile_fails(out: str) -> dict[str, Any]:
    """Rank 1 fails while compiling, catches it and stays alive (until rank 0 is done, at most
    40 s): rank 0, waiting for it in the comparison of the staged programs, must stop at once
    with rank 1's reason, not after the timeout. Last: rank 0's all-gather stays unmatched."""
    start = time.monotonic()
    rec = _error_of(fpipe.pipeline(_fails_on_rank_1, microbatches=MB, timeout=TIMEOUT_S), _fails_on_rank_1)
    rec["seconds"] = time.monotonic() - start
    done = os.path.join(out, "rank0_done")
    if dist.get_rank() == 0:
        open(done, "w").close()
    while not os.path.exists(done) and time.monotonic() - start < 40:
        time.sleep(0.1)
    return rec


TIMELINE_SCHEDULES = ("interleaved-1f1b", "zbv")


def _timeline(out: str) -> dict[str, Any]:
    """Writes `out/run.{schedule}.events.rank{R}.json` per schedule and, through FPIPE_TRACE (set
    for these steps only), `out/trace.rank{R}.json` (test_timeline asserts on them)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runtime"))
    from test_timeline import f, inputs  # tests/runtime/test_timeline.py's 4-stage step

    os.makedirs(out, exist_ok=True)
    os.environ["FPIPE_TRACE"] = os.path.join(out, "trace")
    try:
        for schedule in TIMELINE_SCHEDULES:
            piped = fpipe.pipeline(f, microbatches=4, schedule=schedule)
            fpipe.value_and_grad(piped)(*inputs())
            tl = piped.timeline
            assert tl is not None
            with open(os.path.join(out, f"run.{schedule}.events.rank{dist.get_rank()}.json"), "w") as fh:
                json.dump({"origin": tl.origin, "events": tl.events}, fh)
    finally:
        del os.environ["FPIPE_TRACE"]
    return {"schedules": list(TIMELINE_SCHEDULES)}


def _tdp_zoo() -> dict[str, Any]:
    """tests/tracing/test_from_tdp.py on 2 ranks: per model (each its own case), this rank's stages, the
    max errors against the unsplit function's (fp64) per gradient key this rank returns."""
    from tdp_models import TWO_RANKS

    return {name: _case(functools.partial(_zoo_model, name, opts)) for name, (opts, _) in TWO_RANKS.items()}


def _zoo_model(name: str, options: dict[str, Any]) -> dict[str, Any]:
    from tdp_models import build, forward_ops

    loss, params, data = build(name)
    piped = fpipe.pipeline(loss, microbatches=MB, timeout=60, **options)
    value, grads = fpipe.value_and_grad(piped)(params, *data)
    ref_grads, ref = torch.func.grad_and_value(loss)(params, *data)
    return {
        "loss": abs(value.item() - ref.item()),
        "grads": {k: (g - ref_grads[k]).abs().max().item() for k, g in grads.items()},
        "stages": piped.local_stages,
        "ops": {str(s): forward_ops(next(iter(piped._cache.values())))[s] for s in piped.local_stages},
    }


def _case(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A case's record, or the error it raised (so each case's test fails on its own)."""
    try:
        return run()
    except Exception as err:
        return {"error_type": type(err).__name__, "error": str(err)}


def _mesh_cases() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp = mesh.get_local_rank("dp")
    piped = fpipe.pipeline(_mlp, microbatches=MB, mesh=mesh, timeout=60)
    rec: dict[str, Any] = {"dp": dp, "step": _case(lambda: _max_errors(piped, _mlp, 10, dp))}
    assert piped.pg is not None
    rec["namespace"] = getattr(piped.pg, "namespace", None)  # (None before issue 17)
    if dp == 0 and piped.pg.rank == 1:  # in the call both replicas are at
        piped.pg.report_failure("rank 1 of replica 0 failed: injected report")
    dist.barrier()
    rec["sees"] = piped.pg.failure()
    chain2 = fpipe.pipeline(transforms_worker.chain(2), microbatches=MB, mesh=mesh, timeout=60)
    rec["transforms"] = _case(
        lambda: transforms_worker.cases(chain2, 2, dp)
    )  # tests/pipeline/test_transforms_dist.py
    dp_only = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "pp"))  # no pipeline group
    chain1 = fpipe.pipeline(transforms_worker.chain(1), stages=1, microbatches=MB, mesh=dp_only, timeout=60)
    rec["transforms_dp_only"] = _case(
        lambda: transforms_worker.cases(chain1, 1, dp_only.get_local_rank("dp"), 4)
    )
    rec["transforms_pp4"] = _case(transforms_worker.run_pp)
    rec["after"] = _case(lambda: _max_errors(piped, _mlp, 20, dp))
    return rec


def mesh(out: str) -> None:
    """The --mesh cases (4 ranks); writes `out/rank{R}.json`."""
    record = {"rank": int(os.environ["RANK"]), **_mesh_cases()}
    with open(os.path.join(out, f"rank{record['rank']}.json"), "w") as f:
        json.dump(record, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mesh", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.mesh:
        mesh(args.out)
        return
    record: dict[str, Any] = {"rank": int(os.environ["RANK"])}
    record["timeline"] = _case(lambda: _timeline(os.path.join(args.out, "timeline")))
    a = fpipe.pipeline(_mlp, microbatches=MB, timeout=60)
    b = fpipe.pipeline(_other, microbatches=MB, timeout=60)
    record["alternate"] = _case(lambda: _alternate(a, b))
    record["isolation"] = _case(lambda: _isolation(a, b))
    record["branch"] = _error_of(fpipe.pipeline(_branch, microbatches=MB, timeout=60), _branch)
    measured = fpipe.pipeline(_measured, stages=2, microbatches=MB, timeout=60, partition="measure")
    record["measured"] = _error_of(measured, _measured)
    record["constant"] = _error_of(fpipe.pipeline(_constant, microbatches=MB, timeout=60), _constant)
    record["transforms"] = _case(transforms_worker.run_pp)  # tests/pipeline/test_transforms_dist.py
    record["backward"] = _case(lambda: _backward_of_a_call(a))
    record["after"] = _case(lambda: {"a": _max_errors(a, _mlp, 300), "b": _max_errors(b, _other, 301)})
    record["tdp_zoo"] = _case(_tdp_zoo)
    record["outputs"] = _case(outputs_worker.pp_cases)  # tests/pipeline/test_outputs_dist.py
    record["loss_parallel"] = _case(outputs_worker.loss_parallel_refusals)
    record["clip_failure"] = _case(outputs_worker.clip_failure)  # (its own group: leaves ours usable)
    record["compile_fails"] = _compile_fails(args.out)
    with open(os.path.join(args.out, f"rank{record['rank']}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
