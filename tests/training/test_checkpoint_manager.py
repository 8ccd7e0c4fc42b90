"""fpipe.CheckpointManager in one process (fpipe/_src/training/checkpoint_manager.py).

Step folders, saving every N steps, keeping the last K and deleting only its own folders (a run
folder's other files, a user's folder named like a step, survive), `latest()` after a save that
was SIGKILLed mid-write, the async path, and the refusals. The survival of a killed rank under
torchrun is in tests/training/test_resilient.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fpipe

DT = torch.float64


def _params(value: float = 0.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 3), value, dtype=DT), "b": torch.full((4,), value, dtype=DT)}


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with its bytes (None for a folder)."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
    }


def _kept(*steps: int) -> list[str]:
    """The names a manager leaves in its root for these steps: each step's folder and the lock
    file `fpipe.save` takes beside it (NOTE [publishing a checkpoint])."""
    return sorted(n for s in steps for n in (f"step_{s:08d}", f".step_{s:08d}.lock"))


def test_saves_every_n_steps_into_step_folders_and_keeps_the_last_k(tmp_path):
    mgr = fpipe.CheckpointManager(tmp_path, keep=2, every=3, async_=False)
    params = _params()
    saved = []
    for step in range(1, 11):
        params["w"] += 1
        if mgr.save(step, params, extra={"step": step}):
            saved.append(step)
    assert saved == [3, 6, 9]
    assert mgr.all_steps() == [6, 9] and mgr.latest() == 9
    assert sorted(p.name for p in tmp_path.iterdir()) == _kept(6, 9)
    assert mgr.save(10, params, extra={"step": 10}, force=True)  # forced: off the interval
    assert mgr.all_steps() == [9, 10]
    mine = _params(-1.0)
    assert mgr.restore(mine) == (10, {"step": 10}) and torch.equal(mine["w"], params["w"])
    assert mgr.restore(mine, step=9) == (9, {"step": 9}) and torch.equal(mine["w"], params["w"] - 1)


def test_keep_none_keeps_every_step(tmp_path):
    mgr = fpipe.CheckpointManager(tmp_path, keep=None, every=1, async_=False)
    for step in range(4):
        mgr.save(step, _params(step))
    assert mgr.all_steps() == [0, 1, 2, 3]


def test_files_and_folders_it_did_not_write_are_never_touched_nor_taken_for_steps(tmp_path):
    (tmp_path / "config.yaml").write_text("lr: 3e-3\n")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out").write_bytes(b"\x00\x01")
    (tmp_path / "step_00000001").mkdir()  # a user's folder named like a step, not a checkpoint
    (tmp_path / "step_00000001" / "notes.txt").write_text("mine")
    (tmp_path / "step_7").mkdir()  # not the manager's name (8 digits)
    (tmp_path / "step_00000002.txt").write_text("a file")
    before = _tree(tmp_path)
    mgr = fpipe.CheckpointManager(tmp_path, keep=1, every=1, async_=False)
    assert mgr.latest() is None and mgr.all_steps() == []
    for step in (3, 4, 5):
        mgr.save(step, _params(step))
    assert mgr.all_steps() == [5]
    after = _tree(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before  # all still there, unchanged
    new = set(after) - set(before)  # and nothing else beside the one kept step
    assert {k.split("/")[0] for k in new} == set(_kept(5)), sorted(new)


def test_a_deletion_interrupted_by_a_crash_is_finished_and_never_a_step(tmp_path):
    mgr = fpipe.CheckpointManager(tmp_path, keep=1, every=1, async_=False)
    mgr.save(1, _params(1))
    (tmp_path / "step_00000001").rename(tmp_path / ".step_00000001.deleting")  # as a crash leaves it
    assert mgr.all_steps() == []
    mgr.save(2, _params(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == _kept(2)


KILLED = textwrap.dedent(
    """
    import os, sys, torch, fpipe
    mgr = fpipe.CheckpointManager(sys.argv[1], keep=2, every=10, async_=True)
    params = {"w": torch.zeros(64, 64, dtype=torch.float64)}
    for step in (10, 20, 30):
        if step == 30:  # step 30's files and manifest are written; SIGKILL before it is published
            mgr.wait()  # (step 20's save, in the background, is published first)
            os.environ["FPIPE_CHECKPOINT_KILL_AT"] = "publish"
        params["w"].fill_(step)
        mgr.save(step, params, extra={"step": step})
    mgr.wait()
    """
)


def test_latest_after_a_save_killed_before_its_publish_is_the_last_complete_step(tmp_path):
    root = tmp_path / "run"
    path = os.pathsep.join([str(Path(fpipe.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", KILLED, str(root)], env={**os.environ, "PYTHONPATH": path}, timeout=120
    )
    assert done.returncode == -signal.SIGKILL
    assert (root / ".step_00000030.saving" / "fpipe.json").is_file()  # complete, but never published
    mgr = fpipe.CheckpointManager(root, keep=2, every=10)
    assert mgr.all_steps() == [10, 20] and mgr.latest() == 20
    mine = {"w": torch.zeros(64, 64, dtype=DT)}
    assert mgr.restore(mine) == (20, {"step": 20})
    assert torch.equal(mine["w"], torch.full((64, 64), 20.0, dtype=DT))
    mine["w"].fill_(31)
    mgr.save(30, mine, extra={"step": 30})  # the resumed run saves step 30 again, and prunes
    mgr.wait()
    assert mgr.all_steps() == [20, 30] and sorted(p.name for p in root.iterdir()) == _kept(20, 30)
    assert mgr.restore(mine) == (30, {"step": 30}) and torch.equal(
        mine["w"], torch.full((64, 64), 31.0, dtype=DT)
    )


def test_a_killed_save_of_an_older_step_is_cleared_by_the_next_prune(tmp_path):
    mgr = fpipe.CheckpointManager(tmp_path, keep=1, every=1, async_=False)
    mgr.save(1, _params(1))
    scratch = tmp_path / ".step_00000002.saving"  # as a save of step 2 killed mid-write leaves it
    scratch.mkdir()
    (scratch / ".fpipe-saving").write_text("a checkpoint being written by fpipe.save\n")
    (scratch / "rank0.safetensors").write_bytes(b"half")
    foreign = tmp_path / ".step_00000002.saving.bak"
    foreign.write_text("mine")
    mgr.save(3, _params(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*_kept(3), foreign.name])


def test_async_saves_the_values_of_the_call_and_prunes_once_published(tmp_path):
    params = {"w": torch.randn(32, 32, dtype=DT)}
    with fpipe.CheckpointManager(tmp_path, keep=1, every=1, async_=True) as mgr:
        values = {}
        for step in (1, 2):
            values[step] = params["w"].clone()
            assert mgr.save(step, params, extra={"step": step})
            params["w"].add_(1.0)  # training goes on while it is written
    assert mgr.all_steps() == [2]  # the context's exit waited for step 2, then deleted step 1
    mine = {"w": torch.zeros(32, 32, dtype=DT)}
    assert mgr.restore(mine) == (2, {"step": 2}) and torch.equal(mine["w"], values[2])


def test_an_async_failure_is_raised_by_the_next_save_or_wait_and_is_no_step(tmp_path, monkeypatch):
    from fpipe._src.training import checkpoint_format

    mgr = fpipe.CheckpointManager(tmp_path, keep=2, every=1, async_=True)
    mgr.save(1, _params(1))
    mgr.wait()

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_format, "write_safetensors", full)
    assert mgr.save(2, _params(2))  # returns once staged; the writing fails in the background
    with pytest.raises(
        fpipe.CheckpointError, match=r"async_save\('.*step_00000002', params\): the disk is full"
    ):
        mgr.save(3, _params(3))  # the next save raises the earlier one's failure, and saves nothing
    monkeypatch.undo()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert mgr.all_steps() == [1] and left == sorted([*_kept(1), ".step_00000002.lock"])
    assert mgr.save(4, _params(4)) and mgr.wait() is None and mgr.all_steps() == [1, 4]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep": 0}, r"keep=0; it must be an int >= 1"),
        ({"every": 0}, r"every=0; it must be an int >= 1"),
        ({"every": 2.5}, r"every=2.5; it must be an int >= 1"),
        ({"keep": True}, r"keep=True; it must be an int >= 1"),
    ],
)
def test_bad_settings_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fpipe.CheckpointManager(tmp_path, **kwargs)


def test_a_root_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(ValueError, match=r"exists and is not a folder"):
        fpipe.CheckpointManager(tmp_path / "f")
    assert (tmp_path / "f").read_text() == "mine"


def test_steps_must_increase_and_be_ints(tmp_path):
    mgr = fpipe.CheckpointManager(tmp_path, every=1, async_=False)
    mgr.save(5, _params())
    with pytest.raises(ValueError, match=r"step 5 is already saved in .*; steps must increase"):
        mgr.save(5, _params())
    with pytest.raises(ValueError, match=r"step 5 is already saved"):
        fpipe.CheckpointManager(tmp_path, every=1).save(3, _params())  # a new manager reads the folder
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match=r"step must be an int >= 0"):
            mgr.save(bad, _params())  # type: ignore[arg-type]
    assert mgr.all_steps() == [5]


def test_restore_without_a_checkpoint_or_of_a_missing_step_is_named(tmp_path):
    mgr = fpipe.CheckpointManager(tmp_path / "new", every=1, async_=False)
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint in .*new \(latest\(\) is None\)"):
        mgr.restore(_params())
    mgr.save(2, _params())
    with pytest.raises(
        FileNotFoundError, match=r"no complete checkpoint of step 3 in .*; it has steps \[2\]"
    ):
        mgr.restore(_params(), step=3)


def test_a_step_folder_it_did_not_write_is_refused_not_replaced(tmp_path):
    (tmp_path / "step_00000001").mkdir()
    (tmp_path / "step_00000001" / "notes.txt").write_text("mine")
    mgr = fpipe.CheckpointManager(tmp_path, every=1, async_=False)
    with pytest.raises(ValueError, match=r"step_00000001 is a directory that is not an fpipe checkpoint"):
        mgr.save(1, _params(1))
    assert (tmp_path / "step_00000001" / "notes.txt").read_text() == "mine" and mgr.all_steps() == []
