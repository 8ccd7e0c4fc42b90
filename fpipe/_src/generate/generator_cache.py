"""The step `fpipe.Generator` traces: every row of the batch at its own position.

# NOTE [slots]
`fpipe.Generator` keeps one row of K/V buffers per request slot, `[slots, kv_heads, max_len,
head_dim]` per layer, and a request occupies cache indices 0, 1, ... of its row, where cache
index = the token's position (as a request alone in `model.generate`). Rows are at different
positions, so the step's `offset` is a [rows] tensor (where each row's first new token goes)
and `RowSlotCache` writes each row's keys and values at `offset[row] + arange(q)` (`scatter`,
made in place by `inplace_cache_writes`). `mask` [rows, max_len] is 1 at the cache indices the
row's request has written by the end of this call; the step builds the 4-D attention bias from
it: query i of row r sees index j where `mask[r, j]` and `j <= offset[r] + i` (causality), which
transformers takes as-is (a 4-D mask skips its own mask building). So a prefill can be
right-padded to a length bucket (the pad tokens are written after the prompt, unmasked for no
real query, and overwritten by the decoded tokens before they are unmasked), and an idle row of
the decode step writes at the last index of its row and sees only that. The logits are those
of each row's last real token (`mask.sum - 1 - offset`): for one row (a prefill) through
`logits_to_keep`, as `model.generate` computes the last position only. This module imports
transformers: decode.py imports it when a step is traced, so `import fpipe` does not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache

from .kv_cache import SlotLayer

__all__ = ["RowSlotCache", "row_step"]


class RowSlotLayer(SlotLayer):
    """One layer's K/V buffers [rows, heads, max_len, dim], row r written at `offset[r] + arange(q)`."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, q, d = key_states.shape
        where = self.offset[:, None] + torch.arange(q, device=key_states.device)
        index = where[:, None, :, None].expand(b, h, q, d)
        assert self.keys is not None and self.values is not None  # set at construction
        # out of place, as SlotLayer's: `inplace_cache_writes` makes each write in place
        self.keys = torch.scatter(self.keys, 2, index, key_states)
        self.values = torch.scatter(self.values, 2, index, value_states)
        return self.keys, self.values


class RowSlotCache(Cache):
    """A `Cache` over the caller's buffers, each row at its own `offset` ([rows] long tensor)."""

    def __init__(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], offset: torch.Tensor) -> None:
        super().__init__(layers=[RowSlotLayer(k, v, offset) for k, v in kv])


def row_step(fn: Callable[..., Any], extra: dict[str, Any], cache_kw: str, dtype: torch.dtype) -> Any:
    """The traced step of NOTE [slots]: `fn` the functionalized model, `extra` its forward's
    cache arguments (decode.forward_kwargs), `dtype` the attention's (the K/V buffers')."""

    def step(p: dict[str, torch.Tensor], ids: Any, mask: Any, positions: Any, offset: Any, *kv: Any) -> Any:
        cache = RowSlotCache(list(zip(kv[0::2], kv[1::2])), offset)
        b, q = ids.shape
        bias = attention_bias(mask, offset, q, dtype)
        last = (mask.sum(-1) - 1 - offset).clamp(0, q - 1)  # each row's last real token in this call
        kw = dict(extra)
        keep = q > 1 and "logits_to_keep" in kw
        if keep:
            kw["logits_to_keep"] = last  # hidden[:, last]: [rows, rows, hidden]
        out = fn(p, input_ids=ids, attention_mask=bias, position_ids=positions, **{cache_kw: cache}, **kw)
        rows = torch.arange(b, device=ids.device)
        if q == 1:
            return out.logits[:, -1]
        return out.logits[rows, rows] if keep else out.logits[rows, last]

    return step


def attention_bias(mask: torch.Tensor, offset: torch.Tensor, q: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, 1, q, max_len]: 0 where query i of row r sees cache index j, the dtype's minimum
    elsewhere (NOTE [slots])."""
    n = mask.shape[1]
    query = offset[:, None] + torch.arange(q, device=mask.device)  # [rows, q] cache index
    keys = torch.arange(n, device=mask.device)
    seen = (mask[:, None, :] != 0) & (keys[None, None, :] <= query[:, :, None])
    bias = torch.zeros(mask.shape[0], 1, q, n, dtype=dtype, device=mask.device)
    return bias.masked_fill(~seen[:, None], torch.finfo(dtype).min)
