"""Failures and agreement, in one process: the NCCL wait loop on fake works, per-pipeline store
namespaces, the staged-program fingerprint (deterministic across processes, sensitive to what a
rank-dependent branch changes) and the refusal of concurrent calls. The multi-process side is in
tests/runtime/test_trust_dist.py."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fpipe
from fpipe._src.runtime import dist as fdist
from fpipe._src.runtime.agree import fingerprint, part_name

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda")  # only the device type is read: the polling (NCCL) path, on fake works


class _DoneAfter:
    """A work that completes `after` seconds after it was made; counts its polls and waits."""

    def __init__(self, after: float) -> None:
        self.at = time.monotonic() + after
        self.polls = 0
        self.waited_at: float | None = None

    def is_completed(self) -> bool:
        self.polls += 1
        return time.monotonic() >= self.at

    def wait(self, timeout: Any = None) -> bool:
        assert self.is_completed(), "wait() (the stream order) must come after completion"
        self.waited_at = time.monotonic()
        return True


class _Never(_DoneAfter):
    def __init__(self) -> None:
        super().__init__(1e9)


def _group(rank: int = 0, namespace: str = "fpipe/test/0") -> fdist.PPGroup:
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    return fdist.PPGroup(None, rank, 3, CUDA, store, namespace)


@pytest.fixture(autouse=True)
def _no_exit_hook(monkeypatch):
    monkeypatch.setattr(fdist, "exit_hard_after_failure", lambda: None)  # leave pytest's hooks alone


def test_polling_wait_returns_when_the_works_complete_without_spinning():
    pg = _group()
    works = [_DoneAfter(0.3), _DoneAfter(0.1)]
    wall, cpu = time.monotonic(), time.process_time()
    pg.wait_all(works, 5.0, lambda: "waiting in a test", peer=1)
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    assert 0.3 <= wall < 1.0, wall
    assert all(w.waited_at is not None for w in works)
    assert works[0].polls < 3000, works[0].polls  # ~1 ms apart at most once backed off
    assert cpu < 0.5 * wall, (cpu, wall)  # sleeps between polls: no busy spin


def test_polling_wait_times_out_naming_the_peer_within_the_deadline():
    pg = _group(rank=0)
    start = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        pg.wait_all([_DoneAfter(0.0), _Never()], 0.5, lambda: "at action F1.0 waiting for rank 1", peer=1)
    took = time.monotonic() - start
    assert 0.5 <= took < 1.5, took
    assert str(err.value) == (
        "fpipe rank 0: timed out after 0.5 s at action F1.0 waiting for rank 1; rank 1 is not "
        "responding (stopped, stuck, or far slower). Raise pipeline(..., timeout=...) if it is only slow."
    )
    assert pg.failure() == str(err.value), "the timeout is reported for the other ranks"


def test_polling_wait_raises_a_peer_failure_with_the_stores_report():
    pg = _group(rank=0)
    report = "rank 2 failed at action F2.1 (stage 2, microbatch 1): RuntimeError: boom"
    threading.Timer(0.2, lambda: _group_view(pg, 2).report_failure(report)).start()
    start = time.monotonic()
    with pytest.raises(fdist.PeerFailure) as err:
        pg.wait_all([_Never()], 30.0, lambda: "at action B0.1 waiting for rank 1", peer=1)
    assert time.monotonic() - start < 2.0, "a reported failure ends the wait long before the deadline"
    assert str(err.value) == f"fpipe rank 0: stopping while at action B0.1 waiting for rank 1: {report}"


def _group_view(pg: fdist.PPGroup, rank: int) -> fdist.PPGroup:
    """Another rank's view of the same pipeline (same store, namespace and call)."""
    return fdist.PPGroup(None, rank, pg.size, pg.device, pg.store, pg.namespace, pg.generation)


def test_failure_reports_and_wait_records_are_per_pipeline():
    a, b = _group(namespace="fpipe/g/0"), _group(namespace="fpipe/g/1")
    b.store = a.store  # one job's store, two pipelines
    a.report_failure("pipeline a failed")
    assert a.failure() == "pipeline a failed"
    assert b.failure() is None
    b.wait_all([_DoneAfter(0.05)], 5.0, lambda: "b waits", peer=1)  # not stopped by a's report
    assert a.waits_key(1) != b.waits_key(1)


def test_namespaces_differ_per_group_and_per_pipeline(monkeypatch):
    monkeypatch.setattr(fdist.dist, "get_process_group_ranks", lambda group: group)
    monkeypatch.setattr(fdist, "_SEQ", {})
    first, second = fdist.namespace_for([0, 1]), fdist.namespace_for([0, 1])
    replica = fdist.namespace_for([2, 3])  # a dp replica's pipeline group
    assert len({first, second, replica}) == 3
    assert first.endswith("/0") and second.endswith("/1") and replica.endswith("/0")
    monkeypatch.setattr(fdist, "_SEQ", {})
    assert fdist.namespace_for([0, 1]) == first, "the same on every rank that makes the same calls"


# -- the staged-program fingerprint ----------------------------------------------------------------

_FINGERPRINT = """
import json, sys, torch, fpipe
from fpipe._src.runtime.agree import fingerprint
prints = []
for scale in map(float, sys.argv[1:]):
    def f(w, x):
        h = fpipe.stage_boundary(torch.tanh(x @ w))
        return (h * scale @ w).pow(2).mean()
    piped = fpipe.pipeline(f, microbatches=2)
    fpipe.value_and_grad(piped)(torch.randn(4, 4), torch.randn(6, 4))
    prints.append(fingerprint(piped._last.staged, piped._last.runner.schedule))
print(json.dumps(prints))
"""


def _fingerprints_in_processes(*runs: tuple[str, tuple[float, ...]]) -> list[list[dict[str, int]]]:
    """Per (hash seed, scales): the fingerprints one fresh process computes. The processes run at
    once (each spends most of its time importing torch and fpipe)."""
    procs = []
    for hashseed, scales in runs:
        env = dict(os.environ, PYTHONHASHSEED=hashseed, PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-c", _FINGERPRINT, *map(str, scales)]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, stderr[-3000:]
            outs.append(json.loads(stdout.splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return outs


def test_fingerprint_is_equal_across_processes_and_sees_a_changed_constant():
    (one, other), (two,) = _fingerprints_in_processes(("1", (2.0, 3.0)), ("2", (2.0,)))
    assert one == two, "the fingerprint must not depend on the process (ids, addresses, str hashes)"
    differ = [part_name(k) for k in one if one[k] != other[k]]
    assert differ[0] == "stage 1's forward program", differ


def test_fingerprint_sees_shapes_and_schedule():
    def f(w, x):
        return (fpipe.stage_boundary(x @ w) @ w).sum()

    w = torch.randn(4, 4)
    prints = []
    for schedule, x in (
        ("1f1b", torch.randn(4, 4)),
        ("gpipe", torch.randn(4, 4)),
        ("1f1b", torch.randn(8, 4)),
    ):
        piped = fpipe.pipeline(f, microbatches=2, schedule=schedule)
        fpipe.value_and_grad(piped)(w, x)
        prints.append(fingerprint(piped._last.staged, piped._last.runner.schedule))
    assert prints[0]["the schedule"] != prints[1]["the schedule"]
    assert {k for k in prints[0] if prints[0][k] != prints[2][k]} >= {"the cut into stages", "F0", "F1"}


# -- one call at a time ----------------------------------------------------------------------------


def test_concurrent_calls_of_one_pipeline_are_refused():
    entered, release = threading.Event(), threading.Event()

    def f(w, x):
        entered.set()  # tracing runs f: the first call is inside the pipeline from here on
        assert release.wait(60)
        return (fpipe.stage_boundary(x @ w) @ w).sum()

    piped = fpipe.pipeline(f, microbatches=2, out_axes="sum")
    w, x = torch.randn(3, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    result: dict[str, Any] = {}
    first = threading.Thread(target=lambda: result.update(first=piped(w, x)))
    first.start()
    assert entered.wait(60)
    with pytest.raises(RuntimeError, match=r"pipeline\(f, microbatches=2\): called while another call"):
        piped(w, x)
    release.set()
    first.join(60)
    torch.testing.assert_close(result["first"], f(w, x), rtol=0, atol=1e-12)
    torch.testing.assert_close(piped(w, x), f(w, x), rtol=0, atol=1e-12)  # usable again
