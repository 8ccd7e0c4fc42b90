"""Schedule registry: `register`, `build` and `names` over the built-in and user schedules.

A schedule is plain data (schedule_data.py: `Action`, `Schedule`, the text form, re-exported
here); a builder `fn(pp, microbatches, stages) -> Schedule` makes one. Builders are registered by
name (`register`); `build(name, pp=..., microbatches=...)` makes one. The built-in builders live in
schedule_builders.py (one stage per rank, looped) and schedule_v.py (V placement) and are
registered below. This module is the top of the schedule layers (NOTE [schedule layering] in
schedule_data.py): nothing below it imports it.

Example:
    >>> s = build("1f1b", pp=2, microbatches=3)
    >>> print(s)
    rank 0: F0.0 F0.1 B0.0 F0.2 B0.1 B0.2
    rank 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2
    >>> str(parse(str(s))) == str(s)
    True
"""

from __future__ import annotations

from collections.abc import Callable

from .schedule_builders import gpipe, interleaved_1f1b, looped_bfs, one_f_one_b, zb_h1
from .schedule_data import Action, Schedule, execution_order, parse, parse_action
from .schedule_v import dualpipev, zbv

__all__ = [
    "Action",
    "Schedule",
    "register",
    "build",
    "names",
    "parse",
    "parse_action",
    "execution_order",
    "stages_per_rank",
]


# -- the registry ------------------------------------------------------------------------------

Builder = Callable[[int, int, int], Schedule]
_BUILDERS: dict[str, Builder] = {}
_STAGES_PER_RANK: dict[str, int] = {}


def register(name: str, *, stages_per_rank: int = 1) -> Callable[[Builder], Builder]:
    """Register a schedule builder `fn(pp, microbatches, stages) -> Schedule` under `name`.

    Args:
        name: the name `build` and `fpipe.pipeline(schedule=...)` accept.
        stages_per_rank: how many stages the schedule puts on each rank when `build` is given
            only `stages` (`pp = stages // stages_per_rank`).
    """

    def deco(fn: Builder) -> Builder:
        _BUILDERS[name] = fn
        _STAGES_PER_RANK[name] = stages_per_rank
        return fn

    return deco


def stages_per_rank(name: str) -> int:
    """How many stages the registered schedule `name` places on each rank by default."""
    return _STAGES_PER_RANK[name]


def names() -> list[str]:
    """The registered schedule names, sorted."""
    return sorted(_BUILDERS)


def build(name: str, *, pp: int | None = None, microbatches: int, stages: int | None = None) -> Schedule:
    """Build the registered schedule `name` for `pp` ranks and `microbatches` microbatches.

    Args:
        name: a registered name (see `names()`).
        pp: number of ranks. None: derived from `stages` and the schedule's stages per rank (one
            for "gpipe", "1f1b", "zb-h1"; two for "interleaved-1f1b", "looped-bfs", "zbv",
            "dualpipev").
        microbatches: number of microbatches.
        stages: number of stages. None: `pp` times the schedule's stages per rank.

    Raises:
        ValueError: unknown name, or numbers the schedule cannot place.
    """
    if name not in _BUILDERS:
        raise ValueError(f"schedules.build({name!r}): unknown schedule; known schedules are {names()}.")
    per = _STAGES_PER_RANK[name]
    if pp is None:
        pp = _pp_from_stages(name, stages, per)
    if pp < 1 or microbatches < 1:
        raise ValueError(
            f"schedules.build({name!r}, pp={pp}, microbatches={microbatches}): both must be >= 1."
        )
    return _BUILDERS[name](pp, microbatches, pp * per if stages is None else stages)


def _pp_from_stages(name: str, stages: int | None, per: int) -> int:
    if stages is None:
        raise ValueError(f"schedules.build({name!r}): give pp, stages or both.")
    if stages < 1 or stages % per:
        raise ValueError(
            f"schedules.build({name!r}, stages={stages}): this schedule puts {per} stages on each rank, "
            f"so stages must be a positive multiple of {per}; use stages={per * max(1, stages // per)} "
            f"or pass pp explicitly."
        )
    return stages // per


# -- the built-in schedules: (name, stages per rank, builder) ---------------------------------

_BUILT_IN: tuple[tuple[str, int, Builder], ...] = (
    ("gpipe", 1, gpipe),
    ("1f1b", 1, one_f_one_b),
    ("zb-h1", 1, zb_h1),
    ("interleaved-1f1b", 2, interleaved_1f1b),
    ("looped-bfs", 2, looped_bfs),
    ("zbv", 2, zbv),
    ("dualpipev", 2, dualpipev),
)
for _name, _per, _fn in _BUILT_IN:
    register(_name, stages_per_rank=_per)(_fn)
