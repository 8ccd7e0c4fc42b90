"""A campaign: run a range of examples, count what they covered, group failures by signature,
shrink one failing example per group and print it (`python -m tests.fuzz --help`)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import multiprocessing
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from .check import Outcome, run_example
from .grammar import FEATURES, Example, draw, parse
from .shrink import program_text, shrink, snippet


@dataclasses.dataclass
class Result:
    ex: Example
    outcome: Outcome
    seconds: float


@dataclasses.dataclass
class Campaign:
    seed: int
    features: set[str]
    examples: int = 100
    start: int = 0
    dist: int = 0  # multi-rank examples, all in one launch
    world: int = 2
    jobs: int = 1
    log: Callable[[str], None] = print
    record: Path | None = None  # a JSON line per example, written as it finishes
    deadline_s: float | None = None  # start no in-process example after this many seconds
    results: list[Result] = dataclasses.field(default_factory=list)

    def run(self) -> list[Result]:
        """The multi-rank batch first (one launch), then the in-process examples (to the deadline)."""
        t0 = time.monotonic()
        if self.dist:
            self._run_dist()
        idx = range(self.start, self.start + self.examples)
        stop = None if self.deadline_s is None else t0 + self.deadline_s
        exs = (draw(self.seed, i, self.features) for i in idx if stop is None or time.monotonic() < stop)
        done = 0
        for done, r in enumerate(_run_all(exs, self.jobs), 1):
            self.results.append(r)
            self._record(r)
            if done % 50 == 0 or done == self.examples:
                self.log(f"[{done}/{self.examples}] {_counts(self.results)}  {time.monotonic() - t0:.0f} s")
        if done < self.examples:
            self.log(f"deadline: {done} of {self.examples} in-process examples run")
        return self.results

    def _run_dist(self) -> None:
        exs = [
            draw(self.seed, i, self.features, self.world) for i in range(self.start, self.start + self.dist)
        ]
        t1 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="fpipe-fuzz-dist-") as tmp:
            outs = run_dist(exs, Path(tmp), self.world)
        each = (time.monotonic() - t1) / max(1, len(exs))
        for ex, o in zip(exs, outs):
            self.results.append(Result(ex, o, each))
            self._record(self.results[-1])
        took = time.monotonic() - t1
        self.log(f"[{len(exs)} on {self.world} ranks, one launch] {_counts(self.results)}  {took:.0f} s")

    def _record(self, r: Result) -> None:
        if self.record is not None:
            with open(self.record, "a") as f:
                f.write(json.dumps(to_json(r)) + "\n")


def to_json(r: Result) -> dict[str, Any]:
    return {"example": r.ex.describe(), "outcome": dataclasses.asdict(r.outcome), "seconds": r.seconds}


def from_json(d: dict[str, Any]) -> Result:
    o = d["outcome"]
    return Result(parse(d["example"]), Outcome(**{**o, "warnings": tuple(o["warnings"])}), d["seconds"])


def read_record(path: Path) -> list[Result]:
    return [from_json(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def run_dist(exs: list[Example], tmp: Path, world: int) -> list[Outcome]:
    from .dist import launch

    return launch(exs, tmp, world)


def _one(ex: Example) -> Result:
    t = time.monotonic()
    o = run_example(ex)
    return Result(ex, o, time.monotonic() - t)


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


def _run_all(exs: Iterable[Example], jobs: int) -> Iterator[Result]:
    if jobs <= 1:
        yield from map(_one, exs)
        return
    it = iter(exs)  # handed over a batch at a time, so the generator's deadline is read as it goes
    with multiprocessing.get_context("fork").Pool(
        jobs, initializer=_init_worker, maxtasksperchild=200
    ) as pool:
        while batch := list(itertools.islice(it, 8 * jobs)):
            yield from pool.imap(_one, batch, chunksize=2)


def run_in_workers(exs: list[Example], jobs: int) -> list[Result]:
    """`exs` run by `jobs` spawned worker processes (a clean interpreter each: safe to start
    from a process that already ran threads, as a test session has), results in order."""
    with multiprocessing.get_context("spawn").Pool(jobs, initializer=_init_worker) as pool:
        return pool.map(_one, exs, chunksize=5)


def _counts(results: list[Result]) -> str:
    c = collections.Counter(r.outcome.status for r in results)
    return " ".join(f"{k}={c[k]}" for k in ("ok", "fail", "refused"))


# -- the summary ----------------------------------------------------------------------------------
def groups(results: list[Result]) -> dict[str, list[Result]]:
    out: dict[str, list[Result]] = collections.defaultdict(list)
    for r in results:
        if r.outcome.status == "fail":
            out[r.outcome.signature].append(r)
    return dict(sorted(out.items(), key=lambda kv: -len(kv[1])))


def summary(results: list[Result]) -> str:
    lines = [
        f"examples: {len(results)} ({_counts(results)}), {sum(r.seconds for r in results):.0f} s of runs"
    ]
    feats = collections.Counter(f for r in results for f in r.ex.features)
    failed = collections.Counter(f for r in results if r.outcome.status == "fail" for f in r.ex.features)
    lines.append("features covered (examples / of them failing):")
    for f in FEATURES + ("dp",):
        lines.append(f"  {f:14s} {feats[f]:6d} / {failed[f]}")
    sched = collections.Counter(r.ex.schedule for r in results)
    lines.append("schedules: " + ", ".join(f"{k} {v}" for k, v in sorted(sched.items())))
    mbs = collections.Counter(r.ex.microbatches for r in results)
    stages = collections.Counter(r.ex.n_stages for r in results)
    lines.append("microbatches: " + ", ".join(f"{k}: {v}" for k, v in sorted(mbs.items())))
    lines.append("stages: " + ", ".join(f"{k}: {v}" for k, v in sorted(stages.items())))
    refused = collections.Counter(r.outcome.signature for r in results if r.outcome.status == "refused")
    for sig, n in refused.items():
        lines.append(f"refused ({n}): {sig}")
    warned = collections.Counter(w for r in results for w in r.outcome.warnings)
    for w, n in warned.most_common(8):
        lines.append(f"warned ({n} examples): {w}")
    gs = groups(results)
    lines.append(f"failures: {sum(len(v) for v in gs.values())} in {len(gs)} signature group(s)")
    for sig, rs in gs.items():
        idx = ", ".join(str(r.ex.index) + ("d" if r.ex.dp * r.ex.pp > 1 else "") for r in rs[:12])
        lines.append(f"  [{len(rs)}] {sig[:300]}\n      examples: {idx}{' ...' if len(rs) > 12 else ''}")
    return "\n".join(lines)


def shrink_groups(
    results: list[Result],
    world: int,
    budget: int,
    log: Callable[[str], None] = print,
    most: int | None = None,
) -> list[Any]:
    """Shrink the smallest failing example of each signature group (of the `most` largest);
    print each result."""
    found = []
    for sig, rs in list(groups(results).items())[:most]:
        r = min(rs, key=lambda r: (len(r.ex.layers), r.ex.index))
        multi = r.ex.dp * r.ex.pp > 1
        if multi:
            tmp = Path(tempfile.mkdtemp(prefix="fpipe-fuzz-shrink-"))
            counter = iter(range(10**6))

            def run(cands: list[Example], tmp: Path = tmp, counter: Any = counter) -> list[Outcome]:
                return run_dist(cands, tmp / str(next(counter)), world)
        else:

            def run(cands: list[Example]) -> list[Outcome]:
                return [run_example(c) for c in cands]

        ex, o, runs = shrink(r.ex, r.outcome, run, batch=multi, budget=budget)
        found.append((sig, len(rs), ex, o))
        log(f"\n== failure group ({len(rs)} examples): {sig[:300]}")
        log(f"shrunk from example {r.ex.index} in {runs} runs to:\n  {ex.describe()}")
        log(program_text(ex))
        log("  what differs:\n    " + o.detail[:1500].replace("\n", "\n    "))
        log(f"  reproduce: {snippet(ex)}")
    return found


def parse_features(features: str | None, without: str | None) -> set[str]:
    on = set(FEATURES) if not features else {f.strip() for f in features.split(",") if f.strip()}
    off = {f.strip() for f in (without or "").split(",") if f.strip()}
    unknown = (on | off) - set(FEATURES)
    if unknown:
        sys.exit(f"unknown feature(s) {sorted(unknown)}; known: {', '.join(FEATURES)}")
    return on - off
