"""Checkpoints keyed by the parameters' global names, on torch.distributed.checkpoint (DCP).

# NOTE [checkpoints move between layouts]
A checkpoint holds every parameter once, under its name in the params dict, and the optimizer's
state under the same names (`optim/state/NAME/KEY` for a tensor, `optim/group/NAME` for the
group's hyperparameters and any non-tensor state), so nothing in it depends on how the run that
wrote it was cut. At save, each rank hands DCP only what it owns: a parameter (and its state) is
written by the lowest pipeline rank that uses it (`Pipelined.param_owner`: a tied parameter
once), by data-parallel replica 0 alone unless it is a DTensor, whose shards every replica
writes. At load, each rank builds its own read plan (`no_dist`: no collective) for the
parameters its stages read, in the current run's layout (DTensor shards included), and DCP copies
in place what the checkpoint holds in whatever pieces it was written. Everything is checked
before a byte is read (NOTE [publishing a checkpoint] in checkpoint_files.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from . import checkpoint_files as files
from .api import Pipelined

__all__ = ["save", "async_save", "AsyncCheckpoint"]

STATE, GROUP = "optim/state/", "optim/group/"
_GROUPS: dict[int, Any] = {}  # the default group's id -> the gloo group checkpoints use
_pending: list[AsyncCheckpoint] = []  # this process's async save in flight (at most one)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Who this rank is in the run, and the owner (lowest pipeline rank) of each parameter."""

    distributed: bool
    pp_rank: int = 0
    dp_rank: int = 0
    owner: dict[str, int] = dataclasses.field(default_factory=dict)

    def writes(self, name: str, value: Any) -> bool:
        if isinstance(value, torch.Tensor) and value.is_meta:
            return False
        if self.owner.get(name, 0) != self.pp_rank:
            return False
        return isinstance(value, DTensor) or self.dp_rank == 0


def _in_group() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _layout(call: str, pipeline: Any, saving: bool) -> _Layout:
    """The run's layout; refused under a process group without `pipeline=` (before a collective)."""
    if pipeline is not None and not isinstance(pipeline, Pipelined):
        raise TypeError(
            f"{call}: pipeline= must be the result of fpipe.pipeline, got {type(pipeline).__name__}."
        )
    pg = pipeline.pg if pipeline is not None else None  # (may start the process group)
    if not _in_group():
        return _Layout(False)
    if pipeline is None:
        what = "written once, by the rank that owns it" if saving else "read by the ranks whose stages use it"
        raise ValueError(
            f"{call}: a process group is running, so each rank holds part of the model; pass "
            f"pipeline=piped (the Pipelined that trains params) so each parameter is {what}."
        )
    if saving and not pipeline._cache:
        raise ValueError(
            f"{call}: {pipeline!r} has not traced a step yet, so which rank owns which parameter "
            "is unknown; save after a step or after piped.materialize(...)."
        )
    dp = pipeline.dp.rank if pipeline.dp is not None else 0
    return _Layout(True, pg.rank if pg is not None else 0, dp, pipeline.param_owner())


def _check_params(call: str, params: Any) -> None:
    if not isinstance(params, dict) or not all(isinstance(v, torch.Tensor) for v in params.values()):
        raise TypeError(
            f"{call}: params must be the params dict (name -> tensor) from fpipe.functionalize, "
            f"got {type(params).__name__}."
        )


def _optim_entries(call: str, optimizer: Any, params: dict[str, torch.Tensor]) -> Iterator[Any]:
    """(name, parameter, its state, its group) for each parameter the optimizer holds."""
    ids = {id(t): n for n, t in params.items()}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) not in ids:
                raise ValueError(
                    f"{call}: optimizer.param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) is "
                    "not a tensor of params; build the optimizer over params' own tensors, e.g. "
                    "torch.optim.AdamW(piped.local(params).values())."
                )
            yield ids[id(p)], p, optimizer.state.get(p, {}), group


def _hparams(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


# -- save -----------------------------------------------------------------------------------------
def _save_state(call: str, params: Any, optimizer: Any, lay: _Layout) -> dict[str, Any]:
    """What this rank writes: the parameters it owns and their optimizer state (NOTE above)."""
    sd: dict[str, Any] = {n: t.detach() for n, t in params.items() if lay.writes(n, t)}
    for name, _, state, group in _optim_entries(call, optimizer, params) if optimizer is not None else ():
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        sd.update({f"{STATE}{name}/{k}": v.detach() for k, v in tensors.items() if lay.writes(name, v)})
        blob = {"hparams": _hparams(group), "scalars": {k: v for k, v in state.items() if k not in tensors}}
        if lay.writes(name, blob):
            sd[GROUP + name] = files.to_bytes(call, blob, f"the optimizer's state of {name!r}")
    return sd


def _group() -> Any:
    """A gloo group over all ranks for checkpoints alone (created at the first save, on every
    rank): DCP's collectives, run from a thread by `async_save`, never meet the pipeline's."""
    key = id(dist.group.WORLD)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(backend="gloo", timeout=timedelta(minutes=30))
    return _GROUPS[key]


@dataclasses.dataclass
class _Job:
    """One save: where it writes, what this rank writes, and the group it writes with."""

    call: str
    path: Path
    tmp: Path
    state: dict[str, Any]
    extra: bytes
    group: Any

    @property
    def rank0(self) -> bool:
        return self.group is None or dist.get_rank(self.group) == 0

    def writer(self) -> Any:
        return dcp.FileSystemWriter(self.tmp)

    def publish(self, failed: BaseException | None) -> None:
        """Rank 0 publishes the written checkpoint; every rank learns whether that worked."""
        err = failed
        if err is None and self.rank0:
            try:
                files.finish(self.tmp, self.path, self.extra)
            except Exception as e:
                err = e
        if self.group is not None:
            said = [f"{type(err).__name__}: {err}" if err is not None else None]
            dist.broadcast_object_list(said, src=dist.get_global_rank(self.group, 0), group=self.group)
            if err is None and said[0] is not None:
                err = RuntimeError(f"{self.call}: rank 0 could not publish {self.path}: {said[0]}")
        if err is not None:
            raise err


def _start(call: str, path: Any, params: Any, optimizer: Any, extra: Any, pipeline: Any) -> _Job:
    """Check everything, then (collectively) prepare the directory the new checkpoint goes to."""
    for earlier in list(_pending):
        earlier.result()
    lay = _layout(call, pipeline, saving=True)  # the same verdict on every rank
    group = _group() if lay.distributed else None
    try:
        state, blob = _checked(call, params, optimizer, extra, lay)
    except (TypeError, ValueError) as err:
        _agree(call, group, err)
        raise
    _agree(call, group, None)
    path = Path(path).absolute()
    job = _Job(call, path, files.saving_dir(path), state, blob, group)
    if job.rank0:
        files.begin(path)
    if group is not None:
        dist.barrier(group=group)
    return job


def _checked(
    call: str, params: Any, optimizer: Any, extra: Any, lay: _Layout
) -> tuple[dict[str, Any], bytes]:
    """What this rank writes and `extra`'s bytes; a TypeError or ValueError for bad arguments."""
    _check_params(call, params)
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"{call}: extra must be a dict (step, RNG states, ...), got {type(extra).__name__}.")
    return _save_state(call, params, optimizer, lay), files.to_bytes(call, extra or {}, "extra")


def _agree(call: str, group: Any, err: BaseException | None) -> None:
    """Every rank learns whether any refused the save (an argument error on one rank alone would
    leave the others waiting in DCP's first collective)."""
    if group is None:
        return
    said: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(said, None if err is None else f"{type(err).__name__}: {err}", group=group)
    bad = [(r, m) for r, m in enumerate(said) if m is not None]
    if bad and err is None:
        raise RuntimeError(f"{call}: rank {bad[0][0]} refused to save, so no rank does: {bad[0][1]}")


_NO_DIST = "torch.distributed is disabled, unavailable or uninitialized"  # DCP's, with no_dist too


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST, category=UserWarning)
        yield


def save(
    path: str | Path, params: dict[str, torch.Tensor], *, optimizer: Any = None, extra: Any = None,
    pipeline: Any = None,
) -> None:  # fmt: skip
    """Write a checkpoint of `params` (and `optimizer`'s state, and `extra`) to the directory `path`.

    Collective in a process group: every rank calls it at the same point. Each parameter is
    written once under its name, by the rank that owns it (NOTE [checkpoints move between
    layouts]); the directory is written aside and published atomically, so a save that is killed
    leaves the previous checkpoint at `path` (NOTE [publishing a checkpoint]).

    Args:
        path: the checkpoint directory (replaced when the new checkpoint is complete).
        params: the params dict (`fpipe.functionalize`'s names): this rank's entries are real.
        optimizer: a `torch.optim` optimizer over tensors of `params` (per-parameter state of
            tensors and scalars): its state and hyperparameters are saved under the names.
        extra: a small dict (step, data position, RNG states, a scheduler's state_dict) that
            `torch.load(weights_only=True)` can read back; `load` returns it.
        pipeline: the `Pipelined` that trains `params`; required in a process group.

    Example:
        >>> import torch, fpipe, tempfile
        >>> d = tempfile.mkdtemp()
        >>> fpipe.save(d + "/ckpt", {"w": torch.ones(2)}, extra={"step": 3})
        >>> w = {"w": torch.zeros(2)}
        >>> fpipe.load(d + "/ckpt", w), w["w"]
        ({'step': 3}, tensor([1., 1.]))
    """
    job = _start(f"save({str(path)!r}, params)", path, params, optimizer, extra, pipeline)
    with _quiet():
        dcp.save(job.state, storage_writer=job.writer(), process_group=job.group, no_dist=job.group is None)
    job.publish(None)


class AsyncCheckpoint:
    """A save in progress (`fpipe.async_save`): `result()` waits until it is published."""

    def __init__(self, path: Path, future: Future[None]) -> None:
        self.path, self._future = path, future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> None:
        """Wait until the checkpoint is written and published (re-raises a failure)."""
        try:
            self._future.result(timeout)
        finally:
            if self._future.done() and self in _pending:
                _pending.remove(self)


def async_save(
    path: str | Path, params: dict[str, torch.Tensor], *, optimizer: Any = None, extra: Any = None,
    pipeline: Any = None,
) -> AsyncCheckpoint:  # fmt: skip
    """`save`, with the writing in a background thread (`dcp.async_save`): returns once this
    rank's tensors are copied (staged) to memory, so training can go on and change them.

    Publishing happens when the writing completes; `.result()` waits for that. A later `save`
    or `async_save` in this process waits for this one first. Arguments as for `save`.
    """
    job = _start(f"async_save({str(path)!r}, params)", path, params, optimizer, extra, pipeline)
    if job.group is None:  # DCP warns from its writer thread, past any catch_warnings: this one only
        warnings.filterwarnings("ignore", message=_NO_DIST, category=UserWarning)
    with _quiet():
        up = dcp.async_save(
            job.state, storage_writer=job.writer(), process_group=job.group, no_dist=job.group is None
        )
    upload: Future[Any] = getattr(up, "upload_completion", up)  # type: ignore[arg-type]
    done: Future[None] = Future()

    def after(f: Future[Any]) -> None:
        try:
            job.publish(f.exception())
            done.set_result(None)
        except BaseException as err:
            done.set_exception(err)

    handle = AsyncCheckpoint(job.path, done)
    _pending.append(handle)
    upload.add_done_callback(after)
    return handle
