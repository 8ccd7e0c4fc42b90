"""Hugging Face `save_pretrained` directories (safetensors files, no fpipe manifest), read in place.

The safetensors library parses each file (a JSON header and raw bytes: nothing is unpickled,
NOTE [no code from a checkpoint]); `config.json` and any `.bin` file are never read. Each rank
reads only the tensors its stages use (a DTensor: its shard's rows), and the module's persistent
buffers the files hold (as `from_pretrained` does, a buffer the files lack keeps its value).
Values are cast to the parameter's dtype, as `from_pretrained(torch_dtype=...)` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

MANIFEST = "fpipe.json"


def is_safetensors_dir(path: Path) -> bool:
    """A `save_pretrained` directory: safetensors files and no fpipe manifest."""
    ours = (path / MANIFEST).exists() or (path / ".fpipe-saving").exists()
    return path.is_dir() and not ours and any(path.glob("*.safetensors"))


def safetensors_index(call: str, path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or the index of a sharded save)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        out = {k: path / f for k, f in weight_map.items()}
        for f in sorted(set(out.values())):
            if not f.is_file():
                raise ValueError(f"{call}: {f} is missing (listed in {index}); the download is incomplete.")
        return out
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with _opened(call, f, safe_open) as h:
            out.update({k: f for k in h.keys()})
    return out


class _opened:
    """`safe_open(f)`, with a broken file reported by its path."""

    def __init__(self, call: str, f: Path, safe_open: Any) -> None:
        self.call, self.f, self.safe_open = call, f, safe_open

    def __enter__(self) -> Any:
        try:
            self.h = self.safe_open(str(self.f), framework="pt")
        except Exception as err:
            raise ValueError(f"{self.call}: {self.f} cannot be read ({type(err).__name__}: {err}).") from err
        return self.h.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.h.__exit__(*exc)


def read_safetensors(call: str, where: dict[str, Path], fill: dict[str, Any]) -> None:
    """Call `fill[name](slice)` with a lazy slice of each named tensor, file by file: only the
    tensors named (and only the rows a fill takes) are read."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for n in fill:
        by_file.setdefault(where[n], []).append(n)
    for f, ns in by_file.items():
        with _opened(call, f, safe_open) as h:
            for n in ns:
                fill[n](h.get_slice(n))


def mismatch(call: str, where: Any, missing: list[str], unknown: list[str], bad: list[str]) -> None:
    """One error naming every tensor whose name, shape or dtype differs from the checkpoint's."""
    parts = [f"not in the checkpoint: {missing}"] if missing else []
    parts += [f"in the checkpoint but not in params: {unknown}"] if unknown else []
    parts += [f"shapes or dtypes differ: {'; '.join(bad)}"] if bad else []
    if parts:
        raise ValueError(
            f"{call}: the parameters differ from those of {where}: " + "; ".join(parts)
            + ". Load it into the model it was saved from (the same names, shapes and dtypes); "
            "nothing was loaded."
        )  # fmt: skip


def load_pretrained(
    call: str, path: Path, params: dict[str, torch.Tensor], names: list[str], buffers: dict[str, torch.Tensor],
    optimizer: Any,
) -> dict[str, Any]:  # fmt: skip
    """Read this rank's parameters (for a DTensor, its shard's rows) and the buffers the files
    hold from safetensors files."""
    if optimizer is not None:
        raise ValueError(
            f"{call}: {path} is a Hugging Face save_pretrained directory (safetensors), which holds "
            "weights only; pass optimizer=None."
        )
    where = safetensors_index(call, path)
    missing = [n for n in names if n not in where]
    mismatch(call, f"the safetensors files in {path}", missing, [], [])
    targets = {**{n: params[n] for n in names}, **{n: b for n, b in buffers.items() if n in where}}
    shapes: dict[str, tuple[int, ...]] = {}
    read_safetensors(call, where, {n: _record_shape(shapes, n) for n in targets})
    bad = [f"{n!r} is {tuple(targets[n].shape)} here, {s} in the files" for n, s in shapes.items()
           if s != tuple(targets[n].shape)]  # fmt: skip
    mismatch(call, f"the safetensors files in {path}", [], [], bad)
    whole = {n: t for n, t in targets.items() if not isinstance(t, DTensor)}
    with torch.no_grad():
        read_whole(call, where, whole)
        read_safetensors(call, where, {n: _filler(t) for n, t in targets.items() if n not in whole})
    return {}


# the safetensors dtype names (https://github.com/huggingface/safetensors, format.md)
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def read_whole(call: str, where: dict[str, Path], targets: dict[str, torch.Tensor]) -> None:
    """Read each named tensor's bytes from its file straight into the target (plain reads, no
    memory map: a map's pages would count in this process's resident memory while the file is
    open, doubling a loading rank's peak); a dtype that differs goes through one temporary."""
    by_file: dict[Path, list[str]] = {}
    for n in targets:
        by_file.setdefault(where[n], []).append(n)
    for f, names in by_file.items():
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
            for n in names:
                _read_one(call, f, fh, 8 + size, header[n], targets[n])


def _read_one(call: str, f: Path, fh: Any, start: int, entry: dict[str, Any], t: torch.Tensor) -> None:
    dtype = _DTYPES.get(entry["dtype"])
    begin, end = entry["data_offsets"]
    if dtype is None or end - begin != t.numel() * dtype.itemsize:
        raise ValueError(
            f"{call}: {f} holds {entry['dtype']} {entry['shape']} in {end - begin} bytes, which "
            f"fpipe cannot read into {t.dtype} {tuple(t.shape)}; load it with from_pretrained."
        )
    dst = (
        t
        if t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
        else torch.empty(t.shape, dtype=dtype)
    )
    fh.seek(start + begin)
    if t.numel() and fh.readinto(dst.view(-1).view(torch.uint8).numpy()) != end - begin:
        raise ValueError(f"{call}: {f} ends before the bytes of a tensor it lists; the file is truncated.")
    if dst is not t:
        t.copy_(dst)


def _record_shape(shapes: dict[str, tuple[int, ...]], name: str) -> Any:
    return lambda s: shapes.__setitem__(name, tuple(s.get_shape()))


def _filler(p: torch.Tensor) -> Any:
    """Copy a safetensors slice into `p`: the whole tensor, or a DTensor's own shard."""
    if not isinstance(p, DTensor):
        return lambda s: p.copy_(s[:] if p.dim() else s[...])
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    rows = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return lambda s: p.to_local().copy_(s[rows] if rows else s[:])
