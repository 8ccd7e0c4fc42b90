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

# NOTE [checkpointed regions]
fpipe's programs keep and free their values themselves, so saved-tensor hooks never run in
them. A non-reentrant `torch.utils.checkpoint` region is seen while tracing by its hooks being
active (its pack hook is `_checkpoint_hook`'s), a reentrant one (`use_reentrant=True`, no hook) by
its `CheckpointFunction.forward` being on the Python stack: inside `following_checkpoints()` (the
compiler's traces), every operation traced under them gets `meta["recompute"]` (the region's
number), which the joint trace carries to the joint graph's forward operations (the replay
runs under `fx.traceback.preserve_node_meta`, and so does the functional re-trace of a graph
with in-place operations or dropout, NOTE [functional graphs] in trace.py), and remat.py
recomputes the saved values those
operations make inside the backward program, keeping the region's inputs: each region is
recomputed from its own inputs (the output of the region before it is one of them, kept, not
recomputed too), just before its backward, as `torch.utils.checkpoint` does -- except that a
write in the region runs once (BatchNorm's statistics: NOTE [effects] in effects.py), where
eager checkpoint would update them again. Any other saved-tensor hook (offloading to the host)
is warned about: nothing is offloaded.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import traceback
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .frames import user_line

__all__ = ["RefuseCapturedReads", "following_checkpoints"]

# The checkpoint regions met by the traces of one compile (None: not following them)
_REGIONS: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("fpipe_regions", default=None)


@contextlib.contextmanager
def following_checkpoints() -> Iterator[list[Any]]:
    """Tag the operations of checkpointed regions in the traces run inside (NOTE
    [checkpointed regions]); yields the list of regions met (their pack hooks)."""
    regions: list[Any] = []
    token = _REGIONS.set(regions)
    try:
        with fx_traceback.preserve_node_meta():
            yield regions
    finally:
        _REGIONS.reset(token)


def _is_checkpoint(pack: Any) -> bool:
    return "_checkpoint_hook" in getattr(pack, "__qualname__", "")


_REENTRANT = torch.utils.checkpoint.CheckpointFunction.forward.__code__


def _reentrant_region() -> Any:
    """The innermost `use_reentrant=True` checkpoint running now (its autograd context), found
    on the Python stack: it installs no hook, its forward runs the region under `no_grad`."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _REENTRANT:
            return frame.f_locals.get("ctx")
        frame = frame.f_back  # type: ignore[assignment]
    return None


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
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        regions = _REGIONS.get()
        if hooks is not None and _is_checkpoint(hooks[0]) and regions is not None:
            return self._in_region(regions, hooks[0], func, types, args, kwargs)
        reentrant = _reentrant_region() if regions is not None else None
        if reentrant is not None:
            return self._in_region(regions, reentrant, func, types, args, kwargs)  # type: ignore[arg-type]
        if not self.hooks_seen and hooks is not None:
            self.hooks_seen = True
            _warn_hooks(self.call)
        return self._dispatch(func, args, kwargs)

    def _in_region(self, regions: list[Any], pack: Any, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """`func` traced as an operation of checkpoint region `pack` (NOTE [checkpointed regions])."""
        if not any(r is pack for r in regions):
            regions.append(pack)  # held: a region's number is its place here
        number = next(i for i, r in enumerate(regions) if r is pack)
        outer = fx_traceback.current_meta
        fx_traceback.current_meta = {**outer, "recompute": number}
        try:
            return self._dispatch(func, args, kwargs)
        finally:
            fx_traceback.current_meta = outer

    def _dispatch(self, func: Any, args: Any, kwargs: Any) -> Any:
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
    """A saved-tensor hook other than a followed `torch.utils.checkpoint` (offloading to the
    host; a checkpoint traced outside `following_checkpoints`) is active inside the traced
    function: fpipe's programs keep and free their values themselves, so it never runs."""
    warnings.warn(
        f"{call}: the function runs saved-tensor hooks (offloading with "
        "torch.autograd.graph.saved_tensors_hooks, or a checkpoint fpipe cannot follow). fpipe "
        "traces through them: the gradients are exact, but the values are kept for the "
        "backward, not offloaded or recomputed, so no memory is saved. fpipe recomputes "
        "torch.utils.checkpoint regions (reentrant or not); pipeline(..., "
        "memory_limit=bytes) chooses what to recompute itself.",
        stacklevel=2,
    )


def warn_lost_regions(call: str) -> None:
    """Checkpoint regions were traced but none of their tags reached the joint graph: say that
    nothing is recomputed (a safety net: every trace carries the tags, NOTE [checkpointed
    regions])."""
    warnings.warn(
        f"{call}: the function has torch.utils.checkpoint regions, but fpipe lost track of "
        "them while tracing: the gradients are exact, but the regions' values are kept for the "
        "backward, not recomputed. pipeline(..., memory_limit=bytes) chooses what to recompute "
        "without the regions.",
        stacklevel=2,
    )
