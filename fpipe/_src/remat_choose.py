"""Choosing what to recompute: the least recomputation that brings a rank's step under a limit.

# NOTE [meeting a memory limit]
`pipeline(..., memory_limit=bytes)`: after the split and the schedule, `choose` starts from the
plan that keeps every saved value (with the values of `torch.utils.checkpoint` regions already
recomputed, remat.py) and predicts this rank's peak (memory.py: the held values per microbatch
in flight, the running program's own peak -- the recomputation inside a backward included --
and the zero-bubble W halves' inputs). While the peak is over the limit it drops more values
(remat.py's drops), best first by

    bytes of the value x microbatches of its stage held at the peak / cost of recomputing it

(`partition.node_cost` of the copied operations) -- against the limit less a 10 % headroom
(`HEADROOM_PARTS`: what the prediction does not see) -- so a stage holding more microbatches (1F1B's
stage i holds min(p - i, m)) recomputes first and a stage holding one recomputes last; each
round drops enough to cover the predicted excess, then predicts again. Once under the limit it
takes drops back (up to six, the least bytes per cost first) while the step stays under. The choice is greedy -- not a min-cut -- and every step of it is checked by the
prediction, never assumed. A limit the prediction says no set of drops meets is a ValueError
before anything runs, naming the least peak found and the limit. Each rank chooses for its own
stages (the other ranks' programs do not change what it sends or receives: a drop only adds
readers on the stage's own rank).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .memory import MemoryReport
from .partition import node_cost
from .remat import Drop, apply, candidates, checkpointed, recompute_nodes
from .staged import Staged

__all__ = ["choose"]

Predict = Callable[[Staged], MemoryReport]
# The share of the limit kept free for what the prediction does not see (allocator slack, kernel
# workspaces, what the send thread holds longer than modelled): measured on CPU, the prediction
# ran up to 6.7 % under the resident-set growth (a 2-rank ZBV step of 18 MB, tests/test_memory.py),
# so a plan predicted just under the limit could exceed it.
HEADROOM_PARTS = 10  # 1/10th: 10 %
_TRIALS = 6  # drops `_prune` tries to take back


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def choose(call: str, base: Staged, limit: int | None, predict: Predict, stages: Iterable[int]) -> Staged:
    """The staged programs to run: `base` with checkpointed regions recomputed, and, under a
    `limit` in bytes, the further drops NOTE [meeting a memory limit] chooses."""
    forced, memo = set(checkpointed(base)), dict[Any, Any]()
    st = apply(base, forced, memo) if forced else base
    if limit is None:
        return st
    target = limit * (HEADROOM_PARTS - 1) // HEADROOM_PARTS
    report = predict(st)
    if report.peak <= target:
        return st
    pool = [c for c in candidates(base, stages) if c not in forced]
    cost = {c: _cost(base, c) for c in pool}
    drops, best = set(forced), report
    while report.peak > target:
        batch = _batch(base, pool, drops, cost, report, report.peak - target)
        if not batch:
            break
        drops |= batch
        st = apply(base, drops, memo)
        report = predict(st)
        best = min(best, report, key=lambda r: r.peak)
    if report.peak > target:
        everything = predict(apply(base, {*forced, *pool}, memo))
        best = min(best, everything, key=lambda r: r.peak)
        rank = best.stages[0].rank if best.stages else 0
        least = -(
            -best.peak * HEADROOM_PARTS // (HEADROOM_PARTS - 1)
        )  # the least limit whose target it meets
        raise ValueError(
            f"{call}: memory_limit={limit} bytes ({_mib(limit)}) cannot be met on pipeline rank "
            f"{rank}: recomputing in the backward what fpipe can, the least this rank's step "
            f"needs is {best.peak} bytes ({_mib(best.peak)}, peak during {best.at}), so the "
            f"least limit fpipe can meet is memory_limit={least} (it keeps {1 / HEADROOM_PARTS:.0%} below "
            "the limit for what its prediction does not see). Raise the limit, or hold less: more "
            "stages, more microbatches (smaller ones), or a schedule that keeps fewer "
            "microbatches in flight ('1f1b' rather than 'gpipe' or 'zb-h1')."
        )
    return _prune(base, drops - forced, forced, cost, target, predict, memo)


def _cost(st: Staged, d: Drop) -> float:
    p, v = d
    walk = recompute_nodes(st.programs[st.producer[v]], [v], set(st.programs[p].inputs) - {v})
    return 1.0 + sum(node_cost(n) for n in walk.copy)


def _bytes(st: Staged, v: str) -> int:
    shape, dtype = st.meta[v][:2] if v in st.meta else ((), None)
    if dtype is None:
        return 0
    n = 1
    for s in shape:
        n *= int(s)
    return n * dtype.itemsize


def _score(st: Staged, d: Drop, cost: dict[Drop, float], flight: dict[int, int]) -> float:
    return _bytes(st, d[1]) * flight.get(d[0][1], 0) / cost[d]


def _batch(
    st: Staged, pool: list[Drop], drops: set[Drop], cost: dict[Drop, float], report: MemoryReport, excess: int
) -> set[Drop]:
    """The best-scoring drops whose values' bytes x microbatches in flight cover `excess`."""
    flight = {s.stage: s.in_flight for s in report.stages}
    ranked = sorted(
        (c for c in pool if c not in drops and flight.get(c[0][1], 0) > 0),
        key=lambda c: (-_score(st, c, cost, flight), c),
    )
    out: set[Drop] = set()
    covered = 0
    for c in ranked:
        if covered >= excess:
            break
        out.add(c)
        covered += _bytes(st, c[1]) * flight[c[0][1]]
    return out


def _prune(
    base: Staged,
    chosen: set[Drop],
    forced: set[Drop],
    cost: dict[Drop, float],
    limit: int,
    predict: Predict,
    memo: dict[Any, Any],
) -> Staged:
    """Take drops back, the least saving per cost first, while the step stays under `limit`."""
    keep = set(chosen)
    st = apply(base, {*forced, *keep}, memo)
    order = sorted(chosen, key=lambda c: (_bytes(base, c[1]) / cost[c], c))
    for c in order[:_TRIALS]:  # a bounded number of predictions
        trial = apply(base, {*forced, *(keep - {c})}, memo)
        if predict(trial).peak <= limit:
            keep.discard(c)
            st = trial
    return st
