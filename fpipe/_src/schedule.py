"""Schedule: per-rank ordered actions over (stage, microbatch), as plain data.

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

Builders are registered by name (`register`); `build(name, pp=..., microbatches=...)` makes one.
Text form: one line per rank, `rank 0: F0.0 F0.1 B0.0 B0.1` (kind, stage, '.', microbatch).

Example:
    >>> s = build("1f1b", pp=2, microbatches=3)
    >>> print(s)
    rank 0: F0.0 F0.1 B0.0 F0.2 B0.1 B0.2
    rank 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2
    >>> str(parse(str(s))) == str(s)
    True
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["Action", "Schedule", "register", "build", "names", "parse", "execution_order"]

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
        from .render import render

        return render(self, **costs)


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


def _v_shape(name: str, pp: int, stages: int) -> tuple[int, ...]:
    """Checks the V placement (rank r holds stages r and 2pp-1-r) and returns stage_rank."""
    if stages != 2 * pp:
        raise ValueError(
            f"schedules.build({name!r}, pp={pp}, stages={stages}): the V placement puts stages r and "
            f"{2 * pp - 1}-r on rank r, so stages must be 2 * pp = {2 * pp}; use stages={2 * pp} or pp={stages // 2}."
        )
    return tuple(range(pp)) + tuple(range(pp - 1, -1, -1))


# -- one stage per rank ------------------------------------------------------------------------


@register("gpipe")
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


@register("1f1b")
def one_f_one_b(pp: int, m: int, stages: int) -> Schedule:
    """Warm up with pp - 1 - rank forwards, then alternate: rank r holds min(pp - r, m) microbatches."""
    _one_stage_per_rank("1f1b", pp, stages)
    ranks = []
    for r in range(pp):
        fwd = [Action("F", r, i) for i in range(m)]
        ranks.append(tuple(_alternate(fwd, [Action("B", r, i) for i in range(m)], min(pp - 1 - r, m))))
    return Schedule("1f1b", pp, m, tuple(ranks), tuple(range(pp)))


@register("zb-h1")
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


@register("interleaved-1f1b", stages_per_rank=2)
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


@register("looped-bfs", stages_per_rank=2)
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


# -- two stages per rank: V placement ----------------------------------------------------------


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


@register("zbv", stages_per_rank=2)
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


@register("dualpipev", stages_per_rank=2)
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
