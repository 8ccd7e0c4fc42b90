"""Built-in schedules on the V placement: rank r holds stages r and 2pp-1-r ("zbv", "dualpipev").

The last stage and the loss sit on rank 0 next to the first stage. Builders are pure functions
`fn(pp, microbatches, stages) -> Schedule`, registered by schedule.py; each rank's order is
written with `_Rank`, which numbers microbatches per stage and keeps the W's a rank owes in a
FIFO. They import only schedule_data (NOTE [schedule layering] there).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from .schedule_data import Action, Schedule

__all__ = ["zbv", "dualpipev"]


def _v_shape(name: str, pp: int, stages: int) -> tuple[int, ...]:
    """Checks the V placement (rank r holds stages r and 2pp-1-r) and returns stage_rank."""
    if stages != 2 * pp:
        raise ValueError(
            f"schedules.build({name!r}, pp={pp}, stages={stages}): the V placement puts stages r and "
            f"{2 * pp - 1}-r on rank r, so stages must be 2 * pp = {2 * pp}; use stages={2 * pp} or pp={stages // 2}."
        )
    return tuple(range(pp)) + tuple(range(pp - 1, -1, -1))


W = "W"  # in `_Rank.run`: the oldest W this rank owes


class _Rank:
    """Builds one rank's actions, numbering microbatches per stage; W's wait in a FIFO."""

    def __init__(self) -> None:
        self.acts: list[Action] = []
        self.next: collections.Counter[tuple[str, int]] = collections.Counter()
        self.owed: collections.deque[Action] = collections.deque()

    def run(self, *ops: tuple[str, int] | str, times: int = 1) -> None:
        """Appends `ops` `times` times.

        (kind, stage) is that stage's next F, B or I, or with kind "IW" its next I and that I's W
        at once (a full backward written split); `W` alone is the oldest W this rank owes.
        """
        for _ in range(times):
            for op in ops:
                if isinstance(op, str):
                    self.acts += [self.owed.popleft()] if self.owed else []
                else:
                    self._add(*op)

    def _add(self, kind: str, stage: int) -> None:
        key = ("F" if kind == "F" else "bwd", stage)
        a = Action(kind[0], stage, self.next[key])
        self.next[key] += 1
        self.acts.append(a)
        if kind == "IW":
            self.acts.append(Action("W", stage, a.mb))
        elif kind == "I":
            self.owed.append(Action("W", stage, a.mb))

    def flush(self) -> None:
        """Appends every owed W, oldest first."""
        self.acts += self.owed
        self.owed.clear()


def _v_schedule(
    name: str, pp: int, m: int, stages: int, m_min: int, rank_fn: Callable[..., _Rank]
) -> Schedule:
    """Builds a V schedule for max(m, m_min) microbatches and drops the extra ones.

    Dropping every action of a microbatch keeps a valid schedule valid: no other microbatch
    depends on it, and the remaining order is part of an order that ran to the end.
    """
    stage_rank = _v_shape(name, pp, stages)
    n = max(m, m_min)
    ranks = [rank_fn(pp, n, r, r, 2 * pp - 1 - r).acts for r in range(pp)]
    return Schedule(name, stages, m, tuple(tuple(a for a in acts if a.mb < m) for acts in ranks), stage_rank)


def zbv(pp: int, m: int, stages: int) -> Schedule:
    """Zero Bubble V (Qi et al. 2024, section 6): V placement with I/W split.

    Rank r holds stage r (chunk 0, on the way down) and stage 2pp-1-r (chunk 1, on the way
    back), so the last stage and the loss sit on rank 0 next to the first stage. Each rank fills
    the V's slope with chunk-0 forwards, then runs F, I and W of both chunks in turn and moves
    its leftover W's to the end, where they fill the drain. Peak activations per rank: 2pp
    chunk-microbatches, the memory of 1F1B's pp microbatches on a stage twice as large.
    """
    return _v_schedule("zbv", pp, m, stages, 2 * pp, _zbv_rank)


def _zbv_rank(pp: int, n: int, r: int, a: int, b: int) -> _Rank:
    k = _Rank()
    k.run(("F", a), times=2 * (pp - r) - 1)  # down the slope until chunk 1's first input arrives
    k.run(("F", b), ("F", a), times=r)
    k.run(("F", b), ("I", b), W, times=pp - r)
    while k.next["F", b] < n:  # steady: both chunks in turn
        if k.next["F", a] < n:
            k.run(("F", a))
        k.run(("I", a), W, ("F", b), ("I", b), W)
    k.run(("I", a), ("I", b), times=r)
    k.run(("I", a), W, times=n - k.next["bwd", a])
    k.flush()
    return k


def dualpipev(pp: int, m: int, stages: int) -> Schedule:
    """DeepSeek's DualPipeV (the "cut in half" DualPipe of DeepSeek-V3, arXiv:2412.19437), in order.

    V placement like "zbv". DualPipe's steady phase runs a forward chunk of one microbatch and a
    backward chunk of another at the same time, so one hides the other's all-to-all traffic.
    fpipe runs one action at a time, so each overlapped pair is written as the forward followed by
    the backward, as `I` and its `W` back to back (every backward is split, so a runtime that
    wants one kind of backward per stage can run it); where DualPipe defers the weight gradient
    to fill the drain, the `W` runs later. The order of the work on each rank is DualPipeV's.
    Microbatches below 2 * pp are built as 2 * pp and the extra ones dropped.
    """
    return _v_schedule("dualpipev", pp, m, stages, 2 * pp, _dualpipev_rank)


def _dualpipev_rank(pp: int, n: int, r: int, a: int, b: int) -> _Rank:
    k = _Rank()
    k.run(("F", a), times=2 * (pp - r - 1))  # 1: chunk 0 down the slope
    k.run(("F", a), ("F", b), times=r + 1)  # 2: both chunks, until the first gradient arrives
    k.run(("I", b), W, ("F", b), times=pp - r - 1)  # 3: zero-bubble steps on chunk 1
    k.run(("F", a), ("IW", b), ("F", b), ("IW", a), times=n - 2 * pp + r + 1)  # 4: overlapped pairs
    k.run(("IW", b), ("F", b), ("IW", a), times=pp - r - 1)  # 5: chunk 0 has no forwards left
    half = (r + 1) // 2  # 6: both backwards; the second half defers W
    k.run(("IW", b), ("IW", a), times=half)
    k.run(("I", b), ("I", a), times=r + 1 - half)
    k.run(W, ("I", a), times=pp - r - 1)  # 7: W's fill the waits for chunk 0's gradients
    k.flush()  # 8: the rest
    return k
