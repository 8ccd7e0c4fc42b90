"""Choose how each output is combined over microbatches and replicas: read, warn, refuse.

Per output: the user's `out_axes`, else for a scalar what the walk over the forward graph reads
(NOTE [an honest reduction] in reduction.py), else concatenation along dim 0. Where the values
combined are several (microbatches > 1, or data-parallel replicas), fpipe warns when it cannot
read the reduction or no combination reproduces the unsplit function, and when the function's
examples interact (NOTE [interacting examples]).

# NOTE [outputs keep their dtype]
An output comes back in the dtype the function returns it in, on every rank. An integer (or
bool) output is summed or concatenated, never averaged: an average of integers is no integer
(`torch.mean` refuses them) and would be returned as a float, or -- sent to a rank that expects
the traced dtype -- as float bits read as an integer. So an integer scalar combined over several
values needs the reduction 'sum' (read from the graph, as for `(pred == y).sum()`, or given by
`out_axes`), or to not depend on the batch at all (equal values: any one of them); anything else
is refused at compile time, before any transfer. `outputs.reduce` and `replicas.reduce_values`
keep the dtype of what they combine.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable

import torch
import torch.fx as fx

from ..parallel import Reading, read_outputs
from ..tracing import Forward, tree
from .config import REDUCTIONS, Config
from .inputs import Inputs

__all__ = ["choose_reductions"]

_FPIPE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def choose_reductions(
    cfg: Config, fwd: Forward, inp: Inputs, replicas: int, again: Callable[[], Forward | None]
) -> list[str | int]:
    """Per output: 'mean', 'sum' or a concatenation axis. `replicas`: the dp size (1 without);
    `again`: the forward traced at twice the batch, or None (to tell a count from a constant)."""
    outs = fwd.gm.graph.find_nodes(op="output")[0].args[0]
    vals = [o.meta["val"] for o in outs]  # type: ignore[union-attr]
    axes = {fwd.n_params + j: a for j, a in enumerate(inp.axes) if a is not None}
    parts = cfg.microbatches * replicas
    reading = read_outputs(fwd.gm, axes) if parts > 1 else None
    if reading is not None and reading.interaction is not None:
        _warn_interaction(cfg, reading.interaction, replicas)
    if cfg.out_axes is None:
        out = [
            _scalar(cfg, reading, i, v, replicas, again, axes) if v.dim() == 0 else 0
            for i, v in enumerate(vals)
        ]
    else:
        out = _given(cfg, fwd, len(vals))
    for i, v in enumerate(vals):
        _check_dtype(cfg, v, i, out[i], reading, replicas)
    return out


def _given(cfg: Config, fwd: Forward, n: int) -> list[str | int]:
    template = tree.unflatten(list(range(n)), fwd.out_spec)
    given = tree.broadcast_prefix(cfg.out_axes, template)
    for r in given:
        if not (r in REDUCTIONS or isinstance(r, int)):
            raise ValueError(
                f"{cfg.call}: out_axes entry {r!r} is not 'mean', 'sum' or an int "
                "(the axis along which microbatch outputs are concatenated)."
            )
    return list(given)


def _combined(cfg: Config, replicas: int) -> str:
    """The values combined, in words: "4 microbatch values" / "... x 2 data-parallel replicas"."""
    m = cfg.microbatches
    if replicas == 1:
        return f"{m} microbatch values"
    return f"{m * replicas} values ({m} microbatches x {replicas} data-parallel replicas)"


def _scalar(
    cfg: Config,
    reading: Reading | None,
    i: int,
    val: torch.Tensor,
    replicas: int,
    again: Callable[[], Forward | None],
    axes: dict[int, int],
) -> str:
    """A scalar output's reduction read from the graph (the mean where nothing is read; for an
    integer, `_check_dtype` then refuses what is no sum)."""
    if reading is None:
        return "mean"  # one value: nothing to combine
    kind = reading.kind(i)
    if kind == "divided":  # a count (a mean) or a constant (a sum)? trace at twice the batch
        twice = again()
        kind = "mean" if twice is None else read_outputs(twice.gm, axes).kind(i)
    floating = val.is_floating_point() or val.is_complex()
    if kind is None and reading.interaction is None and floating:
        _warn_unread(cfg, reading, i, replicas)
    if kind == "mixed" and floating:
        _warn_mixed(cfg, i, replicas)
    return "sum" if kind == "sum" else "mean"


def _warn_unread(cfg: Config, reading: Reading, i: int, replicas: int) -> None:
    by = reading.pooled_by[i]
    how = (
        f" (it reduces the batch with {_op(by)}, neither a sum nor a mean: no combination of the "
        "microbatch values reproduces it)"
        if by is not None and by.target not in _SUM_OR_MEAN
        else ""
    )
    warnings.warn(
        f"{cfg.call}: fpipe cannot read how output {i} reduces the batch{how}, so it averages "
        f"the {_combined(cfg, replicas)}. If the output is a sum over the batch, pass "
        "out_axes='sum'; pass out_axes='mean' to confirm a mean (and silence this); for the "
        "unsplit function's value, compute it outside the pipeline (or with microbatches=1"
        f"{' and no data parallelism' if replicas > 1 else ''}).",
        stacklevel=_user_level(),
    )


def _warn_mixed(cfg: Config, i: int, replicas: int) -> None:
    n = cfg.microbatches * replicas
    warnings.warn(
        f"{cfg.call}: output {i} adds a sum over the batch to a term that is not summed over the "
        f"batch (a constant such as a weight decay, or a mean); no combination of the "
        f"{_combined(cfg, replicas)} reproduces the unsplit function, so fpipe averages them. "
        f"To reproduce it, divide that term by {n} (the number of values combined) in the "
        "function and pass out_axes='sum' -- out_axes='sum' alone would count it "
        f"{n} times -- or add the term outside the pipelined function (e.g. the optimizer's "
        "weight_decay); or make the loss a mean (or a sum) throughout.",
        stacklevel=_user_level(),
    )


def _warn_interaction(cfg: Config, where: tuple[fx.Node, fx.Node], replicas: int) -> None:
    origin, meets = where
    split = f"{cfg.microbatches} microbatches" + (
        f" on each of {replicas} data-parallel replicas" if replicas > 1 else ""
    )
    warnings.warn(
        f"{cfg.call}: the function's examples interact: {_op(origin)} reduces over the batch, "
        f"and its result meets per-example values in {_op(meets)}. fpipe runs each of the "
        f"{split} on its own, so the result is the per-microbatch function's, combined "
        "(gradient accumulation's semantics), not the unsplit function's over the whole batch. "
        f"Pass microbatches=1{' and no data parallelism' if replicas > 1 else ''} to keep the "
        "batch together, or restructure: compute the batch-wide value outside the pipelined "
        "function and pass it in.",
        stacklevel=_user_level(),
    )


def _check_dtype(
    cfg: Config, val: torch.Tensor, i: int, r: str | int, reading: Reading | None, replicas: int
) -> None:
    """NOTE [outputs keep their dtype]: an integer output combined over several values must be
    summed (or concatenated), or not depend on the batch."""
    if val.is_floating_point() or val.is_complex() or isinstance(r, int) or reading is None:
        return
    if r == "sum" and val.dtype is not torch.bool:
        return
    if r == "mean" and reading.kind(i) == "constant":
        return
    fix = (
        "If it is a count over the batch (e.g. (pred == y).sum()), give it the reduction 'sum' "
        "(out_axes='sum', or a tuple such as out_axes=('mean', 'sum') for (loss, count))"
        if val.dtype is not torch.bool
        else "Return it as an integer count (.sum()) or per example (out_axes=0)"
    )
    raise ValueError(
        f"{cfg.call}: output {i} is a {val.dtype} scalar that fpipe would "
        f"{'add' if r == 'sum' else 'average'} over the {_combined(cfg, replicas)}; "
        f"{'a sum of bools is no bool' if r == 'sum' else 'an average of integers is no integer (torch.mean refuses them)'}, "
        f"and fpipe does not change an output's dtype. {fix}; to average it, return it as a "
        "float (x.float()).",
    )


_SUM_OR_MEAN = {
    torch.ops.aten.sum.default,
    torch.ops.aten.sum.dim_IntList,
    torch.ops.aten.mean.default,
    torch.ops.aten.mean.dim,
}


def _user_level() -> int:
    """The `stacklevel` of the first caller outside fpipe, seen from the function calling this."""
    level, frame = 2, sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_FPIPE):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


def _op(node: fx.Node) -> str:
    """An operation in messages: its aten name and, where the trace kept it, the user's line."""
    where = ""
    trace = node.meta.get("stack_trace") or ""
    frames = [ln.strip() for ln in trace.splitlines() if ln.strip().startswith("File ")]
    if frames:
        where = f" ({frames[-1].removeprefix('File ')})"
    return f"{node.target}{where}"
