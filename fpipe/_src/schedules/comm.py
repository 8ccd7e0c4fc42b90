"""Communication plan: which transfers each rank issues, grouped and in what order, as plain data.

A *transfer* is one bundle (every value one action sends to one peer) on one channel (an ordered
pair of ranks); a channel's transfers are received in the sender's order, since p2p messages
match by order. Each rank issues its transfers in *groups*, in a fixed order: one group after
each action (after the input-gradient half of a full backward that runs split) with that
action's sends and the receives whose data is sent, in a unit-cost replay of all ranks, before
this rank's next action ends; and one group of receives before the first action. Sends and
receives of one step in one group is what torch.distributed.pipelining does too.

# NOTE [in-order communication streams]
NCCL runs each group on the rank's communication stream in issue order, and an operation only
completes once its peer's matching operation runs too: a receive at the head of a stream blocks
every group behind it. `stream_deadlock` replays the plan under exactly that rule -- a queue of
groups per rank; an operation completes once its group and its peer's matching group are both at
the heads of their queues; a group leaves its queue once all its operations completed -- and
names the cycle if some groups never leave. Gloo has no such order (each operation completes on
its own), so a plan that passes here runs on both; `FPIPE_EMULATE_NCCL_ORDER=1` makes the gloo
runner issue each group only after the previous one completed, which is this rule, for tests.

`chain_plan` is the plan a schedule implies for the standard stage chain (`F` of stage s sends to
`F` of s + 1, a backward of s to the backward of s - 1, when they are on different ranks): what
`validate` checks before anything runs. The runner builds and checks the plan of the real
dataflow (skip connections, tied weights) with the same functions.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence

from .schedule_data import Action, Schedule, execution_order

__all__ = ["CommGroup", "CommPlan", "Transfer", "chain_plan", "comm_plan", "stream_deadlock"]

Key = tuple[int, int, int]  # (src, dst, index on the channel)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """The bundle `action` (run on `src`) sends to `dst`: the `index`-th on that channel."""

    src: int
    dst: int
    index: int
    action: Action
    names: tuple[str, ...] = ()

    @property
    def key(self) -> Key:
        return (self.src, self.dst, self.index)


@dataclasses.dataclass(frozen=True)
class CommGroup:
    """Transfers one rank issues together; `after` is the action whose compute precedes them
    (None: before the rank's first action)."""

    rank: int
    position: int
    after: Action | None
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]

    def keys(self) -> list[Key]:
        return [t.key for t in (*self.sends, *self.recvs)]

    def __str__(self) -> str:
        ops = [f"send {t.action} to rank {t.dst}" for t in self.sends]
        ops += [f"receive {t.action} from rank {t.src}" for t in self.recvs]
        return f"group {self.position} (after {self.after or 'start'}: {', '.join(ops)})"


@dataclasses.dataclass(frozen=True)
class CommPlan:
    """Per rank, its groups in issue order; per action, per source rank, the highest channel
    index it reads (it waits for that transfer and every earlier one on the channel)."""

    groups: tuple[tuple[CommGroup, ...], ...]
    need: dict[Action, dict[int, int]]

    def sends_of(self, a: Action) -> list[Transfer]:
        return [t for gs in self.groups for g in gs if g.after == a for t in g.sends]


Sends = Callable[[Action, int], Iterable[tuple[int, Sequence[str]]]]
Reads = Callable[[Action, int], Iterable[tuple[int, Action]]]


def comm_plan(sched: Schedule, sends: Sends, reads: Reads) -> CommPlan:
    """The plan for `sched` given, per action `a` on rank r, `sends(a, r)`: (peer, value names)
    per bundle it sends, and `reads(a, r)`: (peer, producing action) per bundle it receives.

    Every action gets an end time from a replay of the ranks with unit costs (F, I, W: 1; B: 2)
    and every transfer the end time of the action that sends it; each rank issues its operations
    in the order of those times: after action a_i, every operation timed from a_i's end to
    a_{i+1}'s (a_i's sends first, then receives). All ranks order transfers by the same key, so
    the earliest unfinished transfer always has both sides at the heads of their streams: in-order
    streams never deadlock (module NOTE), and each receive is issued about when its data is sent.

    Raises:
        ValueError: the reads cannot all be met in the ranks' orders (the schedule deadlocks).
    """
    channels: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
    for r, acts in enumerate(sched.ranks):
        for a in acts:
            for dst, names in sends(a, r):
                channels[r, dst].append(Transfer(r, dst, len(channels[r, dst]), a, tuple(names)))
    where = {(t.src, t.dst, t.action): t for ts in channels.values() for t in ts}
    reads_of = {a: list(reads(a, r)) for r, acts in enumerate(sched.ranks) for a in acts}
    need: dict[Action, dict[int, int]] = {}
    for r, acts in enumerate(sched.ranks):
        for a in acts:
            need[a] = {}
            for src, producer in reads_of[a]:
                need[a][src] = max(need[a].get(src, -1), where[src, r, producer].index)
    end = _end_times(sched, lambda a: [p for _, p in reads_of.get(a, [])])
    transfers = sorted(where.values(), key=lambda t: (end[t.action], t.src, t.dst, t.index))
    groups = tuple(_rank_groups(r, acts, end, transfers) for r, acts in enumerate(sched.ranks))
    return CommPlan(groups, need)


_UNIT_COST = {"F": 1, "B": 2, "I": 1, "W": 1}


def _end_times(sched: Schedule, deps: Callable[[Action], list[Action]]) -> dict[Action, int]:
    """When each action ends if each rank runs its list in order, an action starting once its
    rank is free and what it reads has ended (any order keeping those gives the same times)."""
    free = [0] * sched.pp
    end: dict[Action, int] = {}
    rank = {a: r for r, acts in enumerate(sched.ranks) for a in acts}
    for a in execution_order(sched, deps):
        start = max([free[rank[a]], *(end[d] for d in deps(a))])
        end[a] = free[rank[a]] = start + _UNIT_COST[a.kind]
    return end


def _rank_groups(
    r: int, acts: Sequence[Action], end: dict[Action, int], transfers: list[Transfer]
) -> tuple[CommGroup, ...]:
    """Rank r's groups: after each action (or before the first), r's operations in `transfers`
    (sorted by time) timed before the next action's end (comm_plan)."""
    mine = [t for t in transfers if r in (t.src, t.dst)]
    groups: list[CommGroup] = []
    k = 0
    for i in range(-1, len(acts)):
        until = end[acts[i + 1]] if i + 1 < len(acts) else None
        batch = []
        while k < len(mine) and (until is None or end[mine[k].action] < until):
            batch.append(mine[k])
            k += 1
        sends = tuple(t for t in batch if t.src == r)
        recvs = tuple(t for t in batch if t.dst == r)
        if batch:
            groups.append(CommGroup(r, len(groups), acts[i] if i >= 0 else None, sends, recvs))
    return tuple(groups)


def chain_plan(
    sched: Schedule, deps: Callable[[Action], list[Action]], build: Callable[..., CommPlan] | None = None
) -> CommPlan:
    """The plan `sched` implies for a standard stage chain: each dependency `deps(a)` on another
    rank is one bundle, sent by the action depended on to `a`'s rank. `build` (default
    `comm_plan`) orders the transfers."""
    readers: dict[Action, list[int]] = defaultdict(list)
    for r, acts in enumerate(sched.ranks):
        for a in acts:
            for d in deps(a):
                q = sched.stage_rank[d.stage]
                if q != r and r not in readers[d]:
                    readers[d].append(r)

    def sends(a: Action, r: int) -> list[tuple[int, Sequence[str]]]:
        return [(q, ()) for q in readers.get(a, [])]

    def reads(a: Action, r: int) -> list[tuple[int, Action]]:
        return [(sched.stage_rank[d.stage], d) for d in deps(a) if sched.stage_rank[d.stage] != r]

    return (build or comm_plan)(sched, sends, reads)


# -- replay under in-order streams ------------------------------------------------------------


def _replay_streams(plan: CommPlan) -> tuple[list[deque[CommGroup]], set[Key]]:
    """Pops groups as the NOTE's rule allows; returns each rank's groups left (all empty: no
    hang) and the operations that completed."""
    queues = [deque(gs) for gs in plan.groups]
    done: set[Key] = set()
    moved = True
    while moved:
        moved = False
        heads = {r: set(q[0].keys()) for r, q in enumerate(queues) if q}
        for r, keys in heads.items():
            done.update(k for k in keys if k in heads.get(k[1] if k[0] == r else k[0], ()))
        for q in queues:
            while q and all(k in done for k in q[0].keys()):
                q.popleft()
                moved = True
    return queues, done


def stream_deadlock(plan: CommPlan) -> str | None:
    """None if every rank's groups complete under in-order streams (the module NOTE); else which
    ranks wait for which, in a cycle, naming the stuck groups and their actions."""
    left, done = _replay_streams(plan)
    stuck = {r: q[0] for r, q in enumerate(left) if q}
    if not stuck:
        return None
    waits: dict[int, tuple[Transfer, CommGroup]] = {}
    for r, g in stuck.items():
        t = next(t for t in (*g.sends, *g.recvs) if t.key not in done)
        waits[r] = (t, _other_group(plan, t, r))
    parts = []
    for r in _cycle(waits):
        t, theirs = waits[r]
        q = theirs.rank
        op = f"send of {t.action} to rank {q}" if t.src == r else f"receive of {t.action} from rank {q}"
        parts.append(
            f"rank {r} is stuck at its {stuck[r]}: its {op} pairs with rank {q}'s group "
            f"{theirs.position}, queued behind rank {q}'s {stuck[q]}"
        )
    return (
        "the ranks' communication deadlocks on in-order streams (NCCL runs each rank's groups of "
        "sends and receives in issue order, and a receive blocks the groups behind it): "
        + "; ".join(parts)
        + "; reorder these ranks' actions so that each sends what its peer waits for before it "
        "waits itself."
    )


def _other_group(plan: CommPlan, t: Transfer, r: int) -> CommGroup:
    """The group holding the other side of transfer `t` (r is one side)."""
    peer = t.dst if t.src == r else t.src
    for g in plan.groups[peer]:
        if t.key in g.keys():
            return g
    raise ValueError(
        f"communication plan: rank {r}'s transfer of {t.action} (rank {t.src} -> rank {t.dst}, "
        f"#{t.index} on that channel) has no matching operation on rank {peer}; this is a bug in fpipe."
    )


def _cycle(waits: dict[int, tuple[Transfer, CommGroup]]) -> list[int]:
    """The wait-for cycle reached from the lowest stuck rank (each stuck rank waits for a stuck one)."""
    seen: list[int] = []
    r = min(waits)
    while r not in seen:
        seen.append(r)
        r = waits[r][1].rank
    return seen[seen.index(r) :]
