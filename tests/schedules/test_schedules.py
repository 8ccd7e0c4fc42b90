"""Schedules as data: text form, builders, validator, simulator and pictures (no torch needed)."""

from __future__ import annotations

import dataclasses
import doctest
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from fpipe import schedules as S
from fpipe.schedules import Action, Schedule, build, parse, simulate, validate

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
BUILTINS = ["1f1b", "dualpipev", "gpipe", "interleaved-1f1b", "looped-bfs", "zb-h1", "zbv"]
P_M = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]


def grid() -> list[tuple[str, int, int]]:
    """Every built-in for pp in {1, 2, 4, 8} and m in {1, 3, p, 2p, 4p} (so also m=3, pp=4)."""
    return [(n, p, m) for n in BUILTINS for p in (1, 2, 4, 8) for m in sorted({1, 3, p, 2 * p, 4 * p})]


def error(sched: Schedule) -> str:
    with pytest.raises(ValueError) as e:
        validate(sched)
    return str(e.value)


def header(s: Schedule) -> str:
    return (
        f"validate(schedule {s.name!r}, {s.pp} rank(s), {s.n_stages} stage(s), "
        f"{s.n_microbatches} microbatch(es)): "
    )


# -- data and text form ------------------------------------------------------------------------


def test_registry_lists_the_builtins():
    assert set(BUILTINS) <= set(S.names())


@pytest.mark.parametrize("name,p,m", grid())
def test_builtins_pass_the_validator_and_round_trip(name, p, m):
    s = build(name, pp=p, microbatches=m)
    assert validate(s) is s
    assert (s.pp, s.n_microbatches) == (p, m)
    assert sorted(a.mb for a in s.actions() if a.kind == "F") == sorted(list(range(m)) * s.n_stages)
    back = parse(str(s), name=name)
    assert str(back) == str(s)
    assert back.stage_rank == s.stage_rank


def test_text_form():
    s = build("zb-h1", pp=2, microbatches=2)
    assert str(s) == "rank 0: F0.0 F0.1 I0.0 W0.0 I0.1 W0.1\nrank 1: F1.0 I1.0 F1.1 I1.1 W1.0 W1.1"
    assert str(build("1f1b", pp=2, microbatches=3)) == (
        "rank 0: F0.0 F0.1 B0.0 F0.2 B0.1 B0.2\nrank 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2"
    )


def test_actions_are_frozen_and_checked():
    a = Action("W", 2, 0)
    assert str(a) == "W2.0" and a == S.parse("rank 0: W2.0").ranks[0][0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.kind = "F"  # type: ignore[misc]
    with pytest.raises(
        ValueError, match=r"^Action\(kind='X', stage=0, mb=1\): kind must be one of F, B, I, W"
    ):
        Action("X", 0, 1)


def test_schedule_accepts_lists_and_text():
    s = Schedule("mine", 1, 1, [["F0.0", "B0.0"]], [0])
    assert s.ranks == ((Action("F", 0, 0), Action("B", 0, 0)),) and s.stage_rank == (0,)
    assert build("zbv", pp=2, microbatches=1).stages_of(0) == [0, 3]


def test_parse_errors():
    with pytest.raises(ValueError) as e:
        parse("rank 0: F0.0 X1")
    assert str(e.value) == (
        "parse: 'X1' is not an action; write KIND STAGE.MICROBATCH with KIND one of F, B, I, W, e.g. 'F0.3' or 'W2.0'."
    )
    with pytest.raises(ValueError) as e:
        parse("rank 0: F0.0\nrank 2: F1.0")
    assert (
        str(e.value)
        == "parse: line 1 is 'rank 2: F1.0'; it must start with 'rank 1:' (ranks in order from 0)."
    )


# -- build -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,stages,pp",
    [("gpipe", 4, 4), ("1f1b", 3, 3), ("zb-h1", 8, 8), ("interleaved-1f1b", 8, 4), ("looped-bfs", 4, 2)]
    + [("zbv", 8, 4), ("dualpipev", 2, 1)],
)
def test_build_chooses_pp_from_stages(name, stages, pp):
    s = build(name, microbatches=4, stages=stages)
    assert (s.pp, s.n_stages) == (pp, stages)


def test_placements():
    assert build("interleaved-1f1b", pp=2, microbatches=2, stages=6).stage_rank == (0, 1, 0, 1, 0, 1)
    assert build("looped-bfs", pp=2, microbatches=2).stage_rank == (0, 1, 0, 1)
    assert build("zbv", pp=3, microbatches=2).stage_rank == (0, 1, 2, 2, 1, 0)
    assert build("dualpipev", pp=2, microbatches=2).stage_rank == (0, 1, 1, 0)


def test_build_errors():
    with pytest.raises(ValueError) as e:
        build("zbv", microbatches=4, stages=5)
    assert str(e.value) == (
        "schedules.build('zbv', stages=5): this schedule puts 2 stages on each rank, so stages must be a "
        "positive multiple of 2; use stages=4 or pass pp explicitly."
    )
    with pytest.raises(ValueError) as e:
        build("zbv", pp=2, microbatches=4, stages=6)
    assert str(e.value) == (
        "schedules.build('zbv', pp=2, stages=6): the V placement puts stages r and 3-r on rank r, so stages "
        "must be 2 * pp = 4; use stages=4 or pp=3."
    )
    with pytest.raises(ValueError) as e:
        build("interleaved-1f1b", pp=4, microbatches=4, stages=6)
    assert str(e.value) == (
        "schedules.build('interleaved-1f1b', pp=4, stages=6): the looped placement puts stage s on rank s % pp, "
        "so stages must be a multiple of pp=4; use stages=4."
    )
    with pytest.raises(
        ValueError, match=r"^schedules.build\('1f1b', pp=2, stages=4\): this schedule places one"
    ):
        build("1f1b", pp=2, microbatches=4, stages=4)
    with pytest.raises(
        ValueError, match=r"^schedules.build\('nope'\): unknown schedule; known schedules are \["
    ):
        build("nope", pp=2, microbatches=4)


# -- validate: each kind of mistake, message asserted exactly ----------------------------------


def test_unknown_stage():
    s = Schedule("bad", 2, 1, (("F0.0", "B0.0"), ("F1.0", "F5.0", "B1.0")), (0, 1))
    assert error(s) == header(s) + (
        "rank 1 runs F5.0, but stage 5 does not exist: the schedule has 2 stage(s), 0..1; "
        f"fix the action or n_stages.\nschedule:\n{s}"
    )


def test_unknown_microbatch():
    s = parse("rank 0: F0.0 F0.1 B0.0 B0.1\nrank 1: F1.0 B1.0 F1.1 B1.1")
    s = Schedule("short", 2, 1, s.ranks, s.stage_rank)
    assert error(s) == header(s) + (
        "rank 0 runs F0.1, but microbatch 1 does not exist: the schedule has 1 microbatch(es), 0..0; "
        f"fix the action or n_microbatches.\nschedule:\n{s}"
    )


def test_action_on_the_wrong_rank():
    s = Schedule("moved", 2, 1, (("F0.0", "F1.0", "B0.0"), ("B1.0",)), (0, 1))
    assert error(s) == header(s) + (
        "rank 0 runs F1.0, but stage 1 is held by rank 1 (stage_rank[1] = 1); move F1.0 to rank 1's list "
        f"or change stage_rank.\nschedule:\n{s}"
    )


def test_duplicate_action():
    s = parse("rank 0: F0.0 F0.1 B0.0 F0.1 B0.1")
    assert error(s) == header(s) + (
        f"rank 0 runs F0.1 twice (positions 1 and 3); each action runs exactly once.\nschedule:\n{s}"
    )


def test_mixing_full_and_split_backward():
    s = parse("rank 0: F0.0 I0.0 B0.0 W0.0")
    assert error(s) == header(s) + (
        "rank 0 runs B0.0 and also I0.0 and W0.0: stage 0, microbatch 0 must use either the full backward B "
        f"or the pair I + W, not both.\nschedule:\n{s}"
    )


@pytest.mark.parametrize(
    "text,problem",
    [
        (
            "rank 0: F0.1 B0.1 B0.0",
            "rank 0 never runs F0.0; every stage needs a forward for every microbatch.",
        ),
        (
            "rank 0: F0.0 F0.1 B0.0",
            "rank 0 never runs a backward for stage 0, microbatch 1; add B0.1 (or I0.1 and W0.1) after F0.1.",
        ),
        (
            "rank 0: F0.0 I0.0",
            "rank 0 runs I0.0 but never W0.0, so stage 0's weight gradient for microbatch 0 is lost; "
            "add W0.0 after I0.0.",
        ),
        (
            "rank 0: F0.0 W0.0",
            "rank 0 runs W0.0, which needs I0.0, but no rank runs I0.0; add I0.0 before W0.0 (or use B0.0 alone).",
        ),
    ],
)
def test_missing_actions(text, problem):
    s = parse(text)
    assert error(s) == header(s) + f"{problem}\nschedule:\n{s}"


def test_action_before_its_dependency_on_the_same_rank():
    s = parse("rank 0: F0.0 W0.0 I0.0")
    assert error(s) == header(s) + (
        f"rank 0 runs W0.0 at position 1 before I0.0 at position 2, but W0.0 needs I0.0; move I0.0 before W0.0."
        f"\nschedule:\n{s}"
    )


def test_cross_rank_deadlock_reports_the_cycle():
    # Rank 0 waits for the gradient of microbatch 0 before sending microbatch 1 forward, but rank 1
    # wants microbatch 1's forward before it runs microbatch 0's backward.
    s = parse("rank 0: F0.0 B0.0 F0.1 B0.1\nrank 1: F1.0 F1.1 B1.0 B1.1", name="stuck")
    assert error(s) == header(s) + (
        "the ranks deadlock in a cycle: rank 0 waits at B0.0 (position 1) for B1.0, which rank 1 runs at "
        "position 2; rank 1 waits at F1.1 (position 1) for F0.1, which rank 0 runs at position 2; "
        f"reorder one of these ranks to break it.\nschedule:\n{s}"
    )


def test_deadlock_cycle_skips_ranks_that_only_wait_on_it():
    s = parse(
        "rank 0: F0.0 F0.1 B0.0 B0.1\nrank 1: F1.0 B1.0 F1.1 B1.1\nrank 2: F2.0 F2.1 B2.0 B2.1\n"
        "rank 3: F3.1 F3.0 B3.0 B3.1"
    )
    msg = error(s)  # ranks 0 and 3 wait on the cycle but are not part of it
    assert msg.startswith(
        header(s)
        + "the ranks deadlock in a cycle: rank 1 waits at B1.0 (position 1) for B2.0, which rank 2 runs "
        "at position 2; rank 2 waits at F2.1 (position 1) for F1.1, which rank 1 runs at position 2; reorder"
    )


def test_bad_placement():
    s = Schedule("p", 2, 1, (("F0.0", "B0.0"), ("F1.0", "B1.0")), (0, 2))
    assert error(s) == header(s) + (
        f"stage_rank[1] = 2, but the schedule has 2 rank(s) (0..1); fix stage_rank or add ranks.\nschedule:\n{s}"
    )
    s = Schedule("p", 2, 1, (("F0.0", "B0.0"), ("F1.0", "B1.0")), (0,))
    assert error(s).startswith(
        header(s) + "stage_rank has 1 entries but there are 2 stages; give one rank per stage."
    )


def test_execution_order_keeps_its_contract():
    from fpipe._src.schedules.schedule import execution_order

    s = build("zb-h1", pp=4, microbatches=8)
    order = execution_order(s, S.dependencies(s))
    assert sorted(order) == sorted(s.actions())
    seen = set()
    for a in order:
        assert all(d in seen for d in S.dependencies(s)(a))
        seen.add(a)
    stuck = parse("rank 0: F0.0 B0.0 F0.1 B0.1\nrank 1: F1.0 F1.1 B1.0 B1.1")
    with pytest.raises(ValueError, match="deadlocks: rank 0 waits at B0.0 for"):
        execution_order(stuck, S.dependencies(stuck))


# -- simulate: analytic values with F = 1, I = 1, W = 1 (full B = 2), comm = 0 ----------------


@pytest.mark.parametrize("p,m", P_M)
def test_gpipe_and_1f1b_bubble_is_exact(p, m):
    for name in ("gpipe", "1f1b"):
        sim = simulate(build(name, pp=p, microbatches=m))
        assert sim.makespan == 3 * (m + p - 1)
        assert sim.bubble == pytest.approx([(p - 1) / (m + p - 1)] * p, rel=1e-12)


@pytest.mark.parametrize("p,m", P_M)
def test_peak_inflight_of_gpipe_and_1f1b(p, m):
    assert simulate(build("gpipe", pp=p, microbatches=m)).peak_inflight == [m] * p
    peaks = simulate(build("1f1b", pp=p, microbatches=m)).peak_inflight
    assert peaks == [min(p - r, m) for r in range(p)] and peaks[0] == min(p, m)


@pytest.mark.parametrize("p,m", P_M)
def test_zb_h1_has_a_third_of_the_1f1b_bubble_at_the_same_peak(p, m):
    zb, base = simulate(build("zb-h1", pp=p, microbatches=m)), simulate(build("1f1b", pp=p, microbatches=m))
    assert zb.makespan == 3 * m + p - 1
    assert zb.bubble == pytest.approx([(p - 1) / (3 * m + p - 1)] * p, rel=1e-12)
    idle, base_idle = [b * zb.makespan for b in zb.bubble], [b * base.makespan for b in base.bubble]
    assert idle == pytest.approx([p - 1] * p) and base_idle == pytest.approx([3 * (p - 1)] * p)
    assert zb.peak_inflight == [p] * p and max(zb.peak_inflight) == max(base.peak_inflight)


@pytest.mark.parametrize("p,m", P_M)
def test_looped_schedules_divide_the_bubble_by_v(p, m):
    for name in ("interleaved-1f1b", "looped-bfs"):
        sim = simulate(build(name, pp=p, microbatches=m))  # 2 stages per rank, unit costs per stage
        assert sim.makespan == 3 * (2 * m + p - 1)
        assert sim.bubble == pytest.approx([(p - 1) / (2 * m + p - 1)] * p, rel=1e-12)
    assert simulate(build("looped-bfs", pp=p, microbatches=m)).peak_inflight == [2 * m] * p
    peaks = simulate(build("interleaved-1f1b", pp=p, microbatches=m)).peak_inflight
    assert peaks == [min(p + 2 * (p - 1 - r) + 1, 2 * m) for r in range(p)]  # Megatron's warm-up + 1


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 4, 8) for m in (2 * p, 4 * p)])
def test_v_schedules(p, m):
    zbv = simulate(build("zbv", pp=p, microbatches=m))
    assert zbv.makespan == 6 * m + p - 1  # idle p - 1 per rank, against 1F1B's 6 (p - 1) on double stages
    assert zbv.peak_inflight == [2 * p] * p  # 2p half-size chunks: 1F1B's rank-0 memory
    dual = simulate(build("dualpipev", pp=p, microbatches=m))
    assert dual.makespan == 6 * m + p  # its F/B overlap is not modelled: one action at a time
    assert dual.peak_inflight == [2 * p + 1] * p


@pytest.mark.parametrize("name,p,m", [g for g in grid() if g[0] in ("zbv", "dualpipev", "zb-h1")])
def test_zero_bubble_schedules_never_do_worse_than_1f1b(name, p, m):
    s = build(name, pp=p, microbatches=m)
    v = s.n_stages // p
    base = simulate(build("1f1b", pp=p, microbatches=m), forward=v, backward=v, weight=v)
    sim = simulate(s)
    assert sim.makespan <= base.makespan
    assert max(sim.peak_inflight) <= v * min(p, m) + (name == "dualpipev")


def test_timings_by_hand_with_costs_and_comm():
    sim = simulate(build("1f1b", pp=2, microbatches=1), forward=1.0, backward=1.5, weight=0.5, comm=0.5)
    got = {str(a): (sim.start[a], sim.end[a]) for a in sim.start}
    assert got == {"F0.0": (0.0, 1.0), "F1.0": (1.5, 2.5), "B1.0": (2.5, 4.5), "B0.0": (5.0, 7.0)}
    assert sim.makespan == 7.0 and sim.bubble == pytest.approx([1 - 3 / 7, 1 - 3 / 7])


def test_per_stage_costs():
    sim = simulate(build("gpipe", pp=2, microbatches=2), forward=[1, 2], backward=[1, 3], weight=0)
    assert sim.end[Action("B", 0, 1)] == 12.0 and sim.makespan == 12.0
    assert sim.bubble == pytest.approx([1 - 4 / 12, 1 - 10 / 12])


@pytest.mark.parametrize("p,m", P_M)
def test_gpipe_with_comm(p, m):
    assert simulate(build("gpipe", pp=p, microbatches=m), comm=0.5).makespan == 3 * (m + p - 1) + (p - 1)


def test_simulate_errors():
    s = build("gpipe", pp=2, microbatches=2)
    with pytest.raises(ValueError) as e:
        simulate(s, forward=[1, 2, 3])
    assert str(e.value) == "simulate(forward=...): got 3 per-stage costs for 2 stages; give one number or 2."
    with pytest.raises(ValueError, match=r"^simulate\(weight=-1\): costs must be >= 0\.$"):
        simulate(s, weight=-1)
    with pytest.raises(ValueError, match=r"^simulate\(comm=-0.5\): comm must be >= 0\.$"):
        simulate(s, comm=-0.5)
    with pytest.raises(ValueError, match="deadlock in a cycle"):
        simulate(parse("rank 0: F0.0 B0.0 F0.1 B0.1\nrank 1: F1.0 F1.1 B1.0 B1.1"))


# -- pictures ----------------------------------------------------------------------------------


def test_render_ascii():
    s = build("zb-h1", pp=2, microbatches=2)
    assert (
        s.render()
        == S.render(s)
        == (
            "zb-h1: 2 ranks, 2 stages, 2 microbatches; makespan 7, bubble 14.3% per rank (mean)\n"
            "rank 0 |F0.0|F0.1|....|I0.0|W0.0|I0.1|W0.1|\n"
            "rank 1 .....|F1.0|I1.0|F1.1|I1.1|W1.0|W1.1|"
        )
    )


def test_render_method_works_when_only_the_schedule_data_module_is_imported():
    """`Schedule.render` calls the renderer render.py installs (NOTE [schedule layering] in
    schedule_data.py); importing any fpipe module imports fpipe.schedules and so installs it."""
    code = "from fpipe._src.schedules.schedule_data import parse\nprint(parse('rank 0: F0.0 B0.0').render())"
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.splitlines()[1] == "rank 0 |F0.0|B0.0     |"


def test_render_scales_to_the_shortest_action():
    text = build("1f1b", pp=2, microbatches=1).render(forward=2, backward=0.5, weight=0.5, comm=1)
    assert text.splitlines()[1:] == [
        "rank 0 |F0.0     |........................|B0.0|",  # F0.0 takes 2 units of 5 columns
        "rank 1 ...............|F1.0     |B1.0|",
    ]


def test_svg(tmp_path):
    pair = [build("1f1b", pp=4, microbatches=8), build("zb-h1", pp=4, microbatches=8)]
    svg = S.to_svg(pair, tmp_path / "t.svg")
    assert (tmp_path / "t.svg").read_text() == svg
    root = ET.fromstring(svg)
    rects = root.findall("{http://www.w3.org/2000/svg}rect")
    assert len(rects) == 1 + sum(len(list(s.actions())) for s in pair) + 4  # background, actions, legend
    assert S.to_svg(pair[0]).count("<rect") == 1 + 64 + 4


def test_docs_svg_is_current():
    pair = [build("1f1b", pp=4, microbatches=8), build("zb-h1", pp=4, microbatches=8)]
    assert (DOCS / "1f1b_vs_zbh1.svg").read_text() == S.to_svg(pair)


def test_docs_examples_run():
    result = doctest.testfile(str(DOCS / "SCHEDULES.md"), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 5
