"""A checkpoint's directory: written aside, checked, published atomically; `extra`; safetensors.

# NOTE [publishing a checkpoint]
`fpipe.save(path, ...)` never writes into `path`. Rank 0 empties a sibling directory
`.NAME.saving` (a leftover of a save that was killed), every rank writes its DCP files into it,
and rank 0, once DCP has gathered every rank's results and written `.metadata`, adds
`extra.pt` and last the manifest `fpipe.json` (each file's size), fsyncs, and publishes: an
atomic exchange of the two directories (Linux `renameat2(RENAME_EXCHANGE)`), after which the
previous checkpoint, now under the temporary name, is deleted. Where the exchange is not
supported, `path` is renamed to `.NAME.previous` and the new directory to `path` (a crash
between the two renames leaves the previous checkpoint complete under `.NAME.previous`, and
`load` says so). A save killed at any point before the exchange leaves `path` as it was.

Every rank writes into the same directory, and rank 0 lists it: with several machines, `path`
must be on a filesystem they all see (as DCP's resharding on load needs anyway).

`load` trusts nothing it has not checked: no manifest means no complete checkpoint, and every
file it lists must exist with its size, before DCP reads anything (so a missing or truncated file
is an error naming the path, never a partial load).
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

MANIFEST = "fpipe.json"
EXTRA = "extra.pt"
FORMAT = "fpipe-checkpoint-1"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def saving_dir(path: Path) -> Path:
    return path.with_name(f".{path.name}.saving")


def previous_dir(path: Path) -> Path:
    return path.with_name(f".{path.name}.previous")


def begin(path: Path) -> Path:
    """Rank 0: an empty directory beside `path` to write the new checkpoint into."""
    tmp = saving_dir(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def to_bytes(call: str, obj: Any, what: str) -> bytes:
    """`obj` serialised; refused at once unless `torch.load(weights_only=True)` reads it back."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    try:
        from_bytes(buf.getvalue())
    except Exception as err:
        raise ValueError(
            f"{call}: {what} holds an object that torch.load(weights_only=True) does not read back "
            f"({type(err).__name__}: {str(err).splitlines()[0]}); keep it to tensors, numbers, "
            "strings, None and lists/tuples/dicts of them (e.g. numpy's RNG state as a list)."
        ) from None
    return buf.getvalue()


def from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def finish(tmp: Path, path: Path, extra: bytes) -> None:
    """Rank 0, after every rank's files are written: `extra`, the manifest, then publish."""
    _write_synced(tmp / EXTRA, extra)
    files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
    manifest = json.dumps({"format": FORMAT, "files": files}, indent=1).encode()
    _write_synced(tmp / MANIFEST, manifest)
    _fsync_dir(tmp)
    publish(tmp, path)


def publish(tmp: Path, path: Path) -> None:
    """Make `tmp` the checkpoint at `path` atomically; then delete the one it replaces."""
    if not path.exists():
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        shutil.rmtree(tmp)
    else:
        prev = previous_dir(path)
        shutil.rmtree(prev, ignore_errors=True)
        os.rename(path, prev)
        os.rename(tmp, path)
    shutil.rmtree(previous_dir(path), ignore_errors=True)  # (also one an interrupted publish left)
    _fsync_dir(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2); False where that is not available."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading ------------------------------------------------------------------------------------
def is_safetensors_dir(path: Path) -> bool:
    """A `save_pretrained` directory: safetensors files and no fpipe manifest."""
    return path.is_dir() and not (path / MANIFEST).exists() and any(path.glob("*.safetensors"))


def verify(call: str, path: Path) -> None:
    """`path` is a complete checkpoint: its manifest exists and lists files that all have their size."""
    if not path.is_dir():
        prev = previous_dir(path)
        hint = (
            f" (a save interrupted while publishing left the previous one at {prev})" if prev.is_dir() else ""
        )
        raise FileNotFoundError(f"{call}: no checkpoint directory at {path}{hint}.")
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise ValueError(
            f"{call}: {manifest} is missing, so {path} is not a complete fpipe checkpoint (fpipe.save "
            "writes the manifest last); load another checkpoint."
        )
    for rel, size in json.loads(manifest.read_text())["files"].items():
        _check_file(call, path / rel, size)


def _check_file(call: str, f: Path, size: int) -> None:
    if not f.is_file():
        raise ValueError(
            f"{call}: {f} is missing ({size} bytes in the checkpoint's manifest); the checkpoint is "
            "incomplete: restore the file or load another checkpoint."
        )
    if f.stat().st_size != size:
        raise ValueError(
            f"{call}: {f} has {f.stat().st_size} bytes, the manifest says {size}: the file is truncated "
            "or was changed; restore it or load another checkpoint."
        )


def read_extra(path: Path) -> dict[str, Any]:
    return torch.load(path / EXTRA, weights_only=True)


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
