"""`fpipe.load`: fill this rank's parameters and optimizer state from a checkpoint, in place.

Every rank reads on its own (DCP `no_dist`: no collective), only the tensors its stages use
(NOTE [checkpoints move between layouts] in checkpoint.py), after checking the files and the
names and shapes (NOTE [publishing a checkpoint] in checkpoint_files.py). A Hugging Face
`save_pretrained` directory (safetensors, no fpipe manifest) loads the same way, weights only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from . import checkpoint_files as files
from .checkpoint import GROUP, STATE, _check_params, _layout, _optim_entries, _quiet
from .outputs import local_inputs

__all__ = ["load"]


def load(
    path: str | Path, params: dict[str, torch.Tensor], *, optimizer: Any = None, pipeline: Any = None
) -> dict[str, Any]:
    """Fill `params` (and `optimizer`'s state) in place from the checkpoint at `path`; return
    the `extra` dict it was saved with.

    Works in whatever layout this run has (another pipeline degree, schedule, data parallelism,
    sharded parameters, or one process): each rank reads only the parameters its stages use (all
    real ones in one process, or when `pipeline` has not traced a step or `materialize`d yet).
    Call it before the first step of the resumed run, with the optimizer already built over this
    rank's parameters (its state is created from the checkpoint's). `path` may also be a Hugging
    Face `save_pretrained` directory (safetensors): then the weights alone are read, tensors in
    the files that `params` lacks are ignored, and `{}` is returned.

    Raises:
        FileNotFoundError: no directory at `path`.
        ValueError: no complete checkpoint at `path` (a file missing or truncated: named), or
            parameters whose names or shapes differ from the checkpoint's (named), or optimizer
            state it lacks; under a process group without `pipeline=`.

    Each rank checks and reads on its own (no collective): a rank that fails here raises; its
    peers fail at their first step, which it does not join (as for any rank that stops).
    Checkpoints are read with pickle (DCP's `.metadata`): load only checkpoints you trust.
    """
    call = f"load({str(path)!r}, params)"
    _layout(call, pipeline, saving=False)
    _check_params(call, params)
    path = Path(path)
    names = _local_names(call, params, pipeline)
    if files.is_safetensors_dir(path):
        return _load_pretrained(call, path, params, names, optimizer)
    files.verify(call, path)
    md = _metadata(call, path)
    _check_model(call, md, params, names)
    state: dict[str, Any] = {n: params[n] for n in names}
    parts = _optim_targets(call, md, optimizer, params, set(names)) if optimizer is not None else {}
    for _, bufs in parts.values():
        state.update(bufs)
    state.update({GROUP + n: b"" for n in parts})
    _dcp_load(call, path, state)
    if optimizer is not None:
        _apply_optim(call, optimizer, params, parts, state)
    return files.read_extra(path)


def _local_names(call: str, params: dict[str, torch.Tensor], pipeline: Any) -> list[str]:
    """The parameters this rank's stages read (every real one without a traced pipeline)."""
    plans = list(pipeline._cache.values()) if pipeline is not None and pipeline.pg is not None else []
    if not plans:
        return [n for n, t in params.items() if not t.is_meta]
    used: set[str] = set()
    for c in plans:
        pos = local_inputs(pipeline.pg, c, c.staged.param_inputs)
        used |= {k for i, k in enumerate(c.param_keys) if i in pos}
    meta = [n for n in params if n in used and params[n].is_meta]
    if meta:
        raise ValueError(
            f"{call}: parameters {meta[:5]} are on the meta device but this rank's stages use "
            "them; allocate them first with piped.materialize(model, ...)."
        )
    return [n for n in params if n in used]


def _metadata(call: str, path: Path) -> Metadata:
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as err:
        raise ValueError(
            f"{call}: {path / '.metadata'} cannot be read ({type(err).__name__}: {err})."
        ) from err


def _mismatch(call: str, where: Any, missing: list[str], unknown: list[str], shapes: list[str]) -> None:
    """One error naming every parameter whose name or shape differs from the checkpoint's."""
    parts = [f"not in the checkpoint: {missing}"] if missing else []
    parts += [f"in the checkpoint but not in params: {unknown}"] if unknown else []
    parts += [f"shapes differ: {'; '.join(shapes)}"] if shapes else []
    if parts:
        raise ValueError(
            f"{call}: the parameters differ from those of {where}: " + "; ".join(parts)
            + ". Load it into the model it was saved from (the same names and shapes)."
        )  # fmt: skip


def _check_model(call: str, md: Metadata, params: dict[str, torch.Tensor], names: list[str]) -> None:
    saved = {k: m for k, m in md.state_dict_metadata.items() if not k.startswith("optim/")}
    missing = [n for n in names if not isinstance(saved.get(n), TensorStorageMetadata)]
    unknown = sorted(k for k in saved if k not in params)
    shapes = [
        f"{n!r} is {tuple(params[n].shape)} here, {tuple(saved[n].size)} in the checkpoint"  # type: ignore[union-attr]
        for n in names
        if n not in missing and tuple(saved[n].size) != tuple(params[n].shape)  # type: ignore[union-attr]
    ]
    _mismatch(call, "the checkpoint", missing, unknown, shapes)


def _optim_targets(
    call: str, md: Metadata, optimizer: Any, params: dict[str, torch.Tensor], local: set[str]
) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """name -> (parameter, DCP key -> an empty buffer for each state tensor saved for it)."""
    out, missing = {}, []
    for name, p, _, group in _optim_entries(call, optimizer, params):
        if name not in local:
            continue
        if GROUP + name not in md.state_dict_metadata:
            missing.append(name)
            continue
        prefix = f"{STATE}{name}/"
        out[name] = (p, {
            k: _buffer_like(p, m, group)  # type: ignore[arg-type]
            for k, m in md.state_dict_metadata.items()
            if k.startswith(prefix)
        })  # fmt: skip
    if missing:
        raise ValueError(
            f"{call}: the checkpoint holds no optimizer state for {missing[:5]}; it was saved "
            "without optimizer= or with an optimizer over other parameters. Pass optimizer=None "
            "to load the parameters alone."
        )
    return out


def _buffer_like(p: torch.Tensor, m: TensorStorageMetadata, group: dict[str, Any]) -> torch.Tensor:
    """Where a saved state tensor is read to: placed like its parameter when it has the
    parameter's shape; a 0-dim one (a step count) on the CPU, as torch.optim keeps it."""
    dtype = m.properties.dtype
    if tuple(m.size) == tuple(p.shape):
        return torch.zeros_like(p, dtype=dtype)
    on_device = group.get("capturable") or group.get("fused")
    device = p.device if (len(m.size) or on_device) and not isinstance(p, DTensor) else torch.device("cpu")
    return torch.zeros(m.size, dtype=dtype, device=device)


def _dcp_load(call: str, path: Path, state: dict[str, Any]) -> None:
    try:
        with torch.no_grad(), _quiet():
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    except Exception as err:
        raise ValueError(f"{call}: reading {path} failed ({type(err).__name__}: {err}).") from err


def _apply_optim(
    call: str, optimizer: Any, params: dict[str, torch.Tensor], parts: dict[str, Any], state: dict[str, Any]
) -> None:
    """Set each loaded parameter's optimizer state, and each group's saved hyperparameters."""
    saved = {n: files.from_bytes(state[GROUP + n]) for n in parts}
    for name, (p, bufs) in parts.items():
        prefix = f"{STATE}{name}/"
        tensors = {k[len(prefix) :]: state[k] for k in bufs}
        state_of_p = {**tensors, **saved[name]["scalars"]}
        if state_of_p:
            optimizer.state[p] = state_of_p
        else:  # saved before its first step: none, as a fresh optimizer has
            optimizer.state.pop(p, None)
    for gi, group in enumerate(optimizer.param_groups):
        names = [n for n, p, _, g in _optim_entries(call, optimizer, params) if g is group and n in saved]
        got = [saved[n]["hparams"] for n in names]
        if any(str(h) != str(got[0]) for h in got[1:]):
            raise ValueError(
                f"{call}: optimizer.param_groups[{gi}] holds parameters saved in groups with other "
                f"hyperparameters ({names[0]!r}: {got[0]}; ...); build the groups as the run that "
                "saved the checkpoint did."
            )
        if got:
            group.update(got[0])


# -- Hugging Face save_pretrained directories -----------------------------------------------------
def _load_pretrained(
    call: str, path: Path, params: dict[str, torch.Tensor], names: list[str], optimizer: Any
) -> dict[str, Any]:
    """Read this rank's parameters (for a DTensor, its shard's rows) from safetensors files."""
    if optimizer is not None:
        raise ValueError(
            f"{call}: {path} is a Hugging Face save_pretrained directory (safetensors), which holds "
            "weights only; pass optimizer=None."
        )
    where = files.safetensors_index(call, path)
    missing = [n for n in names if n not in where]
    _mismatch(call, f"the safetensors files in {path}", missing, [], [])
    shapes: dict[str, tuple[int, ...]] = {}
    files.read_safetensors(call, where, {n: _record_shape(shapes, n) for n in names})
    bad = [f"{n!r} is {tuple(params[n].shape)} here, {s} in the files" for n, s in shapes.items()
           if s != tuple(params[n].shape)]  # fmt: skip
    _mismatch(call, f"the safetensors files in {path}", [], [], bad)
    with torch.no_grad():
        files.read_safetensors(call, where, {n: _filler(params[n]) for n in names})
    return {}


def _record_shape(shapes: dict[str, tuple[int, ...]], name: str) -> Any:
    return lambda s: shapes.__setitem__(name, tuple(s.get_shape()))


def _filler(p: torch.Tensor) -> Any:
    """Copy a safetensors slice into `p`: the whole tensor, or a DTensor's own shard."""
    if not isinstance(p, DTensor):
        return lambda s: p.copy_(s[:])
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    rows = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return lambda s: p.to_local().copy_(s[rows] if rows else s[:])
