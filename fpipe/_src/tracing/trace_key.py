"""The key of a trace: what `pipeline` and `generate` reuse a traced program by.

# NOTE [trace key]
A trace is reused for a call whose key equals the traced call's, so the key holds everything
that can change what the trace records: each tensor's shape, dtype, device type and strides
(kernels and views differ by layout; a dtype is recorded in every cast the model makes, such as
an RMSNorm's `.to(input_dtype)`, so a model moved to another dtype must be traced again); every
non-tensor argument by type, hash and equality (jax.jit's static arguments: a value that prints
alike but differs, such as two numpy arrays that differ in the middle, must not share a trace,
so unhashable values are refused); and the ambient state the function runs under: autocast per
device type, grad mode, default dtype. `pipeline` keys a call's parameters and arguments
(`Inputs.key`); `generate` keys the model's parameters and buffers and one step's inputs, K/V
buffers included (`decode.step_key`) -- both through `trace_key`. Every rank must compute an
equal key for the same inputs (`group.check_same_signature` compares a digest of its repr): a
meta tensor (another rank's parameter) is keyed as a tensor on the device it is traced on, the
device *type* is keyed (cuda:0 and cuda:1 trace alike), and a static's repr drops object
addresses.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Static", "ambient_key", "tensor_key", "trace_key"]


def trace_key(
    device_type: str,
    param_spec: Any,
    param_leaves: Sequence[torch.Tensor],
    data_spec: Any,
    data_leaves: Sequence[torch.Tensor],
    axes: Sequence[Any] = (),
    statics: Sequence[Any] = (),
    tp: Any = None,
) -> tuple[Any, ...]:
    """The key of a trace of these inputs (NOTE [trace key]); `device_type`: where meta tensors
    are traced (the data's device)."""
    return (
        str(param_spec),
        tuple(tensor_key(t, device_type) for t in param_leaves),
        str(data_spec),
        tuple(tensor_key(t, device_type) for t in data_leaves),
        tuple(axes),
        tuple(Static(s) for s in statics),
        ambient_key(),
        tp,
    )


def tensor_key(t: torch.Tensor, device_type: str) -> tuple[Any, ...]:
    # a meta parameter (another rank's) traces like a real one on the data's device: same key
    dev = device_type if t.is_meta else t.device.type
    strides = tuple(st if n > 1 else 0 for st, n in zip(t.stride(), t.shape))  # size-1 dims: any
    return (tuple(t.shape), t.dtype, dev, strides)


def ambient_key() -> tuple[Any, ...]:
    autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))
    return (autocast, torch.is_grad_enabled(), torch.get_default_dtype())


@dataclasses.dataclass(frozen=True, eq=False)
class Static:
    """A non-tensor argument in a trace key: equal by type and value, hashed by value."""

    value: Any

    def __hash__(self) -> int:
        return hash((type(self.value), self.value))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Static) or type(self.value) is not type(other.value):
            return False
        return bool(self.value is other.value or self.value == other.value)

    def __repr__(self) -> str:  # the same on every rank: no object addresses
        return re.sub(r" at 0x[0-9a-fA-F]+", "", f"{type(self.value).__qualname__}:{self.value!r}")
