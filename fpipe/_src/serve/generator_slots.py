"""`fpipe.Generator`'s cache slots: how many fit a byte limit, the buffers, and each call's inputs
(NOTE [slots] in generator_cache.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..generate import Layout

__all__ = ["SlotBuffers", "bucket_of", "decode_data", "default_buckets", "prefill_data", "slot_bytes"]


def slot_bytes(layout: Layout, layers: Sequence[int], max_len: int) -> int:
    """Bytes of one slot's K/V buffers for decoder `layers` ((heads, dim, dtype) per k0, v0, ...)."""
    return sum(h * max_len * d * dt.itemsize for i in layers for h, d, dt in layout[2 * i : 2 * i + 2])


def default_buckets(max_len: int, smallest: int = 8) -> tuple[int, ...]:
    """Powers of two from `smallest` below `max_len`, then `max_len`: at most
    log2(max_len / smallest) + 1 prefill traces."""
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return (*out, max_len)


def bucket_of(length: int, buckets: Sequence[int] | None) -> int:
    """The traced prefill length a prompt of `length` tokens runs at (right-padded to it)."""
    if buckets is None:
        return length
    return min(b for b in buckets if b >= length)


class SlotBuffers:
    """The K/V buffers of this rank's decoder layers, one row per slot: [slots, heads, max_len, dim]."""

    def __init__(self, layout: Layout, layers: Sequence[int], slots: int, max_len: int, device: Any) -> None:
        self.buffers = {
            f"{kind}{i}": torch.zeros(slots, h, max_len, d, dtype=dt, device=device)
            for i in layers
            for kind, (h, d, dt) in zip("kv", layout[2 * i : 2 * i + 2])
        }

    def row(self, slot: int) -> dict[str, torch.Tensor]:
        """Slot `slot`'s buffers as [1, ...] views (a prefill writes through them)."""
        return {k: t[slot : slot + 1] for k, t in self.buffers.items()}

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.buffers.values())


def prefill_data(prompt: torch.Tensor, bucket: int, max_len: int) -> dict[str, torch.Tensor]:
    """One prompt right-padded to `bucket`, written from cache index 0 (= its positions)."""
    n = prompt.numel()
    ids = torch.zeros(1, bucket, dtype=torch.long, device=prompt.device)
    ids[0, :n] = prompt
    mask = torch.zeros(1, max_len, dtype=torch.long, device=prompt.device)
    mask[0, :n] = 1
    positions = torch.arange(bucket, device=prompt.device)[None]
    offset = torch.zeros(1, dtype=torch.long, device=prompt.device)
    return {"ids": ids, "mask": mask, "positions": positions, "offset": offset}


def decode_data(
    rows: dict[int, tuple[int, int]], slots: int, max_len: int, device: Any
) -> dict[str, torch.Tensor]:
    """One token per slot: `rows[slot] = (token, position)` for the running slots; an idle slot
    writes at the last cache index of its row and sees only that (NOTE [slots])."""
    ids = torch.zeros(slots, 1, dtype=torch.long)
    positions = torch.zeros(slots, 1, dtype=torch.long)
    offset = torch.full((slots,), max_len - 1, dtype=torch.long)
    mask = torch.zeros(slots, max_len, dtype=torch.long)
    mask[:, -1] = 1
    for slot, (token, pos) in rows.items():
        ids[slot, 0], positions[slot, 0], offset[slot] = token, pos, pos
        mask[slot, -1] = 0
        mask[slot, : pos + 1] = 1
    data = {"ids": ids, "mask": mask, "positions": positions, "offset": offset}
    return {k: v.to(device) for k, v in data.items()}
