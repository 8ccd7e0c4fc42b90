"""The differential fuzzer's CI tier (tests/fuzz, docs/FUZZING.md): a fixed range of random
programs x settings, each against the unsplit function under torch.func in float64 (loss, aux,
gradients, buffers, the step after a save/load round trip). In one process, and a batch of
multi-rank examples (pp = 2, dp = 2 on gloo) in one shared torchrun launch.

A failure prints each failing example's signature, its program and the command that runs it
again; `python -m tests.fuzz --seed 0 --start K --examples 1` shrinks it.
"""

from __future__ import annotations

import collections

import pytest
from fuzz.campaign import Result, groups, summary
from fuzz.check import run_example
from fuzz.dist import launch
from fuzz.grammar import FEATURES, draw
from fuzz.shrink import program_text, snippet

import fpipe

SEED = 0
EXAMPLES = 300  # in one process, in CHUNK-sized tests
CHUNK = 50
DIST_EXAMPLES = 12  # on 2 ranks, one torchrun launch
RANKS = 2

# Features left out of the CI draw, each with the reason. Empty: every feature is fuzzed.
EXCLUDED: dict[str, str] = {}
ENABLED = set(FEATURES) - set(EXCLUDED)


def _verdict(results: list[Result]) -> str:
    lines = [summary(results)]
    for sig, rs in groups(results).items():
        ex = rs[0].ex
        lines += [f"\n-- {sig}", ex.describe(), program_text(ex), rs[0].outcome.detail[:1200], snippet(ex)]
    return "\n".join(lines)


@pytest.mark.parametrize("start", range(0, EXAMPLES, CHUNK))
def test_fuzz_in_one_process(start):
    results = []
    for i in range(start, start + CHUNK):
        ex = draw(SEED, i, ENABLED)
        results.append(Result(ex, run_example(ex), 0.0))
    assert not groups(results), _verdict(results)
    assert collections.Counter(r.outcome.status for r in results)["ok"] >= CHUNK // 2, _verdict(results)


def test_fuzz_on_ranks(tmp_path):
    exs = [draw(SEED, i, ENABLED, RANKS) for i in range(DIST_EXAMPLES)]
    results = [Result(ex, o, 0.0) for ex, o in zip(exs, launch(exs, tmp_path, RANKS, deadline_s=400.0))]
    assert {(r.ex.dp, r.ex.pp) for r in results} == {(1, 2), (2, 1)}
    assert not groups(results), _verdict(results)


def test_the_ci_range_covers_every_enabled_feature():
    """The fixed range exercises each enabled feature (and every schedule) at least 5 times."""
    exs = [draw(SEED, i, ENABLED) for i in range(EXAMPLES)] + [
        draw(SEED, i, ENABLED, RANKS) for i in range(DIST_EXAMPLES)
    ]
    feats = collections.Counter(f for ex in exs for f in ex.features)
    assert all(feats[f] >= 5 for f in ENABLED), feats
    assert {ex.schedule for ex in exs} == set(fpipe.schedules.names())
