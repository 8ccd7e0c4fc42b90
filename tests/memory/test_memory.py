"""`piped.memory`: the predicted peak of a step, against what a step really holds.

Two measurements, neither computed from the prediction's formula: the resident-set growth of a
real step in fresh processes (tests/support/memory_worker.py, with a fixed mmap threshold so freed tensors
leave the resident set): all stages in one process, and each rank of 2 processes in a gloo group
(one launch for the module); and, after every action, the bytes of the tensors the runner really
holds (`LocalRunner.record_memory`, counting each storage once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_launch import kill, report, start_ranks, wait_all
from models import GPT, MLP, lm_loss

import fpipe
from fpipe._src.runtime import run as run_
from fpipe._src.runtime.dist import SendReaper

WORKER = Path(__file__).resolve().parents[1] / "support" / "memory_worker.py"
CASES = ["mlp-gpipe-4-8", "mlp-1f1b-4-8", "mlp-zb-h1-4-8", "gpt-gpipe-4-8", "gpt-1f1b-4-8"]
CASES += ["gpt-zb-h1-4-8@0.6", "gptck-1f1b-4-8"]  # under memory_limit (0.6 x the peak); checkpointed
CASES += ["cnn-1f1b-2-4", "cnn-1f1b-2-4@0.8", "cnn64-1f1b-2-4"]  # convolutions' workspaces: oneDNN, im2col
GROUP_CASES = ["gpt-1f1b-2-8", "gpt-zbv-4-8"]  # 2 ranks; zbv: 2 stages per rank
GROUP_CASES += ["gpt128-1f1b-2-8@0.5", "gpt128-zbv-4-8@0.5"]  # one limit: half the larger rank's peak
EFFECT_CASES = ["stepbuf-gpipe-2-4@0.8", "stepbuf-1f1b-2-4@0.8"]  # gradients only: too small to measure
MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # freed tensors leave the resident set


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _result(log: str) -> dict[str, list[dict[str, int]]]:
    return json.loads(next(ln for ln in log.splitlines() if ln.startswith("RESULT "))[7:])


@pytest.fixture(scope="module")
def measured() -> dict[str, dict[str, int]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **MMAP)  # one thread: spinning threads crawl on shared cores
    out = subprocess.run(
        [sys.executable, str(WORKER), *CASES], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return {case: ranks[0] for case, ranks in _result(out.stdout).items()}


@pytest.fixture(scope="module")
def measured_ranks(tmp_path_factory) -> dict[str, list[dict[str, int]]]:
    with pytest.MonkeyPatch.context() as mp:
        for k, v in MMAP.items():
            mp.setenv(k, v)
        procs, _store = start_ranks(
            "memory_worker.py", 2, tmp_path_factory.mktemp("m"), "plan", *GROUP_CASES, *EFFECT_CASES
        )
    try:
        wait_all(procs, 600)
    finally:
        kill(procs)
    assert all(p.rc == 0 for p in procs), report(procs)
    return _result(procs[0].text())


def _within(m: dict[str, int], tol: float = 0.15) -> None:
    assert m["measured"] > 10 * 2**20  # big enough that the allocator's small pieces do not matter
    assert abs(m["predicted"] - m["measured"]) <= tol * m["measured"], m


@pytest.mark.parametrize("case", CASES)
def test_prediction_within_15_percent_of_resident_set_growth(measured, case):
    _within(measured[case])


@pytest.mark.parametrize("case", GROUP_CASES)
def test_each_ranks_prediction_within_15_percent_in_a_two_rank_group(measured_ranks, case):
    assert len(measured_ranks[case]) == 2
    for m in measured_ranks[case]:
        _within(m)


def test_1f1b_less_than_gpipe_and_zero_bubble_w_inputs_counted(measured):
    for model in ("mlp", "gpt"):
        gpipe, one_f_one_b = measured[f"{model}-gpipe-4-8"], measured[f"{model}-1f1b-4-8"]
        for kind in ("predicted", "measured"):
            assert one_f_one_b[kind] < 0.7 * gpipe[kind]
    # ZB-H1 keeps each W half's inputs until it runs, later than 1F1B frees them: more memory
    zb, one_f_one_b = measured["mlp-zb-h1-4-8"], measured["mlp-1f1b-4-8"]
    for kind in ("predicted", "measured"):
        assert zb[kind] > 1.2 * one_f_one_b[kind]


def _under_limit(m: dict[str, Any]) -> None:
    assert m["grads_equal"], m  # bit for bit the unconstrained pipeline's gradients
    assert m["predicted"] <= m["limit"] < m["unconstrained"], m  # a limit that binds, met
    assert m["measured"] <= m["limit"], m  # the real resident-set growth


def test_a_memory_limit_is_met_in_one_process(measured):
    _under_limit(measured["gpt-zb-h1-4-8@0.6"])


def test_a_memory_limit_is_met_on_a_conv_net(measured):
    """Issue 24, case 6: convolutions' kernel workspaces (oneDNN's blocked copies; in float64,
    im2col's columns) were left out of the prediction, 17 % (47 % in float64) under the
    resident-set growth of this CNN's step (the accuracy tests of `cnn-1f1b-2-4` and
    `cnn64-1f1b-2-4` above failed); a limit of 0.8 x its peak is met."""
    _under_limit(measured["cnn-1f1b-2-4@0.8"])
    assert measured["cnn-1f1b-2-4@0.8"]["recomputed_ops"] > 0


def test_a_memory_limit_is_met_on_each_rank(measured_ranks):
    for case in ("gpt128-1f1b-2-8@0.5", "gpt128-zbv-4-8@0.5"):
        assert len(measured_ranks[case]) == 2
        for m in measured_ranks[case]:
            _under_limit(m)
            assert m["recomputed_ops"] > 0  # each rank had to recompute to fit
            assert m["bound_sends"]  # and its sends complete by the end of the next action
    assert not any(m["bound_sends"] for m in measured_ranks["gpt-zbv-4-8"])  # no limit: overlapped


@pytest.mark.parametrize("case", EFFECT_CASES)
def test_a_buffer_written_in_place_under_a_limit_on_two_ranks(measured_ranks, case):
    """Issue 24 case 1 on 2 ranks (limit 0.8 x): a module buffer written in place and read by
    every layer; stage 0 recomputes, and every rank's gradients are bit for bit the unconstrained
    pipeline's (tests/tracing/test_effects.py checks those against the unsplit module; base: 30-44 %
    off on stage 0)."""
    rank0, rank1 = measured_ranks[case]
    assert rank0["recomputed_ops"] > 0 and rank0["predicted"] <= rank0["limit"], rank0
    assert rank0["grads_equal"] and rank1["grads_equal"], (rank0, rank1)


def test_plan_under_torchrun_starts_the_group_so_every_rank_plans_alike(measured_ranks):
    """Issue 24, case 7b: `fpipe.plan(f, params, x, y, world_size=2)` as docs/guide/planning.md writes it,
    under torchrun with no process group started: each rank planned alone (different stages),
    and `pipeline(f, plan=p)` failed saying the ranks staged different programs. `plan` starts
    the group as `pipeline` does; the ranks plan together (verified on the job) and alike, and
    the plan's pipeline gives `torch.func`'s loss and gradients (float64)."""
    recs = measured_ranks["plan"]
    assert all("error" not in r for r in recs), recs
    assert all(r["group"] and r["verified"] > 0 for r in recs), recs
    assert recs[0]["layout"] == recs[1]["layout"], recs
    assert max(max(r["loss_err"], r["grad_err"]) for r in recs) < 1e-12, recs
    assert set().union(*(r["keys"] for r in recs)) == {f"{k}{i}" for i in range(4) for k in "wb"}


def test_a_plan_under_a_memory_limit_is_met_on_each_rank(measured_ranks):
    """Issue 24, case 7: `fpipe.plan(..., memory_limit=)` kept layouts predicted up to the limit
    itself, without the receive buffers and sent values (a chosen layout's ranks then grew past
    it). Under the least limit a candidate meets, the others dropped, the chosen layout's step
    on each of 2 ranks stays under it: the planner aims 15 % under, as `pipeline` does, with
    `pipeline`'s own prediction of each rank's step."""
    for r in measured_ranks["plan"]:
        assert "error" not in r, r
        assert r["dropped"] > 0, r  # the limit binds
        assert r["measured"] <= r["limit"], r


def test_checkpointed_blocks_hold_less(measured):
    """torch.utils.checkpoint around every block, recomputed: less resident-set growth."""
    ck, plain = measured["gptck-1f1b-4-8"], measured["gpt-1f1b-4-8"]
    assert ck["measured"] < 0.8 * plain["measured"], (ck, plain)


def _tensors(env: dict[str, Any]) -> dict[Any, torch.Tensor]:
    """A runner's values, the elements of tuple values too (a tuple holds its tensors' memory)."""
    out: dict[Any, torch.Tensor] = {}
    for k, v in env.items():
        for i, t in enumerate(v if isinstance(v, (tuple, list)) else [v]):
            if isinstance(t, torch.Tensor):
                out[k, i] = t
    return out


def gpt_case(stages: int) -> tuple[Any, dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    fn, params = fpipe.functionalize(GPT(vocab=32, d=16, n_head=2, n_layer=3, seq=8, stages=stages))
    tokens = torch.randint(0, 32, (16, 8))
    return (lambda p, x, y: lm_loss(fn(p, x), y)), params, (tokens, tokens.roll(1, 1))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zbv", "interleaved-1f1b"])
def test_held_values_match_the_runner_after_every_action(monkeypatch, schedule):
    stages = 4 if schedule in ("zbv", "interleaved-1f1b") else 2
    loss, params, args = gpt_case(stages)
    pp = {"zbv": 2, "interleaved-1f1b": 2}.get(schedule, stages)
    sched = fpipe.schedules.build(schedule, pp=pp, microbatches=4, stages=stages)
    piped = fpipe.pipeline(loss, microbatches=4, schedule=sched)
    report = piped.memory_report(params, *args)
    assert piped.timeline is None  # predicted without running a step
    live = run_.live_bytes
    monkeypatch.setattr(run_, "live_bytes", lambda envs, skip=(): live(map(_tensors, envs), skip))
    step = fpipe.value_and_grad(piped)
    step(params, *args)
    runner = piped._last.runner
    runner.record_memory = True
    step(params, *args)
    assert [(a, held) for a, _, held in report.actions] == runner.memory
    assert max(running for _, running, _ in report.actions) == report.peak == piped.memory(params, *args)


def test_memory_of_a_function_with_aux(monkeypatch):
    """`memory` of a function returning (loss, aux) predicts `value_and_grad(piped,
    has_aux=True)`'s step (issue 24, case 5: it told the user to pass has_aux=True, which it
    does not take): the step reuses the plan `memory` compiled, and holds what it predicted."""
    loss, params, args = gpt_case(2)

    def with_aux(p: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        value = loss(p, x, y)
        return value, {"loss": value.detach(), "tokens": (x >= 0).sum()}

    piped = fpipe.pipeline(with_aux, microbatches=4, schedule="1f1b")
    report = piped.memory_report(params, *args)
    assert report.peak == piped.memory(params, *args) > 0
    live = run_.live_bytes
    monkeypatch.setattr(run_, "live_bytes", lambda envs, skip=(): live(map(_tensors, envs), skip))
    step = fpipe.value_and_grad(piped, has_aux=True)
    step(params, *args)
    assert len(piped._cache) == 1  # the plan `memory` compiled
    piped._last.runner.record_memory = True
    (_, aux), _ = step(params, *args)
    assert [(a, held) for a, _, held in report.actions] == piped._last.runner.memory
    assert int(aux["tokens"]) == args[0].numel()
    with pytest.raises(ValueError, match=r"returns 3 tensors; reduce it to a scalar, or pass has_aux=True"):
        fpipe.value_and_grad(piped)(params, *args)  # without has_aux: refused, as before
    rows = fpipe.pipeline(lambda p, x, y: with_aux(p, x, y)[0] * torch.ones(3), microbatches=4)
    with pytest.raises(ValueError) as err:
        rows.memory(params, *args)
    assert str(err.value).endswith(
        ".memory(...): the function must return a scalar loss, but returns a tensor of shape (3,); "
        "reduce it to a scalar, or return (loss, aux)."
    )


def test_report_table_and_meta_inputs():
    loss, params, args = gpt_case(2)
    piped = fpipe.pipeline(loss, microbatches=4, schedule="1f1b")
    report = piped.memory_report(params, *args)
    assert int(report) == report.peak
    assert [s.stage for s in report.stages] == [0, 1]
    grads = sum(p.numel() * p.element_size() for p in params.values())
    assert sum(s.grads for s in report.stages) == grads  # every gradient sum, once
    assert report.peak >= grads + max(s.transient for s in report.stages)
    lines = report.table().splitlines()
    assert lines[0].split()[:2] == ["stage", "rank"] and len(lines) == 4
    assert lines[-1].startswith("total") and f"peak during {report.at}" in lines[-1]
    # a model built on the meta device: the same prediction, nothing allocated
    meta = {k: v.to("meta") for k, v in params.items()}
    piped_meta = fpipe.pipeline(loss, microbatches=4, schedule="1f1b")
    assert piped_meta.memory(meta, *(a.to("meta") for a in args)) == report.peak


def test_one_microbatch_gradients_kept_as_computed():
    """With one microbatch the runner keeps each program's gradient outputs as they are (no
    running sums): a view's base counts whole."""
    torch.manual_seed(0)
    fn, params = fpipe.functionalize(MLP(d_in=6, hidden=32, d_out=3, n_layers=4, stages=2))
    piped = fpipe.pipeline(lambda p, x: fn(p, x).pow(2).mean(), microbatches=1)
    report = piped.memory_report(params, torch.randn(8, 6))
    grads = sum(p.numel() * p.element_size() for p in params.values())
    assert sum(s.grads for s in report.stages) == grads


class _GatedGroup:
    """A process group stand-in whose send waits end when `gate` is set, or raise `error`."""

    rank, store = 0, None

    def __init__(self) -> None:
        self.gate, self.error = threading.Event(), None

    def wait_all(self, works: Any, timeout: float, what: Any, peer: Any) -> None:
        assert self.gate.wait(10)
        if self.error is not None:
            raise self.error


def test_under_a_limit_a_send_lets_its_tensor_go_before_the_next_action_ends():
    """memory.py predicts an action's sent values let go once the next action has ended; gloo's
    send waits for the peer's receive, so under `memory_limit` the runner waits for them there
    (`SendReaper.settled`) rather than hold them as long as a slow peer makes it."""
    pg = _GatedGroup()
    reaper = SendReaper(pg, 10.0)  # type: ignore[arg-type]
    t = torch.ones(1024)
    gone = weakref.ref(t)
    before = reaper.submitted
    reaper.submit([object()], [t], "a send")
    del t
    waiter = threading.Thread(target=reaper.settled, args=(before + 1,))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and gone() is not None  # the peer has not received it: held, waited on
    pg.gate.set()
    waiter.join(10)
    assert not waiter.is_alive() and gone() is None  # settled: the tensor is let go
    pg.error = RuntimeError("rank 1 stopped")
    reaper.submit([object()], [torch.ones(4)], "a failing send")
    with pytest.raises(RuntimeError, match="rank 1 stopped"):  # the send's failure, on the caller
        reaper.settled(reaper.submitted)
