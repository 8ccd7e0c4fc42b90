"""Captured values: refuse a trace that reads the value of a tensor the function did not get as an
argument.

# NOTE [captured values]
A tensor the function captures (a module attribute, a global, a buffer) is lifted to a `const`
input when it is used as a tensor, so the runtime passes the current one at every call. But when
the function reads its *value* as a Python number -- `torch.arange(self.length, ...)`,
`int(t)`, `t.item()`, or any op that takes a number -- the trace keeps the number it read:
a cache length counter advanced between calls would be ignored, a wrong result with no error.
So while the user's function is traced, `RefuseCapturedReads` follows the tensors that come
from outside (real tensors: the trace's own inputs are fake) and every value computed from
them, and a read of such a value's number (`aten._local_scalar_dense`) is a ValueError naming
the user's line. A number read from a tensor the function creates itself (`torch.tensor(3)`)
is the same at every call and stays allowed; one read from an argument is data-dependent and
is refused by the tracer itself (NOTE [tracing is specialisation] in trace.py).
"""

from __future__ import annotations

import traceback
import warnings
import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .frames import user_line

__all__ = ["RefuseCapturedReads"]

_READ = torch.ops.aten._local_scalar_dense.default
_LITERALS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


class RefuseCapturedReads(TorchDispatchMode):
    """Active while the user's function is traced (NOTE [captured values])."""

    def __init__(self, call: str) -> None:
        super().__init__()
        self.call = call
        self.hooks_seen = False  # saved-tensor hooks active (torch.utils.checkpoint): see below
        # fakes computed from outside, by id (a WeakSet would compare tensors with ==)
        self.derived: dict[int, weakref.ref[torch.Tensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.hooks_seen and torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            self.hooks_seen = True
            _warn_hooks(self.call)
        if func in _LITERALS:  # `torch.tensor(3)` in the function: made here, not captured
            return func(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outside = any(self._from_outside(t) for t in tensors)
        if outside and func is _READ:
            self._refuse()
        # a value known at trace time only when every input is: one computed with an argument
        # is data-dependent (the tracer refuses reading it), not a captured number
        outside = outside and all(self._from_outside(t) or _known(t) for t in tensors)
        out = func(*args, **kwargs)
        if outside:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.derived[id(t)] = weakref.ref(t)
        return out

    def _from_outside(self, t: torch.Tensor) -> bool:
        if not isinstance(t, FakeTensor):
            return True
        ref = self.derived.get(id(t))
        return ref is not None and ref() is t

    def _refuse(self) -> None:
        where = user_line(traceback.extract_stack())
        raise ValueError(
            f"{self.call}: the function reads the value of a tensor it did not receive as an "
            f"argument (a module attribute, buffer or global) as a Python number at {where}. The "
            "trace would keep that number, so a later change to the tensor (a cache length, a "
            "step counter) would be ignored. Compute with it as a tensor (`torch.arange(n) + "
            "self.length` keeps it an input the runtime reads at every call), or pass the number "
            "as a Python int or float argument (it then becomes part of the trace's signature)."
        )


def _known(t: torch.Tensor) -> bool:
    """A fake whose value the tracer knows (a constant: `torch.tensor(3)` in the function)."""
    return isinstance(t, FakeTensor) and t.constant is not None


def _warn_hooks(call: str) -> None:
    """`torch.utils.checkpoint` (non-reentrant) or another saved-tensor hook (CPU offloading) is
    active inside the traced function. fpipe's programs keep and free their values themselves,
    so the hooks never run: the gradients are right, but nothing is recomputed or offloaded."""
    warnings.warn(
        f"{call}: the function runs saved-tensor hooks (torch.utils.checkpoint, or offloading "
        "with torch.autograd.graph.saved_tensors_hooks). fpipe traces through them: the "
        "gradients are exact, but the region's activations are kept for the backward, not "
        "recomputed or offloaded, so no memory is saved.",
        stacklevel=2,
    )
