"""Processes end cleanly with sends still pending after a failure (NOTE [threads at exit] in
fpipe/_src/runtime/exiting.py). Three pairs of ranks, launched at once, each rank leaving a send the
other never receives; every process must end with status 0 and no abort, within the bound."""

from __future__ import annotations

from dist_launch import kill, report, start_ranks, wait_all

PAIRS = 3
DEADLINE_S = 120.0


def test_pending_sends_do_not_abort_processes_at_exit(tmp_path):
    procs, stores = [], []
    try:
        for i in range(PAIRS):
            ps, store = start_ranks("exit_race_worker.py", 2, tmp_path / f"pair{i}")
            procs += ps
            stores.append(store)
        wait_all(procs, DEADLINE_S)
    finally:
        kill(procs)
    assert [p.rc for p in procs] == [0] * len(procs), report(procs)
    for p in procs:
        assert "terminate called" not in p.text(), report([p])
        assert "ends" in p.text(), report([p])
