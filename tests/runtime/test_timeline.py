"""`Pipelined.timeline`: what a real step executed, per rank, as events and as a Chrome trace.

One process runs every stage (the events' rank is the rank that holds the stage); two
processes under torchrun show the waits for a peer and the per-rank trace files (the 2-rank
launch of tests/support/trust_dist_worker.py runs that step first: the `trust_launch` fixture of
tests/conftest.py, shared with tests/runtime/test_trust_dist.py).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest
import torch
from dist_launch import report
from torch.profiler import ProfilerActivity, profile

import fpipe
from fpipe.schedules import Schedule, build


def f(params, x):
    h = fpipe.stage_boundary(torch.tanh(x @ params["a"]))
    h = fpipe.stage_boundary(torch.tanh(h @ params["b"]))
    h = fpipe.stage_boundary(torch.tanh(h @ params["c"]))
    return (h @ params["d"]).pow(2).mean()


def inputs():
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(6, 6, generator=g) for k in "abcd"}
    return params, torch.randn(16, 6, generator=g)


def step(schedule: str = "1f1b", microbatches: int = 4) -> tuple[fpipe.Pipelined, Schedule]:
    """One value-and-grad step of the 4-stage `f`; returns the pipeline and the schedule it ran."""
    piped = fpipe.pipeline(f, microbatches=microbatches, schedule=schedule)
    fpipe.value_and_grad(piped)(*inputs())
    return piped, build(schedule, stages=4, microbatches=microbatches)


def per_rank(events) -> dict[int, list[str]]:
    out: dict[int, list[str]] = defaultdict(list)
    for name, rank, *_ in events:
        out[rank].append(name)
    return dict(out)


def test_no_timeline_before_the_first_step():
    assert fpipe.pipeline(f, microbatches=2).timeline is None


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved-1f1b", "zbv"])
def test_one_event_per_action_in_each_ranks_order(schedule):
    piped, sched = step(schedule)
    events = piped.timeline.events
    assert len(events) == sum(len(acts) for acts in sched.ranks)
    assert {kind for *_, kind in events} == {"action"}  # one process: nothing waits for a peer
    assert per_rank(events) == {r: [str(a) for a in acts] for r, acts in enumerate(sched.ranks)}
    # one process runs one action at a time: the events follow each other, none overlaps
    times = [(start, end) for _, _, start, end, _ in events]
    assert all(0 <= s <= e for s, e in times)
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(times, times[1:]))


def test_each_step_replaces_the_timeline():
    piped, sched = step()
    first = piped.timeline
    fpipe.value_and_grad(piped)(*inputs())
    assert piped.timeline is not first
    assert len(piped.timeline.events) == len(first.events) == 32  # 4 stages x 4 microbatches x (F, B)


def test_forward_call_records_forwards_only():
    piped = fpipe.pipeline(f, microbatches=2)
    piped(*inputs())
    assert sorted(name for name, *_ in piped.timeline.events) == sorted(
        f"F{s}.{m}" for s in range(4) for m in range(2)
    )


def test_chrome_is_trace_event_json():
    piped, sched = step("zb-h1")
    trace = json.loads(json.dumps(piped.timeline.chrome()))  # plain JSON, nothing lost
    meta = [ev for ev in trace["traceEvents"] if ev["ph"] == "M"]
    ranks = sorted({rank for _, rank, *_ in piped.timeline.events})
    assert meta == [
        {"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in ranks
    ]
    events = [ev for ev in trace["traceEvents"] if ev["ph"] != "M"]
    assert len(events) == len(piped.timeline.events)
    base = piped.timeline.wall_origin * 1e6  # wall clock: files of several ranks line up
    for ev, (name, rank, start, end, kind) in zip(events, piped.timeline.events):
        # complete events ("ph": "X") with microsecond timestamps; one process per pipeline rank
        assert ev == {
            "name": name,
            "cat": kind,
            "ph": "X",
            "ts": pytest.approx(base + start * 1e6),
            "dur": pytest.approx((end - start) * 1e6),
            "pid": rank,
            "tid": 0,
        }
        assert ev["dur"] >= 0 and ev["ts"] >= 0
    assert sorted(ev["name"] for ev in events) == sorted(str(a) for a in sched.actions())


def test_fpipe_trace_writes_a_file_per_step(tmp_path, monkeypatch):
    prefix = tmp_path / "trace"
    monkeypatch.setenv("FPIPE_TRACE", str(prefix))
    piped, _ = step()
    path = tmp_path / "trace.rank0.json"
    assert json.loads(path.read_text()) == json.loads(json.dumps(piped.timeline.chrome()))
    path.unlink()
    fpipe.value_and_grad(piped)(*inputs())  # rewritten after every step
    assert json.loads(path.read_text()) == json.loads(json.dumps(piped.timeline.chrome()))


def test_no_file_without_fpipe_trace(tmp_path, monkeypatch):
    monkeypatch.delenv("FPIPE_TRACE", raising=False)
    monkeypatch.chdir(tmp_path)
    step()
    assert list(tmp_path.iterdir()) == []


def test_profiler_shows_each_action():
    piped = fpipe.pipeline(f, microbatches=2, schedule="zb-h1")
    vg = fpipe.value_and_grad(piped)
    vg(*inputs())  # compile outside the profiled step
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        vg(*inputs())
    labels = {e.name for e in prof.events() if e.name.startswith("fpipe ")}
    expected = {f"fpipe {a}" for a in build("zb-h1", stages=4, microbatches=2).actions()}
    assert labels == expected
    assert "fpipe F0.0" in labels and "fpipe W3.1" in labels


# -- two processes ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(trust_launch):
    """The folder of the 2-rank step (2 ranks, 4 stages: interleaved-1f1b, then zbv, FPIPE_TRACE
    set: the trace files hold zbv's step, the last)."""
    out, procs = trust_launch
    recs = [out / f"rank{r}.json" for r in range(2)]
    assert all(rec.exists() for rec in recs), report(procs)
    for r, rec in enumerate(recs):
        timeline = json.loads(rec.read_text())["timeline"]
        assert "error" not in timeline, (r, timeline)
    return out / "timeline"


def test_two_ranks_each_record_their_own_actions_and_waits(two_ranks):
    sched = build("zbv", pp=2, microbatches=4)
    for r in range(2):
        got = json.loads((two_ranks / f"run.zbv.events.rank{r}.json").read_text())["events"]
        assert {rank for _, rank, *_ in got} == {r}
        actions = [name for name, _, _, _, kind in got if kind == "action"]
        assert actions == [str(a) for a in sched.ranks[r]]
        waits = [name for name, _, _, _, kind in got if kind == "wait"]
        assert waits, f"rank {r} never waited for its peer"
        # a wait is recorded just before the action that needed the peer's data
        for i, (name, _, start, end, kind) in enumerate(got):
            if kind == "wait":
                assert got[i + 1][0] == name.removeprefix("wait ")
                assert start <= end <= got[i + 1][2]
    # rank 1 holds stages 1 and 2: its first action needs rank 0's F0.0
    assert json.loads((two_ranks / "run.zbv.events.rank1.json").read_text())["events"][0][0] == "wait F1.0"


def test_two_ranks_write_one_trace_file_each(two_ranks):
    for r in range(2):
        trace = json.loads((two_ranks / f"trace.rank{r}.json").read_text())
        events = json.loads((two_ranks / f"run.zbv.events.rank{r}.json").read_text())["events"]
        assert [(e["name"], e["pid"], e["cat"]) for e in trace["traceEvents"] if e["ph"] == "X"] == [
            (name, rank, kind) for name, rank, _, _, kind in events
        ]


def test_two_ranks_a_backward_that_sends_logs_its_two_halves(two_ranks):
    """A full B whose input gradient goes to the other rank runs as two halves around the send,
    each an event (named by its action, perhaps with a suffix such as "/w"); other actions are one
    event. Merging each action's consecutive events gives the rank's action list."""
    sched = build("interleaved-1f1b", pp=2, microbatches=4)
    for r in range(2):
        got = json.loads((two_ranks / f"run.interleaved-1f1b.events.rank{r}.json").read_text())["events"]
        names = [re.match(r"[A-Z]\d+\.\d+", name)[0] for name, _, _, _, kind in got if kind == "action"]
        merged = [name for i, name in enumerate(names) if i == 0 or names[i - 1] != name]
        assert merged == [str(a) for a in sched.ranks[r]]
        for a in sched.ranks[r]:
            sends = a.kind == "B" and a.stage > 0  # stage s - 1 is on the other rank
            assert names.count(str(a)) == (2 if sends else 1), a
