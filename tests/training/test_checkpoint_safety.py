"""What a checkpoint refuses, and the errors that say what happened (issue 25, cases 1 and 3-8).

Never delete what fpipe did not write (a project folder, a symlink, a file); a second writer is
refused by a lock; checksums and the manifest's format are checked before anything is copied; a
publish during a read cannot mix two checkpoints; nothing in the directory is unpickled (a
crafted pickle's payload never runs); a failed `async_save` surfaces at `.result()`, at the next
fpipe call, or at exit; a full disk says so and cleans up; `load` waits for a pending save.
Kills at every phase are in tests/training/test_checkpoint_crash.py.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import fpipe
from fpipe._src.training import checkpoint_files


def _fmt():  # type: ignore[no-untyped-def]
    """fpipe's checkpoint data formats (imported here: a module base b6b0e74 lacks)."""
    from fpipe._src.training import checkpoint_format

    return checkpoint_format


def _params(v: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 2), v), "b": torch.full((2,), v)}


def _zeros() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(3, 2), "b": torch.zeros(2)}


def _env() -> dict[str, str]:
    root = str(Path(fpipe.__file__).parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


# -- case 1: never delete or overwrite what fpipe did not write ------------------------------------
def test_saving_to_a_project_folder_is_refused_and_touches_nothing(tmp_path, monkeypatch):
    """`fpipe.save(".")` from a project folder replaced train.py; now refused before any write."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(proj)
    with pytest.raises(
        ValueError, match=r"is a directory that is not an fpipe checkpoint \(it holds \['train.py'\]\)"
    ):
        fpipe.save(".", _params())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["proj"]
    assert (
        sorted(p.name for p in proj.iterdir()) == ["train.py"]
        and (proj / "train.py").read_text() == "print('hi')\n"
    )


def test_a_checkpoint_holding_files_fpipe_did_not_write_is_not_replaced(tmp_path):
    """A user's file dropped into a checkpoint directory (a config, notes) would be deleted by the
    next save to that path, which replaces the directory whole: refused, the file and the
    checkpoint untouched."""
    ck = tmp_path / "ck"
    fpipe.save(ck, _params())
    assert checkpoint_files.foreign_entries(ck, checkpoint_files.manifest_of(ck)) == []
    (ck / "notes.txt").write_text("mine\n")
    with pytest.raises(ValueError, match=r"also holds files fpipe did not write \(\['notes.txt'\]\)"):
        fpipe.save(ck, _params(2.0))
    assert (ck / "notes.txt").read_text() == "mine\n"
    p = _params(0.0)
    fpipe.load(ck, p)
    assert torch.equal(p["w"], _params()["w"])


def test_the_manager_keeps_a_step_folder_holding_a_users_file(tmp_path):
    """`CheckpointManager(keep=1)` deletes its old step folders, but not one a user put a file
    into: it warns and keeps it."""
    mgr = fpipe.CheckpointManager(tmp_path, keep=1, async_=False)
    mgr.save(1, _params())
    (mgr.step_dir(1) / "notes.txt").write_text("mine\n")
    with pytest.warns(UserWarning, match=r"step_00000001 is kept past keep=1: .*\['notes.txt'\]"):
        mgr.save(2, _params(2.0))
    assert mgr.all_steps() == [1, 2] and (mgr.step_dir(1) / "notes.txt").read_text() == "mine\n"


def test_a_symlink_and_a_file_are_refused_with_the_reason(tmp_path):
    real = tmp_path / "real"
    fpipe.save(real, _params())
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(
        ValueError, match=r"link is a symbolic link \(to .*real\); pass the directory it points to"
    ):
        fpipe.save(tmp_path / "link", _params(2.0))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"file is a file\. A save replaces the directory at its path whole"):
        fpipe.save(tmp_path / "file", _params(2.0))
    assert (tmp_path / "file").read_text() == "x" and (tmp_path / "link").is_symlink()
    mine = _zeros()
    fpipe.load(real, mine)
    assert torch.equal(mine["w"], _params()["w"])  # the link's target was left as it was
    fpipe.save(tmp_path / "link2", _params(3.0))  # a new path, and a later save, work
    fpipe.save(tmp_path / "link2", _params(4.0))


def test_an_empty_folder_is_saved_into(tmp_path):
    (tmp_path / "c").mkdir()
    fpipe.save(tmp_path / "c", _params(2.0), extra={"step": 2})
    assert fpipe.load(tmp_path / "c", _zeros()) == {"step": 2}


def test_a_scratch_folder_fpipe_did_not_write_is_refused(tmp_path):
    (tmp_path / ".c.saving").mkdir()
    (tmp_path / ".c.saving" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"\.c\.saving exists and was not written by fpipe"):
        fpipe.save(tmp_path / "c", _params())
    assert (tmp_path / ".c.saving" / "notes.txt").read_text() == "mine"


# -- case 3: read whole or refuse -------------------------------------------------------------------
def test_a_second_writer_is_refused_by_the_lock(tmp_path):
    """Another writer holds the lock (a requeued job while the old one still runs): this save
    does not start, and the checkpoint is as it was."""
    path = tmp_path / "c"
    fpipe.save(path, _params(1.0), extra={"step": 1})
    held = checkpoint_files.lock("another writer", path)
    try:
        with pytest.raises(fpipe.CheckpointError, match=r"another save to .*c is in progress"):
            fpipe.save(path, _params(2.0), extra={"step": 2})
    finally:
        checkpoint_files.unlock(held)
    mine = _zeros()
    assert fpipe.load(path, mine) == {"step": 1} and torch.equal(mine["w"], _params(1.0)["w"])


def test_a_byte_changed_in_place_is_caught_by_its_checksum_before_anything_is_copied(tmp_path):
    path = tmp_path / "c"
    fpipe.save(path, _params(1.0))
    data = path / "rank0.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # the last value of the last tensor, same size
    data.write_bytes(bytes(raw))
    mine = _zeros()
    with pytest.raises(ValueError, match=r"rank0.safetensors does not have the SHA-256 the manifest records"):
        fpipe.load(path, mine)
    assert not mine["w"].any() and not mine["b"].any()


@pytest.mark.parametrize("change", [("version", 3), ("format", "fpipe-checkpoint-1")])
def test_a_manifest_of_another_format_or_version_is_refused(tmp_path, change):
    path = tmp_path / "c"
    fpipe.save(path, _params())
    manifest = json.loads((path / "fpipe.json").read_text())
    manifest[change[0]] = change[1]
    (path / "fpipe.json").write_text(json.dumps(manifest))
    with pytest.raises(
        ValueError, match=r"holds format .* this fpipe reads 'fpipe-checkpoint' version 2 alone"
    ):
        fpipe.load(path, _zeros())


def test_a_publish_during_a_load_never_mixes_two_checkpoints(tmp_path, monkeypatch):
    """Issue 25 case 7: a save publishes while a load reads (here: right after the load checked
    its first file). The load read one directory, opened once: it returns one whole checkpoint
    (the weights match the extra), never step-1 weights with step-2 extra."""
    path = tmp_path / "c"
    fpipe.save(path, _params(1.0), extra={"step": 1})
    mapped = _fmt().Mapped
    real, fired = mapped.sha256, []

    def racing(self: object) -> str:
        if not fired:
            fired.append(1)
            fpipe.save(path, _params(2.0), extra={"step": 2})
        return real(self)

    monkeypatch.setattr(mapped, "sha256", racing)
    mine = _zeros()
    extra = fpipe.load(path, mine)
    assert fired and torch.equal(mine["w"], _params(float(extra["step"]))["w"])
    assert torch.equal(mine["b"], _params(float(extra["step"]))["b"])


# -- case 4: no code from a checkpoint --------------------------------------------------------------
class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.marker, "w"))


def _crafted(tmp_path: Path, manifest: bool) -> tuple[Path, Path]:
    """A folder that looks like a Hugging Face download, with a pickled `.metadata` (and files
    fpipe once read with pickle) whose payload would create `marker`."""
    from safetensors.torch import save_file

    d, marker = tmp_path / "download", tmp_path / "pwned"
    d.mkdir()
    save_file(_params(5.0), str(d / "model.safetensors"))
    (d / "config.json").write_text("{}")
    for name in (".metadata", "extra.pt", "__0_0.distcp", "pytorch_model.bin"):
        (d / name).write_bytes(pickle.dumps(_Payload(str(marker))))
    if manifest:
        files = {n: {"size": (d / n).stat().st_size, "sha256": ""} for n in (".metadata", "extra.pt")}
        (d / "fpipe.json").write_text(json.dumps({"format": "fpipe-checkpoint-1", "files": files}))
    return d, marker


def test_a_crafted_fpipe_directory_runs_no_code(tmp_path):
    d, marker = _crafted(tmp_path, manifest=True)
    with pytest.raises(ValueError, match="holds format 'fpipe-checkpoint-1'"):
        fpipe.load(d, _zeros(), optimizer=torch.optim.SGD([torch.zeros(1)], lr=0.1))
    with pytest.raises(ValueError, match="holds format 'fpipe-checkpoint-1'"):
        fpipe.load(d, _zeros())
    assert not marker.exists()


def test_a_crafted_safetensors_folder_runs_no_code(tmp_path):
    d, marker = _crafted(tmp_path, manifest=False)
    mine = _zeros()
    assert fpipe.load(d, mine) == {} and torch.equal(mine["w"], _params(5.0)["w"])
    assert not marker.exists()


# -- case 5/8: errors that say what happened ---------------------------------------------------------
def _disk_full(*args: object, **kwargs: object) -> tuple[int, str]:
    raise OSError(errno.ENOSPC, "No space left on device", str(args[0]))


def test_a_full_disk_says_so_cleans_up_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c"
    fpipe.save(path, _params(1.0), extra={"step": 1})
    monkeypatch.setattr(_fmt(), "write_safetensors", _disk_full)
    with pytest.raises(
        fpipe.CheckpointError,
        match=r"the disk is full \(.*rank0.safetensors\).*scratch directory was deleted",
    ):
        fpipe.save(path, _params(2.0), extra={"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".c.lock", "c"]
    monkeypatch.undo()
    assert fpipe.load(path, _zeros()) == {"step": 1}
    fpipe.save(path, _params(3.0), extra={"step": 3})  # the lock was released
    assert fpipe.load(path, _zeros()) == {"step": 3}


def test_a_failed_async_save_is_an_exception_at_result(tmp_path, monkeypatch):
    monkeypatch.setattr(_fmt(), "write_safetensors", _disk_full)
    handle = fpipe.async_save(tmp_path / "c", _params())
    with pytest.raises(fpipe.CheckpointError, match=r"async_save\(.*c', params\): the disk is full") as err:
        handle.result()
    assert isinstance(err.value, Exception)
    monkeypatch.undo()
    fpipe.save(tmp_path / "c", _params())  # reported once: the next save is not refused


def _wait_done(handle: fpipe.AsyncCheckpoint) -> None:
    end = time.monotonic() + 30
    while not handle.done() and time.monotonic() < end:
        time.sleep(0.01)


def test_a_failed_async_save_nobody_waited_for_fails_the_next_fpipe_call(tmp_path, monkeypatch):
    """Raised by the next pipeline call (which does nothing), naming the save and its path."""
    monkeypatch.setattr(_fmt(), "write_safetensors", _disk_full)
    _wait_done(fpipe.async_save(tmp_path / "c", _params()))
    piped = fpipe.pipeline(lambda p, x: (x @ p["w"]).sum(), microbatches=1)
    with pytest.raises(
        fpipe.CheckpointError, match=r"not run, because an earlier async_save\(.*c', params\) failed"
    ):
        piped(_params(), torch.ones(4, 3))
    assert piped(_params(), torch.ones(4, 3)).item() == 24.0  # said once
    _wait_done(fpipe.async_save(tmp_path / "d", _params()))
    with pytest.raises(
        fpipe.CheckpointError, match=r"save\(.*e', params\): not run, because an earlier async_save"
    ):
        fpipe.save(tmp_path / "e", _params())
    assert not (tmp_path / "e").exists()


EXITS = textwrap.dedent(
    """
    import errno, sys, torch, fpipe
    from fpipe._src.training import checkpoint_format
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(args[0]))
    checkpoint_format.write_safetensors = full
    fpipe.async_save(sys.argv[1], {"w": torch.ones(2)})
    """
)


def test_a_failed_async_save_nobody_saw_is_reported_at_exit_with_status_1(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", EXITS, str(tmp_path / "c")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "fpipe: async_save(" in proc.stderr and "the disk is full" in proc.stderr


def test_load_waits_for_this_process_s_async_save(tmp_path, monkeypatch):
    real = _fmt().write_safetensors

    def slow(*args: object, **kwargs: object) -> tuple[int, str]:
        time.sleep(0.5)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_fmt(), "write_safetensors", slow)
    fpipe.async_save(tmp_path / "c", _params(2.0), extra={"step": 2})
    mine = _zeros()
    assert fpipe.load(tmp_path / "c", mine) == {"step": 2} and torch.equal(mine["w"], _params(2.0)["w"])


def test_a_malformed_manifest_or_index_is_a_value_error_naming_the_checkpoint(tmp_path):
    path = tmp_path / "c"
    fpipe.save(path, _params())
    (path / "fpipe.json").write_text(json.dumps({"format": "fpipe-checkpoint", "version": 2}))
    with pytest.raises(ValueError, match=r"c is not a well-formed fpipe checkpoint \(KeyError: 'files'\)"):
        fpipe.load(path, _zeros())
