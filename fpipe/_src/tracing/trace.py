"""Trace: a user function, once per input signature, into aten graphs on fake tensors.

Two traces, both on fake tensors (no parameter or activation memory):

1. `trace_forward` records `f` on one microbatch as a flat forward graph. Tensors the function
   captures (module buffers, masks) become explicit inputs (`consts`), so that in-place buffer
   updates (BatchNorm statistics) are mutations of inputs, which torch.func allows, and so that the
   runtime hands the real tensors to whichever stage uses them; `Forward.sources` says which
   module buffer each one is, so the runtime reads the module's current tensor at every call.
2. `trace_joint` replays that graph under `torch.func.grad_and_value` and records the joint
   forward + backward graph. The cotangent of the loss is an input (`ct`): every node that depends
   on it is backward work, which is how `split.py` tells the two apart.

Both graphs leave here functional: no in-place operation but explicit writes into inputs
(NOTE [functional graphs]).

# NOTE [tracing is specialisation]
As with `jax.jit`, Python control flow runs once at trace time. A branch on a tensor's *value*
cannot be traced; `_raise_data_dependent` turns torch's internal error into one that names the
user's line.
"""

from __future__ import annotations

import contextvars
import dataclasses
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import _disable_current_modes

from . import tree
from .captured import RefuseCapturedReads
from .cut_at import is_pipe_split, pipe_splits_to_markers
from .cuts import Cutter
from .effects import is_mutating
from .frames import user_line
from .marker import BOUNDARY, BOUNDARY_BWD, boundary_apply, boundary_bwd_apply

__all__ = ["Forward", "Joint", "trace_forward", "trace_joint", "fake_like"]


@dataclasses.dataclass
class Forward:
    """A forward graph over flat inputs `[*params, *data, *consts]`, returning flat outputs."""

    gm: fx.GraphModule
    n_params: int
    n_data: int
    consts: list[torch.Tensor]  # as traced; the runtime reads `sources` afresh at every call
    out_spec: Any
    # where each const came from: (module, buffer name), or None (a tensor the function captured)
    sources: list[tuple[torch.nn.Module, str] | None] = dataclasses.field(default_factory=list)


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


def _raise_data_dependent(call: str, err: BaseException) -> None:
    where = user_line(traceback.extract_tb(err.__traceback__))
    raise ValueError(
        f"{call}: the function depends on the value of a tensor at {where}. fpipe traces the "
        "function once per input signature (shapes, dtypes, structure), like jax.jit, so Python "
        "control flow and shapes must not depend on tensor values. Use torch.where or masking "
        "instead of the branch, or pass the deciding value as a Python number (it then becomes "
        "part of the signature)."
    ) from err


@dataclasses.dataclass
class _TraceState:
    """What one running trace learns from the modules it calls (`note_module`)."""

    snapshots: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    sources: dict[int, tuple[torch.nn.Module, str]] = dataclasses.field(default_factory=dict)
    cutter: Cutter | None = None  # `pipeline(cuts=...)`: NOTE [cuts by module path] in cuts.py


# Per thread and per context, never process-wide: two traces in two threads do not mix.
_STATE: contextvars.ContextVar[_TraceState | None] = contextvars.ContextVar("fpipe_trace", default=None)


def note_module(module: torch.nn.Module) -> None:
    """Called by `Functionalized` while a trace runs: remember where each buffer lives (so the
    runtime reads the module's current tensor at every call, `Forward.sources`) and snapshot
    its real buffers to restore after the trace.

    Fake tracing applies an in-place update of a real captured tensor to the tensor itself
    (BatchNorm's `num_batches_tracked += 1`, a user's `self.buf.add_(1)`): it would really
    happen at trace time, so the trace puts it back.
    """
    state = _STATE.get()
    if state is None:
        return
    if state.cutter is not None:
        state.cutter.install(module)
    with _disable_current_modes():  # a real copy, not a traced one
        for name, t in module.named_buffers():
            state.sources.setdefault(id(t), (module, name))
            if t.device.type != "meta" and not isinstance(t, FakeTensor):
                state.snapshots.append((t, t.detach().clone()))


def run_trace(
    call: str, fn: Callable[..., Any], fakes: Sequence[torch.Tensor], cutter: Cutter | None = None
) -> tuple[fx.GraphModule, _TraceState]:
    state = _TraceState(cutter=cutter)
    token = _STATE.set(state)
    try:
        return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*fakes), state
    except (DataDependentOutputException, DynamicOutputShapeException) as err:
        _raise_data_dependent(call, err)
        raise  # unreachable
    finally:
        _STATE.reset(token)
        if cutter is not None:
            cutter.remove()
        with torch.no_grad():
            for t, saved in reversed(state.snapshots):
                t.copy_(saved)


# NOTE [functional graphs]
# The split hands values between programs and reorders work across stages and microbatches, so
# an in-place operation in a traced graph is a wrong result waiting to happen: a mutation of a
# value another program saved (`y = stage_boundary(h); y.mul_(2)` mutates stage 0's saved `h`),
# or a write that runs before a read the user's program order put first (`b = h + a; a.mul_(3)`
# with `b` on a later stage). So every traced graph is re-traced under
# `torch.func.functionalize(remove="mutations")` (as AOTAutograd does): in-place operations become
# out-of-place ones, and a mutation of an *input* (BatchNorm's running statistics, lifted to a
# `const` input) becomes one explicit `copy_` into that input at the end of the graph -- the only
# mutations left, each placed with the forward work that computes the new value. Views stay views
# (nothing mutates them any more), so the partition's cost model and the runtime's matrix-product
# accumulation still see `t`/`view`. The re-trace runs on the already-traced aten graph, where the
# boundary markers are plain custom ops: functionalize cannot run an autograd.Function itself.
# It runs the graph node by node (an `fx.Interpreter`), so each node's meta -- a checkpoint
# region's tag -- reaches the nodes it becomes (NOTE [checkpointed regions] in captured.py).
# Which nodes write is effects.py's answer (NOTE [effects]).


def functional(gm: fx.GraphModule, fakes: Sequence[torch.Tensor]) -> fx.GraphModule:
    """`gm` re-traced without in-place operations (NOTE [functional graphs]); a graph with none
    is returned as it is (the re-trace would change nothing, and costs a trace's time)."""
    if not any(is_mutating(n) for n in gm.graph.nodes):
        return gm
    plain = [f.detach() for f in fakes]
    # run node by node: each node's meta (a checkpoint region's tag) reaches the nodes it
    # becomes, inside `following_checkpoints` (NOTE [checkpointed regions] in captured.py)
    functional = torch.func.functionalize(fx.Interpreter(gm).run, remove="mutations")
    out = make_fx(functional, tracing_mode="fake", _allow_non_fake_inputs=True)(*plain)
    _drop_same_copies(out)
    _hoist_input_writes(out)
    return out


def _hoist_input_writes(gm: fx.GraphModule) -> None:
    """Move each write into an input (`copy_(input, new)`, which functionalize puts at the end)
    back to where the user wrote it: right after the new value and every read of the old one.
    The split places a write nothing reads with the forward work that follows it, so a BatchNorm
    counter's update runs on that BatchNorm's stage (its rank holds the buffer), not on stage 0."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)):
        dst = node.args[0]
        if not isinstance(dst, fx.Node) or dst.op != "placeholder":
            continue
        after = [a for a in node.all_input_nodes if a is not dst] + [u for u in dst.users if u is not node]
        anchor = max(after, key=order.__getitem__, default=dst)
        if order[anchor] < order[node]:
            anchor.append(node)
    gm.recompile()


def _drop_same_copies(gm: fx.GraphModule) -> None:
    """`copy(dst, src)` with `src` already of `dst`'s shape, dtype and layout is `src` itself (the
    functional form of an input write; the `copy_` into the input that follows reads it)."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.copy.default):
        dst, src = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[:2])
        if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor) and _same_layout(dst, src):
            node.replace_all_uses_with(node.args[1])  # type: ignore[arg-type]
            gm.graph.erase_node(node)
    gm.recompile()


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    same = (a.shape, a.dtype, a.device, a.stride()) == (b.shape, b.dtype, b.device, b.stride())
    return bool(same) and not b._is_view()  # a view of `a` itself must still be copied first


def lift_constants(gm: fx.GraphModule) -> list[torch.Tensor]:
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


def _refuse_custom_autograd(call: str, outs: Sequence[Any]) -> None:
    """Refuse `torch.autograd.Function` subclasses that the outputs' gradients go through.

    # NOTE [custom autograd.Function]
    The forward trace records a Function's forward as plain aten ops and the joint trace then
    differentiates those ops: a custom backward (a straight-through estimator, gradient
    reversal) would be silently replaced by the true derivative. Until the joint trace calls the
    user's backward, such a function is an error, not a wrong gradient. The trace runs with the
    inputs to be differentiated requiring grad (`_wanting_grad` in compiler.py), so each Function a
    gradient passes through left its backward node on the outputs' autograd graph; the walk
    finds the user's ones (fpipe's markers and torch's own Functions are fine).
    """
    used = _custom_functions(o.grad_fn for o in outs if isinstance(o, torch.Tensor))
    if used:
        raise ValueError(
            f"{call}: the function calls the custom autograd.Function {used[0].__qualname__} "
            f"(from {used[0].__module__}); fpipe traces its forward into plain operations and would "
            "differentiate those instead of calling its backward, giving wrong gradients. Move it "
            "out of the pipelined function, or express it with differentiable operations (a "
            "straight-through estimator is `x + (f(x) - x).detach()`)."
        )


def _custom_functions(roots: Iterable[Any]) -> list[type]:
    """The user-defined autograd.Function classes on the autograd graph below `roots`."""
    seen: set[int] = set()
    stack = [r for r in roots if r is not None]
    found: list[type] = []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        cls = getattr(type(node), "_forward_cls", None)
        if cls is not None and not cls.__module__.startswith(("fpipe.", "torch.")) and cls not in found:
            found.append(cls)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return found


def flat_function(
    call: str,
    f: Callable[..., Any],
    rebuild: Callable[[list[torch.Tensor]], tuple[Any, tuple[Any, ...], dict[str, Any]]],
    out_spec: list[Any],
) -> Callable[..., list[torch.Tensor]]:
    """`f` over flat leaves, returning its flat output tensors (their structure appended to
    `out_spec`); refuses non-tensor outputs and custom autograd.Functions."""

    def flat_f(*leaves: torch.Tensor) -> list[torch.Tensor]:
        params, args, kwargs = rebuild(list(leaves))
        with RefuseCapturedReads(call):  # NOTE [captured values] in captured.py
            out = f(params, *args, **kwargs)
        out_leaves, spec = tree.flatten(out)
        bad = [type(v).__name__ for v in out_leaves if not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(
                f"{call}: the function must return tensors (in any pytree), but its output "
                f"{spec} has leaves of type {bad}; return tensors only."
            )
        _refuse_custom_autograd(call, out_leaves)
        out_spec.append(spec)
        return out_leaves

    return flat_f


def trace_forward(
    call: str,
    f: Callable[..., Any],
    rebuild: Callable[[list[torch.Tensor]], tuple[Any, tuple[Any, ...], dict[str, Any]]],
    fakes: Sequence[torch.Tensor],
    n_params: int,
    device: torch.device | None = None,
    cuts: Any = None,
) -> Forward:
    """Trace `f(*rebuild(leaves))` into a flat, functional forward graph (see `_functional`);
    `device`: where meta constants are traced (the data's device); `cuts`: module paths where
    stages begin (NOTE [cuts by module path] in cuts.py); `pipe_split()` calls become markers
    (NOTE [pipe_split] in cut_at.py)."""
    out_spec: list[Any] = []
    cutter = Cutter(call, cuts) if cuts is not None else None
    gm, state = run_trace(call, flat_function(call, f, rebuild, out_spec), fakes, cutter)
    if cutter is not None:
        splits = sum(1 for n in gm.graph.nodes if is_pipe_split(n))
        cutter.check(gm.graph.find_nodes(op="call_function", target=BOUNDARY), splits)
    consts = lift_constants(gm)
    sources = [state.sources.get(id(c)) for c in consts]
    mode = detect_fake_mode(fakes) or FakeTensorMode(allow_non_fake_inputs=True)
    gm = functional(gm, [*fakes, *(fake_like(mode, c, device) for c in consts)])
    pipe_splits_to_markers(call, gm, n_params, len(fakes) - n_params)  # NOTE [pipe_split] in cut_at.py
    _refuse_captured_writes(call, gm, len(fakes), consts, sources)
    return Forward(gm, n_params, len(fakes) - n_params, consts, out_spec[0], sources)


def _refuse_captured_writes(
    call: str, gm: fx.GraphModule, n_inputs: int, consts: list[torch.Tensor], sources: list[Any]
) -> None:
    """Refuse an in-place write into a captured tensor that is no module's buffer.

    # NOTE [writes into captured tensors]
    Fake tracing applies an in-place update of a real captured tensor to the tensor itself
    (StaticCache's `cumulative_length.add_(n)`, a global step counter). For a module buffer the
    trace puts the old value back (`note_module`); for any other captured tensor fpipe cannot,
    so the write would happen once at trace time and again at every call, and the positions a
    cache length gives would be off by a step: wrong tokens, no error. So it is an error, and
    the message says the tensor's value was already changed.
    """
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"][n_inputs:]
    written = {
        phs.index(n.args[0])
        for n in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)
        if n.args[0] in phs
    }
    bad = sorted(i for i in written if sources[i] is None)
    if bad:
        t = consts[bad[0]]
        what = f"a {t.dim()}-dim {t.device.type} {t.dtype} tensor" + (" (a counter?)" if t.dim() == 0 else "")
        raise ValueError(
            f"{call}: the function writes in place into {what} it captured that is not a module "
            "buffer (a cache length, a step counter: transformers' StaticCache keeps its length "
            "so). fpipe's trace cannot undo that write, so it already happened once at trace "
            "time, and the traced program would repeat it at every call: wrong results with no "
            "error. Pass the tensor (or the position it counts) as an argument of the function, "
            "or register it as a buffer of the module (register_buffer); fpipe.generate keeps "
            "the cache position as an input."
        )


class _Replay(fx.Interpreter):
    """Re-run a forward graph; boundary nodes become the differentiable marker again."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is BOUNDARY:
            return boundary_apply(list(args[0]))
        if target is BOUNDARY_BWD:  # the function took a gradient through a boundary itself
            return boundary_bwd_apply(list(args[0]))
        return super().call_function(target, args, kwargs)


def forward_as_joint(fwd: Forward) -> Joint:
    """The forward graph with an (unused) cotangent input, so `split` treats both alike (a
    forward-only pipeline call; generate's decode programs)."""
    gm = fwd.gm
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last):
        gm.graph.placeholder("ct")
    gm.recompile()
    n_outs = len(gm.graph.find_nodes(op="output")[0].args[0])
    return Joint(gm, fwd.n_params, fwd.n_data, len(fwd.consts), n_outs, [])


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

    gm = functional(run_trace(call, joint, fakes)[0], fakes)
    n_outs = len(fwd.gm.graph.find_nodes(op="output")[0].args[0])
    return Joint(gm, fwd.n_params, fwd.n_data, len(fwd.consts), n_outs, list(diff))


def make_fakes(
    tensors: Sequence[torch.Tensor], data_device: torch.device | None
) -> tuple[FakeTensorMode, list[torch.Tensor]]:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode, [fake_like(mode, t, data_device) for t in tensors]


del sys
