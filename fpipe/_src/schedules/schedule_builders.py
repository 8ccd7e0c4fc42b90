"""Built-in schedules that place one stage per rank, or stages round-robin (stage s on rank s % pp).

Each builder is a pure function `fn(pp, microbatches, stages) -> Schedule` that checks its
placement and returns the schedule; schedule.py registers them under their names ("gpipe",
"1f1b", "zb-h1", "interleaved-1f1b", "looped-bfs"). They import only schedule_data (NOTE
[schedule layering] there); the V-placement schedules are in schedule_v.py.

Example:
    >>> print(one_f_one_b(2, 3, 2))
    rank 0: F0.0 F0.1 B0.0 F0.2 B0.1 B0.2
    rank 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2
"""

from __future__ import annotations

from collections.abc import Sequence

from .schedule_data import Action, Schedule

__all__ = ["gpipe", "one_f_one_b", "zb_h1", "interleaved_1f1b", "looped_bfs"]


# -- placement checks --------------------------------------------------------------------------


def _one_stage_per_rank(name: str, pp: int, stages: int) -> None:
    if stages != pp:
        raise ValueError(
            f"schedules.build({name!r}, pp={pp}, stages={stages}): this schedule places one stage "
            f"per rank, so stages must equal pp; use 'interleaved-1f1b' for several stages per rank."
        )


def _looped(name: str, pp: int, stages: int) -> int:
    """Checks the looped placement (stage s on rank s % pp) and returns stages per rank."""
    if stages < pp or stages % pp:
        raise ValueError(
            f"schedules.build({name!r}, pp={pp}, stages={stages}): the looped placement puts stage s "
            f"on rank s % pp, so stages must be a multiple of pp={pp}; use stages={pp * max(1, stages // pp)}."
        )
    return stages // pp


# -- one stage per rank ------------------------------------------------------------------------


def gpipe(pp: int, m: int, stages: int) -> Schedule:
    """All forwards, then all backwards: simple, holds every microbatch's activations."""
    _one_stage_per_rank("gpipe", pp, stages)
    ranks = tuple(
        tuple([Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)])
        for r in range(pp)
    )
    return Schedule("gpipe", pp, m, ranks, tuple(range(pp)))


def _alternate(fwd: Sequence[Action], bwd: Sequence[Action], warm: int) -> list[Action]:
    """`warm` forwards, then one forward and one backward in turn, then the remaining backwards."""
    steady = len(fwd) - warm
    acts = list(fwd[:warm])
    for f, b in zip(fwd[warm:], bwd[:steady]):
        acts += [f, b]
    return acts + list(bwd[steady:])


def one_f_one_b(pp: int, m: int, stages: int) -> Schedule:
    """Warm up with pp - 1 - rank forwards, then alternate: rank r holds min(pp - r, m) microbatches."""
    _one_stage_per_rank("1f1b", pp, stages)
    ranks = []
    for r in range(pp):
        fwd = [Action("F", r, i) for i in range(m)]
        ranks.append(tuple(_alternate(fwd, [Action("B", r, i) for i in range(m)], min(pp - 1 - r, m))))
    return Schedule("1f1b", pp, m, tuple(ranks), tuple(range(pp)))


def zb_h1(pp: int, m: int, stages: int) -> Schedule:
    """Zero Bubble H1 (Qi et al. 2024, arXiv:2401.10241): 1F1B with B split into I and W.

    Rank r runs 1F1B's order with `I` in place of `B`, and runs each `W` r steady steps after its
    `I`, just before the next forward; the W's it still owes fill the cooldown, where 1F1B idles.
    Rank r then holds at most pp microbatches, 1F1B's peak (on rank 0), so the peak memory over
    ranks does not grow, and with F = I = W the idle time per rank is a third of 1F1B's.
    """
    _one_stage_per_rank("zb-h1", pp, stages)
    return Schedule("zb-h1", pp, m, tuple(tuple(_zb_h1_rank(pp, m, r)) for r in range(pp)), tuple(range(pp)))


def _zb_h1_rank(pp: int, m: int, r: int) -> list[Action]:
    warm = min(pp - 1 - r, m)
    acts = [Action("F", r, i) for i in range(warm)]
    w = 0  # the next microbatch whose W is owed
    for i in range(m):  # step i: the next forward, if any, then I of microbatch i
        steady = warm + i < m
        if (i - w > r) if steady else (w < i):  # W lags r steps; in the cooldown it fills each wait
            acts.append(Action("W", r, w))
            w += 1
        acts += [Action("F", r, warm + i)] if steady else []
        acts.append(Action("I", r, i))
    return acts + [Action("W", r, j) for j in range(w, m)]


# -- several stages per rank: looped placement -------------------------------------------------


def _rounds(pp: int, m: int) -> list[int]:
    """Sizes of the microbatch groups: max(1, m // pp) groups as equal as possible, larger first.

    Megatron uses groups of exactly pp and so needs m % pp == 0. Groups of at least pp keep the
    schedule free of deadlock and the bubble as small for any m >= pp (checked by the tests).
    """
    k = max(1, m // pp)
    return [m // k + (i < m % k) for i in range(k)]


def _megatron_order(pp: int, m: int, v: int, r: int, backward: bool) -> list[tuple[int, int]]:
    """(stage, mb) pairs of rank r: each group of microbatches runs through every local chunk in turn."""
    chunks = range(v - 1, -1, -1) if backward else range(v)
    out, first = [], 0
    for size in _rounds(pp, m):
        out += [(c * pp + r, mb) for c in chunks for mb in range(first, first + size)]
        first += size
    return out


def interleaved_1f1b(pp: int, m: int, stages: int) -> Schedule:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): v = stages / pp chunks per rank.

    Stage s lives on rank s % pp. Each rank runs a group of microbatches through its chunks in
    turn (depth first), warms up with (v - 1) * group + 2 * (pp - 1 - r) forwards, then
    alternates forward and backward. With m >= pp the idle time per rank is that of 1F1B on one
    chunk, so the bubble shrinks v times, for v times the messages and more activations held.
    """
    v = _looped("interleaved-1f1b", pp, stages)
    ranks = []
    for r in range(pp):
        fwd = [Action("F", s, mb) for s, mb in _megatron_order(pp, m, v, r, backward=False)]
        bwd = [Action("B", s, mb) for s, mb in _megatron_order(pp, m, v, r, backward=True)]
        warm = (v - 1) * _rounds(pp, m)[0] + 2 * (pp - 1 - r)
        ranks.append(tuple(_alternate(fwd, bwd, min(warm, len(fwd)))))
    return Schedule("interleaved-1f1b", stages, m, tuple(ranks), tuple(s % pp for s in range(stages)))


def looped_bfs(pp: int, m: int, stages: int) -> Schedule:
    """Breadth-first looping (Lamy-Poirier 2023): every microbatch through chunk 0, then chunk 1, ...

    Same placement as "interleaved-1f1b"; each rank runs all forwards chunk by chunk, then all
    backwards in reverse chunk order, like GPipe per chunk. It holds every microbatch's
    activations, but needs the fewest switches between chunks.
    """
    v = _looped("looped-bfs", pp, stages)
    ranks = []
    for r in range(pp):
        fwd = [Action("F", c * pp + r, mb) for c in range(v) for mb in range(m)]
        bwd = [Action("B", c * pp + r, mb) for c in reversed(range(v)) for mb in range(m)]
        ranks.append(tuple(fwd + bwd))
    return Schedule("looped-bfs", stages, m, tuple(ranks), tuple(s % pp for s in range(stages)))
