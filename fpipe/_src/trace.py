"""Trace: a user function, once per input signature, into aten graphs on fake tensors.

Two traces, both on fake tensors (no parameter or activation memory):

1. `trace_forward` records `f` on one microbatch as a flat forward graph. Tensors the function
   captures (module buffers, masks) become explicit inputs (`consts`), so that in-place buffer
   updates (BatchNorm statistics) are mutations of inputs, which torch.func allows, and so that the
   runtime hands the real tensors to whichever stage uses them.
2. `trace_joint` replays that graph under `torch.func.grad_and_value` and records the joint
   forward + backward graph. The cotangent of the loss is an input (`ct`): every node that depends
   on it is backward work, which is how `split.py` tells the two apart.

# NOTE [tracing is specialisation]
As with `jax.jit`, Python control flow runs once at trace time. A branch on a tensor's *value*
cannot be traced; `_raise_data_dependent` turns torch's internal error into one that names the
user's line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import linecache
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import _disable_current_modes

from . import tree
from .marker import BOUNDARY, BOUNDARY_BWD, boundary_apply, boundary_bwd_apply

__all__ = ["Forward", "Joint", "trace_forward", "trace_joint", "fake_like"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_FPIPE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Forward:
    """A forward graph over flat inputs `[*params, *data, *consts]`, returning flat outputs."""

    gm: fx.GraphModule
    n_params: int
    n_data: int
    consts: list[torch.Tensor]
    out_spec: Any


@dataclasses.dataclass
class Joint:
    """The joint graph over `[*params, *data, *consts, ct]` returning `[*outs, *grads]`."""

    gm: fx.GraphModule
    n_params: int
    n_data: int
    n_consts: int
    n_outs: int
    diff: list[int]  # flat input positions whose gradients are returned, in order


def fake_like(mode: FakeTensorMode, t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """A fake tensor with `t`'s metadata; a meta tensor is placed on `device` (the data's)."""
    dev = device if (t.device.type == "meta" and device is not None) else t.device
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=dev, requires_grad=False)


def _user_frame(tb: Any) -> traceback.FrameSummary | None:
    frames = [f for f in traceback.extract_tb(tb) if not f.filename.startswith((_TORCH_DIR, _FPIPE_DIR))]
    frames = [f for f in frames if "/torch/" not in f.filename and "/functorch/" not in f.filename]
    return frames[-1] if frames else None


def _raise_data_dependent(call: str, err: BaseException) -> None:
    frame = _user_frame(err.__traceback__)
    where = "an unknown line"
    if frame is not None:
        code = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
        where = f"{frame.filename}:{frame.lineno} (`{code}`)"
    raise ValueError(
        f"{call}: the function depends on the value of a tensor at {where}. fpipe traces the "
        "function once per input signature (shapes, dtypes, structure), like jax.jit, so Python "
        "control flow and shapes must not depend on tensor values. Use torch.where or masking "
        "instead of the branch, or pass the deciding value as a Python number (it then becomes "
        "part of the signature)."
    ) from err


_SNAPSHOTS: list[tuple[torch.Tensor, torch.Tensor]] | None = None


def note_state(tensors: Iterable[torch.Tensor]) -> None:
    """Called by `Functionalized` while a trace runs: remember scalar buffers to restore after.

    Fake tracing treats 0-dim CPU tensors as real values, so an in-place update of one (BatchNorm's
    `num_batches_tracked += 1`) would really happen at trace time; the trace puts it back.
    """
    if _SNAPSHOTS is None:
        return
    with _disable_current_modes():  # a real copy, not a traced one
        for t in tensors:
            if t.dim() == 0 and t.device.type != "meta" and not isinstance(t, FakeTensor):
                _SNAPSHOTS.append((t, t.detach().clone()))


def _trace(call: str, fn: Callable[..., Any], fakes: Sequence[torch.Tensor]) -> fx.GraphModule:
    global _SNAPSHOTS
    outer, _SNAPSHOTS = _SNAPSHOTS, []
    try:
        return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*fakes)
    except (DataDependentOutputException, DynamicOutputShapeException) as err:
        _raise_data_dependent(call, err)
        raise  # unreachable
    finally:
        with torch.no_grad():
            for t, saved in reversed(_SNAPSHOTS):
                t.copy_(saved)
        _SNAPSHOTS = outer


def _lift_constants(gm: fx.GraphModule) -> list[torch.Tensor]:
    """Turn captured tensors (`get_attr` nodes) into trailing placeholders; return the tensors."""
    consts: list[torch.Tensor] = []
    graph = gm.graph
    last_ph = [n for n in graph.nodes if n.op == "placeholder"][-1]
    lifted: dict[int, fx.Node] = {}  # id of a captured tensor -> its placeholder
    for node in list(graph.nodes):
        if node.op != "get_attr" or not isinstance(getattr(gm, node.target), torch.Tensor):  # type: ignore[arg-type]
            continue
        value = getattr(gm, node.target)  # type: ignore[arg-type]
        if id(value) not in lifted:
            with graph.inserting_after(last_ph):
                last_ph = lifted[id(value)] = graph.placeholder(f"const_{len(consts)}")
            last_ph.meta.update(node.meta)
            consts.append(value)
        node.replace_all_uses_with(lifted[id(value)])
        graph.erase_node(node)
    for name in [n for n, _ in gm.named_buffers()] + [n for n, _ in gm.named_parameters()]:
        if "." not in name:
            delattr(gm, name)
    for name in list(vars(gm)):
        if name.startswith("_tensor_constant"):
            delattr(gm, name)
    gm.recompile()
    return consts


@contextlib.contextmanager
def _no_custom_autograd(call: str) -> Iterator[None]:
    """Refuse `torch.autograd.Function` subclasses in a traced function.

    # NOTE [custom autograd.Function]
    The forward trace records a Function's forward as plain aten ops and the joint trace then
    differentiates those ops: a custom backward (a straight-through estimator, gradient
    reversal) would be silently replaced by the true derivative. Until the joint trace calls the
    user's backward, such a function is an error, not a wrong gradient.
    """
    function = torch.autograd.function.Function
    original = function.__dict__["apply"]
    used: list[type] = []

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if not cls.__module__.startswith(("fpipe.", "torch.")):
            used.append(cls)
        return original.__func__(cls, *args, **kwargs)

    function.apply = classmethod(apply)  # type: ignore[assignment, method-assign]
    try:
        yield
    finally:
        function.apply = original  # type: ignore[method-assign]
    if used:
        raise ValueError(
            f"{call}: the function calls the custom autograd.Function {used[0].__qualname__} "
            f"(from {used[0].__module__}); fpipe traces its forward into plain operations and would "
            "differentiate those instead of calling its backward, giving wrong gradients. Move it "
            "out of the pipelined function, or express it with differentiable operations (a "
            "straight-through estimator is `x + (f(x) - x).detach()`)."
        )


def trace_forward(
    call: str,
    f: Callable[..., Any],
    rebuild: Callable[[list[torch.Tensor]], tuple[Any, tuple[Any, ...], dict[str, Any]]],
    fakes: Sequence[torch.Tensor],
    n_params: int,
) -> Forward:
    """Trace `f(*rebuild(leaves))` into a flat forward graph."""
    out_spec: list[Any] = []

    def flat_f(*leaves: torch.Tensor) -> list[torch.Tensor]:
        params, args, kwargs = rebuild(list(leaves))
        out = f(params, *args, **kwargs)
        out_leaves, spec = tree.flatten(out)
        bad = [type(v).__name__ for v in out_leaves if not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(
                f"{call}: the function must return tensors (in any pytree), but its output "
                f"{spec} has leaves of type {bad}; return tensors only."
            )
        out_spec.append(spec)
        return out_leaves

    with _no_custom_autograd(call):
        gm = _trace(call, flat_f, fakes)
    consts = _lift_constants(gm)
    return Forward(gm, n_params, len(fakes) - n_params, consts, out_spec[0])


class _Replay(fx.Interpreter):
    """Re-run a forward graph; boundary nodes become the differentiable marker again."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is BOUNDARY:
            return boundary_apply(list(args[0]))
        if target is BOUNDARY_BWD:  # the function took a gradient through a boundary itself
            return boundary_bwd_apply(list(args[0]))
        return super().call_function(target, args, kwargs)


def trace_joint(
    call: str, fwd: Forward, fakes: Sequence[torch.Tensor], diff: list[int], has_aux: bool
) -> Joint:
    """Trace value-and-grad of output 0 of `fwd` w.r.t. the flat inputs at positions `diff`.

    `fakes` are `[*params, *data, *consts, ct]`; the scalar `ct` scales the loss, so the graph
    computes the vector-Jacobian product the runtime asks for (1/M for a mean over microbatches).
    """
    diff_set = set(diff)

    def joint(*leaves: torch.Tensor) -> list[torch.Tensor]:
        *inputs, ct = leaves

        # Non-differentiated inputs go through grad_and_value as an argument, not a closure:
        # torch.func forbids mutating captured tensors (BatchNorm statistics are mutated).
        def inner(
            primals: list[torch.Tensor], rest: list[torch.Tensor]
        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
            p_it, r_it = iter(primals), iter(rest)
            full = [next(p_it) if i in diff_set else next(r_it) for i in range(len(inputs))]
            outs = _Replay(fwd.gm).run(*full)
            return (outs[0] * ct).sum(), list(outs)

        primals = [inputs[i] for i in diff]
        rest = [x for i, x in enumerate(inputs) if i not in diff_set]
        grads, (_, outs) = torch.func.grad_and_value(inner, has_aux=True)(primals, rest)
        return [*outs, *grads]

    gm = _trace(call, joint, fakes)
    n_outs = len(fwd.gm.graph.find_nodes(op="output")[0].args[0])
    return Joint(gm, fwd.n_params, fwd.n_data, len(fwd.consts), n_outs, list(diff))


def make_fakes(
    tensors: Sequence[torch.Tensor], data_device: torch.device | None
) -> tuple[FakeTensorMode, list[torch.Tensor]]:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode, [fake_like(mode, t, data_device) for t in tensors]


del sys
