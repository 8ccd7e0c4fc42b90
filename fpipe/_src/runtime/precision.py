"""Mixed precision: the dtypes a step computes, accumulates, reduces and hands back gradients in.

NOTE [precision policy]
A pipeline step splits the batch into microbatches and sums each parameter's gradient over them
(and over data-parallel replicas). With bf16 parameters, summing 64 microbatch gradients in bf16
rounds 64 times: the gradient error grows with the microbatch count a pipeline needs. The policy
(`Precision`, `pipeline(..., precision=...)`; FSDP2's `MixedPrecisionPolicy` is the same shape):

- `param_dtype`: the call's floating parameters are cast to it once per step, before the trace
  and the schedule (`cast`), so every microbatch program reads the same cast copy and holds no
  cast of its own. A rank casts only its real parameters (another rank's, on the meta device,
  cost nothing), so each stage's parameters are cast once per step.
- `accum_dtype` (default float32): a summed gradient of a narrower floating dtype is accumulated
  over microbatches in it (`Results` in run.py: the one place sums are made). It only widens.
- `reduce_dtype`: the dtype of the data-parallel all-reduce (default: the accumulated sums').
- `grad_dtype`: the dtype of the gradients handed back (default: each parameter's dtype as the
  call passed it, so fp32 master weights get fp32 gradients and bf16 parameters bf16 ones).

Without `precision=`, `Precision()` applies: no cast, float32 accumulation, gradients handed back
in the parameters' own dtype. Autocast regions inside the function trace as they run unsplit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["Precision"]

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
    """The dtypes of a pipelined step (NOTE [precision policy] in precision.py).

    Args:
        param_dtype: cast floating parameters to this once per step for compute (None: as passed).
        accum_dtype: accumulate narrower gradient sums over microbatches in this (float32).
        reduce_dtype: sum gradients over data-parallel replicas in this (None: `accum_dtype`'s).
        grad_dtype: hand gradients back in this (None: each parameter's dtype as passed).
    """

    param_dtype: torch.dtype | None = None
    accum_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None
    grad_dtype: torch.dtype | None = None

    def check(self, call: str) -> None:
        """Refuse a dtype that is not a floating one, naming the field."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if (v is not None or f.name == "accum_dtype") and v not in FLOATS:
                raise TypeError(
                    f"{call}: Precision({f.name}={v!r}): expected one of "
                    f"{[str(d) for d in FLOATS]}{'' if f.name == 'accum_dtype' else ' or None'}."
                )

    def widen(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a gradient sum of `dtype` is accumulated in."""
        if dtype in FLOATS and dtype.itemsize < self.accum_dtype.itemsize:
            return self.accum_dtype
        return dtype


DEFAULT = Precision()


def of(setting: Precision | None) -> Precision:
    return DEFAULT if setting is None else setting


def check_precision(call: str, setting: object) -> None:
    """`pipeline(precision=...)`: a `Precision` or None."""
    if setting is None:
        return
    if not isinstance(setting, Precision):
        raise TypeError(
            f"{call}: precision must be an fpipe.Precision(param_dtype=..., accum_dtype=..., "
            f"reduce_dtype=..., grad_dtype=...) or None, got {type(setting).__name__}."
        )
    setting.check(call)


def cast_leaf(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One parameter's compute copy (the one cast per parameter per step)."""
    return t.to(dtype)


def cast(setting: Precision | None, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters a step computes with: floating ones in `param_dtype`, once per step. A
    meta parameter (another rank's) is cast too, for the trace, at no cost."""
    dtype = of(setting).param_dtype
    if dtype is None:
        return leaves
    return [cast_leaf(t, dtype) if t.is_floating_point() and t.dtype != dtype else t for t in leaves]


def handed_back(setting: Precision | None, passed: torch.dtype | None, traced: torch.dtype) -> torch.dtype:
    """The dtype a summed gradient is handed back in: `grad_dtype`, else the dtype of the
    parameter as passed (`passed`; None for a data argument: its traced dtype)."""
    p = of(setting)
    if traced not in FLOATS:
        return traced
    return p.grad_dtype or passed or traced


def for_reduce(setting: Precision | None, t: torch.Tensor) -> torch.Tensor:
    """A (flattened) gradient sum in the dtype of the data-parallel reduction."""
    dtype = of(setting).reduce_dtype
    return t if dtype is None or not t.is_floating_point() else t.to(dtype)


def cast_inputs(setting: Precision | None, inp: Any) -> Any:
    """A call's `Inputs` with its parameters cast for compute (`cast`), remembering the dtypes
    the call passed them in (`Inputs.passed`: the dtypes gradients are handed back in)."""
    leaves = cast(setting, inp.param_leaves)
    if leaves is inp.param_leaves:
        return inp
    return dataclasses.replace(inp, param_leaves=leaves, passed=[t.dtype for t in inp.param_leaves])


def hand_back(setting: Precision | None, inp: Any, c: Any, results: Any) -> None:
    """Cast the step's gradient sums (accumulated, and reduced over dp) to the dtype they are
    handed back in; `results.dtypes` records it for every summed gradient, also those another
    pipeline rank computes (what a receiving rank allocates)."""
    st, n_p = c.staged, len(inp.param_leaves)
    for i in results.summed:
        pos = c.diff[i - st.n_outs]
        leaf = inp.param_leaves[pos] if pos < n_p else inp.data_leaves[pos - n_p]
        passed = inp.passed[pos] if inp.passed is not None and pos < n_p else leaf.dtype
        results.dtypes[i] = dtype = handed_back(setting, passed, leaf.dtype)
        s = results.sums.get(i)
        if s is not None and s.dtype != dtype:
            results.sums[i] = s.to(dtype)
