"""The traced decode steps of one model, reused by their trace key (NOTE [trace key]), and the
K/V buffers' layout they are traced with.

The layout is read off the model, not its config: one step of one token runs on fake tensors
(no memory, no compute) through a cache that records the keys and values each layer's attention
hands it (`ProbeCache`). A config's head count is not always what the attention stores: Falcon
with `multi_query=True` stores one K/V head for all `num_attention_heads`, and the dtype is the
attention's, not the first parameter's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..tracing import Forward, make_fakes
from ..tracing import trace_key as trace_key_
from .decode import (
    DATA,
    Layout,
    Programs,
    Shapes,
    cache_kwarg,
    decoder_blocks,
    example,
    forward_kwargs,
    trace_programs,
    trace_step,
)

__all__ = ["StepTraces", "kv_layout"]


class StepTraces:
    """One model's traced steps: the K/V layout, the traced forward and the programs per stage
    count, each under the key of what it was traced from (the model's parameters and buffers:
    names, shapes, dtypes, devices; the step's inputs; the ambient state)."""

    def __init__(self) -> None:
        self.layouts: dict[Any, Layout] = {}
        self.forwards: dict[Any, Forward] = {}
        self.programs: dict[tuple[Any, int], Programs] = {}

    def get(self, model: nn.Module, shapes: Shapes, stages: int, device: torch.device) -> Programs:
        """The programs of the model's step at `shapes` on `stages` stages, traced at the first
        use of their key."""
        names, leaves = _state(model)
        model_key = trace_key_.trace_key(device.type, names, leaves, (), ())
        if model_key not in self.layouts:
            self.layouts[model_key] = kv_layout(model, device)
        layout = self.layouts[model_key]
        kv_names = [f"{kind}{i}" for i in range(len(layout) // 2) for kind in "kv"]
        key = trace_key_.trace_key(device.type, names, leaves, [*DATA, *kv_names], example(shapes, layout))
        if (key, stages) not in self.programs:
            if key not in self.forwards:
                call = f"fpipe.generate({type(model).__name__}, stages={stages})"
                with traceable_experts(model):
                    self.forwards[key] = trace_step(call, model, shapes, device, layout)
            self.programs[key, stages] = trace_programs(model, self.forwards[key], stages, layout)
        return self.programs[key, stages]


def _state(model: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """The names and tensors a trace of the model reads: its parameters, then its buffers."""
    items = [*model.named_parameters(), *model.named_buffers()]
    return [n for n, _ in items], [t for _, t in items]


def kv_layout(model: nn.Module, device: torch.device) -> Layout:
    """(heads, head dim, dtype) of each K/V buffer, k0, v0, k1, ...: what each decoder layer's
    attention stores, from one step of one token on fake tensors."""
    from .kv_cache import ProbeCache  # (transformers: imported here, not by `import fpipe`)

    n_layers = decoder_blocks(model)[1]
    cache = ProbeCache(n_layers)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    mode, fakes = make_fakes(list(state.values()), device)
    with mode, torch.no_grad(), traceable_experts(model):
        one = torch.ones((1, 1), dtype=torch.long, device=device)
        kwargs = dict(input_ids=one, attention_mask=one, position_ids=one - 1, **forward_kwargs(model))
        kwargs[cache_kwarg(model)] = cache
        torch.func.functional_call(model, dict(zip(state, fakes)), (), kwargs)
    if len(cache.seen) != n_layers:
        raise ValueError(
            f"fpipe.generate({type(model).__name__}): the model's {n_layers} decoder layers "
            f"called cache.update {len(cache.seen)} times in one step; fpipe.generate supports "
            "models whose every decoder layer calls cache.update once per forward (full "
            "attention: no sliding-window, linear-attention or cross-attention layers). Use "
            "model.generate for this model."
        )
    return [(t.shape[1], t.shape[-1], t.dtype) for kv in cache.seen for t in kv]


@contextlib.contextmanager
def traceable_experts(model: nn.Module) -> Iterator[None]:
    """Mixture-of-experts layers as transformers traces them for torch.compile: its grouped
    matmul (`torch.nn.functional.grouped_mm`) has a CPU kernel for float32 but a fake-tensor
    (meta) kernel that accepts bfloat16 only, so a fake trace of a float32 MoE model fails
    inside the trace ("Expected inputs of BF16 type"). transformers itself takes its
    `grouped_mm_fallback` op (same product, a fake kernel for every dtype) for non-bfloat16
    weights under torch.compile; the trace takes it too. bfloat16 keeps grouped_mm."""
    if getattr(getattr(model, "config", None), "_experts_implementation", None) != "grouped_mm":
        yield
        return
    from transformers.integrations import moe

    usable = moe._can_use_grouped_mm

    def bf16_only(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> bool:
        return weight.dtype == torch.bfloat16 and bool(usable(input, weight, offs))

    moe._can_use_grouped_mm = bf16_only
    try:
        yield
    finally:
        moe._can_use_grouped_mm = usable
