"""fpipe.plan: layouts enumerated, predicted and ranked from measurements, in one process.

What is comparable in one process: a pipeline whose stages all run here takes about the sum of its
actions' times (plus the time outside actions), not the simulated multi-rank makespan. So the
prediction checked against a measured step is `Plan.serial_s` (that sum, from the same measured
per-stage times); the simulated `predicted_step_s` of pp ranks is checked on 2 and 4 ranks by
bench/plan.py (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import fpipe
import fpipe._src.plan.plan as plan_mod
from fpipe._src.plan.plan import _cuts
from fpipe._src.plan.plan_tp import entries, group

D, V, L, B = 64, 1024, 4, 64


def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = x
    for i in range(L):
        h = torch.tanh(h @ p[f"w{i}"])
    return F.cross_entropy(h @ p["head"], y)


@pytest.fixture(scope="module")
def inputs() -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    params = {f"w{i}": torch.randn(D, D, generator=g) * 0.3 for i in range(L)}
    params["head"] = torch.randn(D, V, generator=g) * 0.1
    return params, torch.randn(B, D, generator=g), torch.randint(0, V, (B,), generator=g)


@pytest.fixture(scope="module")
def planned(inputs: tuple, one_thread: object) -> fpipe.Plan:
    params, x, y = inputs
    return fpipe.plan(loss_fn, params, x, y, world_size=2)


def _step_seconds(piped: fpipe.Pipelined, params: dict, x: torch.Tensor, y: torch.Tensor) -> float:
    step = fpipe.value_and_grad(piped)
    for _ in range(2):
        step(params, x, y)
    times = []
    for _ in range(10):  # the least: other work on a shared host only ever adds time
        start = time.perf_counter()
        step(params, x, y)
        times.append(time.perf_counter() - start)
    return min(times)


def test_plan_enumerates_layouts_and_ranks_them(planned: fpipe.Plan) -> None:
    layouts = {(c.dp, c.pp) for c in planned.candidates}
    assert layouts == {(1, 2), (2, 1)}
    assert {c.schedule for c in planned.candidates if c.pp == 2} >= {"1f1b", "gpipe", "zb-h1", "zbv"}
    steps = [c.predicted_step_s for c in planned.candidates]
    assert steps == sorted(steps) and planned.layout == planned.candidates[0].layout
    assert planned.tp == 1 and planned.measure_s > 0
    for c in planned.candidates:
        assert c.dp * c.pp == 2 and (B // c.dp) % c.microbatches == 0
        assert len(c.cuts) == c.stages - 1 and c.predicted_peak_bytes > 0


def test_one_process_step_matches_the_prediction(planned: fpipe.Plan, inputs: tuple) -> None:
    params, x, y = inputs
    for c in planned.candidates[:3]:
        rows = B // c.dp  # one replica's share
        measured = _step_seconds(fpipe.pipeline(loss_fn, plan=c), params, x[:rows], y[:rows])
        if not 1 / 3 < measured / c.serial_s < 3:  # the host's load changed: both again, once
            saved = dict(plan_mod.CACHE)
            plan_mod.CACHE.clear()
            fresh = fpipe.plan(loss_fn, params, x, y, world_size=2)
            plan_mod.CACHE.update(saved)  # the other tests compare with `planned`'s
            c = next(d for d in fresh.candidates if d.layout == c.layout)
            measured = _step_seconds(fpipe.pipeline(loss_fn, plan=c), params, x[:rows], y[:rows])
        assert 1 / 3 < measured / c.serial_s < 3, (c.layout, measured, c.serial_s)


def test_plan_pipeline_has_the_plans_cuts_and_gradients(planned: fpipe.Plan, inputs: tuple) -> None:
    params, x, y = inputs
    c = next(c for c in planned.candidates if c.pp == 2 and c.stages == 4)
    piped = fpipe.pipeline(loss_fn, plan=c)
    loss, grads = fpipe.value_and_grad(piped)(params, x, y)
    want_grads, want_loss = torch.func.grad_and_value(loss_fn)(params, x, y)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(grads, want_grads)
    assert piped.cfg.microbatches == c.microbatches and piped.cfg.schedule == c.schedule
    assert len(piped.local_stages) == c.stages and _cuts(piped._last) == c.cuts
    # each cut is named by the first parameter its stage reads (or its first op, reading none)
    assert len(c.cuts) == c.stages - 1 and all(k in params or k.startswith("op ") for k in c.cuts)
    assert any(k in params for k in c.cuts), c.cuts


def test_nothing_is_verified_in_one_process(planned: fpipe.Plan) -> None:
    """verify= times real steps on a job's ranks; one process has none (tests/parallel/test_dp.py: 4 ranks)."""
    assert planned.verified == 0 and all(c.measured_step_s != c.measured_step_s for c in planned.candidates)
    assert "step (measured)" in str(planned).splitlines()[0]


def test_measurements_are_cached_per_signature(planned: fpipe.Plan, inputs: tuple) -> None:
    params, x, y = inputs
    again = fpipe.plan(loss_fn, params, x, y, world_size=2)
    assert again.measure_s == 0.0 and again.layout == planned.layout
    assert again.predicted_step_s == planned.predicted_step_s


def test_memory_limit_drops_candidates(planned: fpipe.Plan, inputs: tuple) -> None:
    params, x, y = inputs
    peaks = sorted({c.predicted_peak_bytes for c in planned.candidates})
    assert len(peaks) >= 2, peaks
    # a limit whose target (15 % under it) is the middle peak: the smaller peaks fit, the larger not
    limit = -(-peaks[(len(peaks) - 1) // 2] * 100 // 85)
    p = fpipe.plan(loss_fn, params, x, y, world_size=2, memory_limit=limit)
    target = limit * 85 // 100  # 15 % under the limit, as pipeline(memory_limit=) aims
    assert all(c.predicted_peak_bytes <= target for c in p.candidates)
    over = [c for c, why in p.dropped if why.startswith("peak")]
    assert over and all(c.predicted_peak_bytes > target for c in over)
    assert len(p.candidates) + len(over) == len(planned.candidates)
    assert "dropped: peak" in p.table()
    with pytest.raises(ValueError, match=f"the least memory reachable is {peaks[0]} bytes"):
        fpipe.plan(loss_fn, params, x, y, world_size=2, memory_limit=peaks[0] - 1)


def test_table_names_the_winner_and_why(planned: fpipe.Plan) -> None:
    text = str(planned)
    assert text == planned.table()
    rows = text.splitlines()
    assert rows[0].split()[:3] == ["#", "layout", "stages"]
    assert rows[1].startswith("1") and planned.layout in rows[1] and rows[1].endswith("<- chosen")
    runner_up = planned.candidates[1]
    assert f"chosen: {planned.layout} ({planned.stages} stages)" in text
    assert f"faster than the next, {runner_up.layout} (bubble" in text
    assert "links: gloo loopback between two threads of this process" in text


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True])
def test_invalid_world_size_is_refused(bad: object, inputs: tuple) -> None:
    params, x, y = inputs
    with pytest.raises(ValueError) as err:
        fpipe.plan(loss_fn, params, x, y, world_size=bad)
    assert str(err.value) == (
        f"plan(loss_fn, world_size={bad!r}): world_size must be a positive int (the number of "
        f"ranks), got {bad!r}."
    )


def test_a_world_size_the_batch_does_not_divide_is_refused(inputs: tuple) -> None:
    params, x, y = inputs
    with pytest.raises(ValueError, match=r"no layout of 3 ranks fits: dp=1 pp=3: the per-replica"):
        fpipe.plan(loss_fn, params, x[:2], y[:2], world_size=3)


def test_layouts_not_timed_within_the_budget_are_dropped(inputs: tuple, one_thread: object) -> None:
    params, x, y = inputs
    p = fpipe.plan(loss_fn, params, x, y, world_size=2, budget_s=0.0)
    untimed = [c for c, why in p.dropped if why == "not measured: budget_s=0 spent"]
    assert p.candidates and untimed
    timed_all = {c.layout for c in fpipe.plan(loss_fn, params, x, y, world_size=2).candidates}
    assert timed_all <= {c.layout for c in p.candidates} | {c.layout for c in untimed}


def test_tp_cuts_group_segments_contiguously_with_the_slowest_stage_least() -> None:
    """With tp the planner cuts between blocks (NOTE [planning with tensor parallelism]):
    `group` gives each stage a contiguous run of segments, the heaviest run as light as it can be
    (checked against every way to cut), and `entries` reads the blocks from parameter names."""
    import itertools

    weights = [3.0, 1.0, 1.0, 1.0, 1.0, 5.0]  # a heavy first (embedding) and last (head) segment
    for n in range(1, len(weights) + 1):
        starts = group(weights, n)
        assert starts[0] == 0 and starts == sorted(set(starts)) and len(starts) == n
        runs = lambda s: [sum(weights[a:b]) for a, b in zip(s, [*s[1:], len(weights)])]  # noqa: E731
        best = min(max(runs([0, *c])) for c in itertools.combinations(range(1, len(weights)), n - 1))
        assert max(runs(starts)) == best, (n, starts)
    assert group(weights, 2) == [0, 4]  # 3+1+1+1 | 1+5
    with pytest.raises(ValueError, match="cannot group 6 segments into 7 stages"):
        group(weights, 7)
    keys = ["emb.weight", "blocks.0.w", "blocks.1.w", "blocks.10.w", "blocks.2.w", "head.0.w", "norm.w"]
    assert entries(dict.fromkeys(keys)) == ["blocks.0", "blocks.1", "blocks.2", "blocks.10"]
    assert entries({"w0": 1, "head": 2}) == []


def test_arguments_the_plan_sets_are_refused_alongside_it(planned: fpipe.Plan) -> None:
    with pytest.raises(ValueError) as err:
        fpipe.pipeline(loss_fn, plan=planned, microbatches=3)
    assert str(err.value) == (
        "pipeline(plan=...): the plan sets stages, microbatches, schedule, mesh, partition, cuts; "
        "do not pass microbatches=3 too (plan again to change them)."
    )
    fpipe.pipeline(loss_fn, plan=planned, timeout=30.0)  # the others are kept


def test_tensor_parallel_builds_need_a_job_and_a_function(planned: fpipe.Plan, inputs: tuple) -> None:
    """In one process there are no tp ranks to build on: `tensor_parallel=` plans tp = 1 (the
    measurements `planned` cached) and says so in the table; a non-function is refused."""
    params, x, y = inputs
    built = []
    p = fpipe.plan(loss_fn, params, x, y, world_size=2, tensor_parallel=lambda m: built.append(m))
    assert not built and p.measure_s == 0.0 and all(c.tp == 1 for c in p.candidates)
    assert p.layout == planned.layout and p.function is loss_fn and p.params is params
    assert [why for c, why in p.dropped if c.tp == 2] == ["tp=2: tp > 1 is planned under torchrun only"]
    assert "tp > 1 is planned under torchrun only" in str(p)
    with pytest.raises(TypeError, match="tensor_parallel must be a function tp_mesh -> \\(f, params\\)"):
        fpipe.plan(loss_fn, params, x, y, world_size=2, tensor_parallel="tp")
