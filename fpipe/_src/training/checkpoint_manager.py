"""`fpipe.CheckpointManager`: a checkpoint every N steps in its own folder, the last K kept.

# NOTE [the checkpoint manager]
A training run's checkpoints, in the shape of Orbax's `CheckpointManager` and torchtitan's
checkpointer: step S is saved (`fpipe.save`, or `fpipe.async_save`) to `root/step_SSSSSSSS`, a
folder of its own. A step folder appears only when its checkpoint is complete (fpipe publishes a
checkpoint by one rename, NOTE [publishing a checkpoint]), so a save that was killed leaves no
step folder, and `latest()` -- the newest step folder that holds an fpipe manifest -- is always a
checkpoint that loads. After each save is published, the oldest step folders beyond `keep` are
deleted: only folders named `step_<8+ digits>` that hold an fpipe checkpoint (renamed to
`.step_...deleting` first, so a folder half deleted by a crash is never taken for a step). Every
other file or folder in `root` (a config, logs, a user's folder named like a step) is never
touched. In a process group, rank 0 deletes and decides which step `restore` reads; every rank
checks it sees that step too (`root` must be on a filesystem every rank sees).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import checkpoint_files as files
from .checkpoint import AsyncCheckpoint, async_save, checkpoint_group, save
from .checkpoint_load import load

__all__ = ["CheckpointManager", "Restored"]

_STEP = re.compile(r"step_(\d{8,})")


class Restored(NamedTuple):
    """What `CheckpointManager.restore` read: the step, and the `extra` saved with it."""

    step: int
    extra: dict[str, Any]


def _rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _is_checkpoint(folder: Path) -> bool:
    """A real folder (not a link) holding an fpipe manifest: a checkpoint fpipe published."""
    return not folder.is_symlink() and folder.is_dir() and files.manifest_of(folder) is not None


class CheckpointManager:
    """Checkpoints of a training run under `root`: one folder per saved step, the last `keep` kept.

    Args:
        root: the run's checkpoint folder (created at the first save). It may hold other files:
            the manager reads and deletes only its step folders (NOTE [the checkpoint manager]).
        keep: how many of the newest step folders to keep (None: all).
        every: `save(step, ...)` saves when `step % every == 0` (or when forced).
        async_: save with `fpipe.async_save` (training goes on while the files are written); the
            manager waits for one save before it starts the next, and in `wait()`/`close()`.
        pipeline: the `Pipelined` that trains the parameters (required in a process group, as for
            `fpipe.save`/`fpipe.load`).

    Example:
        >>> import torch, fpipe, tempfile
        >>> mgr = fpipe.CheckpointManager(tempfile.mkdtemp(), keep=2, every=10, async_=False)
        >>> params = {"w": torch.zeros(2)}
        >>> for step in range(1, 31):
        ...     params["w"] += 1
        ...     _ = mgr.save(step, params, extra={"data": step})
        >>> mgr.all_steps(), mgr.latest()
        ([20, 30], 30)
        >>> mgr.restore(params, step=20), params["w"]
        (Restored(step=20, extra={'data': 20}), tensor([20., 20.]))
    """

    def __init__(
        self, root: str | Path, *, keep: int | None = 3, every: int = 1, async_: bool = True,
        pipeline: Any = None,
    ) -> None:  # fmt: skip
        call = f"CheckpointManager({str(root)!r})"
        for name, value, least in (("keep", keep, 1), ("every", every, 1)):
            if value is None and name == "keep":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{call}: {name}={value!r}; it must be an int >= {least}.")
        self.root = Path(root).absolute()
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(
                f"{call}: {self.root} exists and is not a folder; give a folder for the run's checkpoints."
            )
        self.keep, self.every, self.async_, self.pipeline = keep, every, bool(async_), pipeline
        self._pending: AsyncCheckpoint | None = None
        self._last = self.latest()

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.root)!r}, keep={self.keep}, every={self.every}, async_={self.async_})"

    # -- reading the folder ---------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        """The folder of step `step`: `root/step_00000100` for step 100."""
        return self.root / f"step_{step:08d}"

    def all_steps(self) -> list[int]:
        """The steps with a complete checkpoint under `root`, oldest first."""
        if not self.root.is_dir():
            return []
        found = (_STEP.fullmatch(d.name) for d in self.root.iterdir())
        return sorted(int(m.group(1)) for m in found if m and _is_checkpoint(self.root / m.group(0)))

    def latest(self) -> int | None:
        """The newest step with a complete checkpoint; None when there is none yet."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        return step % self.every == 0

    # -- saving ---------------------------------------------------------------------------------
    def save(
        self, step: int, params: dict[str, torch.Tensor], *, optimizer: Any = None, buffers: Any = None,
        extra: Any = None, force: bool = False,
    ) -> bool:  # fmt: skip
        """Save step `step` if `step % every == 0` or `force`; True when it saved (or started to).

        Collective in a process group, like `fpipe.save`: every rank calls it at every step.
        `optimizer`, `buffers` and `extra` (each rank's own) as for `fpipe.save`. The previous
        save (when `async_`) is waited for first, and its failure raised here. Steps must
        increase: a step at or below the newest saved one is refused.
        """
        call = f"CheckpointManager.save({step!r}, params)"
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{call}: step must be an int >= 0, got {step!r}.")
        if not (force or self.should_save(step)):
            return False
        self.wait()
        if self._last is not None and step <= self._last:
            raise ValueError(
                f"{call}: step {self._last} is already saved in {self.root}; steps must increase "
                "(restore the latest step and go on from there, or use another root)."
            )
        kw = {"optimizer": optimizer, "buffers": buffers, "extra": extra, "pipeline": self.pipeline}
        if self.async_:
            self._pending = async_save(self.step_dir(step), params, **kw)
        else:
            save(self.step_dir(step), params, **kw)
            self._prune()
        self._last = step
        return True

    def wait(self) -> None:
        """Wait until the save in progress (if any) is published, then delete the steps beyond
        `keep`; a failure of that save is raised here."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
            self._prune()

    close = wait

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wait()

    def _prune(self) -> None:
        """Rank 0: delete the oldest step folders beyond `keep` (NOTE [the checkpoint manager])."""
        if self.keep is None or not _rank0():
            return
        for old in self.root.glob(".step_*.deleting"):  # a deletion a crash interrupted
            if _STEP.fullmatch(old.name[1 : -len(".deleting")]) and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
        steps = self.all_steps()
        for step in steps[: -self.keep]:
            folder = self.step_dir(step)
            if extra := files.foreign_entries(folder, files.manifest_of(folder) or {}):
                warnings.warn(
                    f"CheckpointManager: {folder} is kept past keep={self.keep}: it also holds "
                    f"files fpipe did not write ({extra[:5]}); move them away to let it go.",
                    stacklevel=3,
                )
                continue
            gone = folder.with_name(f".{folder.name}.deleting")
            folder.rename(gone)
            shutil.rmtree(gone)
        for step in self._older_leftovers(steps[-self.keep :]):
            self._clear_leftovers(step)

    def _older_leftovers(self, kept: list[int]) -> list[int]:
        """Steps older than the oldest kept one with fpipe's scratch or lock files beside them."""
        found = set()
        for p in self.root.glob(".step_*"):
            m = re.fullmatch(r"\.(step_\d{8,})\.(saving|lock)", p.name)
            if m and kept and int(m.group(1)[5:]) < kept[0]:
                found.add(int(m.group(1)[5:]))
        return sorted(found)

    def _clear_leftovers(self, step: int) -> None:
        """A killed save's scratch folder (fpipe's, unlocked: no save of it runs) and its lock."""
        folder = self.step_dir(step)
        try:
            fd = files.lock(repr(self), folder)
        except files.CheckpointError:  # a save of that step runs (another job): leave it
            return
        try:
            scratch = files.saving_dir(folder)
            if files.saving_dir(folder).exists() and files._ours(scratch):
                shutil.rmtree(scratch)
            with contextlib.suppress(FileNotFoundError):
                folder.with_name(f".{folder.name}.lock").unlink()
        finally:
            files.unlock(fd)

    # -- restoring ------------------------------------------------------------------------------
    def restore(
        self, params: dict[str, torch.Tensor], *, optimizer: Any = None, buffers: Any = None,
        step: int | None = None,
    ) -> Restored:  # fmt: skip
        """Load step `step` (default: the latest) into `params` (and `optimizer`, the buffers, the
        pipeline's step) in place, as `fpipe.load` does; return the step and this rank's `extra`.

        Raises:
            FileNotFoundError: no complete checkpoint under `root` (check `latest()` first), or
                none of step `step` (the steps there are named).
        """
        call = f"CheckpointManager.restore(params, step={step!r})"
        self.wait()
        steps = self.all_steps()
        chosen = self._agreed(steps[-1] if step is None and steps else step)
        if chosen is None:
            raise FileNotFoundError(f"{call}: no complete checkpoint in {self.root} (latest() is None).")
        if chosen not in steps:
            raise FileNotFoundError(
                f"{call}: no complete checkpoint of step {chosen} in {self.root}; it has steps {steps}."
            )
        extra = load(
            self.step_dir(chosen), params, optimizer=optimizer, buffers=buffers, pipeline=self.pipeline
        )
        self._last = max(steps)
        return Restored(chosen, extra)

    def _agreed(self, step: int | None) -> int | None:
        """In a process group: rank 0's choice of step, on every rank (ranks that listed the
        folder a moment apart must not resume from different steps)."""
        if self.pipeline is not None:
            _ = self.pipeline.pg  # (starts the process group under torchrun, as fpipe.load would)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return step
        said = [step]
        dist.broadcast_object_list(said, src=0, group=checkpoint_group())  # its 30-minute deadline
        return said[0]
