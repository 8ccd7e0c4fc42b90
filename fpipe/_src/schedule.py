"""Schedule: per-rank ordered actions over (stage, microbatch), as plain data.

An `Action` names work on one stage for one microbatch: `F` forward, `B` the full backward
(input and weight gradients), and for zero-bubble schedules `I` (input gradients only) and `W`
(weight gradients only). A `Schedule` is, for each rank, the list of actions that rank runs in
order, plus which rank holds each stage. Communication is not in the schedule: the runtime
derives it from which program produces and which consumes each value.

Builders are registered by name (`register`); `build(name, pp=..., microbatches=...)` makes one.
Text form: one line per rank, `rank 0: F0.0 F0.1 B0.0 B0.1` (kind, stage, '.', microbatch).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable

__all__ = ["Action", "Schedule", "register", "build", "names", "parse"]

KINDS = ("F", "B", "I", "W")


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"


_ACTION_RE = re.compile(r"^([FBIW])(\d+)\.(\d+)$")


def parse_action(text: str) -> Action:
    m = _ACTION_RE.match(text)
    if m is None:
        raise ValueError(f"parse: {text!r} is not an action; write KIND STAGE.MICROBATCH, e.g. 'F0.3' or 'B2.0'")
    return Action(m.group(1), int(m.group(2)), int(m.group(3)))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Ordered actions per rank. `stage_rank[s]` is the rank that holds stage s."""

    name: str
    n_stages: int
    n_microbatches: int
    ranks: tuple[tuple[Action, ...], ...]
    stage_rank: tuple[int, ...]

    @property
    def pp(self) -> int:
        return len(self.ranks)

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.ranks))

    def actions(self) -> Iterable[Action]:
        for acts in self.ranks:
            yield from acts


def parse(text: str, *, name: str = "custom") -> Schedule:
    """Parse the text form (as printed by `str(schedule)`) back into a `Schedule`."""
    ranks: list[tuple[Action, ...]] = []
    for line in text.strip().splitlines():
        head, _, body = line.partition(":")
        if not head.strip().startswith("rank"):
            raise ValueError(f"parse: line {line!r} must start with 'rank N:'")
        ranks.append(tuple(parse_action(t) for t in body.split()))
    stage_rank: dict[int, int] = {}
    for r, acts in enumerate(ranks):
        for a in acts:
            stage_rank.setdefault(a.stage, r)
    n_stages = max(stage_rank) + 1 if stage_rank else 0
    n_mb = max((a.mb for acts in ranks for a in acts), default=-1) + 1
    return Schedule(name, n_stages, n_mb, tuple(ranks), tuple(stage_rank.get(s, 0) for s in range(n_stages)))


Builder = Callable[[int, int, int], Schedule]
_BUILDERS: dict[str, Builder] = {}


def register(name: str) -> Callable[[Builder], Builder]:
    """Register a schedule builder `fn(pp, microbatches, stages) -> Schedule` under `name`."""

    def deco(fn: Builder) -> Builder:
        _BUILDERS[name] = fn
        return fn

    return deco


def names() -> list[str]:
    return sorted(_BUILDERS)


def build(name: str, *, pp: int | None = None, microbatches: int, stages: int | None = None) -> Schedule:
    """Build the registered schedule `name` for `pp` ranks and `microbatches` microbatches.

    With `pp=None`, `stages` decides: one stage per rank (local runs use this).
    """
    if name not in _BUILDERS:
        raise ValueError(f"schedules.build({name!r}): unknown schedule; known schedules are {names()}.")
    if pp is None:
        if stages is None:
            raise ValueError(f"schedules.build({name!r}): give pp, stages or both.")
        pp = stages
    if pp < 1 or microbatches < 1:
        raise ValueError(f"schedules.build({name!r}, pp={pp}, microbatches={microbatches}): both must be >= 1.")
    return _BUILDERS[name](pp, microbatches, pp if stages is None else stages)


def _one_stage_per_rank(name: str, pp: int, stages: int) -> None:
    if stages != pp:
        raise ValueError(
            f"schedules.build({name!r}, pp={pp}, stages={stages}): this schedule places one stage "
            f"per rank, so stages must equal pp; use 'interleaved-1f1b' for several stages per rank."
        )


@register("gpipe")
def gpipe(pp: int, m: int, stages: int) -> Schedule:
    """All forwards, then all backwards: simple, holds every microbatch's activations."""
    _one_stage_per_rank("gpipe", pp, stages)
    ranks = tuple(
        tuple([Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]) for r in range(pp)
    )
    return Schedule("gpipe", pp, m, ranks, tuple(range(pp)))


@register("1f1b")
def one_f_one_b(pp: int, m: int, stages: int) -> Schedule:
    """Warm up with pp - 1 - rank forwards, then alternate: rank r holds min(pp - r, m) microbatches."""
    _one_stage_per_rank("1f1b", pp, stages)
    ranks = []
    for r in range(pp):
        warm = min(pp - 1 - r, m)
        acts = [Action("F", r, i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", r, warm + i), Action("B", r, i)]
        acts += [Action("B", r, i) for i in range(m - warm, m)]
        ranks.append(tuple(acts))
    return Schedule("1f1b", pp, m, tuple(ranks), tuple(range(pp)))


Deps = Callable[[Action], Iterable[Action]]


def execution_order(sched: Schedule, deps: Deps) -> list[Action]:
    """One global order that keeps every rank's order and every data dependency.

    Steps ranks round-robin, each running its next action once its dependencies are done; raises
    if no rank can move (the schedule would deadlock).
    """
    pos = [0] * sched.pp
    done: set[Action] = set()
    order: list[Action] = []
    total = sum(len(a) for a in sched.ranks)
    while len(order) < total:
        moved = False
        for r, acts in enumerate(sched.ranks):
            while pos[r] < len(acts) and all(d in done for d in deps(acts[pos[r]])):
                done.add(acts[pos[r]])
                order.append(acts[pos[r]])
                pos[r] += 1
                moved = True
        if not moved:
            stuck = [
                f"rank {r} waits at {acts[pos[r]]} for {[str(d) for d in deps(acts[pos[r]]) if d not in done]}"
                for r, acts in enumerate(sched.ranks)
                if pos[r] < len(acts)
            ]
            raise ValueError(f"schedule {sched.name!r} deadlocks: " + "; ".join(stuck) + f"\n{sched}")
    return order
