"""Inputs: a call's arguments, flattened, named, keyed and split into microbatches.

`flatten` turns `(params, *args, **kwargs)` into `Inputs`: the parameter leaves, the tensor
leaves of the arguments with the axis each is split along (`in_axes`), and the non-tensor leaves
(statics). `Inputs.key` is the trace key (NOTE [trace key] in trace_key.py); `split` cuts the data into
microbatches; `rebuilder` puts leaves back into the user's structure for the trace. Flat
positions count the parameter leaves first, then the data leaves: `positions_of_argnum` maps an
`argnums` entry to them.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..parallel import split_params
from ..runtime import PPGroup
from ..tracing import trace_key as trace_key_
from ..tracing import tree
from .config import Config


@dataclasses.dataclass
class Inputs:
    """A call's inputs, flattened: params leaves, data leaves (split per microbatch), statics."""

    param_leaves: list[torch.Tensor]
    param_spec: Any
    data_leaves: list[torch.Tensor]  # whole-batch tensors
    axes: list[int | None]  # split axis of each data leaf
    statics: list[Any]  # non-tensor leaves of (args, kwargs), in order
    is_tensor: list[bool]
    data_spec: Any
    # tensor parallelism: the layout of each parameter that came as a DTensor on mesh["tp"] (its
    # leaf above is then the local shard), else None (NOTE [tensor-parallel tracing] in tp.py)
    tp: list[Any] | None = None
    passed: list[torch.dtype] | None = None  # params' dtypes as passed, before a precision cast

    def key(self, device_type: str) -> tuple[Any, ...]:
        """Everything a trace depends on (NOTE [trace key] in trace_key.py); `device_type`:
        where meta tensors are traced (the data's device)."""
        tp = tuple(s and s.key() for s in self.tp) if self.tp else None
        return trace_key_.trace_key(
            device_type, self.param_spec, self.param_leaves, self.data_spec, self.data_leaves,
            self.axes, self.statics, tp,
        )  # fmt: skip

    def axis_of(self, pos: int) -> int | None:
        """The microbatch split axis of flat input `pos` (None for parameters and whole arguments)."""
        n_p = len(self.param_leaves)
        return None if pos < n_p else self.axes[pos - n_p]

    def args_template(self) -> Any:
        """The positional arguments with each leaf replaced by its index among all leaves."""
        return tree.unflatten(list(range(len(self.is_tensor))), self.data_spec)[0]


def flatten(cfg: Config, params: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Inputs:
    """Flatten a call's inputs; refuse non-tensor params and unhashable statics."""
    p_leaves, p_spec = tree.flatten(params)
    for i, leaf in enumerate(p_leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{cfg.call}: leaf {i} of params is a {type(leaf).__name__}; params must be a "
                "pytree of tensors (pass other values as later arguments)."
            )
    leaves, spec = tree.flatten((args, kwargs))
    arg_axes = tree.broadcast_prefix(cfg.in_axes, args)
    data, axes, statics, is_tensor = [], [], [], []
    for i, leaf in enumerate(leaves):
        is_tensor.append(isinstance(leaf, torch.Tensor))
        if not is_tensor[-1]:
            statics.append(leaf)
            continue
        axis = arg_axes[i] if i < len(arg_axes) else 0  # keyword tensors: dim 0
        data.append(leaf)
        axes.append(None if leaf.dim() == 0 else axis)
    check_hashable(cfg, statics, spec, is_tensor)
    return Inputs(p_leaves, p_spec, data, axes, statics, is_tensor, spec)


def refuse_transforms_in_a_group(call: str, pg: Any) -> None:
    """A call that reaches the data path under a torch.func transform in a process group (a
    pipelined call or `fpipe.value_and_grad` is lifted out of the transforms first: NOTE
    [transforms in a group] in transforms.py; `memory`/`materialize` are not): the transform
    would see only this rank's programs. Refused before any collective."""
    if pg is None or torch._C._functorch.peek_interpreter_stack() is None:
        return
    raise ValueError(
        f"{call}: memory/materialize called under a torch.func transform (grad, vjp, vmap, ...) "
        "in a process group; a transform would see only this rank's stages. Call it outside the "
        "transform (the pipelined call itself composes with them: docs/guide/transforms.md)."
    )


def split(cfg: Config, inp: Inputs, replicas: int = 1) -> list[list[torch.Tensor]]:
    """The data leaves of each microbatch (an unsplit leaf is passed whole to every one).
    With `replicas` data-parallel replicas, each leaf is this rank's slice of the global batch."""
    m = cfg.microbatches
    chunks = []
    for j, (t, axis) in enumerate(zip(inp.data_leaves, inp.axes)):
        if axis is None:
            chunks.append([t] * m)
            continue
        size = t.shape[axis]
        if size % m:
            good = [d for d in range(1, size + 1) if size % d == 0 and d <= m]
            name = leaf_names(cfg.f, inp.data_spec, inp.is_tensor)[j]
            if replicas > 1:
                raise ValueError(
                    f"{cfg.call}: argument {name} (dim {axis}) has {size} rows on this rank, its "
                    f"slice of the global batch over dp={replicas} replicas, and {size} is not "
                    f"divisible by microbatches={m}; give every replica an equal slice of a global "
                    f"batch that is a multiple of dp x microbatches = {replicas * m}, or use "
                    f"microbatches={good[-1]}."
                )
            raise ValueError(
                f"{cfg.call}: batch size {size} of argument {name} (dim {axis}) is not divisible by "
                f"microbatches={m}; use a batch that is a multiple of {m} or microbatches={good[-1]}."
            )
        chunks.append(list(torch.split(t, size // m, dim=axis)))
    return [[c[i] for c in chunks] for i in range(m)]


def rebuilder(inp: Inputs) -> Callable[[list[torch.Tensor]], tuple[Any, tuple[Any, ...], dict[str, Any]]]:
    """A function from flat leaves (params, then data) to the user's `(params, args, kwargs)`."""
    n_p = len(inp.param_leaves)

    def rebuild(leaves: list[torch.Tensor]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        params = tree.unflatten(leaves[:n_p], inp.param_spec)
        data, statics = iter(leaves[n_p:]), iter(inp.statics)
        flat = [next(data) if t else next(statics) for t in inp.is_tensor]
        args, kwargs = tree.unflatten(flat, inp.data_spec)
        return params, args, kwargs

    return rebuild


def device_of(pg: PPGroup | None, inp: Inputs) -> torch.device:
    """Where this rank computes: its group's device, else the first real input's."""
    if pg is not None:
        return pg.device
    real = [t for t in [*inp.data_leaves, *inp.param_leaves] if not t.is_meta]
    return real[0].device if real else torch.device("cpu")


def check_hashable(cfg: Config, statics: list[Any], spec: Any, is_tensor: list[bool]) -> None:
    """Non-tensor arguments key the trace by hash and equality (NOTE [trace key])."""
    for i, s in enumerate(statics):
        try:
            hash(s)
        except TypeError:
            name = leaf_names(cfg.f, spec, [not t for t in is_tensor])[i]
            raise TypeError(
                f"{cfg.call}: argument {name} is a {type(s).__name__}, which is not hashable; fpipe "
                "traces the function once per input signature and keys it by the value of every "
                "non-tensor argument (like jax.jit's static arguments), so those must be hashable. "
                "Pass it as a tensor (torch.as_tensor(...); it is then an input of the program) or "
                "as a tuple of hashable values."
            ) from None


def leaf_names(f: Callable[..., Any], spec: Any, is_tensor: list[bool]) -> list[str]:
    """Readable names of the tensor leaves of (args, kwargs): 'tokens', "batch['ids']", 'mask'."""
    import torch.utils._pytree as py

    positional = _positional_names(f)
    template = tree.unflatten(list(range(len(is_tensor))), spec)
    paths, _ = py.tree_flatten_with_path(template)
    names = []
    for (path, _), t in zip(paths, is_tensor):
        if not t:
            continue
        head, rest = path[1], "".join(str(k) for k in path[2:])
        if path[0].idx == 1:  # type: ignore[attr-defined]
            root = str(head.key)  # type: ignore[attr-defined]
        else:
            i = head.idx  # type: ignore[attr-defined]
            root = positional[i] if i < len(positional) else f"args[{i}]"
        names.append(f"'{root}{rest}'")
    return names


def _positional_names(f: Callable[..., Any]) -> list[str]:
    """The names of `f`'s positional parameters after `params`."""
    try:
        params = list(inspect.signature(f).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def positions_of_argnum(inp: Inputs, num: int) -> list[int]:
    """The flat positions of argument `num`'s tensor leaves (0: the params)."""
    n_p = len(inp.param_leaves)
    if num == 0:
        return list(range(n_p))
    args_template = inp.args_template()
    if num - 1 >= len(args_template):
        return []
    arg_leaf_ids, _ = tree.flatten(args_template[num - 1])
    tensor_rank = {leaf: k for k, leaf in enumerate(i for i, t in enumerate(inp.is_tensor) if t)}
    return [n_p + tensor_rank[i] for i in arg_leaf_ids if i in tensor_rank]


def argnum_positions(call: str, inp: Inputs, argnums: tuple[int, ...]) -> list[int]:
    """`positions_of_argnum` for each of `argnums`, refusing an argument out of range or one
    that is not floating point."""
    n_args = len(inp.args_template())
    leaves = inp.param_leaves + inp.data_leaves
    out: list[int] = []
    for num in argnums:
        if not 0 <= num <= n_args:
            raise ValueError(
                f"{call}: argnums={num} is out of range for a call with {n_args + 1} positional arguments."
            )
        positions = positions_of_argnum(inp, num)
        for p in positions:
            if not leaves[p].is_floating_point() and not leaves[p].is_complex():
                raise ValueError(
                    f"{call}: argnums={num} asks for the gradient of a {leaves[p].dtype} tensor; "
                    "only floating-point inputs have gradients."
                )
        out.extend(positions)
    return out


def param_keys(inp: Inputs) -> list[Any]:
    """For a flat params dict: the key of each parameter leaf, in leaf order (else [], as for a
    nested dict or a list: nothing downstream is keyed by name then)."""
    positions = tree.unflatten(list(range(len(inp.param_leaves))), inp.param_spec)
    if not isinstance(positions, dict) or not all(isinstance(i, int) for i in positions.values()):
        return []
    keys: list[Any] = [None] * len(positions)
    for k, i in positions.items():
        keys[i] = k
    return keys


def localize(call: str, inp: Inputs, tp_mesh: Any) -> Inputs:
    """`inp` with its tensor-parallel parameters as local shards (`inp.tp`; NOTE [tensor-parallel
    tracing] in tp.py)."""
    leaves, specs = split_params(call, inp.param_leaves, param_keys(inp), tp_mesh)
    if specs and any(isinstance(t, DTensor) for t in inp.data_leaves):
        raise TypeError(
            f"{call}: a data argument is a DTensor; with tensor-parallel parameters pass the data "
            "as plain tensors, the same on every tp rank (the plan's input hooks distribute them, "
            "as in eager tensor parallelism)."
        )
    return dataclasses.replace(inp, param_leaves=leaves, tp=specs) if specs else inp
