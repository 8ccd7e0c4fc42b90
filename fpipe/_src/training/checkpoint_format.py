"""A checkpoint's data formats: tensors in safetensors files, everything else in JSON; no pickle.

# NOTE [no code from a checkpoint]
Loading a checkpoint never unpickles anything from its directory (a pickle can run any code):
tensors are in safetensors files (a JSON header, then raw bytes), written and parsed here, and
everything else -- the manifest, each rank's index, the optimizer's hyperparameters and scalar
state, `extra` -- is JSON. Values JSON lacks are tagged: a tuple `{"$tuple": [...]}`, a dict
with keys other than strings `{"$dict": [[k, v], ...]}`, a tensor `{"$tensor": KEY}` (its bytes
in the rank's safetensors file), `{"$bytes": base64}` and `{"$dtype": "float32"}`. Anything else
(an arbitrary object) is refused at save, before a byte is written, naming where it is.
Each file's SHA-256 is computed as it is written and checked before a loaded value is used.
"""

from __future__ import annotations

import base64
import hashlib
import json
import mmap
import os
import struct
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["encode", "decode", "write_safetensors", "Mapped"]

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}  # fmt: skip
_NAMES = {v: k for k, v in _DTYPES.items()}
_CHUNK = 64 << 20


# -- values as JSON -------------------------------------------------------------------------------
def encode(obj: Any, sink: Callable[[torch.Tensor], str], where: str) -> Any:
    """`obj` as JSON-able data; each tensor handed to `sink`, which names it. A TypeError naming
    `where` (a path into obj) for a value that is not data."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        return {"$tensor": sink(obj)}
    if isinstance(obj, torch.dtype):
        return {"$dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, bytes):
        return {"$bytes": base64.b64encode(obj).decode()}
    if isinstance(obj, list):
        return [encode(v, sink, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"$tuple": [encode(v, sink, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        return _encode_dict(obj, sink, where)
    raise TypeError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which a checkpoint does not "
        "hold (no pickle: NOTE [no code from a checkpoint]); keep it to tensors, numbers, strings, "
        "bytes, None and lists/tuples/dicts of them (e.g. numpy's RNG state as a list)."
    )


def _encode_dict(obj: dict[Any, Any], sink: Callable[[torch.Tensor], str], where: str) -> Any:
    if all(isinstance(k, str) and not k.startswith("$") for k in obj):
        return {k: encode(v, sink, f"{where}[{k!r}]") for k, v in obj.items()}
    return {"$dict": [[encode(k, sink, f"{where} key {k!r}"), encode(v, sink, f"{where}[{k!r}]")]
                      for k, v in obj.items()]}  # fmt: skip


def decode(data: Any, tensors: Callable[[str], torch.Tensor]) -> Any:
    """The value `encode` gave `data` for; `tensors(key)` reads a tensor back."""
    if isinstance(data, list):
        return [decode(v, tensors) for v in data]
    if not isinstance(data, dict):
        return data
    if "$tensor" in data:
        return tensors(data["$tensor"])
    if "$tuple" in data:
        return tuple(decode(v, tensors) for v in data["$tuple"])
    if "$dict" in data:
        return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in data["$dict"]}
    if "$dtype" in data:
        dtype = getattr(torch, str(data["$dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{data['$dtype']!r} is not a torch dtype")
        return dtype
    if "$bytes" in data:
        return base64.b64decode(data["$bytes"])
    return {k: decode(v, tensors) for k, v in data.items()}


def _hashable(k: Any) -> Any:
    return tuple(_hashable(v) for v in k) if isinstance(k, list) else k


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, indent=1).encode()


# -- safetensors ----------------------------------------------------------------------------------
def check_dtype(where: str, t: torch.Tensor) -> None:
    if t.dtype not in _DTYPES:
        raise TypeError(f"{where} is a {t.dtype} tensor, which a safetensors file does not hold.")


def _raw(t: torch.Tensor) -> memoryview:
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.contiguous().view(torch.uint8).cpu().numpy())  # type: ignore[arg-type]


def write_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> tuple[int, str]:
    """Write `tensors` as a safetensors file (fsynced); its size and SHA-256."""
    header: dict[str, Any] = {}
    pos = 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        pos += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        chunks: list[bytes | memoryview] = [struct.pack("<Q", len(head)), head]
        for chunk in [*chunks, *(_raw(t) for t in tensors.values())]:
            digest.update(chunk)
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(head) + pos, digest.hexdigest()


def write_synced(path: str, data: bytes) -> tuple[int, str]:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data), hashlib.sha256(data).hexdigest()


class Mapped:
    """A file of the checkpoint, opened once (by descriptor, in the directory that was resolved)
    and mapped: its bytes stay readable even if the directory is replaced meanwhile."""

    def __init__(self, fd: int, name: str) -> None:
        self.name = name
        size = os.fstat(fd).st_size
        self.mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else None
        self.size = size

    def sha256(self) -> str:
        digest = hashlib.sha256()
        view = memoryview(self.mm) if self.mm is not None else memoryview(b"")
        for i in range(0, self.size, _CHUNK):
            digest.update(view[i : i + _CHUNK])
        view.release()
        return digest.hexdigest()

    def data(self) -> bytes:
        return bytes(self.mm) if self.mm is not None else b""

    def header(self) -> dict[str, Any]:
        """The safetensors header: tensor key -> dtype, shape, data offsets (checked)."""
        if self.size < 8:
            raise ValueError(f"{self.name} is not a safetensors file ({self.size} bytes).")
        (n,) = struct.unpack("<Q", self.mm[:8])  # type: ignore[index]
        head = json.loads(self.mm[8 : 8 + n])  # type: ignore[index]
        head.pop("__metadata__", None)
        for k, h in head.items():
            if h.get("dtype") not in _NAMES:
                raise ValueError(
                    f"{self.name}: tensor {k!r} has dtype {h.get('dtype')!r}, which fpipe does not read."
                )
            b, e = h["data_offsets"]
            want = torch.Size(h["shape"]).numel() * _NAMES[h["dtype"]].itemsize
            if e - b != want or 8 + n + e > self.size:
                raise ValueError(
                    f"{self.name}: tensor {k!r} has {e - b} bytes for {want}: the file is damaged."
                )
            h["start"] = 8 + n + b
        return head

    def tensor(self, h: dict[str, Any]) -> torch.Tensor:
        dtype = _NAMES[h["dtype"]]
        count = h["data_offsets"][1] - h["data_offsets"][0]
        if count == 0:
            return torch.empty(h["shape"], dtype=dtype)
        raw = torch.frombuffer(self.mm, dtype=torch.uint8, count=count, offset=h["start"])  # type: ignore[arg-type]
        return raw.view(dtype).reshape(h["shape"])


def sha256_file(path: Any) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
