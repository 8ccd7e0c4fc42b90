"""Every schedule computes the same loss and gradients as the unsplit function (one process, fp64).

The model has 7 layers, which no stage count used here divides: the automatic split and the
hand-placed `stage_boundary` markers both give stages of unequal size. Schedules with two stages
per rank (interleaved, looped, V) run the same stage count on half as many ranks. Besides the
registered names, `pipeline` takes a `Schedule` value (here parsed from text) and a function
`(pp=, microbatches=) -> Schedule`; a broken hand-written schedule is rejected by the validator
before any action runs.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import fpipe
from fpipe.schedules import Action, Schedule, build, names, parse, validate

TOL = 1e-10
N_LAYERS = 7


class Net(nn.Module):
    """`N_LAYERS` Linear + tanh layers; with `stages`, boundaries after unevenly spaced layers."""

    def __init__(self, stages: int | None = None, d: int = 5):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(N_LAYERS))
        n = N_LAYERS
        self.cuts = {i for i in range(n - 1) if stages and i * stages // n != (i + 1) * stages // n}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i in self.cuts:
                x = fpipe.stage_boundary(x)
        return x


@pytest.fixture(scope="module", autouse=True)
def fp64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@functools.cache
def problem(stages: int | None):
    """(loss, params, x, y, reference loss, reference grads); the same weights with or without markers.

    Cached: nothing here is mutated by a pipeline, and the reference is the costly part."""
    torch.manual_seed(0)
    fn, params = fpipe.functionalize(Net(stages))
    x, y = torch.randn(8, 5), torch.randn(8, 5)

    def loss(p, x, y):
        return ((fn(p, x) - y) ** 2).mean()

    ref_grads, ref_loss = torch.func.grad_and_value(loss)(params, x, y)
    return loss, params, x, y, ref_loss, ref_grads


def run(schedule, stages: int, microbatches: int, markers: bool) -> fpipe.Pipelined:
    loss, params, x, y, ref_loss, ref_grads = problem(stages if markers else None)
    piped = fpipe.pipeline(loss, stages=stages, microbatches=microbatches, schedule=schedule)
    value, grads = fpipe.value_and_grad(piped)(params, x, y)
    torch.testing.assert_close(value, ref_loss, rtol=TOL, atol=TOL)
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        assert grads[k].dtype == torch.float64
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=TOL, atol=TOL, msg=lambda m, k=k: f"{k}: {m}")
    return piped


def executed(piped: fpipe.Pipelined) -> list[str]:
    assert piped.timeline is not None
    return sorted(name for name, *_ in piped.timeline.events)


@pytest.mark.parametrize("microbatches", [1, 4, 8])
@pytest.mark.parametrize("markers", [False, True], ids=["auto", "markers"])
@pytest.mark.parametrize("name", names())
def test_every_schedule_matches_grad_and_value(name, markers, microbatches):
    piped = run(name, 4, microbatches, markers)
    # the whole schedule ran: every action of the 4-stage schedule, once
    assert executed(piped) == sorted(
        str(a) for a in build(name, stages=4, microbatches=microbatches).actions()
    )


@pytest.mark.parametrize("name", names())
def test_six_stages(name):
    """7 layers over 6 stages: one stage holds two layers; three ranks for two-per-rank schedules."""
    piped = run(name, 6, 4, markers=False)
    assert executed(piped) == sorted(str(a) for a in build(name, stages=6, microbatches=4).actions())


# -- schedules the user writes ------------------------------------------------------------------

HAND_WRITTEN = """
rank 0: F0.0 F0.1 F0.2 I0.0 F0.3 W0.0 I0.1 W0.1 I0.2 W0.2 I0.3 W0.3
rank 1: F1.0 F1.1 I1.0 F1.2 I1.1 W1.0 F1.3 I1.2 W1.1 I1.3 W1.2 W1.3
rank 2: F2.0 F2.1 B2.0 B2.1 F2.2 F2.3 B2.3 B2.2
"""


def test_schedule_parsed_from_text():
    """Hand-ordered: split backwards (I/W) on stages 0 and 1, a LIFO pair of B's on stage 2."""
    sched = parse(HAND_WRITTEN, name="hand")
    piped = run(sched, 3, 4, markers=False)
    assert executed(piped) == sorted(str(a) for a in sched.actions())


def reverse_gpipe(*, pp: int, microbatches: int) -> Schedule:
    """All forwards, then the backwards newest first (a LIFO drain)."""
    ranks = [
        [Action("F", r, m) for m in range(microbatches)]
        + [Action("B", r, m) for m in reversed(range(microbatches))]
        for r in range(pp)
    ]
    return Schedule("reverse-gpipe", pp, microbatches, ranks, list(range(pp)))


@pytest.mark.parametrize("markers", [False, True], ids=["auto", "markers"])
def test_schedule_function(markers):
    piped = run(reverse_gpipe, 4, 4, markers)
    assert executed(piped) == sorted(str(a) for a in reverse_gpipe(pp=4, microbatches=4).actions())


def test_schedule_function_building_a_registered_schedule():
    """The function receives the program's stage count as `pp` in one process."""
    seen = []

    def zbv_for(*, pp: int, microbatches: int) -> Schedule:
        seen.append((pp, microbatches))
        return build("zbv", stages=pp, microbatches=microbatches)

    run(zbv_for, 4, 8, markers=True)
    assert seen == [(4, 8)]


BROKEN = """
rank 0: F0.0 F0.1 B0.0 B0.1
rank 1: F1.0 B1.0 B1.1 F1.1
"""


def test_broken_schedule_is_rejected_before_anything_runs():
    """B1.1 before F1.1 on rank 1: the validator's own message, and no action has run."""
    sched = parse(BROKEN)
    with pytest.raises(ValueError) as expected:
        validate(sched)
    loss, params, x, y, *_ = problem(2)
    piped = fpipe.pipeline(loss, microbatches=2, schedule=sched)
    with pytest.raises(ValueError) as got:
        fpipe.value_and_grad(piped)(params, x, y)
    assert str(got.value) == str(expected.value)
    assert str(got.value).startswith(
        "validate(schedule 'custom', 2 rank(s), 2 stage(s), 2 microbatch(es)): rank 1 runs B1.1"
    )
    assert piped.timeline is None


def test_deadlocking_schedule_is_rejected_before_anything_runs():
    """Each rank valid alone, but together they wait on each other: run, it would hang."""
    sched = parse("rank 0: F0.0 B0.0 F0.1 B0.1\nrank 1: F1.0 F1.1 B1.0 B1.1")
    loss, params, x, y, *_ = problem(2)
    piped = fpipe.pipeline(loss, microbatches=2, schedule=sched)
    with pytest.raises(ValueError, match="the ranks deadlock in a cycle: rank 0 waits at B0.0"):
        fpipe.value_and_grad(piped)(params, x, y)
    assert piped.timeline is None
