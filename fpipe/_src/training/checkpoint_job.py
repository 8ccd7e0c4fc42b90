"""One save's writing and publishing, on this thread (`save`) or a background one (`async_save`).

# NOTE [a save's failure is never lost]
Ranks coordinate the writing through the scratch directory alone, not through a process group
(NOTE [publishing a checkpoint]): each rank writes its files and then its index, rank 0 waits
for every rank's index (or a rank's `rank{R}.failed`, naming what went wrong there) and
publishes, and the other ranks wait until the manifest at `path` carries this save's nonce (or
the scratch directory is gone: rank 0 failed). So `dist.destroy_process_group()` right after an
`async_save` does not stop it, and the background thread, not a daemon, is waited for when the
interpreter exits. A failure is a `CheckpointError` (an `Exception`) naming the save and its
path: raised by `.result()`; else by the next `fpipe.save`/`async_save`/`load` or pipeline call
of the process, which then does nothing; else reported at exit, which then exits with status 1.
A full disk says so, and the save deletes its scratch directory.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import os
import shutil
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from ..pipeline import check_before_calls
from . import checkpoint_files as files
from . import checkpoint_format as fmt
from .checkpoint_files import CheckpointError

__all__ = ["AsyncCheckpoint", "Job", "check_earlier", "wait_earlier"]

WAIT_S = 1800.0  # how long a rank waits for the others' files (a killed rank's never come)
_pending: list[AsyncCheckpoint] = []


@dataclasses.dataclass
class Job:
    """One rank's part of one save."""

    call: str
    path: Path
    tmp: Path
    rank: int
    ranks: int
    nonce: str
    tensors: dict[str, dict[str, torch.Tensor]]  # file suffix -> its tensors
    index: dict[str, Any]
    head: dict[str, Any]  # rank 0: what the manifest says besides the files
    lock: int | None = None  # rank 0: the lock's descriptor

    def run(self) -> None:
        """Write this rank's files; rank 0 then publishes, the others wait until it has."""
        try:
            self._write()
            if self.rank == 0:
                self._wait_for_ranks()
                files.finish(self.tmp, self.path, {**self.head, "nonce": self.nonce}, self.ranks)
            else:
                self._wait_for_publish()
        except BaseException as err:
            self._failed(err)
            raise _said(self.call, self.path, err) from err
        finally:
            if self.lock is not None:
                files.unlock(self.lock)

    def _write(self) -> None:
        written = {}
        for part, tensors in self.tensors.items():  # rank{R}.safetensors, rank{R}.extra.safetensors
            name = f"rank{self.rank}{part}.safetensors"
            size, sha = fmt.write_safetensors(str(self.tmp / name), tensors)
            written[name] = {"size": size, "sha256": sha}
        files.phase("written")
        index = {**self.index, "files": written}
        aside = self.tmp / f".rank{self.rank}.json.part"
        fmt.write_synced(str(aside), fmt.dumps(index))
        os.rename(aside, self.tmp / f"rank{self.rank}.json")

    def _wait_for_ranks(self) -> None:
        for r in range(1, self.ranks):
            _poll(self.call, f"rank {r}'s files in {self.tmp}", lambda r=r: self._rank_done(r))

    def _rank_done(self, r: int) -> bool:
        failed = self.tmp / f"rank{r}.failed"
        if failed.is_file():
            raise CheckpointError(f"rank {r} failed: {failed.read_text().strip()}")
        return (self.tmp / f"rank{r}.json").is_file()

    def _wait_for_publish(self) -> None:
        def published() -> bool:
            if (files.manifest_of(self.path) or {}).get("nonce") == self.nonce:
                return True
            if not self.tmp.is_dir() and (files.manifest_of(self.path) or {}).get("nonce") != self.nonce:
                raise CheckpointError("rank 0 did not publish it (it failed: see rank 0's error)")
            return False

        _poll(self.call, f"rank 0 to publish {self.path}", published)

    def _failed(self, err: BaseException) -> None:
        """Leave nothing behind: rank 0 deletes the scratch directory, another rank says why."""
        if self.rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
        elif self.tmp.is_dir():
            try:
                (self.tmp / f"rank{self.rank}.failed").write_text(f"{type(err).__name__}: {err}\n")
            except OSError:
                pass


def _poll(call: str, what: str, done: Any) -> None:
    start, nap = time.monotonic(), 0.005
    while not done():
        if time.monotonic() - start > WAIT_S:
            raise TimeoutError(f"waited {WAIT_S:.0f} s for {what} (a rank stopped?)")
        time.sleep(nap)
        nap = min(nap * 2, 0.2)


def _said(call: str, path: Path, err: BaseException) -> CheckpointError:
    if isinstance(err, CheckpointError) and str(err).startswith(call):
        return err
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return CheckpointError(
            f"{call}: the disk is full ({err.filename or path}): the checkpoint was not written, its "
            f"scratch directory was deleted, and {path} is as it was. Free space and save again."
        )
    return CheckpointError(
        f"{call}: the checkpoint was not published ({type(err).__name__}: {err}); {path} is as it was."
    )


# -- async ----------------------------------------------------------------------------------------
class AsyncCheckpoint:
    """A save in progress (`fpipe.async_save`): `result()` waits until it is published."""

    def __init__(self, job: Job) -> None:
        self.path, self.call = job.path, job.call
        self._future: Future[None] = Future()
        self._reported = False
        self._thread = threading.Thread(target=self._run, args=(job,), name=f"fpipe {job.call}")
        _pending.append(self)
        self._thread.start()

    def _run(self, job: Job) -> None:
        try:
            job.run()
            self._future.set_result(None)
        except BaseException as err:
            self._future.set_exception(err)

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> None:
        """Wait until the checkpoint is written and published; a failure is a CheckpointError."""
        try:
            self._future.result(timeout)
        finally:
            if self._future.done():
                _forget(self)

    def _error(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None


def _forget(handle: AsyncCheckpoint) -> None:
    if handle in _pending:
        _pending.remove(handle)


def check_earlier(call: str) -> None:
    """Raise (once) the failure of an earlier `async_save` of this process that has ended."""
    for h in list(_pending):
        err = h._error()
        if h.done():
            _forget(h)
        if err is not None:
            raise CheckpointError(
                f"{call}: not run, because an earlier {h.call} failed (said once): {err}"
            ) from err


def wait_earlier(call: str) -> None:
    """Wait for this process's `async_save`s in flight; raise an earlier one's failure."""
    for h in list(_pending):
        h._future.exception()  # waits
    check_earlier(call)


def _at_exit() -> None:
    """Wait for saves in flight; report a failure nobody has seen and exit with status 1."""
    bad = []
    for h in list(_pending):
        err = h._future.exception()
        if err is not None:
            bad.append(err)
    if bad:
        for err in bad:
            print(f"fpipe: {err}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


atexit.register(_at_exit)
check_before_calls(check_earlier)  # the next pipeline call raises an earlier failure
