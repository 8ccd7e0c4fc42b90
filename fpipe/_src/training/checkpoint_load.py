"""`fpipe.load`: fill this rank's parameters, optimizer state and buffers from a checkpoint, in place.

Every rank reads on its own (no collective), only the tensors its stages use (NOTE [checkpoints
move between layouts] in checkpoint.py), from one directory opened once, after checking the
manifest, every file it reads (size and SHA-256), and the names, dtypes and shapes (NOTE
[publishing a checkpoint] in checkpoint_files.py): a checkpoint is read whole or not at all.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..pipeline import local_inputs
from . import checkpoint_files as files
from . import checkpoint_format as fmt
from . import checkpoint_hf as hf
from .checkpoint import _check_params, _in_group, _layout, _optim_entries, buffers_of
from .checkpoint_files import CheckpointError
from .checkpoint_job import wait_earlier

__all__ = ["load", "read_into"]
Key = tuple[str, str, str]  # (kind, name, state)


def load(
    path: str | Path, params: dict[str, torch.Tensor], *, optimizer: Any = None, buffers: Any = None,
    pipeline: Any = None,
) -> dict[str, Any]:  # fmt: skip
    """Fill `params` (and `optimizer`'s state, the module's buffers, the pipeline's step) in place
    from the checkpoint at `path`; return this rank's `extra` (docs/CHECKPOINTS.md).

    Works in whatever layout this run has (another pipeline degree, schedule, data parallelism,
    sharded parameters, or one process): each rank reads only the parameters its stages use (all
    real ones in one process, or when `pipeline` has not traced a step or `materialize`d yet).
    Call it before the first step of the resumed run, with the optimizer already built over this
    rank's parameters. `buffers` as for `save` (by default the module's of `pipeline`). `path`
    may also be a Hugging Face `save_pretrained` directory (safetensors): then the weights and
    the buffers the files hold are read, tensors `params` lacks are ignored, and `{}` is returned.

    Raises:
        FileNotFoundError: no directory at `path`.
        ValueError: no complete checkpoint at `path` (a file missing, truncated or changed:
            named), another format, names, shapes or dtypes that differ (named), optimizer state
            or buffers it lacks; under a process group without `pipeline=`. Nothing is loaded.
        CheckpointError: an earlier `async_save` of this process failed.

    Nothing in the directory is unpickled (NOTE [no code from a checkpoint]).
    """
    call = f"load({str(path)!r}, params)"
    wait_earlier(call)
    _layout(call, pipeline, saving=False)
    _check_params(call, params)
    names = _local_names(call, params, pipeline)
    bufs = {n: b for n, b in buffers_of(call, buffers, pipeline).items() if not b.is_meta}
    return read_into(call, Path(path), params, names, bufs, optimizer, pipeline, buffers)


def read_into(
    call: str, path: Path, params: dict[str, torch.Tensor], names: list[str], bufs: dict[str, torch.Tensor],
    optimizer: Any = None, pipeline: Any = None, buffers: Any = None,
) -> dict[str, Any]:  # fmt: skip
    """Fill `params[n]` for each n in `names` and the buffers `bufs` from the checkpoint or
    `save_pretrained` folder at `path` (the one reader `load` and `generate(weights=...)` use)."""
    if hf.is_safetensors_dir(path):
        return hf.load_pretrained(call, path, params, names, bufs, optimizer)
    for _ in range(3):
        where = files.resolve(call, path)
        seen = _inode(where)
        try:
            opened = files.Opened(call, where)
            try:
                return _Load(call, opened, params, names, bufs, optimizer, pipeline, buffers).run()
            finally:
                opened.close()
        except (OSError, ValueError):
            if _inode(where) == seen:  # not replaced by a publish meanwhile: the error stands
                raise
        except (KeyError, TypeError, IndexError, AttributeError) as err:
            raise ValueError(
                f"{call}: {where} is not a well-formed fpipe checkpoint ({type(err).__name__}: {err}); "
                "load another checkpoint."
            ) from None
    raise CheckpointError(f"{call}: {path} was replaced three times while it was read; load it again.")


def _inode(path: Path) -> tuple[int, int] | None:
    """Which directory is at `path` now (a publish replaces it by another)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


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


class _Load:
    """One read of one opened checkpoint: check everything, then copy."""

    def __init__(
        self, call: str, d: files.Opened, params: dict[str, torch.Tensor], names: list[str],
        bufs: dict[str, torch.Tensor], optimizer: Any, pipeline: Any, given: Any = None,
    ) -> None:  # fmt: skip
        self.call, self.d, self.params, self.names, self.bufs = call, d, params, names, bufs
        self.optimizer, self.pipeline, self.given = optimizer, pipeline, given
        self.ranks = int(d.manifest["ranks"])
        self.index = [json.loads(d.mapped(f"rank{r}.json").data()) for r in range(self.ranks)]
        self.pieces: dict[Key, list[tuple[int, dict[str, Any]]]] = {}
        for r, idx in enumerate(self.index):
            for e in idx["entries"]:
                self.pieces.setdefault((e["kind"], e["name"], e["state"]), []).append((r, e))
        self.files: dict[tuple[int, str], tuple[fmt.Mapped, dict[str, Any]]] = {}

    def run(self) -> dict[str, Any]:
        targets = {("param", n, ""): self.params[n] for n in self.names}
        self._check("param", self.params, self.names)
        self._check_buffers(targets, self.given)
        parts = _optim_targets(self, targets) if self.optimizer is not None else {}
        hparams = _group_hparams(self, parts)
        me = dist.get_rank() if _in_group() else 0
        extra = self._extra(me)
        plan = [(t, self._plan(key, t)) for key, t in targets.items()]  # every file read and checked
        with torch.no_grad():
            for t, copies in plan:
                for src, dst in copies:
                    dst(t).copy_(src)
        if self.optimizer is not None:
            _apply_optim(self, parts, targets, hparams)
        self._step()
        return extra

    def _mapped(self, r: int, part: str = "") -> tuple[fmt.Mapped, dict[str, Any]]:
        """Rank r's tensors (`part` ".extra": its extra's), checked."""
        if (r, part) not in self.files:
            m = self.d.mapped(f"rank{r}{part}.safetensors")
            try:
                self.files[(r, part)] = (m, m.header())
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{self.call}: {err}") from None
        return self.files[(r, part)]

    def tensor(self, r: int, key: str, part: str = "") -> torch.Tensor:
        m, head = self._mapped(r, part)
        return m.tensor(head[key]).clone()

    def _check(self, kind: str, have: dict[str, torch.Tensor], names: list[str]) -> None:
        saved = {k[1] for k in self.pieces if k[0] == kind}
        missing = [n for n in names if n not in saved]
        unknown = sorted(n for n in saved if n not in have) if kind == "param" else []
        bad = [
            self._differs(f"{n!r}", have[n], self.pieces[(kind, n, "")][0][1]) for n in names if n in saved
        ]
        hf.mismatch(self.call, f"the checkpoint at {self.d.path}", missing, unknown, [b for b in bad if b])

    def _differs(self, what: str, t: torch.Tensor, e: dict[str, Any]) -> str:
        saved = (tuple(e["shape"]), e["dtype"])
        here = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        return (
            ""
            if saved == here
            else f"{what} is {here[1]} {here[0]} here, {saved[1]} {saved[0]} in the checkpoint"
        )

    def _check_buffers(self, targets: dict[Key, torch.Tensor], given: Any) -> None:
        saved = sorted(k[1] for k in self.pieces if k[0] == "buffer")
        if not self.bufs and saved and given is None:
            raise ValueError(
                f"{self.call}: the checkpoint at {self.d.path} holds buffers ({saved[:5]}), and no module "
                "is known to load them into (the pipeline has not traced a step); pass buffers=model "
                "(or buffers={} to leave them). Nothing was loaded."
            )
        if not self.bufs:
            return
        if not any(k[0] == "buffer" for k in self.pieces):
            raise ValueError(
                f"{self.call}: the module has persistent buffers ({list(self.bufs)[:5]}) but the checkpoint "
                f"at {self.d.path} holds none (saved without them); pass buffers={{}} to load the rest alone."
            )
        self._check("buffer", self.bufs, list(self.bufs))
        targets.update({("buffer", n, ""): b for n, b in self.bufs.items()})

    def _plan(self, key: Key, t: torch.Tensor) -> list[tuple[torch.Tensor, Any]]:
        """(source slice, where in `t` it goes) for each saved piece overlapping what `t` holds."""
        shape, off = _box(t)
        out, covered, seen = [], 0, set()
        for r, e in self.pieces[key]:
            m, head = self._mapped(r)
            h = head[e["tensor"]]
            if (tuple(e["offset"]), tuple(h["shape"])) in seen:
                continue  # the same piece from another replica
            seen.add((tuple(e["offset"]), tuple(h["shape"])))
            inter = [
                (max(a, o), min(a + n, o + s)) for a, n, o, s in zip(off, shape, e["offset"], h["shape"])
            ]
            if any(lo >= hi for lo, hi in inter):
                continue
            src = m.tensor(h)[tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, e["offset"]))]
            rows = tuple(slice(lo - a, hi - a) for (lo, hi), a in zip(inter, off))
            out.append((src, _dest(rows)))
            covered += src.numel()
        if covered != _numel(shape):
            raise ValueError(
                f"{self.call}: the checkpoint's pieces of {key[1]!r} cover {covered} of {_numel(shape)} values."
            )
        return out

    def _extra(self, me: int) -> dict[str, Any]:
        world = dist.get_world_size() if _in_group() else 1
        own = me if me < self.ranks else 0
        if world != self.ranks:
            every = [fmt.decode(i["extra"], self._reader(r, ".extra")) for r, i in enumerate(self.index)]
            if any(not _equal(every[0], e) for e in every[1:]):
                warnings.warn(
                    f"{self.call}: the checkpoint was saved by {self.ranks} ranks, with an extra of "
                    f"its own on each, and is loaded by {world}: rank r gets rank r's extra (ranks >= "
                    f"{self.ranks} get rank 0's), so the extras of ranks {world}..{self.ranks - 1} are "
                    "not returned. Resume on as many ranks to get each one back.",
                    stacklevel=4,
                )
        return fmt.decode(self.index[own]["extra"], self._reader(own, ".extra"))

    def _reader(self, r: int, part: str = "") -> Callable[[str], torch.Tensor]:
        return lambda key: self.tensor(r, key, part)

    def _step(self) -> None:
        step = self.d.manifest.get("rng_step")
        if self.pipeline is not None and step is not None:
            self.pipeline._steps = int(step)
        elif step and self.d.manifest.get("random"):
            warnings.warn(
                f"{self.call}: the checkpoint holds its pipeline's step ({step}), which seeds its random "
                "operations (dropout); pass pipeline=piped so that they resume where they stopped.",
                stacklevel=4,
            )


def _box(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """The shape and global offset of what `t` holds (a DTensor: its local shard)."""
    if isinstance(t, DTensor):
        shape, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return list(shape), list(off)
    return list(t.shape), [0] * t.dim()


def _dest(rows: tuple[slice, ...]) -> Any:
    return lambda t: (t.to_local() if isinstance(t, DTensor) else t)[rows]


def _numel(shape: list[int]) -> int:
    return int(torch.Size(shape).numel())


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


# -- optimizer state ------------------------------------------------------------------------------
def _optim_targets(ld: _Load, targets: dict[Key, torch.Tensor]) -> dict[str, Any]:
    """name -> (parameter, its state and hyperparameters); an empty tensor for each saved state
    tensor, added to `targets`."""
    saved = {n: (r, i["optim"][n]) for r, i in enumerate(ld.index) for n in i["optim"]}
    out: dict[str, Any] = {}
    missing, local = [], set(ld.names)
    for name, p, _, group in _optim_entries(ld.call, ld.optimizer, ld.params):
        if name not in local:
            continue
        if name not in saved:
            missing.append(name)
            continue
        r, data = saved[name]
        out[name] = (p, fmt.decode(data, ld._reader(r)), [])
        for (kind, n, state), ps in ld.pieces.items():
            if kind == "optim" and n == name:
                targets[(kind, n, state)] = _buffer_like(p, ps[0][1], group)
                out[name][2].append(state)
    if missing:
        raise ValueError(
            f"{ld.call}: the checkpoint holds no optimizer state for {missing[:5]}; it was saved "
            "without optimizer= or with an optimizer over other parameters. Pass optimizer=None "
            "to load the parameters alone."
        )
    return out


def _buffer_like(p: torch.Tensor, e: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
    """Where a saved state tensor is read to: placed like its parameter when it has the
    parameter's shape; a 0-dim one (a step count) on the CPU, as torch.optim keeps it."""
    dtype, size = getattr(torch, e["dtype"]), tuple(e["shape"])
    if size == tuple(p.shape):
        return torch.zeros_like(p, dtype=dtype)
    on_device = group.get("capturable") or group.get("fused")
    device = p.device if (len(size) or on_device) and not isinstance(p, DTensor) else torch.device("cpu")
    return torch.zeros(size, dtype=dtype, device=device)


def _group_hparams(ld: _Load, parts: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(group, its saved hyperparameters) for each param group; refused if they disagree."""
    out = []
    for gi, group in enumerate(ld.optimizer.param_groups if ld.optimizer is not None else []):
        names = [
            n for n, _, _, g in _optim_entries(ld.call, ld.optimizer, ld.params) if g is group and n in parts
        ]
        got = [parts[n][1]["hparams"] for n in names]
        if any(str(h) != str(got[0]) for h in got[1:]):
            raise ValueError(
                f"{ld.call}: optimizer.param_groups[{gi}] holds parameters saved in groups with other "
                f"hyperparameters ({names[0]!r}: {got[0]}; ...); build the groups as the run that "
                "saved the checkpoint did."
            )
        if got:
            out.append((group, got[0]))
    return out


def _apply_optim(ld: _Load, parts: dict[str, Any], targets: dict[Key, torch.Tensor], hparams: Any) -> None:
    """Set each loaded parameter's optimizer state, and each group's saved hyperparameters."""
    for name, (p, saved, states) in parts.items():
        state_of_p = {**{k: targets[("optim", name, k)] for k in states}, **saved["scalars"]}
        if state_of_p:
            ld.optimizer.state[p] = state_of_p
        else:  # saved before its first step: none, as a fresh optimizer has
            ld.optimizer.state.pop(p, None)
    for group, h in hparams:
        group.update(h)
