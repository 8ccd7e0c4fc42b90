"""Schedule data: per-rank ordered actions over (stage, microbatch), as plain values.

An `Action` names work on one stage for one microbatch. Its kind follows the convention of
`torch.distributed.pipelining`:

- `F`: forward;
- `B`: full backward (input and weight gradients together);
- `I`: backward for the input gradient only (what the previous stage waits for);
- `W`: backward for the weight gradient only (nothing waits for it, so zero-bubble schedules
  move it into idle time).

For each (stage, microbatch) a schedule uses either `B` or the pair `I` + `W`, never both. A
`Schedule` is, for each rank, the list of actions that rank runs in order, plus which rank holds
each stage. Communication is not in the schedule: the runtime derives it from which program
produces and which consumes each value.

Text form: one line per rank, `rank 0: F0.0 F0.1 B0.0 B0.1` (kind, stage, '.', microbatch).

# NOTE [schedule layering]
This module is the bottom layer of the schedule modules and imports nothing from fpipe:

    schedule_data  (Action, Schedule, parse, execution_order)
      <- comm <- simulate <- render        (what a schedule implies, costs, pictures)
      <- schedule_builders, schedule_v     (the built-in schedules, pure functions)
      <- schedule                          (the registry: register, build, names)

`Schedule.render` is a method for users, but the timeline lives in render.py, which needs
`simulate`, which needs this module. So the method does not import render: it calls the renderer
that render.py installs here at import (`set_renderer`). fpipe/__init__.py imports
fpipe.schedules, which imports render.py, and Python runs fpipe/__init__.py before any
`fpipe._src` module, so the renderer is installed whenever a `Schedule` can exist.

Example:
    >>> s = parse("rank 0: F0.0 F1.0 B1.0 B0.0")
    >>> s.stage_rank, [str(a) for a in s.actions()]
    ((0, 0), ['F0.0', 'F1.0', 'B1.0', 'B0.0'])
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["Action", "Schedule", "parse", "parse_action", "execution_order", "set_renderer"]

KINDS = ("F", "B", "I", "W")


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One unit of work: `kind` ("F", "B", "I" or "W") of stage `stage` for microbatch `mb`."""

    kind: str
    stage: int
    mb: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"Action(kind={self.kind!r}, stage={self.stage}, mb={self.mb}): kind must be one of "
                f"{', '.join(KINDS)} (forward, full backward, input-gradient, weight-gradient)."
            )

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"


_ACTION_RE = re.compile(r"^([FBIW])(\d+)\.(\d+)$")


def parse_action(text: str) -> Action:
    """Read one action in text form, e.g. `parse_action("I2.0") == Action("I", 2, 0)`."""
    m = _ACTION_RE.match(text)
    if m is None:
        raise ValueError(
            f"parse: {text!r} is not an action; write KIND STAGE.MICROBATCH with KIND one of F, B, I, W, "
            "e.g. 'F0.3' or 'W2.0'."
        )
    return Action(m.group(1), int(m.group(2)), int(m.group(3)))


def _as_action(a: Action | str) -> Action:
    return parse_action(a) if isinstance(a, str) else a


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Ordered actions per rank. `stage_rank[s]` is the rank that holds stage s.

    `ranks` and `stage_rank` may be given as lists, and actions as text ("F0.1"); they are stored
    as tuples of `Action`. `fpipe.schedules.validate` checks that the schedule is complete and
    cannot deadlock.
    """

    name: str
    n_stages: int
    n_microbatches: int
    ranks: tuple[tuple[Action, ...], ...]
    stage_rank: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(tuple(_as_action(a) for a in acts) for acts in self.ranks))
        object.__setattr__(self, "stage_rank", tuple(self.stage_rank))

    @property
    def pp(self) -> int:
        """The number of ranks."""
        return len(self.ranks)

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.ranks))

    def actions(self) -> Iterable[Action]:
        """Every action, rank by rank."""
        for acts in self.ranks:
            yield from acts

    def stages_of(self, rank: int) -> list[int]:
        """The stages that `rank` holds, in increasing order."""
        return [s for s, r in enumerate(self.stage_rank) if r == rank]

    def render(self, **costs: Any) -> str:
        """An ASCII timeline of this schedule; see `fpipe.schedules.render`."""
        if _renderer is None:  # only while fpipe itself is half imported: NOTE [schedule layering]
            raise RuntimeError("Schedule.render: import fpipe.schedules first (it installs the renderer).")
        return _renderer(self, **costs)


def parse(text: str, *, name: str = "custom") -> Schedule:
    """Parse the text form (as printed by `str(schedule)`) back into a `Schedule`.

    A stage is placed on the first rank whose line mentions it; `validate` reports a stage that
    appears on two ranks.
    """
    ranks: list[tuple[Action, ...]] = []
    for i, line in enumerate(text.strip().splitlines()):
        head, _, body = line.partition(":")
        if head.split() != ["rank", str(i)]:
            raise ValueError(
                f"parse: line {i} is {line!r}; it must start with 'rank {i}:' (ranks in order from 0)."
            )
        ranks.append(tuple(parse_action(t) for t in body.split()))
    stage_rank: dict[int, int] = {}
    for r, acts in enumerate(ranks):
        for a in acts:
            stage_rank.setdefault(a.stage, r)
    n_stages = max(stage_rank) + 1 if stage_rank else 0
    n_mb = max((a.mb for acts in ranks for a in acts), default=-1) + 1
    return Schedule(name, n_stages, n_mb, tuple(ranks), tuple(stage_rank.get(s, 0) for s in range(n_stages)))


# -- a global order for the local runner -------------------------------------------------------

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


# -- the renderer, installed by render.py (NOTE [schedule layering]) ----------------------------

Renderer = Callable[..., str]
_renderer: Renderer | None = None


def set_renderer(fn: Renderer) -> None:
    """Make `Schedule.render(**costs)` return `fn(schedule, **costs)`; render.py calls this."""
    global _renderer
    _renderer = fn
