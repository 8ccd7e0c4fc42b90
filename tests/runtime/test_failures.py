"""Failures never hang: a rank that raises, is killed or stops ends every rank, with an error that
names it (NOTE [failures never hang] in fpipe/_src/runtime/dist.py).

Each case is its own launch of `tests/support/dist_fail_worker.py`: 4 ranks, 1F1B, 8 microbatches, stage
s on rank s, the fault in the second step (the first compiles everywhere). The four launches run
at the same time (the stop case spends most of its time waiting for its timeout), each with a hard
deadline, after which everything left is SIGKILLed.

Cases (a)-(c) start bare processes, one per rank, with no launcher: torchrun ends the other
workers as soon as one exits, which would hide whether fpipe's own mechanism ends them. Here only
fpipe can, and each process's exit code and output is its own. The c10d store is served from the
test process, as torchrun's agent serves it. Case (d) is the user's launch: two torchrun "nodes"
on loopback. Times are from the fault (the failing rank writes its wall time just before it) to
each process's exit.
"""

from __future__ import annotations

import datetime
import re
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_launch import free_port, kill, read_json, report, start, start_ranks, torchrun_cmd, wait_all

from fpipe._src.runtime import dist as fdist

WORLD = 4
BOUND_S = 60.0  # every process must be gone this long after the fault
DEADLINE_S = 200.0  # hard limit for all four launches together
TIMEOUT_S = 20  # pipeline(timeout=...) of the stop case
ROOT_CAUSE = "rank 1 failed at action F1.3 (stage 1, microbatch 3): RuntimeError: injected failure on rank 1 at its forward call 3"
CLOSED = "the peer closed the connection; did it crash or get killed?"


class Run:
    """One launch: its processes, the fault record and each rank's exception record."""

    def __init__(self, out: Any, procs: list[Any]) -> None:
        self.out, self.procs = out, procs
        self.fault: dict[str, Any] | None = None
        self.records: dict[int, dict[str, Any]] = {}
        self.stopped_alive: bool | None = None

    def collect(self) -> None:
        if (self.out / "fault.json").exists():
            self.fault = read_json(self.out / "fault.json")
        for r in range(WORLD):
            if (self.out / f"rank{r}.json").exists():
                self.records[r] = read_json(self.out / f"rank{r}.json")

    def exit_after_fault(self, which: list[int]) -> dict[int, float]:
        assert self.fault is not None, "the fault never fired\n" + report(self.procs)
        return {i: round(self.procs[i].ended - self.fault["time"], 2) for i in which}

    def error(self, rank: int) -> str:
        rec = self.records.get(rank)
        assert rec is not None and not rec["ok"], f"rank {rank} left no error record\n" + report(self.procs)
        return f"{rec['error_type']}: {rec['error']}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {name: tmp_path_factory.mktemp(name) for name in ("raise", "kill", "stop", "catch", "nodes")}
    faults = {
        "raise": ("--mode", "raise", "--rank", "1"),
        "catch": ("--mode", "raise", "--rank", "1", "--catch"),
        "kill": ("--mode", "kill", "--rank", "2"),
        "stop": ("--mode", "stop", "--rank", "2", "--timeout", str(TIMEOUT_S)),
    }
    stores, result = [], {}
    try:
        for name, args in faults.items():
            procs, store = start_ranks(
                "dist_fail_worker.py", WORLD, out[name], "--out", str(out[name]), *args
            )
            stores.append(store)
            result[name] = Run(out[name], procs)
        port, args = free_port(), ("--out", str(out["nodes"]), "--mode", "raise", "--rank", "1")
        nodes = [
            torchrun_cmd("dist_fail_worker.py", 2, *args, nnodes=2, node_rank=i, port=port) for i in range(2)
        ]
        result["nodes"] = Run(
            out["nodes"],
            [start(f"node{i}", cmd, out["nodes"] / f"node{i}.log") for i, cmd in enumerate(nodes)],
        )
        stopped = result["stop"].procs[2]
        waited = [p for run in result.values() for p in run.procs if p is not stopped]
        wait_all(waited, DEADLINE_S)
        result["stop"].stopped_alive = stopped.popen.poll() is None
    finally:
        kill([p for run in result.values() for p in run.procs])  # nothing survives: the stopped rank neither
    for run in result.values():
        run.collect()
    return result


# -- (a) a raise on stage 1 at microbatch 3 --------------------------------------------------------


def test_raise_ends_every_rank_nonzero_in_bounded_time(runs):
    run = runs["raise"]
    assert [p.rc for p in run.procs] == [1] * WORLD, report(run.procs)
    times = run.exit_after_fault(list(range(WORLD)))
    print(f"(a) raise on rank 1: exit after the fault, per rank (s): {times}")
    assert max(times.values()) < BOUND_S, times


def test_raise_failing_rank_names_itself_and_the_action(runs):
    run = runs["raise"]
    assert run.error(1) == f"RuntimeError: fpipe {ROOT_CAUSE}"
    assert f"RuntimeError: fpipe {ROOT_CAUSE}" in run.procs[1].text()


@pytest.mark.parametrize(
    ("rank", "where"),
    [
        (
            0,
            "at action B0.1 (stage 0, microbatch 1) waiting for rank 1's action B1.1 (stage 1, microbatch 1)",
        ),
        (
            2,
            "at action F2.3 (stage 2, microbatch 3) waiting for rank 1's action F1.3 (stage 1, microbatch 3)",
        ),
        (
            3,
            "at action F3.3 (stage 3, microbatch 3) waiting for rank 2's action F2.3 (stage 2, microbatch 3)",
        ),
    ],
)
def test_raise_every_peer_names_the_failing_rank(runs, rank, where):
    """Ranks 0 and 2 see rank 1's sockets close, rank 3 sees rank 2's; all read why in the store."""
    run = runs["raise"]
    expected = f"PeerFailure: fpipe rank {rank}: stopping while {where}: {ROOT_CAUSE}"
    assert run.error(rank) == expected
    assert expected.replace("PeerFailure", "fpipe._src.runtime.dist.PeerFailure") in run.procs[rank].text()


# -- (b) rank 2 SIGKILLs itself mid-step -------------------------------------------------------------


def test_kill_ends_every_rank_nonzero_in_bounded_time(runs):
    run = runs["kill"]
    assert [p.rc for p in run.procs] == [1, 1, -9, 1], report(run.procs)
    times = run.exit_after_fault([0, 1, 3])
    print(f"(b) SIGKILL of rank 2: exit after the kill, per rank (s): {times}")
    assert max(times.values()) < BOUND_S, times


@pytest.mark.parametrize(
    ("rank", "where"),
    [
        (
            1,
            "at action B1.2 (stage 1, microbatch 2) waiting for rank 2's action B2.2 (stage 2, microbatch 2)",
        ),
        (
            3,
            "at action F3.3 (stage 3, microbatch 3) waiting for rank 2's action F2.3 (stage 2, microbatch 3)",
        ),
    ],
)
def test_kill_neighbours_name_the_killed_rank(runs, rank, where):
    """Ranks 1 and 3 wait on rank 2 itself; each says so (and that it crashed or was killed, in its
    own words or in the other neighbour's report, whichever reached the store first)."""
    line = runs["kill"].error(rank)
    prefix = f"PeerFailure: fpipe rank {rank}: stopping while {where}: "
    assert line.startswith(prefix), line
    assert "crash" in line[len(prefix) :], line


def test_kill_rank0_names_the_killed_rank(runs):
    """Rank 0 waits on rank 1, which stopped because rank 2 died: the reason must name rank 2."""
    line = runs["kill"].error(0)
    prefix = (
        "PeerFailure: fpipe rank 0: stopping while at action B0.2 (stage 0, microbatch 2) waiting for "
        "rank 1's action B1.2 (stage 1, microbatch 2): "
    )
    assert line.startswith(prefix), line
    reason = line[len(prefix) :]
    # the first to see rank 2 vanish reports it: while waiting for it, or while sending to it
    assert "rank 2" in reason and "crashed or was killed" in reason, line


# -- (c) rank 2 SIGSTOPs itself mid-step; pipeline(timeout=20) --------------------------------------

LIVE = [0, 1, 3]
TIMED_OUT = re.compile(
    rf"fpipe rank (\d): timed out after {TIMEOUT_S} s "
    # the main thread's receive, or the send reaper's send (gloo's send waits for the receiver)
    r"(?:at action \S+ \(stage \d, microbatch \d\) waiting for rank \d's action \S+ \(stage \d, microbatch \d\)"
    r"|sending \S+'s outputs \(stage \d, microbatch \d\) to rank \d)"
    r"; rank (\d)(?: \(waited on through ranks \[[\d, ]+\]\))? "
    r"is not responding \(stopped, stuck, or far slower\)\. Raise pipeline\(\.\.\., timeout=\.\.\.\) if it is "
    r"only slow\."
)


def test_stop_ends_the_others_after_the_timeout(runs):
    run = runs["stop"]
    assert run.stopped_alive, "the stopped rank should still exist (stopped) when the others are gone"
    rcs = [run.procs[r].rc for r in LIVE]
    print(f"(c) exit codes of ranks {LIVE}: {rcs}")
    assert rcs == [1, 1, 1], report(run.procs)  # the uncaught error's status: no abort (-6)
    assert run.procs[2].rc == -9, "the stopped rank is SIGKILLed by the test's cleanup"
    times = run.exit_after_fault(LIVE)
    print(f"(c) SIGSTOP of rank 2, timeout={TIMEOUT_S} s: exit after the stop, per rank (s): {times}")
    # they waited for the timeout (not a crash): a wait may have begun shortly before the stop
    assert min(times.values()) >= TIMEOUT_S - 5, times
    assert max(times.values()) < BOUND_S, times


def test_stop_the_first_to_time_out_raises_timeout_error_and_the_others_repeat_it(runs):
    run = runs["stop"]
    errors = {r: run.error(r) for r in LIVE}
    first = [r for r, e in errors.items() if e.startswith("TimeoutError: ")]
    assert first, errors
    for r in first:
        assert TIMED_OUT.fullmatch(errors[r][len("TimeoutError: ") :]), errors[r]
    for r, e in errors.items():
        assert e.startswith(("TimeoutError: ", f"PeerFailure: fpipe rank {r}: stopping while ")), e
        assert TIMED_OUT.search(e), e


def test_stop_every_rank_blames_the_stopped_rank(runs):
    run = runs["stop"]
    blamed = {r: [m.group(2) for m in TIMED_OUT.finditer(run.error(r))] for r in LIVE}
    assert blamed == {r: ["2"] for r in LIVE}, {r: run.error(r) for r in LIVE}


# -- (e) the raise of (a), caught by every rank's script, which then goes on --------------------------


def test_caught_failure_lets_every_rank_exit_normally(runs):
    """A script that catches the pipeline's failure decides how it ends: status 0 here, and its
    own atexit handlers ran (no forced exit after a failure the user handled)."""
    run = runs["catch"]
    assert [p.rc for p in run.procs] == [0] * WORLD, report(run.procs)
    assert all((run.out / f"atexit{r}.json").exists() for r in range(WORLD)), report(run.procs)
    times = run.exit_after_fault(list(range(WORLD)))
    print(f"(e) raise on rank 1, caught everywhere: exit after the fault, per rank (s): {times}")
    assert max(times.values()) < BOUND_S, times


def test_caught_failure_still_names_the_failing_rank(runs):
    run = runs["catch"]
    assert run.error(1) == f"RuntimeError: fpipe {ROOT_CAUSE}"
    for r in (0, 2, 3):
        assert run.error(r).startswith(f"PeerFailure: fpipe rank {r}: stopping while "), run.error(r)
        assert run.error(r).endswith(ROOT_CAUSE), run.error(r)
    for r, p in enumerate(run.procs):
        assert f"rank {r} caught" in p.text(), report(run.procs)


def test_no_process_aborts_at_exit(runs):
    """Gloo threads left blocked on a vanished or stopped peer must not abort a process as it
    ends ("terminate called without an active exception")."""
    for name, run in runs.items():
        for p in run.procs:
            assert "terminate called" not in p.text(), f"{name}: {p.name}\n{p.text()[-3000:]}"


# -- (d) the raise across two torchrun nodes on loopback ---------------------------------------------


def test_two_nodes_raise_ends_both_nodes(runs):
    run = runs["nodes"]
    assert [p.rc for p in run.procs] == [1, 1], report(run.procs)
    times = run.exit_after_fault([0, 1])
    print(
        f"(d) raise on rank 1 (node 0) of 2 nodes x 2: torchrun exit after the fault, per node (s): {times}"
    )
    assert max(times.values()) < BOUND_S, times


def test_two_nodes_raise_names_the_failing_rank_on_both_nodes(runs):
    node0, node1 = (p.text() for p in runs["nodes"].procs)
    assert f"RuntimeError: fpipe {ROOT_CAUSE}" in node0, node0[-3000:]
    # rank 2 (node 1) waits on rank 1 (node 0) and reads the reason in the agent's store
    expected = (
        "fpipe rank 2: stopping while at action F2.3 (stage 2, microbatch 3) waiting for rank 1's action F1.3 "
        f"(stage 1, microbatch 3): {ROOT_CAUSE}"
    )
    assert expected in node1, node1[-3000:]


# -- the timing race behind (c), in one process: two ranks' timeouts fire together ----------------


class _TimesOut:
    """A p2p work whose wait times out (as gloo's does) after `after` seconds."""

    def __init__(self, after: float) -> None:
        self.after = after

    def wait(self, timeout: Any = None) -> None:
        time.sleep(self.after)
        raise RuntimeError("[gloo] Timed out waiting 400ms for recv operation to complete")


def test_simultaneous_timeouts_still_blame_the_stopped_rank(monkeypatch):
    """Rank 1 waits on (stopped) rank 2; rank 0 waits on rank 1. When rank 1's timeout fires just
    before rank 0's, rank 0 must still name rank 2: rank 1's wait record outlives its raise, and a
    failure already reported is repeated rather than re-diagnosed."""
    monkeypatch.setattr(fdist, "exit_hard_after_failure", lambda: None)  # keep pytest alive
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))  # a get of a missing key fails, never hangs
    ranks = [fdist.PPGroup(None, r, 3, torch.device("cpu"), store) for r in range(3)]
    where = {1: "at action B1.2 (stage 1, microbatch 2)", 0: "at action B0.2 (stage 0, microbatch 2)"}

    # rank 1 times out first; its wait (long enough to be recorded) was on rank 2
    with pytest.raises(TimeoutError, match=r"fpipe rank 1: timed out .*; rank 2 is not responding"):
        ranks[1].wait_all([_TimesOut(1.2)], 0.4, lambda: where[1], peer=2)
    record = ranks[1].waits_key(1)
    assert store.check([record]) and store.get(record) == b"2", "rank 1's wait record must outlive its raise"

    # rank 0's timeout fires after rank 1's report: it repeats it
    with pytest.raises(
        fdist.PeerFailure, match=r"fpipe rank 0: stopping while .*: fpipe rank 1: timed out .*rank 2 is"
    ):
        ranks[0].wait_all([_TimesOut(0.0)], 0.4, lambda: where[0], peer=1)

    # ... and when both fire before either report lands, it follows rank 1's record to rank 2
    store.delete_key(ranks[0]._failed_key())
    with pytest.raises(TimeoutError, match=r"rank 2 \(waited on through ranks \[1\]\) is not responding"):
        ranks[0].wait_all([_TimesOut(0.0)], 0.4, lambda: where[0], peer=1)
