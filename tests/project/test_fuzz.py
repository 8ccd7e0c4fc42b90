"""The differential fuzzer's CI tier (tests/fuzz, docs/FUZZING.md): a fixed range of random
programs x settings, each against the unsplit function under torch.func in float64 (loss, aux,
gradients, buffers, the step after a save/load round trip). In one process, and a batch of
multi-rank examples (pp = 2, dp = 2 on gloo) in one shared torchrun launch.

A failure prints each failing example's signature, its program and the command that runs it
again; `python -m tests.fuzz --seed 0 --start K --examples 1` shrinks it.
"""

from __future__ import annotations

import collections
import multiprocessing

import pytest
from fuzz.campaign import Result, groups, run_in_workers, summary
from fuzz.check import run_example
from fuzz.dist import launch
from fuzz.grammar import FEATURES, Example, draw
from fuzz.shrink import program_text, snippet

import fpipe

SEED = 0
EXAMPLES = 300  # each in one process (two worker processes share them), checked in CHUNK-sized tests
CHUNK = 50
JOBS = 2  # the examples are single-threaded Python: one worker per core of a 2-core CI machine
DIST_EXAMPLES = 12  # on 2 ranks, one torchrun launch
RANKS = 2

# Left out of the CI draw, each with the reason (docs/FUZZING.md lists them). A feature, or
# features joined by "+": an example with all of them is drawn again without the last one.
# Empty: every feature and combination is fuzzed.
EXCLUDED: dict[str, str] = {}
ENABLED = set(FEATURES) - {k for k in EXCLUDED if "+" not in k}


def ci_draw(i: int, world: int = 1) -> Example:
    """Example i of the CI range: drawn again without an excluded combination's last feature
    until it holds no excluded combination."""
    features = set(ENABLED)
    ex = draw(SEED, i, features, world)
    while hit := [c for c in (k.split("+") for k in EXCLUDED if "+" in k) if set(c) <= ex.features]:
        features.discard(hit[0][-1])
        ex = draw(SEED, i, features, world)
    return ex


def test_exclusions_are_named_features_with_a_reason():
    for key, why in EXCLUDED.items():
        assert set(key.split("+")) <= set(FEATURES) and why.strip(), (key, why)


def _verdict(results: list[Result]) -> str:
    lines = [summary(results)]
    for sig, rs in groups(results).items():
        ex = rs[0].ex
        lines += [f"\n-- {sig}", ex.describe(), program_text(ex), rs[0].outcome.detail[:1200], snippet(ex)]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def in_one_process() -> list[Result]:
    """Every example of the one-process range, each run whole in one process, by JOBS worker
    processes at once (spawned: a fork of the test process would inherit its threads)."""
    exs = [ci_draw(i) for i in range(EXAMPLES)]
    if multiprocessing.cpu_count() < 2:
        return [Result(ex, run_example(ex), 0.0) for ex in exs]
    return run_in_workers(exs, JOBS)


@pytest.mark.parametrize("start", range(0, EXAMPLES, CHUNK))
def test_fuzz_in_one_process(in_one_process, start):
    results = in_one_process[start : start + CHUNK]
    assert [r.ex for r in results] == [ci_draw(i) for i in range(start, start + CHUNK)]
    assert not groups(results), _verdict(results)
    assert collections.Counter(r.outcome.status for r in results)["ok"] >= CHUNK // 2, _verdict(results)


def test_fuzz_on_ranks(tmp_path):
    exs = [ci_draw(i, RANKS) for i in range(DIST_EXAMPLES)]
    results = [Result(ex, o, 0.0) for ex, o in zip(exs, launch(exs, tmp_path, RANKS, deadline_s=400.0))]
    assert {(r.ex.dp, r.ex.pp) for r in results} == {(1, 2), (2, 1)}
    assert not groups(results), _verdict(results)


def test_the_ci_range_covers_every_enabled_feature():
    """The fixed range exercises each enabled feature (and every schedule) at least 5 times."""
    exs = [ci_draw(i) for i in range(EXAMPLES)] + [ci_draw(i, RANKS) for i in range(DIST_EXAMPLES)]
    feats = collections.Counter(f for ex in exs for f in ex.features)
    assert all(feats[f] >= 5 for f in ENABLED), feats
    assert not [ex for ex in exs for k in EXCLUDED if set(k.split("+")) <= ex.features]
    assert {ex.schedule for ex in exs} == set(fpipe.schedules.names())


# -- the fuzzer itself --------------------------------------------------------------------------
def test_an_example_is_a_function_of_seed_index_and_features():
    some = {"buffer_rw", "boundaries", "int_aux"}
    for i in range(40):
        assert draw(7, i, some) == draw(7, i, some)
        ex = draw(7, i, some)
        assert ex.features <= some, (ex, ex.features)
    assert len({draw(7, i, some) for i in range(40)}) > 30


def test_a_mismatch_of_dtype_value_or_presence_is_a_failure():
    import torch
    from fuzz.check import compare, problems_outcome

    out: list = []
    compare("step1:aux", {"n": torch.tensor(4.0)}, {"n": torch.tensor(4)}, out)
    compare(
        "step1:loss",
        torch.tensor(1.0, dtype=torch.float64) + 1e-6,
        torch.tensor(1.0, dtype=torch.float64),
        out,
    )
    compare("step1:grads", {"w": None}, {"w": torch.zeros(2)}, out)
    compare(
        "step1:buffers",
        {"b": torch.ones(2, dtype=torch.float64)},
        {"b": torch.ones(2, dtype=torch.float64)},
        out,
    )
    o = problems_outcome(out)
    assert o.status == "fail" and o.signature.split() == [
        "step1:aux.n:dtype", "step1:grads:missing", "step1:loss:value"
    ], o  # fmt: skip


def test_shrinking_keeps_the_failure_and_drops_the_rest():
    from fuzz.check import Outcome
    from fuzz.shrink import shrink

    def run(cands):  # a planted bug: a written buffer read under a memory limit
        bad = [("buf_rw" in c.layers and c.limit is not None) for c in cands]
        return [Outcome("fail", "step1:grads:value") if b else Outcome("ok") for b in bad]

    ex = next(
        e
        for i in range(200)
        if len((e := draw(0, i, ENABLED)).layers) >= 3 and e.limit and "buf_rw" in e.layers
    )
    small, o, runs = shrink(ex, run([ex])[0], run, batch=False)
    assert o.status == "fail" and small.layers == ("buf_rw",) and small.limit is not None, small
    assert small.cuts == () and small.aux == () and not small.grad_x and small.microbatches == 1, small
