"""The crash matrix (issue 25): a save SIGKILLed at each phase, two writers, a reader mid-publish.

A child process saves step 2 over a published step 1 and is killed (SIGKILL) or stopped
(SIGSTOP) at a phase by the test-only hook `FPIPE_CHECKPOINT_KILL_AT=PHASE[:stop]`
(`checkpoint_files.phase`); `FPIPE_CHECKPOINT_NO_EXCHANGE=1` makes it publish by two renames,
as where `renameat2(RENAME_EXCHANGE)` is missing. Afterwards the latest complete checkpoint
loads and equals what was saved, the next save works, and nothing else was deleted (a file of
the user's beside the checkpoint stays). One process, tiny tensors.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import fpipe
from fpipe._src.training import checkpoint_files

CHILD = textwrap.dedent(
    """
    import sys, torch, fpipe
    path, step, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    params = {"w": torch.full((4, 3), float(step)), "b": torch.full((2,), float(step))}
    if mode == "sync":
        fpipe.save(path, params, extra={"step": step})
    else:
        fpipe.async_save(path, params, extra={"step": step}).result()
    """
)


def _params(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 3), float(step)), "b": torch.full((2,), float(step))}


def _child(path: Path, step: int, mode: str, at: str = "", fallback: bool = False) -> subprocess.Popen:
    root = str(Path(fpipe.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    env.pop(checkpoint_files.KILL_AT, None)
    if at:
        env[checkpoint_files.KILL_AT] = at
    if fallback:
        env[checkpoint_files.NO_EXCHANGE] = "1"
    cmd = [sys.executable, "-c", CHILD, str(path), str(step), mode]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _loads(path: Path, step: int) -> None:
    """The checkpoint at `path` loads whole and is the one saved at `step`."""
    mine = {"w": torch.zeros(4, 3), "b": torch.zeros(2)}
    assert fpipe.load(path, mine) == {"step": step}
    assert all(torch.equal(mine[k], v) for k, v in _params(step).items())


def _setup(tmp_path: Path) -> Path:
    path = tmp_path / "c"
    fpipe.save(path, _params(1), extra={"step": 1})
    (tmp_path / "notes.txt").write_text("the user's")
    return path


def _nothing_else_deleted(tmp_path: Path) -> None:
    assert (tmp_path / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".c.lock", "c", "notes.txt"]


# (mode, phase, the fallback publish, the step that loads after the kill)
KILLS = [
    ("sync", "written", False, 1),
    ("sync", "manifest", False, 1),
    ("sync", "publish", False, 1),
    ("sync", "exchanged", False, 2),
    ("sync", "publish", True, 1),
    ("sync", "between_renames", True, 2),
    ("async", "written", False, 1),
    ("async", "publish", False, 1),
    ("async", "exchanged", False, 2),
    ("async", "between_renames", True, 2),
]


@pytest.mark.parametrize(("mode", "at", "fallback", "step"), KILLS)
def test_a_save_killed_at_any_phase_leaves_the_latest_complete_checkpoint(tmp_path, mode, at, fallback, step):
    path = _setup(tmp_path)
    proc = _child(path, 2, mode, at, fallback)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err
    _loads(path, step)  # a kill between the two renames: the newer copy, in .c.saving
    fpipe.save(path, _params(3), extra={"step": 3})  # finishes an interrupted publish first
    _loads(path, 3)
    _nothing_else_deleted(tmp_path)


def _stopped(proc: subprocess.Popen, path: Path) -> None:
    """Wait until the child has stopped itself (SIGSTOP) at its phase."""
    end = time.monotonic() + 120
    while time.monotonic() < end:
        state = Path(f"/proc/{proc.pid}/stat").read_text().split(") ")[1][0]
        if state == "T":
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("the child never reached its phase")


def test_a_second_writer_is_refused_while_the_first_writes(tmp_path):
    """Two saves to one path at once (a requeued job while the old one runs): the second is
    refused by the lock, the first publishes its own checkpoint whole."""
    path = _setup(tmp_path)
    first = _child(path, 2, "sync", "written:stop")
    try:
        _stopped(first, path)
        second = _child(path, 3, "async")
        _, err = second.communicate(timeout=120)
        assert second.returncode == 1 and "another save to" in err and "is in progress" in err, err
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    _loads(path, 2)
    _nothing_else_deleted(tmp_path)


@pytest.mark.parametrize(("at", "step"), [("publish:stop", 1), ("exchanged:stop", 2)])
def test_a_reader_during_a_publish_gets_one_whole_checkpoint(tmp_path, at, step):
    """Stopped with its manifest written but not yet published: a load reads step 1; stopped
    right after the exchange (the old copy not yet deleted): step 2. Either whole."""
    path = _setup(tmp_path)
    proc = _child(path, 2, "sync", at)
    try:
        _stopped(proc, path)
        _loads(path, step)
    finally:
        proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    _loads(path, 2)
    _nothing_else_deleted(tmp_path)
