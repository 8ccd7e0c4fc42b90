"""A checkpoint's directory: refused unless ours, locked, written aside, published atomically.

# NOTE [publishing a checkpoint]
`fpipe.save(path, ...)` never writes into `path`, and never deletes or replaces what fpipe did
not write: a `path` that is a symbolic link, a file, or a non-empty directory that is not an
fpipe checkpoint (no `fpipe.json` manifest) is refused before anything is written. Rank 0 takes
an exclusive lock (`fcntl.flock` on `.NAME.lock` beside `path`; a second writer to the same
path, in this process or another, is refused) and holds it until the save is published or has
failed. It makes a sibling directory `.NAME.saving` (marked as fpipe's); every rank writes its
files into it (`rank{R}.safetensors`, then its index `rank{R}.json`, renamed into place last);
rank 0 waits for every rank's index, writes the manifest `fpipe.json` (each file's size and
SHA-256, the format and its version, the number of ranks, the pipeline's step), fsyncs, and
publishes: an atomic exchange of the two directories (Linux `renameat2(RENAME_EXCHANGE)`), after
which the previous checkpoint, now under the scratch name, is deleted. Where the exchange is not
supported, `path` is renamed to `.NAME.previous` and the new directory to `path`; a crash between
the two renames leaves the newer checkpoint complete in `.NAME.saving`: `load` reads it, and the
next save finishes that publish before it starts. A save that fails (a full disk, a rank that
failed) deletes its scratch directory and releases the lock. A published checkpoint is never
written again: the next save replaces it whole.

`load` resolves the path once, opens that directory and reads every file through it (a publish
meanwhile cannot mix two checkpoints), checks the manifest's format and version, each file's
size and SHA-256, the names, dtypes and shapes, all before the first value is copied into a
tensor. Every rank writes into the same directory, and rank 0 lists it: with several machines,
`path` must be on a filesystem they all see.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import shutil
import signal
import uuid
from pathlib import Path
from typing import Any

from . import checkpoint_format as fmt

MANIFEST = "fpipe.json"
MARK = ".fpipe-saving"
FORMAT, VERSION = "fpipe-checkpoint", 2
KILL_AT = "FPIPE_CHECKPOINT_KILL_AT"  # test-only: SIGKILL this process at the named phase
NO_EXCHANGE = "FPIPE_CHECKPOINT_NO_EXCHANGE"  # test-only: publish by two renames
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class CheckpointError(RuntimeError):
    """A save or load that could not complete (the message says what happened and where)."""


def phase(name: str) -> None:
    """Test-only hook (tests/training/test_checkpoint_crash.py): FPIPE_CHECKPOINT_KILL_AT=name kills
    this process with SIGKILL when a save reaches the phase `name` ("written", "manifest",
    "publish", "exchanged", "between_renames"); `name:stop` stops it (SIGSTOP) there instead."""
    at, _, action = os.environ.get(KILL_AT, "").partition(":")
    if at == name:
        os.kill(os.getpid(), signal.SIGSTOP if action == "stop" else signal.SIGKILL)


def saving_dir(path: Path) -> Path:
    return path.with_name(f".{path.name}.saving")


def previous_dir(path: Path) -> Path:
    return path.with_name(f".{path.name}.previous")


def manifest_of(d: Path) -> dict[str, Any] | None:
    """The manifest of the directory `d` if it holds an fpipe checkpoint's, else None."""
    try:
        data = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and str(data.get("format", "")).startswith(FORMAT)
    return data if ok else None


def foreign_entries(d: Path, manifest: dict[str, Any]) -> list[str]:
    """The entries of checkpoint directory `d` that fpipe did not write (a user's files dropped in
    beside the checkpoint's): neither the manifest, the saving mark, nor a file the manifest lists."""
    ours = {MANIFEST, MARK} | {str(rel).split("/", 1)[0] for rel in manifest.get("files", {})}
    return sorted(p.name for p in d.iterdir() if p.name not in ours)


def _ours(d: Path) -> bool:
    return not d.is_symlink() and d.is_dir() and (manifest_of(d) is not None or (d / MARK).is_file())


# -- saving ---------------------------------------------------------------------------------------
def refuse_foreign(call: str, path: Path) -> None:
    """`path` must be absent, an empty directory, or an fpipe checkpoint (NOTE above)."""
    why = None
    manifest = manifest_of(path) if path.is_dir() and not path.is_symlink() else None
    if path.is_symlink():
        why = f"is a symbolic link (to {os.readlink(path)}); pass the directory it points to"
    elif path.exists() and not path.is_dir():
        why = "is a file"
    elif path.is_dir() and any(path.iterdir()) and manifest is None:
        shown = sorted(p.name for p in path.iterdir())[:5]
        why = f"is a directory that is not an fpipe checkpoint (it holds {shown})"
    elif path.is_dir() and manifest is not None and (extra := foreign_entries(path, manifest)):
        why = f"is an fpipe checkpoint that also holds files fpipe did not write ({extra[:5]})"
    if why is not None:
        raise ValueError(
            f"{call}: {path} {why}. A save replaces the directory at its path whole, so fpipe "
            "refuses to save where it would delete what it did not write; save to a new path "
            "(e.g. a subdirectory) instead."
        )
    for d in (saving_dir(path), previous_dir(path)):
        if (d.exists() or d.is_symlink()) and not _ours(d):
            raise ValueError(f"{call}: {d} exists and was not written by fpipe; move it away first.")


def lock(call: str, path: Path) -> int:
    """An exclusive lock on `.NAME.lock` beside `path`: a second writer is refused."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointError(
            f"{call}: another save to {path} is in progress (it holds the lock "
            f"{path.with_name(f'.{path.name}.lock')}); two writers would mix their files, so this one "
            "does not start. Wait for the other save (a job still running?) or save elsewhere."
        ) from None
    return fd


def unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def begin(call: str, path: Path) -> Path:
    """Rank 0, holding the lock: an empty scratch directory beside `path` (NOTE above)."""
    refuse_foreign(call, path)
    tmp = saving_dir(path)
    if not path.exists() and manifest_of(tmp) is not None:  # a publish interrupted between renames
        os.rename(tmp, path)
        _fsync_dir(path.parent)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(previous_dir(path), ignore_errors=True)
    tmp.mkdir()
    (tmp / MARK).write_text("a checkpoint being written by fpipe.save\n")
    return tmp


def new_nonce() -> str:
    return uuid.uuid4().hex


def finish(tmp: Path, path: Path, head: dict[str, Any], ranks: int) -> None:
    """Rank 0, once every rank's index is in `tmp`: the manifest, then publish."""
    files = {}
    for f in sorted(tmp.iterdir()):
        if f.name.startswith("rank") and f.name.endswith(".json"):
            index = json.loads(f.read_bytes())
            files[f.name] = {"size": f.stat().st_size, "sha256": fmt.sha256_file(f)}
            files.update(index["files"])
    manifest = {"format": FORMAT, "version": VERSION, "ranks": ranks, **head, "files": files}
    phase("manifest")
    fmt.write_synced(str(tmp / MANIFEST), fmt.dumps(manifest))
    _fsync_dir(tmp)
    phase("publish")
    publish(tmp, path)


def publish(tmp: Path, path: Path) -> None:
    """Make `tmp` the checkpoint at `path` atomically; then delete the one it replaces."""
    if not path.exists():
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        phase("exchanged")
        shutil.rmtree(tmp)
    else:
        prev = previous_dir(path)
        os.rename(path, prev)
        phase("between_renames")
        os.rename(tmp, path)
    shutil.rmtree(previous_dir(path), ignore_errors=True)
    _fsync_dir(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2); False where that is not available."""
    if os.environ.get(NO_EXCHANGE):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading --------------------------------------------------------------------------------------
def resolve(call: str, path: Path) -> Path:
    """The directory to read: `path`, or the newer complete checkpoint a publish interrupted
    between its two renames left beside it (NOTE above)."""
    if path.is_dir():
        return path
    for d in (saving_dir(path), previous_dir(path)):
        if manifest_of(d) is not None:
            return d
    raise FileNotFoundError(f"{call}: no checkpoint directory at {path}.")


class Opened:
    """A checkpoint directory opened once: its manifest checked, its files read through it."""

    def __init__(self, call: str, path: Path) -> None:
        self.call, self.path = call, path
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        self.manifest = self._manifest()

    def close(self) -> None:
        os.close(self.fd)

    def _manifest(self) -> dict[str, Any]:
        try:
            data = json.loads(self.read(MANIFEST))
        except FileNotFoundError:
            raise ValueError(
                f"{self.call}: {self.path / MANIFEST} is missing, so {self.path} is not a complete fpipe "
                "checkpoint (fpipe.save writes the manifest last); load another checkpoint."
            ) from None
        except ValueError as err:
            raise ValueError(f"{self.call}: {self.path / MANIFEST} is not valid JSON ({err}).") from None
        if not isinstance(data, dict) or (data.get("format"), data.get("version")) != (FORMAT, VERSION):
            raise ValueError(
                f"{self.call}: {self.path} holds format {data.get('format') if isinstance(data, dict) else '?'!r}"
                f" version {data.get('version') if isinstance(data, dict) else '?'!r}; this fpipe reads "
                f"{FORMAT!r} version {VERSION} alone (earlier checkpoints held pickled metadata, which "
                "fpipe no longer loads: NOTE [no code from a checkpoint]). Save it again with this fpipe."
            )
        for rel, info in data["files"].items():
            self._check_size(rel, info["size"])
        return data

    def read(self, rel: str) -> bytes:
        fd = os.open(rel, os.O_RDONLY, dir_fd=self.fd)
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def _check_size(self, rel: str, size: int) -> None:
        try:
            have = os.stat(rel, dir_fd=self.fd).st_size
        except FileNotFoundError:
            raise ValueError(
                f"{self.call}: {self.path / rel} is missing ({size} bytes in the checkpoint's manifest); the "
                "checkpoint is incomplete: restore the file or load another checkpoint."
            ) from None
        if have != size:
            raise ValueError(
                f"{self.call}: {self.path / rel} has {have} bytes, the manifest says {size}: the file is "
                "truncated or was changed; restore it or load another checkpoint."
            )

    def mapped(self, rel: str) -> fmt.Mapped:
        """`rel`, mapped and its SHA-256 checked against the manifest's."""
        fd = os.open(rel, os.O_RDONLY, dir_fd=self.fd)
        try:
            m = fmt.Mapped(fd, str(self.path / rel))
        finally:
            os.close(fd)
        want = self.manifest["files"][rel]["sha256"]
        if m.sha256() != want:
            raise ValueError(
                f"{self.call}: {self.path / rel} does not have the SHA-256 the manifest records (the "
                "file was changed or damaged after it was written); restore it or load another checkpoint."
            )
        return m
