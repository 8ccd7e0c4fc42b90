"""Choosing what to recompute: the least recomputation that brings a rank's step under a limit.

# NOTE [meeting a memory limit]
`pipeline(..., memory_limit=bytes)`: after the split and the schedule, `choose` starts from the
plan that keeps every saved value (with the values of `torch.utils.checkpoint` regions already
recomputed, remat.py) and predicts this rank's peak (memory.py: the held values per microbatch
in flight, the running program's own peak -- the recomputation inside a backward included --
and the zero-bubble W halves' inputs), against the limit less a 15 % headroom
(`HEADROOM_PERCENT`: what the prediction does not see, the bound its accuracy is tested to).
While the peak is over it, `_Search`:

1. keeps each stage's anchors (NOTE [recomputing segment by segment] in remat_segments.py: the
   residual stream between blocks) and drops *units* (the reads that free one storage), best
   first by

       bytes of the storage x microbatches of its stage held at the peak / cost it adds

   (`partition.node_cost` of the operations it adds to the recomputation already chosen,
   stopping at the nearest kept value or anchor) -- so a stage holding more microbatches
   (1F1B's stage i holds min(p - i, m)) recomputes first and a stage holding one last, and a
   cheap value of a kept product (a GELU of a kept matrix product) goes before the product;
   each round drops enough to cover the predicted excess, then predicts again;
2. if every unit is dropped and the peak is still over, lets anchors go: first in patterns
   (every stage keeps one anchor in k, k = 2, 3, 4, at each offset: segments k times longer,
   fewer anchors held per microbatch, more held while a segment's backward runs -- a single
   anchor let go lengthens the longest segment and saves the bytes of one), the best kept if
   the predicted peak falls; then one at a time (the most bytes per cost first), each kept
   only if the predicted peak falls;
3. once under, takes units back (up to `_TRIALS`, the least bytes per cost first) while the
   step stays under.

Every step is checked by the prediction, never assumed; the choice is greedy, not a min-cut. A
limit no plan tried meets is a ValueError before anything runs, naming the least limit that
the least peak found meets. Each rank chooses for its own stages (the other ranks' programs do
not change what it sends or receives: a drop only adds readers on the stage's own rank).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..stages import Staged
from .memory import MemoryReport
from .remat import Drop, Keep, apply, candidates, checkpointed
from .remat_segments import Costs, Unit, anchors, storage_key, units

__all__ = ["HEADROOM_PERCENT", "choose", "least", "least_limit", "target_of"]

Predict = Callable[[Staged], MemoryReport]
# The share of the limit kept free for what the prediction does not see (allocator slack, kernel
# workspaces -- inside a matrix product or an attention kernel, 0.2-0.7 MiB per program in
# tests/memory/test_memory.py's GPT): measured on CPU, the prediction ran up to 13.4 % under the
# resident-set growth of a 2-rank ZBV step of 13 MB under a limit (a loaded CI host; 10 % was
# exceeded), and the prediction is tested to be within 15 %. (What the send thread holds is not
# left to the headroom: under a limit each action's sends complete by the end of the next
# action, as predicted -- `DistRunner.bound_sends`.)
HEADROOM_PERCENT = 15
_TRIALS = 8  # units `_prune` tries to take back


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def choose(call: str, base: Staged, limit: int | None, predict: Predict, stages: Iterable[int]) -> Staged:
    """The staged programs to run: `base` with checkpointed regions recomputed, and, under a
    `limit` in bytes, the further drops NOTE [meeting a memory limit] chooses."""
    forced, memo = set(checkpointed(base)), dict[Any, Any]()
    st = apply(base, forced, memo) if forced else base
    if limit is None:
        return st
    target = target_of(limit)
    report = predict(st)
    if report.peak <= target:
        return st
    search = _Search(base, forced, predict, list(stages), memo, report)
    if search.meet(target):
        return search.prune(target)
    raise _refusal(call, limit, search.best)


def target_of(limit: int) -> int:
    """The peak a plan is chosen to stay under: `limit` less the headroom."""
    return limit * (100 - HEADROOM_PERCENT) // 100


def least_limit(peak: int) -> int:
    """The least limit whose target a predicted `peak` meets."""
    return -(-peak * 100 // (100 - HEADROOM_PERCENT))


def least(base: Staged, predict: Predict, stages: Iterable[int]) -> MemoryReport:
    """The least peak `choose` finds for this rank (what the least limit it meets is made of)."""
    forced, memo = set(checkpointed(base)), dict[Any, Any]()
    report = predict(apply(base, forced, memo) if forced else base)
    search = _Search(base, forced, predict, list(stages), memo, report)
    search.meet(0)
    return search.best


def _refusal(call: str, limit: int, best: MemoryReport) -> ValueError:
    rank = best.stages[0].rank if best.stages else 0
    least = least_limit(best.peak)
    return ValueError(
        f"{call}: memory_limit={limit} bytes ({_mib(limit)}) cannot be met on pipeline rank "
        f"{rank}: recomputing in the backward what fpipe can, the least this rank's step "
        f"needs is {best.peak} bytes ({_mib(best.peak)}, peak during {best.at}), so the "
        f"least limit fpipe can meet is memory_limit={least} (it keeps {HEADROOM_PERCENT}% below "
        "the limit for what its prediction does not see). Raise the limit, or hold less: more "
        "stages, more microbatches (smaller ones), or a schedule that keeps fewer "
        "microbatches in flight ('1f1b' rather than 'gpipe' or 'zb-h1')."
    )


class _Search:
    """One rank's choice (NOTE [meeting a memory limit]): the drops and anchors so far, and the
    predictions made."""

    def __init__(
        self,
        base: Staged,
        forced: set[Drop],
        predict: Predict,
        stages: list[int],
        memo: Any,
        report: MemoryReport,
    ) -> None:
        self.base, self.forced, self.predict_, self.memo = base, forced, predict, memo
        self.keep: Keep = {s: anchors(base, s) for s in stages}
        held = {storage_key(base, s, a): (s, a) for s, names in self.keep.items() for a in names}
        pool = units(base, [c for c in candidates(base, stages) if c not in forced])
        self.units = {k: u for k, u in pool.items() if k not in held}  # step 1
        self.anchors = [(s, a, pool.get(k, (frozenset(), 0))) for k, (s, a) in held.items()]  # step 2
        self.costs = Costs(base, forced)
        self.drops, self.report, self.best = set(forced), report, report
        self.staged = apply(base, forced, memo) if forced else base
        self.best_plan = (self.drops, self.keep, self.staged)

    def predict(self, drops: set[Drop], keep: Keep) -> MemoryReport:
        st = apply(self.base, drops, self.memo, keep)
        report = self.predict_(st)
        if report.peak < self.best.peak:
            self.best, self.best_plan = report, (set(drops), keep, st)
        self.last = st
        return report

    def _flight(self) -> dict[int, int]:
        return {s.stage: s.in_flight for s in self.report.stages}

    def meet(self, target: int) -> bool:
        """Steps 1 and 2: True once the predicted peak is at most `target`."""
        while self.report.peak > target:
            batch = self._batch(self.report.peak - target)
            if not batch:
                break
            self._take(self.drops | batch, self.keep)
        if self.report.peak > target:
            self._release(target)
        if self.report.peak > target:
            self.floor()
        if self.best.peak < self.report.peak:  # an earlier plan was better
            self.report, (self.drops, self.keep, self.staged) = self.best, self.best_plan
        return self.report.peak <= target

    def _take(self, drops: set[Drop], keep: Keep) -> None:
        self.report = self.predict(drops, keep)
        self.drops, self.keep, self.staged = drops, keep, self.last

    def _score(self, unit: Unit, size: int, flight: dict[int, int]) -> float:
        return size * flight.get(_stage(unit), 0) / self.costs.added(unit, self.drops, self.keep)

    def _batch(self, excess: int) -> set[Drop]:
        """Step 1's round: the best-scoring units whose bytes x microbatches in flight cover
        `excess`."""
        flight = self._flight()
        left = [
            (u, n) for u, n in self.units.values() if not u <= self.drops and flight.get(_stage(u), 0) > 0
        ]
        ranked = sorted(left, key=lambda un: (-self._score(un[0], un[1], flight), sorted(un[0])))
        out: set[Drop] = set()
        covered = 0
        for unit, size in ranked:
            if covered >= excess:
                break
            out |= unit
            covered += size * flight[_stage(unit)]
        return out

    def _strided(self) -> None:
        """Step 2's first part: every stage keeps one anchor in k (k = 2, 3, 4, each offset),
        the others let go at once -- segments k times longer, one anchor per segment held (a
        single anchor let go lengthens the longest segment for the bytes of one)."""
        order = {s: _in_order(self.base, s, names) for s, names in self.keep.items()}
        start = (self.report, self.drops, self.keep, self.staged)
        best = start
        for k in (2, 3, 4):
            for offset in range(k):
                keep = {
                    s: frozenset(a for i, a in enumerate(names) if i % k == offset)
                    for s, names in order.items()
                }
                gone = {(s, a) for s, names in order.items() for a in names if a not in keep[s]}
                drops = start[1] | {d for s, a, (u, _) in self.anchors if (s, a) in gone for d in u}
                report = self.predict(drops, keep)
                if report.peak < best[0].peak:
                    best = (report, drops, keep, self.last)
        self.report, self.drops, self.keep, self.staged = best

    def _release(self, target: int) -> None:
        """Step 2: anchors let go one at a time, each kept only if the peak falls."""
        self._strided()
        tried: set[tuple[int, str]] = set()
        while self.report.peak > target:
            flight = self._flight()
            left = [(s, a, u) for s, a, u in self.anchors if (s, a) not in tried and flight.get(s, 0) > 0]
            if not left:
                return
            s, a, (unit, _) = max(left, key=lambda x: (self._anchor_score(x[0], x[1], x[2], flight), x[:2]))
            tried.add((s, a))
            keep = {**self.keep, s: self.keep[s] - {a}}
            drops = self.drops | unit
            report = self.predict(drops, keep)
            if report.peak < self.report.peak:
                self.report, self.drops, self.keep, self.staged = report, drops, keep, self.last

    def _anchor_score(self, s: int, a: str, unit_size: tuple[Unit, int], flight: dict[int, int]) -> float:
        unit, size = unit_size
        keep = {**self.keep, s: self.keep[s] - {a}}
        drops = self.drops | unit
        places = {p for p, _ in drops if p[1] == s}
        cost = sum(
            self.costs.program(p, drops, keep) - self.costs.program(p, self.drops, self.keep) for p in places
        )
        return size * flight.get(s, 0) / (1.0 + cost)

    def prune(self, target: int) -> Staged:
        """Step 3: units taken back, the least bytes per cost first, while under `target`."""
        flight = {s: max(n, 1) for s, n in self._flight().items()}
        chosen = [(u, n) for u, n in self.units.values() if u <= self.drops]
        saving = {
            u: n * flight.get(_stage(u), 1) / self.costs.added(u, self.drops - u, self.keep)
            for u, n in chosen
        }
        for unit, _ in sorted(chosen, key=lambda un: (saving[un[0]], sorted(un[0])))[:_TRIALS]:
            drops = self.drops - unit
            report = self.predict(drops, self.keep)
            if report.peak <= target:
                self.report, self.drops, self.staged = report, drops, self.last
        return self.staged

    def floor(self) -> MemoryReport:
        """The least peak found, trying also every unit and anchor dropped at once (recomputing
        back to the stage's inputs)."""
        every = {*self.drops, *(d for u, _ in self.units.values() for d in u)}
        every |= {d for _, _, (u, _) in self.anchors for d in u}
        self.predict(every, {})
        return self.best


def _in_order(st: Staged, s: int, names: frozenset[str]) -> list[str]:
    """`names` (values of stage s's F) in the order F makes them."""
    return [n.name for n in st.programs["F", s].gm.graph.nodes if n.name in names]


def _stage(unit: Unit) -> int:
    return next(iter(unit))[0][1]
