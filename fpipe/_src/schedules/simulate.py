"""Simulate: check and time a schedule without running anything.

Both functions replay the ranks the way the runtime runs them: each rank takes its actions in
order, and an action waits until the actions it depends on have finished. The dependencies are
the standard ones (`dependencies`):

- `F(s, m)` needs `F(s-1, m)`;
- `B(s, m)` and `I(s, m)` need `F(s, m)` and the input gradient of stage s+1 for m, which is
  `I(s+1, m)` if the schedule splits that backward and `B(s+1, m)` otherwise;
- `W(s, m)` needs `I(s, m)`.

`validate` replays with blocking waits and no clock, and rejects a schedule that would lose work
or hang -- also on NCCL, whose streams run each rank's sends and receives in issue order: the
communication the schedule implies for a chain of stages is replayed under that rule too
(`comm.py`, NOTE [in-order communication streams]). `simulate` replays with costs and reports
when each action runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from .comm import CommPlan, chain_plan, stream_deadlock
from .schedule_data import Action, Schedule

__all__ = ["Simulation", "dependencies", "simulate", "validate", "validate_comm"]

Deps = Callable[[Action], list[Action]]


def dependencies(sched: Schedule) -> Deps:
    """The standard dependencies of `sched`'s actions: `dependencies(sched)(a)` lists what `a` needs.

    Example:
        >>> from fpipe.schedules import Action, build
        >>> deps = dependencies(build("zb-h1", pp=2, microbatches=2))
        >>> [str(d) for d in deps(Action("I", 0, 1))]
        ['F0.1', 'I1.1']
    """
    present = set(sched.actions())
    last = sched.n_stages - 1

    def needs(a: Action) -> list[Action]:
        if a.kind == "F":
            return [Action("F", a.stage - 1, a.mb)] if a.stage > 0 else []
        if a.kind == "W":
            return [Action("I", a.stage, a.mb)]
        if a.stage == last:
            return [Action("F", a.stage, a.mb)]
        grad = Action("I", a.stage + 1, a.mb)
        return [Action("F", a.stage, a.mb), grad if grad in present else Action("B", a.stage + 1, a.mb)]

    table = {a: needs(a) for a in present}
    return lambda a: table[a] if a in table else needs(a)


def _replay(ranks: Sequence[Sequence[Action]], deps: Deps) -> tuple[list[Action], list[int]]:
    """Runs the ranks with blocking waits; returns the global order and where each rank stopped."""
    pos = [0] * len(ranks)
    done: set[Action] = set()
    order: list[Action] = []
    waiting: dict[Action, list[int]] = {}
    todo = list(range(len(ranks)))
    while todo:
        r = todo.pop()
        while pos[r] < len(ranks[r]):
            a = ranks[r][pos[r]]
            unmet = next((d for d in deps(a) if d not in done), None)
            if unmet is not None:
                waiting.setdefault(unmet, []).append(r)
                break
            done.add(a)
            order.append(a)
            pos[r] += 1
            todo.extend(waiting.pop(a, ()))
    return order, pos


# -- validate ----------------------------------------------------------------------------------


def validate(sched: Schedule) -> Schedule:
    """Check that `sched` runs every action exactly once, where its stage lives, without deadlock.

    Checks, in order: the placement (`stage_rank`), stage and microbatch indices, that each
    action runs on the rank holding its stage, duplicates, that no (stage, microbatch) mixes `B`
    with `I`/`W`, that nothing is missing, that no action comes before its dependency on the
    same rank, that the ranks, each blocking on its next action, all finish, and that the
    communication this implies for a chain of stages (`comm.chain_plan`) completes on in-order
    streams such as NCCL's (`comm.stream_deadlock`).

    Returns:
        `sched`, so that `validate(build(...))` chains.

    Raises:
        ValueError: naming the rank, the action and the unmet dependency, followed by the schedule.

    Example:
        >>> from fpipe.schedules import parse
        >>> validate(parse("rank 0: F0.0 B0.0")).name
        'custom'
        >>> validate(parse("rank 0: B0.0 F0.0"))
        Traceback (most recent call last):
        ...
        ValueError: validate(schedule 'custom', 1 rank(s), 1 stage(s), 1 microbatch(es)): rank 0 runs B0.0 at position 0 before F0.0 at position 1, but B0.0 needs F0.0; move F0.0 before B0.0.
        schedule:
        rank 0: B0.0 F0.0
    """
    for check in _CHECKS:
        _raise(sched, check(sched))
    return sched


def validate_comm(sched: Schedule, plan: CommPlan) -> None:
    """Reject `plan`, the communication a runner built for `sched` from the real dataflow, if it
    deadlocks on in-order streams (`comm.stream_deadlock`); the same error as `validate`'s."""
    _raise(sched, stream_deadlock(plan))


def _raise(sched: Schedule, problem: str | None) -> None:
    if problem is not None:
        head = (
            f"validate(schedule {sched.name!r}, {sched.pp} rank(s), {sched.n_stages} stage(s), "
            f"{sched.n_microbatches} microbatch(es))"
        )
        raise ValueError(f"{head}: {problem}\nschedule:\n{sched}")


def _check_placement(sched: Schedule) -> str | None:
    if len(sched.stage_rank) != sched.n_stages:
        return (
            f"stage_rank has {len(sched.stage_rank)} entries but there are {sched.n_stages} stages; "
            "give one rank per stage."
        )
    for s, r in enumerate(sched.stage_rank):
        if not 0 <= r < sched.pp:
            return f"stage_rank[{s}] = {r}, but the schedule has {sched.pp} rank(s) (0..{sched.pp - 1}); fix stage_rank or add ranks."
    return None


def _check_indices(sched: Schedule) -> str | None:
    for r, acts in enumerate(sched.ranks):
        for a in acts:
            if not 0 <= a.stage < sched.n_stages:
                return (
                    f"rank {r} runs {a}, but stage {a.stage} does not exist: the schedule has "
                    f"{sched.n_stages} stage(s), 0..{sched.n_stages - 1}; fix the action or n_stages."
                )
            if not 0 <= a.mb < sched.n_microbatches:
                return (
                    f"rank {r} runs {a}, but microbatch {a.mb} does not exist: the schedule has "
                    f"{sched.n_microbatches} microbatch(es), 0..{sched.n_microbatches - 1}; fix the action "
                    "or n_microbatches."
                )
    return None


def _check_ranks(sched: Schedule) -> str | None:
    for r, acts in enumerate(sched.ranks):
        for a in acts:
            if sched.stage_rank[a.stage] != r:
                holder = sched.stage_rank[a.stage]
                return (
                    f"rank {r} runs {a}, but stage {a.stage} is held by rank {holder} "
                    f"(stage_rank[{a.stage}] = {holder}); move {a} to rank {holder}'s list or change stage_rank."
                )
    return None


def _check_duplicates(sched: Schedule) -> str | None:
    for r, acts in enumerate(sched.ranks):
        first: dict[Action, int] = {}
        for i, a in enumerate(acts):
            if a in first:
                return (
                    f"rank {r} runs {a} twice (positions {first[a]} and {i}); each action runs exactly once."
                )
            first[a] = i
    return None


def _check_mixed(sched: Schedule) -> str | None:
    present = set(sched.actions())
    for a in sched.actions():
        if a.kind != "B":
            continue
        split = [str(x) for x in (Action("I", a.stage, a.mb), Action("W", a.stage, a.mb)) if x in present]
        if split:
            return (
                f"rank {sched.stage_rank[a.stage]} runs {a} and also {' and '.join(split)}: stage {a.stage}, "
                f"microbatch {a.mb} must use either the full backward B or the pair I + W, not both."
            )
    return _check_one_backward_kind(sched)


def _check_one_backward_kind(sched: Schedule) -> str | None:
    """fpipe compiles one backward per stage: B, or I and W -- the same for every microbatch."""
    kinds: dict[int, dict[str, Action]] = {}
    for a in sched.actions():
        if a.kind != "F":
            kinds.setdefault(a.stage, {}).setdefault("B" if a.kind == "B" else "IW", a)
    for stage, seen in sorted(kinds.items()):
        if len(seen) == 2:
            return (
                f"rank {sched.stage_rank[stage]} runs {seen['B']} and {seen['IW']}: stage {stage} must use "
                "the same backward for every microbatch (B for all, or I + W for all); fpipe compiles "
                "one backward per stage."
            )
    return None


def _check_missing(sched: Schedule) -> str | None:
    present = set(sched.actions())
    for s in range(sched.n_stages):
        r = sched.stage_rank[s]
        for m in range(sched.n_microbatches):
            problem = _missing_one(present, r, s, m)
            if problem is not None:
                return problem
    return None


def _missing_one(present: set[Action], r: int, s: int, m: int) -> str | None:
    f, b, i, w = (Action(k, s, m) for k in "FBIW")
    if f not in present:
        return f"rank {r} never runs {f}; every stage needs a forward for every microbatch."
    if w in present and i not in present:
        return f"rank {r} runs {w}, which needs {i}, but no rank runs {i}; add {i} before {w} (or use {b} alone)."
    if i in present and w not in present:
        return f"rank {r} runs {i} but never {w}, so stage {s}'s weight gradient for microbatch {m} is lost; add {w} after {i}."
    if b not in present and i not in present:
        return f"rank {r} never runs a backward for stage {s}, microbatch {m}; add {b} (or {i} and {w}) after {f}."
    return None


def _check_local_order(sched: Schedule) -> str | None:
    deps = dependencies(sched)
    for r, acts in enumerate(sched.ranks):
        where = {a: i for i, a in enumerate(acts)}
        for i, a in enumerate(acts):
            for d in deps(a):
                if where.get(d, -1) > i:
                    return (
                        f"rank {r} runs {a} at position {i} before {d} at position {where[d]}, but {a} "
                        f"needs {d}; move {d} before {a}."
                    )
    return None


def _check_deadlock(sched: Schedule) -> str | None:
    deps = dependencies(sched)
    order, pos = _replay(sched.ranks, deps)
    if len(order) == sum(len(acts) for acts in sched.ranks):
        return None
    done = set(order)
    waits = {
        r: (acts[pos[r]], next(d for d in deps(acts[pos[r]]) if d not in done))
        for r, acts in enumerate(sched.ranks)
        if pos[r] < len(acts)
    }
    cycle = _cycle(waits, sched.stage_rank)
    parts = []
    for r in cycle:
        head, dep = waits[r]
        q = sched.stage_rank[dep.stage]
        parts.append(
            f"rank {r} waits at {head} (position {pos[r]}) for {dep}, which rank {q} runs at "
            f"position {sched.ranks[q].index(dep)}"
        )
    return "the ranks deadlock in a cycle: " + "; ".join(parts) + "; reorder one of these ranks to break it."


def _cycle(waits: dict[int, tuple[Action, Action]], stage_rank: Sequence[int]) -> list[int]:
    """The wait-for cycle reached from the lowest stuck rank (every stuck rank waits for a stuck one)."""
    seen: list[int] = []
    r = min(waits)
    while r not in seen:
        seen.append(r)
        r = stage_rank[waits[r][1].stage]
    return seen[seen.index(r) :]


def _check_comm(sched: Schedule) -> str | None:
    return stream_deadlock(chain_plan(sched, dependencies(sched)))


_CHECKS: tuple[Callable[[Schedule], str | None], ...] = (
    _check_placement,
    _check_indices,
    _check_ranks,
    _check_duplicates,
    _check_mixed,
    _check_missing,
    _check_local_order,
    _check_deadlock,
    _check_comm,
)


# -- simulate ----------------------------------------------------------------------------------

Cost = float | Sequence[float]


@dataclasses.dataclass(frozen=True)
class Simulation:
    """When each action of `schedule` runs under given costs, and what that implies.

    Attributes:
        schedule: the schedule simulated.
        makespan: the time from the first start to the last finish.
        bubble: per rank, the fraction of the makespan the rank is idle.
        peak_inflight: per rank, the most (stage, microbatch) pairs whose activations the rank
            holds at once: from the pair's F until its B, or until its W when the backward is
            split. With one stage per rank this counts microbatches.
        start: the start time of each action.
        end: the end time of each action.
    """

    schedule: Schedule
    makespan: float
    bubble: list[float]
    peak_inflight: list[int]
    start: dict[Action, float]
    end: dict[Action, float]


def simulate(
    sched: Schedule,
    forward: Cost = 1.0,
    backward: Cost = 1.0,
    weight: Cost = 1.0,
    comm: float = 0.0,
) -> Simulation:
    """Time `sched` with a cost per action, as if each rank ran its list in order.

    An action starts when its rank is free and its dependencies have finished, plus `comm` when a
    dependency ran on another rank. Costs are per action on one stage: a scalar or one value per
    stage. `F` costs `forward`, `I` costs `backward`, `W` costs `weight` and a full `B` costs
    `backward + weight`.

    A rank's bubble is its idle time divided by the makespan. With the defaults (F = 1, full
    B = 2, comm = 0) GPipe and 1F1B both take 3 (m + pp - 1) for m microbatches on pp ranks and
    every rank is busy 3m of it, so each rank's bubble is exactly (pp - 1) / (m + pp - 1), the
    textbook value. (Idle time over busy time would give (pp - 1) / m instead.) ZB-H1
    (F = I = W = 1) takes 3m + pp - 1 for m >= pp: idle time pp - 1 per rank, a third of 1F1B's
    3 (pp - 1), and a bubble of (pp - 1) / (3m + pp - 1).

    Args:
        sched: the schedule; it is validated first.
        forward: cost of one forward on a stage.
        backward: cost of one input-gradient backward (`I`) on a stage.
        weight: cost of one weight-gradient backward (`W`) on a stage.
        comm: delay between an action and a dependent one on another rank.

    Returns:
        A `Simulation` with `makespan`, per-rank `bubble` and `peak_inflight`, and the timings.

    Example:
        >>> from fpipe.schedules import build
        >>> sim = simulate(build("1f1b", pp=4, microbatches=8))
        >>> sim.makespan, sim.bubble[0], sim.peak_inflight
        (33.0, 0.2727272727272727, [4, 3, 2, 1])
    """
    validate(sched)
    f, b, w = (
        _per_stage(n, c, sched.n_stages)
        for n, c in (("forward", forward), ("backward", backward), ("weight", weight))
    )
    if comm < 0:
        raise ValueError(f"simulate(comm={comm}): comm must be >= 0.")
    cost = {"F": f, "I": b, "W": w, "B": [x + y for x, y in zip(b, w)]}
    start, end = _times(sched, cost, comm)
    makespan = max(end.values(), default=0.0)
    return Simulation(
        sched,
        makespan,
        _bubbles(sched, start, end, makespan),
        [_peak(acts) for acts in sched.ranks],
        start,
        end,
    )


def _per_stage(name: str, c: Cost, n_stages: int) -> list[float]:
    values = [float(x) for x in c] if isinstance(c, Iterable) else [float(c)] * n_stages
    if len(values) != n_stages:
        raise ValueError(
            f"simulate({name}=...): got {len(values)} per-stage costs for {n_stages} stages; "
            f"give one number or {n_stages}."
        )
    if any(x < 0 for x in values):
        raise ValueError(f"simulate({name}={c!r}): costs must be >= 0.")
    return values


def _times(
    sched: Schedule, cost: dict[str, list[float]], comm: float
) -> tuple[dict[Action, float], dict[Action, float]]:
    deps = dependencies(sched)
    order, _ = _replay(sched.ranks, deps)
    free = [0.0] * sched.pp
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    for a in order:  # any order that keeps dependencies and rank order gives the same times
        r = sched.stage_rank[a.stage]
        ready = (end[d] + (comm if sched.stage_rank[d.stage] != r else 0.0) for d in deps(a))
        start[a] = max([free[r], *ready])
        end[a] = free[r] = start[a] + cost[a.kind][a.stage]
    return start, end


def _bubbles(
    sched: Schedule, start: dict[Action, float], end: dict[Action, float], makespan: float
) -> list[float]:
    if makespan == 0:
        return [0.0] * sched.pp
    return [(makespan - sum(end[a] - start[a] for a in acts)) / makespan for acts in sched.ranks]


def _peak(acts: Iterable[Action]) -> int:
    """Activations are held from F until B, or until W when the backward is split."""
    held = peak = 0
    for a in acts:
        held += {"F": 1, "B": -1, "W": -1}.get(a.kind, 0)
        peak = max(peak, held)
    return peak
