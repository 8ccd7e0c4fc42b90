"""Tensor parallelism: DTensor parameters on the mesh's "tp" dimension, traced into programs over
local shards.

# NOTE [tensor-parallel tracing]
A model parallelized the ecosystem's way (`parallelize_module(model, mesh["tp"], plan)`) holds
DTensor parameters; its forward hooks and DTensor's sharding rules decide every op's layout and
insert the collectives. Running a traced graph on DTensors would pay DTensor's dispatch on every
op of every microbatch (../shared/DESIGN.md measured 14x on a small MLP). So fpipe desugars
DTensor at trace time, once:

* a call's DTensor parameters enter the pipeline as their local shards (`split_params`); each
  one's layout (`TPSpec`) is part of the trace key;
* the trace wraps each shard back with `DTensor.from_local` (`wrapping`) and runs the user's
  function: DTensor's dispatch runs under the tracer, which records the ops it runs on local
  shards and the functional collectives it issues. Outputs leave as plain tensors
  (`plain_outputs`: a sharded or partial output is made whole, as the unsplit function's is);
* the joint (value-and-grad) graph is traced the same way with `torch.autograd.grad`
  (`trace_joint_tp`): torch.func transforms cannot run DTensor, and replaying the plain forward
  graph would differentiate its collectives without DTensor's placement rules;
* collectives become fpipe's (NOTE [collectives in stage programs] in tp_collectives.py); the
  programs run on plain tensors, with no DTensor dispatch;
* a value crossing a stage boundary crosses as its local shard (`marker.boundary_apply`): each
  tp rank sends to the same tp rank of the next stage (the pipeline group is the mesh's "pp"
  dimension at this rank's tp coordinate). A replicated value goes from every tp rank;
* a gradient comes back as a DTensor with its parameter's placements (`TPSpec.wrap`): DTensor's
  `from_local` backward puts the gradient in the parameter's layout inside the traced program.

Data arguments are plain tensors, the same on every tp rank (as `parallelize_module`'s input
hooks take them); the ranks compare their shapes at each call.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from ..tracing import (
    Cutter,
    Forward,
    Joint,
    flat_function,
    functional,
    lift_constants,
    refuse_pipe_splits,
    run_trace,
    tree,
)

__all__ = ["TPSpec", "split_params", "wrapping", "plain_outputs", "trace_joint_tp"]


@dataclasses.dataclass(frozen=True)
class TPSpec:
    """How a tensor-parallel parameter is laid out over mesh["tp"]."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    def wrap(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )

    def key(self) -> tuple[Any, ...]:
        return (tuple(str(p) for p in self.placements), tuple(self.shape))


def split_params(
    call: str, leaves: list[torch.Tensor], keys: list[Any], tp_mesh: Any
) -> tuple[list[torch.Tensor], list[TPSpec | None] | None]:
    """The parameter leaves with each DTensor on `tp_mesh` replaced by its local shard, and the
    layouts of those (None without tensor parallelism). ShardedTensor parameters are refused."""
    _refuse_sharded_tensor(call, leaves, keys)
    if tp_mesh is None:
        return leaves, None
    specs: list[TPSpec | None] = []
    out = []
    for p in leaves:
        if isinstance(p, DTensor) and p.device_mesh == tp_mesh:
            specs.append(TPSpec(p.device_mesh, tuple(p.placements), p.shape, p.stride()))
            out.append(p.to_local())
        else:
            specs.append(None)
            out.append(p)
    return out, (specs if any(specs) else None)


def _refuse_sharded_tensor(call: str, leaves: list[torch.Tensor], keys: list[Any]) -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    for i, p in enumerate(leaves):
        if isinstance(p, ShardedTensor):
            name = repr(keys[i]) if i < len(keys) else f"leaf {i}"
            raise TypeError(
                f"{call}: parameter {name} is a ShardedTensor; torch deprecates ShardedTensor in "
                "favour of DTensor, and fpipe shards through DTensor only. Parallelize the model "
                "with torch.distributed.tensor.parallel.parallelize_module(model, mesh['tp'], "
                "plan), or convert the parameter with distribute_tensor(t, mesh['tp'], placements)."
            )


def wrapping(
    rebuild: Callable[[list[torch.Tensor]], Any], specs: list[TPSpec | None] | None
) -> Callable[[list[torch.Tensor]], Any]:
    """`rebuild` with each tensor-parallel parameter's local shard wrapped as its DTensor."""
    if specs is None:
        return rebuild

    def wrapped(leaves: list[torch.Tensor]) -> Any:
        n = len(specs)
        params = [s.wrap(t) if s is not None else t for t, s in zip(leaves[:n], specs)]
        return rebuild([*params, *leaves[n:]])

    return wrapped


def plain_outputs(f: Callable[..., Any]) -> Callable[..., Any]:
    """`f` whose DTensor outputs are returned whole, as plain tensors."""

    def plain(*args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree.flatten(f(*args, **kwargs))
        return tree.unflatten([_whole(v) for v in leaves], spec)

    return plain


def _whole(v: Any) -> Any:
    return v.full_tensor() if isinstance(v, DTensor) else v


def trace_joint_tp(
    call: str,
    f: Callable[..., Any],
    rebuild: Callable[[list[torch.Tensor]], Any],
    fwd: Forward,
    fakes: Sequence[torch.Tensor],
    diff: list[int],
    cuts: Any,
) -> Joint:
    """The joint graph `[*params, *data, *consts, ct] -> [*outs, *grads]` of a tensor-parallel
    function, traced with `torch.autograd.grad` (NOTE [tensor-parallel tracing]); `fakes` are
    `[*params, *data, ct]`. The function captures its constants again; they are matched to the
    forward trace's (`fwd.consts`), so both graphs take the same inputs."""
    diff_set = set(diff)
    out_spec: list[Any] = []
    flat_f = flat_function(call, f, rebuild, out_spec)

    def joint(*leaves: torch.Tensor) -> list[torch.Tensor]:
        *inputs, ct = leaves
        inputs = [x.detach().requires_grad_(True) if i in diff_set else x for i, x in enumerate(inputs)]
        with torch.enable_grad():
            outs = flat_f(*inputs)
            wrt = [inputs[i] for i in diff]
            found = torch.autograd.grad((outs[0] * ct).sum(), wrt, allow_unused=True)
        grads = [torch.zeros_like(x) if g is None else g for g, x in zip(found, wrt)]
        return [*(o.detach() for o in outs), *grads]

    cutter = Cutter(call, cuts) if cuts is not None else None
    gm, _ = run_trace(call, joint, fakes, cutter)
    why = (
        "a tensor-parallel function's gradient is traced in one piece (its backward after all of its forward)"
    )
    refuse_pipe_splits(call, gm, why)  # NOTE [pipe_split] in cut_at.py
    _align_consts(call, gm, lift_constants(gm), fwd.consts)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    gm = functional(gm, [n.meta["val"] for n in placeholders])
    n_outs = len(fwd.gm.graph.find_nodes(op="output")[0].args[0])
    return Joint(gm, fwd.n_params, fwd.n_data, len(fwd.consts), n_outs, list(diff))


def _align_consts(call: str, gm: fx.GraphModule, found: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Reorder the joint's lifted constants (placeholders after `ct`) into `want`'s order, before
    `ct`: each is the forward trace's tensor itself, or (a tensor the function creates) an equal
    one; a constant the joint does not read still gets its placeholder."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ct, lifted = placeholders[-1 - len(found)], placeholders[len(placeholders) - len(found) :]
    taken: dict[int, fx.Node] = {}
    for node, t in zip(lifted, found):
        k = next((k for k, w in enumerate(want) if w is t and k not in taken), None)
        if k is None:
            k = next((k for k, w in enumerate(want) if k not in taken and _equal(w, t)), None)
        if k is None:
            raise ValueError(
                f"{call}: the value-and-grad trace of this tensor-parallel function captured a "
                f"tensor of shape {tuple(t.shape)} that its forward trace did not; the function "
                "must capture the same tensors each time it runs."
            )
        taken[k] = node
    for k, w in enumerate(want):
        with gm.graph.inserting_before(ct):
            new = gm.graph.placeholder(f"const_{k}")
        old = taken.get(k)
        if old is not None:
            new.meta.update(old.meta)
            old.replace_all_uses_with(new)
            gm.graph.erase_node(old)
        new.meta["val"] = _fake_of(ct, w)
    gm.recompile()


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a.shape, a.dtype) == (b.shape, b.dtype) and a.device == b.device and torch.equal(a, b))


def _fake_of(ct: fx.Node, t: torch.Tensor) -> torch.Tensor:
    mode = ct.meta["val"].fake_mode
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=ct.meta["val"].device)


# -- loss_parallel ------------------------------------------------------------------------------
# torch.distributed.tensor.parallel.loss_parallel() installs DTensor handlers for cross-entropy
# on vocab-sharded logits; fpipe's tracing (NOTE [tensor-parallel tracing]) hands the loss plain
# targets and cannot follow those handlers, so it is refused by name, around the call and inside
# the function (where the context manager installs them: `_Refusing.update`).

_LOSS_PARALLEL = (
    "{call}: torch.distributed.tensor.parallel.loss_parallel() {where} is not supported: fpipe "
    "traces each stage over local shards, and loss_parallel's vocab-parallel cross-entropy does "
    "not trace there. Compute the loss without it: parallelize the output layer with "
    "ColwiseParallel(output_layouts=Replicate()) (torchtitan: --parallelism.disable_loss_parallel) "
    "and call F.cross_entropy on the whole logits."
)


def _loss_ops() -> Any:
    from torch.distributed.tensor.parallel.loss import customized_loss_ops

    return customized_loss_ops


def check_no_loss_parallel(call: str) -> None:
    """Refuse a pipelined call made inside loss_parallel() (before any collective)."""
    if any(op in DTensor._op_dispatcher._custom_op_handlers for op in _loss_ops()):
        raise ValueError(_LOSS_PARALLEL.format(call=call, where="around the pipelined call"))


class _Refusing(dict):  # type: ignore[type-arg]
    """DTensor's custom-op handlers while fpipe traces: loss_parallel() entering is refused."""

    def __init__(self, handlers: dict[Any, Any], call: str) -> None:
        super().__init__(handlers)
        self.call = call

    def update(self, *args: Any, **kwargs: Any) -> None:
        if any(op in _loss_ops() for op in dict(*args, **kwargs)):
            raise ValueError(_LOSS_PARALLEL.format(call=self.call, where="inside the function"))
        super().update(*args, **kwargs)


@contextlib.contextmanager
def refusing_loss_parallel(call: str) -> Iterator[None]:
    """While tracing: loss_parallel() inside the function raises `_LOSS_PARALLEL`."""
    dispatcher = DTensor._op_dispatcher
    handlers = dispatcher._custom_op_handlers
    dispatcher._custom_op_handlers = _Refusing(handlers, call)
    try:
        yield
    finally:
        dispatcher._custom_op_handlers = handlers
