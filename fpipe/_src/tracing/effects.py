"""Effects: which operations of a traced graph write what.

# NOTE [effects]
Every pass that copies, moves, reorders or drops operations asks this module, and only it,
whether an operation writes: the split and the automatic partition (a writer is never dead
work, never copied; a value computed from an input the step writes is computed once), the I/W
split (writers stay in I), recomputation (a
writer is never run again, and a copy never reads an input a writer changes: it would read the
new value, `remat.py`), checkpoint regions (the same walk), the memory walk (a write aliases
what it writes), the operation timer (a writer runs on a copy of what it writes) and the
decode programs (the cache writes).

An operation writes the arguments its schema marks `(a!)` -- an in-place op, `copy_` into an
input (NOTE [functional graphs] in trace.py) -- and, for a few operations whose schema hides
the write, the arguments `HIDDEN_WRITES` names: BatchNorm in training mode updates its
`running_mean`/`running_var` in place though its schema (`native_batch_norm`, its cuDNN and
MIOpen twins, `batch_norm`, `_batch_norm_impl_index`, `instance_norm` with input statistics)
says they are only read, and the statistics kernels `batch_norm_update_stats` and
`batch_norm_gather_stats*` update them always. The table comes from torch's op list, not from
bug reports: tests/tracing/test_effects.py scans every aten schema for an argument that looks like
state (`running_*`, optimizer state, RNG state, ...) and is not marked written, and fails until
each one is classified here, as a hidden write or in `READS_STATE` (read only: backward
kernels, `_functional` variants that return the new state, evaluation-mode kernels).
Random operations are the other effect a copy must respect (it must draw the same numbers):
`rng.is_random` answers that, keyed by torch's `nondeterministic_seeded` tag.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

__all__ = [
    "HIDDEN_WRITES",
    "READS_STATE",
    "is_mutating",
    "output_alias",
    "replay",
    "written",
    "written_inputs",
    "writes",
]

_STATS = ("running_mean", "running_var")

# op name -> (arguments written, the bool argument that must be true for the write, or None)
HIDDEN_WRITES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "aten::native_batch_norm": (_STATS, "training"),
    "aten::batch_norm": (_STATS, "training"),
    "aten::_batch_norm_impl_index": (_STATS, "training"),
    "aten::cudnn_batch_norm": (_STATS, "training"),
    "aten::miopen_batch_norm": (_STATS, "training"),
    "aten::instance_norm": (_STATS, "use_input_stats"),
    "aten::batch_norm_update_stats": (_STATS, None),
    "aten::batch_norm_gather_stats": (_STATS, None),
    "aten::batch_norm_gather_stats_with_counts": (_STATS, None),
}

# op name -> why its state-like arguments are only read (classified against torch's op list)
READS_STATE: dict[str, str] = {
    **dict.fromkeys(
        [
            "aten::native_batch_norm_backward",
            "aten::batch_norm_backward",
            "aten::_batch_norm_impl_index_backward",
            "aten::cudnn_batch_norm_backward",
            "aten::miopen_batch_norm_backward",
            "aten::_cudnn_rnn_backward",
            "aten::miopen_rnn_backward",
            "aten::lstm_mps_backward",
            "aten::_flash_attention_backward",
            "aten::_efficient_attention_backward",
            "aten::_cudnn_attention_backward",
            "aten::_scaled_dot_product_flash_attention_backward",
            "aten::_scaled_dot_product_efficient_attention_backward",
            "aten::_scaled_dot_product_cudnn_attention_backward",
            "aten::_scaled_dot_product_fused_attention_overrideable_backward",
        ],
        "a backward kernel: reads the forward's state",
    ),
    **dict.fromkeys(
        [
            "aten::_native_batch_norm_legit_functional",
            "aten::_batch_norm_with_update_functional",
            "aten::_fused_moving_avg_obs_fq_helper_functional",
            "aten::_amp_foreach_non_finite_check_and_unscale",
            "aten::_amp_update_scale",
            "aten::_fused_adam",
            "aten::_fused_adamw",
            "aten::_fused_adagrad",
            "aten::_fused_sgd",
        ],
        "a functional variant: returns the new state instead of writing it",
    ),
    **dict.fromkeys(
        ["aten::_native_batch_norm_legit_no_training", "aten::_batch_norm_no_update"],
        "evaluation mode: reads the running statistics",
    ),
    **dict.fromkeys(
        ["aten::_amp_update_scale_", "aten::_fused_adam_", "aten::_fused_adamw_", "aten::_fused_adagrad_"],
        "writes only what its schema marks; `found_inf`/`state_steps` are read",
    ),
    "aten::_fused_sgd_": "writes only what its schema marks; `found_inf` is read",
    "aten::_cudnn_rnn": "reads the dropout state cuDNN initialised (`_cudnn_init_dropout_state`)",
    "aten::miopen_rnn": "reads the dropout state MIOpen initialised",
    **dict.fromkeys(
        ["aten::_sobol_engine_draw", "aten::_sobol_engine_ff_"],
        "reads `sobolstate` (the quasi-random state `self` is marked written)",
    ),
}


def _value(node: fx.Node, schema: Any, name: str) -> Any:
    """The value `node` passes for the schema argument `name`."""
    for i, arg in enumerate(schema.arguments):
        if arg.name == name:
            if arg.kwarg_only or i >= len(node.args):
                return node.kwargs.get(name, arg.default_value)
            return node.args[i]
    raise KeyError(name)


def writes(node: fx.Node) -> list[Any]:
    """The argument values `node` writes: those its schema marks `(a!)` and those it writes
    without saying so (`HIDDEN_WRITES`). Empty for any operation that only reads."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    out = [
        _value(node, schema, arg.name)
        for arg in schema.arguments
        if arg.alias_info is not None and arg.alias_info.is_write
    ]
    hidden = HIDDEN_WRITES.get(schema.name)
    if hidden is not None:
        names, when = hidden
        if when is None or _value(node, schema, when):
            out += [_value(node, schema, n) for n in names]
    return [v for v in out if v is not None]


def replay(node: fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The arguments to run `node` again (a recomputation's copy) without its writes, or None
    when it cannot be: an operation that only reads runs as it is; one that hides a write into
    optional arguments (BatchNorm's running statistics in training) runs with None there --
    the same outputs (training normalises by the batch's statistics), no update; one that
    declares a write is never run again."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return node.args, dict(node.kwargs)
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return None
    args, kwargs = list(node.args), dict(node.kwargs)
    if writes(node):
        for name in HIDDEN_WRITES[schema.name][0]:
            i = next(i for i, a in enumerate(schema.arguments) if a.name == name)
            if i < len(args):
                args[i] = None
            else:
                kwargs[name] = None
    return tuple(args), kwargs


def is_mutating(node: fx.Node) -> bool:
    """Does `node` write into one of its arguments (an in-place op, a `copy_` into an input,
    BatchNorm's running statistics in training)?"""
    return bool(writes(node))


def written(nodes: Iterable[fx.Node]) -> set[fx.Node]:
    """The values any of `nodes` writes."""
    return {v for n in nodes for v in writes(n) if isinstance(v, fx.Node)}


def written_inputs(graph: fx.Graph) -> set[fx.Node]:
    """The placeholders of `graph` an operation of it writes (a buffer's counter, BatchNorm's
    running statistics): a copy of a reader placed after the write would read the new value."""
    return {v for v in written(graph.nodes) if v.op == "placeholder"}


_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default  # a view whose schema does not say so


def output_alias(node: fx.Node) -> fx.Node | None | bool:
    """The argument `node`'s (first) output views or writes in place: a node, None when the
    argument is not a node, False when the output is new memory."""
    if node.target is operator.getitem or node.target is _UNSAFE_VIEW:
        return node.args[0]  # type: ignore[return-value]
    schema = getattr(node.target, "_schema", None)
    ret = schema.returns[0].alias_info if schema is not None and schema.returns else None
    if schema is None or ret is None:
        return False
    for arg, a in zip(schema.arguments, node.args):
        if arg.alias_info is not None and set(arg.alias_info.before_set) & set(ret.before_set):
            return a if isinstance(a, fx.Node) else None
    return False
