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
program that owns them (`inplace_cache_writes`, kv_writes.py, turns the functional write the
trace records back into an in-place one), so no step copies a cache. This module imports
transformers: decode.py imports it only when a step is traced, so `import fpipe` does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

__all__ = ["ProbeCache", "SlotCache"]


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
        # out of place, so the trace has no mutation to functionalize (a second trace's time);
        # `inplace_cache_writes` makes each write in place on the program's own buffer
        keys = torch.index_copy(_tensor(self.keys), 2, index, key_states)
        values = torch.index_copy(_tensor(self.values), 2, index, value_states)
        self.keys, self.values = keys, values
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return _tensor(self.keys).shape[2], 0

    def get_seq_length(self) -> Any:  # a tensor: the position stays data
        return self.offset

    def get_max_length(self) -> int:
        return _tensor(self.keys).shape[2]


def _tensor(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None  # set at construction
    return t


class SlotCache(Cache):
    """A `Cache` over the caller's buffers: `kv[layer] = (keys, values)`; `offset` the position
    (0-dim long tensor) where the tokens of this call go."""

    def __init__(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], offset: torch.Tensor) -> None:
        super().__init__(layers=[SlotLayer(k, v, offset) for k, v in kv])


class ProbeLayer(CacheLayerMixin):
    """Records the keys and values the layer's attention hands the cache (a step on fake tensors)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, seen: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self.seen, self.is_initialized = seen, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen.append((key_states, value_states))
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class ProbeCache(Cache):
    """A `Cache` that records what each layer stores (`seen`: (keys, values) per `update`)."""

    def __init__(self, n_layers: int) -> None:
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        super().__init__(layers=[ProbeLayer(self.seen) for _ in range(n_layers)])
