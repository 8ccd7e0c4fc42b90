"""Checkpoints keyed by the parameters' global names: what each rank writes (`save`, `async_save`).

# NOTE [checkpoints move between layouts]
A checkpoint holds every parameter once, under its name in the params dict, the optimizer's
state under the same names (each state tensor, and the group's hyperparameters and any
non-tensor state as data), the module's persistent buffers under their names (BatchNorm's
running statistics, `num_batches_tracked`), so nothing in it depends on how the run that wrote
it was cut. At save, each rank writes only what it owns: a parameter (and its state) by the
lowest pipeline rank that uses it (`Pipelined.param_owner`: a tied parameter once), a buffer by
the lowest pipeline rank whose stages read it (the one that updates it), by data-parallel
replica 0 alone unless it is a DTensor, whose shard each replica writes with its offset. At load
each rank reads, in the current run's layout, the pieces that overlap what it holds (a DTensor:
its own shard). Besides: the pipeline's step, which seeds its random operations (NOTE
[random-number policy]: dropout resumes bit-identically), and each rank's own `extra`.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..pipeline import Pipelined
from ..tracing import Functionalized, seeded
from . import checkpoint_files as files
from . import checkpoint_format as fmt
from .checkpoint_files import CheckpointError
from .checkpoint_job import AsyncCheckpoint, Job, wait_earlier

__all__ = ["save", "async_save", "AsyncCheckpoint", "persistent_buffers"]

_GROUPS: dict[int, Any] = {}  # the default group's id -> the gloo group checkpoints use


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Who this rank is in the run, and the owner (lowest pipeline rank) of each tensor."""

    distributed: bool
    pp_rank: int = 0
    dp_rank: int = 0
    owner: dict[str, int] = dataclasses.field(default_factory=dict)
    buffer_owner: dict[int, int] = dataclasses.field(default_factory=dict)  # id(buffer) -> rank

    def writes(self, owner: int, value: Any) -> bool:
        if isinstance(value, torch.Tensor) and value.is_meta:
            return False
        return owner == self.pp_rank and (isinstance(value, DTensor) or self.dp_rank == 0)


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
    rank = pg.rank if pg is not None else 0
    return _Layout(True, rank, dp, pipeline.param_owner(), _buffer_owner(pipeline))


def _buffer_owner(pipeline: Pipelined) -> dict[int, int]:
    """id(buffer) -> the lowest pipeline rank whose stages read it (the one that updates it)."""
    out: dict[int, int] = {}
    for c in pipeline._cache.values():
        sources = c.const_sources or [None] * len(c.consts)
        for name, traced, src in zip(c.staged.const_inputs, c.consts, sources):
            ranks = [c.runner.rank_of(p) for p in c.staged.consumers.get(name, [])]
            now = traced if src is None else src[0].get_buffer(src[1])
            if ranks:
                out[id(now)] = min(ranks + [out.get(id(now), ranks[0])])
    return out


def _check_params(call: str, params: Any) -> None:
    if not isinstance(params, dict) or not all(isinstance(v, torch.Tensor) for v in params.values()):
        raise TypeError(
            f"{call}: params must be the params dict (name -> tensor) from fpipe.functionalize, "
            f"got {type(params).__name__}."
        )


def _optim_entries(call: str, optimizer: Any, params: dict[str, torch.Tensor]) -> Any:
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


# -- buffers --------------------------------------------------------------------------------------
def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers `module.state_dict()` holds (persistent ones), by name, each once."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, sub in module.named_modules():
        for name, b in sub._buffers.items():
            if b is not None and name not in sub._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                out[f"{prefix}.{name}" if prefix else name] = b
    return out


def buffers_of(call: str, buffers: Any, pipeline: Any) -> dict[str, torch.Tensor]:
    """`buffers=`: a module (its persistent buffers) or a dict; by default the persistent
    buffers of the module `pipeline` traced (or was `fpipe.functionalize`d from)."""
    if isinstance(buffers, nn.Module):
        return persistent_buffers(buffers)
    if buffers is None:
        roots = _traced_modules(pipeline) if pipeline is not None else []
        return {n: b for m in roots for n, b in persistent_buffers(m).items()} if len(roots) == 1 else {}
    if isinstance(buffers, dict) and all(isinstance(v, torch.Tensor) for v in buffers.values()):
        return buffers
    raise TypeError(
        f"{call}: buffers= must be the module (its persistent buffers are taken) or a dict of name "
        f"-> tensor, got {type(buffers).__name__}."
    )


def _traced_modules(pipeline: Pipelined) -> list[nn.Module]:
    """The modules `pipeline`'s function runs through `fpipe.functionalize` (one, usually)."""
    found = [pipeline.cfg.f.module] if isinstance(pipeline.cfg.f, Functionalized) else []
    for c in pipeline._cache.values():
        found += [src[0] for src in c.const_sources or [] if src is not None]
    return list({id(m): m for m in found}.values())


# -- what this rank writes ------------------------------------------------------------------------
class _Writing:
    """This rank's tensors (key -> tensor) and its index (what each one is)."""

    def __init__(self, stage: bool) -> None:
        self.stage = stage  # async: copy each tensor now, so training may change the original
        self.tensors: dict[str, torch.Tensor] = {}
        self.extra: dict[str, torch.Tensor] = {}  # extra's tensors: a small file of their own
        self.entries: list[dict[str, Any]] = []

    def sink(
        self, t: torch.Tensor, where: str = "a value", into: dict[str, torch.Tensor] | None = None
    ) -> str:
        t = t.detach()
        fmt.check_dtype(where, t)
        into = self.tensors if into is None else into
        key = f"t{len(into)}"
        into[key] = t.to("cpu", copy=True) if self.stage else t
        return key

    def add(self, kind: str, name: str, t: torch.Tensor, state: str = "") -> None:
        """A piece of a named tensor: the whole of it, or a DTensor's local shard and its offset."""
        offset = [0] * t.dim()
        local = t
        if isinstance(t, DTensor):
            _, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            offset, local = list(off), t.to_local()
        key = self.sink(local, f"{kind} {name!r}" + (f" state {state!r}" if state else ""))
        self.entries.append({
            "kind": kind, "name": name, "state": state, "tensor": key, "offset": offset,
            "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
        })  # fmt: skip


def _collect(
    call: str, params: Any, optimizer: Any, buffers: dict[str, torch.Tensor], extra: Any, lay: _Layout,
    stage: bool,
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:  # fmt: skip
    """What this rank writes (NOTE above) and its index; a TypeError or ValueError for bad arguments."""
    _check_params(call, params)
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"{call}: extra must be a dict (step, RNG states, ...), got {type(extra).__name__}.")
    w = _Writing(stage)
    for n, t in params.items():
        if lay.writes(lay.owner.get(n, 0), t):
            w.add("param", n, t)
    for n, b in buffers.items():
        if lay.writes(lay.buffer_owner.get(id(b), 0), b):
            w.add("buffer", n, b)
    optim = _collect_optim(call, optimizer, params, lay, w) if optimizer is not None else {}
    try:
        enc = fmt.encode(extra or {}, lambda t: w.sink(t, "a tensor of extra", w.extra), "extra")
    except TypeError as err:
        raise TypeError(f"{call}: {err}") from None
    return {"": w.tensors, ".extra": w.extra}, {"entries": w.entries, "optim": optim, "extra": enc}


def _collect_optim(call: str, optimizer: Any, params: Any, lay: _Layout, w: _Writing) -> dict[str, Any]:
    out = {}
    for name, p, state, group in _optim_entries(call, optimizer, params):
        if not lay.writes(lay.owner.get(name, 0), p):
            continue
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        for k, v in tensors.items():
            w.add("optim", name, v, k)
        rest = {"hparams": _hparams(group), "scalars": {k: v for k, v in state.items() if k not in tensors}}
        try:
            out[name] = fmt.encode(rest, w.sink, f"the optimizer's state of {name!r}")
        except TypeError as err:
            raise TypeError(f"{call}: {err}") from None
    return out


# -- starting a save ------------------------------------------------------------------------------
def checkpoint_group() -> Any:
    """A gloo group over all ranks for checkpoints alone (created at the first save, on every
    rank): its collectives never meet the pipeline's."""
    key = id(dist.group.WORLD)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(backend="gloo", timeout=timedelta(minutes=30))
    return _GROUPS[key]


def _agree(call: str, group: Any, err: BaseException | None, what: str = "refused to save") -> None:
    """Every rank learns whether any failed (an error on one rank alone would leave the others
    waiting for its files)."""
    if group is None:
        return
    said: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(said, None if err is None else f"{type(err).__name__}: {err}", group=group)
    bad = [(r, m) for r, m in enumerate(said) if m is not None]
    if bad and err is None:
        raise CheckpointError(f"{call}: rank {bad[0][0]} {what}, so no rank does: {bad[0][1]}")


def _start(call: str, path: Any, args: dict[str, Any], stage: bool) -> Job:
    """Check everything, then (collectively) prepare the directory the new checkpoint goes to."""
    wait_earlier(call)
    pipeline = args["pipeline"]
    lay = _layout(call, pipeline, saving=True)  # the same verdict on every rank
    group = checkpoint_group() if lay.distributed else None
    try:
        bufs = buffers_of(call, args["buffers"], pipeline)
        tensors, index = _collect(call, args["params"], args["optimizer"], bufs, args["extra"], lay, stage)
    except Exception as err:  # any failure here (a bad argument, memory for a staging copy): every rank hears
        _agree(call, group, err)
        raise
    _agree(call, group, None)
    rank = dist.get_rank(group) if group is not None else 0
    path = Path(os.path.abspath(path))
    lock, failed = _begin(call, path) if rank == 0 else (None, None)
    _agree(call, group, failed, "could not start the save")
    if failed is not None:
        raise failed
    nonce = [files.new_nonce()]
    if group is not None:
        dist.broadcast_object_list(nonce, src=dist.get_global_rank(group, 0), group=group)
    head = {"rng_step": pipeline._steps, "random": _draws(pipeline)} if pipeline is not None else {}
    ranks = dist.get_world_size(group) if group is not None else 1
    return Job(call, path, files.saving_dir(path), rank, ranks, nonce[0], tensors, index, head, lock)


def _draws(pipeline: Pipelined) -> bool:
    """Do the pipeline's programs draw random numbers (seeded by its step: NOTE [random-number
    policy])?"""
    progs = [p for c in pipeline._cache.values() for p in c.staged.programs.values()]
    return any(n.target is seeded for p in progs for n in p.gm.graph.nodes)


def _begin(call: str, path: Path) -> tuple[int | None, BaseException | None]:
    lock = None
    try:
        files.refuse_foreign(call, path)  # before the lock file is made beside it
        lock = files.lock(call, path)
        files.begin(call, path)
        return lock, None
    except (ValueError, OSError, CheckpointError) as err:
        if lock is not None:
            files.unlock(lock)
        return None, err


def save(
    path: str | Path, params: dict[str, torch.Tensor], *, optimizer: Any = None, buffers: Any = None,
    extra: Any = None, pipeline: Any = None,
) -> None:  # fmt: skip
    """Write a checkpoint of `params`, `optimizer`'s state, the module's buffers, the pipeline's
    step and `extra` to the directory `path` (docs/CHECKPOINTS.md).

    Collective in a process group: every rank calls it at the same point. Each tensor is written
    once under its name, by the rank that owns it (NOTE [checkpoints move between layouts]); the
    directory is written aside and published atomically, so a save that is killed leaves the
    previous checkpoint at `path` (NOTE [publishing a checkpoint]).

    Args:
        path: the checkpoint directory: absent, empty, or an earlier fpipe checkpoint (replaced
            whole when the new one is complete); anything else is refused.
        params: the params dict (`fpipe.functionalize`'s names): this rank's entries are real.
        optimizer: a `torch.optim` optimizer over tensors of `params`: its state and
            hyperparameters are saved under the parameters' names.
        buffers: the module whose persistent buffers are saved (or a dict name -> tensor); by
            default those of the module `pipeline`'s function was functionalized from.
        extra: this rank's small dict (step, data position, RNG states, a scheduler's
            state_dict): tensors, numbers, strings, bytes, None, lists/tuples/dicts of them;
            `load` gives each rank its own back.
        pipeline: the `Pipelined` that trains `params`: its step (which seeds dropout) is saved;
            required in a process group.

    Raises:
        ValueError, TypeError: bad arguments, or a `path` fpipe did not write (nothing written).
        CheckpointError: another save to `path` is running, the disk is full, a rank failed.

    Example:
        >>> import torch, fpipe, tempfile
        >>> d = tempfile.mkdtemp()
        >>> fpipe.save(d + "/ckpt", {"w": torch.ones(2)}, extra={"step": 3})
        >>> w = {"w": torch.zeros(2)}
        >>> fpipe.load(d + "/ckpt", w), w["w"]
        ({'step': 3}, tensor([1., 1.]))
    """
    args = dict(params=params, optimizer=optimizer, buffers=buffers, extra=extra, pipeline=pipeline)
    _start(f"save({str(path)!r}, params)", path, args, stage=False).run()


def async_save(
    path: str | Path, params: dict[str, torch.Tensor], *, optimizer: Any = None, buffers: Any = None,
    extra: Any = None, pipeline: Any = None,
) -> AsyncCheckpoint:  # fmt: skip
    """`save`, with the writing in a background thread: returns once this rank's tensors are
    copied to memory, so training can go on and change them.

    Publishing happens when every rank's files are written; `.result()` waits for that and
    raises a `CheckpointError` if it failed. A failure nobody waited for is raised by the next
    fpipe call of this process, or reported at exit (NOTE [a save's failure is never lost]).
    A later `save`, `async_save` or `load` in this process waits for this one first.
    """
    args = dict(params=params, optimizer=optimizer, buffers=buffers, extra=extra, pipeline=pipeline)
    return AsyncCheckpoint(_start(f"async_save({str(path)!r}, params)", path, args, stage=True))
