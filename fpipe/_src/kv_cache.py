"""A transformers `Cache` over fixed-size K/V buffers the caller owns, written at a position tensor.

# NOTE [a cache whose position is data]
transformers' own `StaticCache` keeps its length as a 0-dim tensor attribute that it advances
in place (`cumulative_length.add_`): a trace reads that attribute as a captured value, so the
trace-time length is baked into the positions and the mask. `SlotCache` keeps nothing of its
own: each layer's keys and values are `[batch, kv_heads, max_len, head_dim]` tensors handed in
by the caller (the traced program's inputs), and the position of the first new token is a 0-dim
long tensor handed in too (`offset`). `update` writes the new keys and values at
`arange(q) + offset` with `index_copy_`, and the mask is sized for the whole buffer
(`get_mask_sizes` -> `max_len`), so every shape is fixed: one decode trace serves every step,
and a prefill trace every prompt of its length. The buffers are updated in place by the
program that owns them (`inplace_cache_writes` turns the functional write the trace records back
into an in-place one), so no step copies a cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from transformers.cache_utils import Cache, CacheLayerMixin

__all__ = ["SlotCache", "inplace_cache_writes"]


class SlotLayer(CacheLayerMixin):
    """One layer's K/V buffers, written at `offset + arange(q)`."""

    is_compileable = True  # fixed shapes: transformers then always materialises the mask
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, offset: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.offset = keys, values, offset
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the buffers exist already

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.arange(key_states.shape[-2], device=key_states.device) + self.offset
        self.keys.index_copy_(2, index, key_states)
        self.values.index_copy_(2, index, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> Any:  # a tensor: the position stays data
        return self.offset

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class SlotCache(Cache):
    """A `Cache` over the caller's buffers: `kv[layer] = (keys, values)`; `offset` the position
    (0-dim long tensor) where the tokens of this call go."""

    def __init__(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], offset: torch.Tensor) -> None:
        super().__init__(layers=[SlotLayer(k, v, offset) for k, v in kv])


def inplace_cache_writes(gm: fx.GraphModule) -> int:
    """Turn `copy_(buf, index_copy(buf, d, i, x))` (how a functional trace records
    `buf.index_copy_(d, i, x)` on an input) back into `buf.index_copy_(d, i, x)`: the buffer is
    this program's own state, read nowhere else, so writing it in place saves a copy of the
    whole cache per step. Returns how many writes were rewritten."""
    rewritten = 0
    copies = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)
    for copy in list(copies):
        buf, new = copy.args[:2]
        if not _is_write_of(buf, new, copy):
            continue
        assert isinstance(new, fx.Node)
        new.target = torch.ops.aten.index_copy_.default
        copy.replace_all_uses_with(new)
        gm.graph.erase_node(copy)
        rewritten += 1
    gm.graph.lint()
    gm.recompile()
    return rewritten


def _is_write_of(buf: Any, new: Any, copy: fx.Node) -> bool:
    """Is `new` an `index_copy` of the input `buf` that nothing but the write back reads, and
    `buf` read by nothing else (so writing in place cannot change another reader's value)?"""
    if not (isinstance(buf, fx.Node) and isinstance(new, fx.Node) and buf.op == "placeholder"):
        return False
    if new.target is not torch.ops.aten.index_copy.default or new.args[0] is not buf:
        return False
    return set(buf.users) == {new, copy}
