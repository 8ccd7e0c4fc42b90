"""`torch.func.vjp` of a batched output around a pipelined call in a process group (NOTE
[transforms in a group] in transforms.py).

Where the first output is not a scalar loss (per-example losses, logits), `grad`'s road
(`fpipe.value_and_grad`) does not apply: the cotangent is known only when `vjp_fn` is called. So
the call is one pipelined forward of `f` (the value), and `vjp_fn(ct)` is one pipelined call of
the gradient of `H(params, data, ct) = sum((f(params, data) * ct).sum())` (`transforms_fns.
vjp_lifted`), which is exactly the vjp at `ct`: the forward is recomputed there. `ct` is cut into
microbatches along each output's concatenation axis as the data is cut, so each microbatch's
slice of `ct` meets that microbatch's slice of the output (equal microbatches, concatenated in
order). An output combined over microbatches otherwise (a sum, a mean) is refused by name
before any transfer; so is a `vjp_fn` called under a transform (`jacrev`). Each rank's `ct` is
read where its stages read it (the stage computing the output), like any input of a pipelined
call: pass the same `ct` on every rank of a replica; shapes are checked, values are not compared.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

from ..tracing import tree
from . import inputs as inputs_
from . import transforms_fns as grads_
from .transforms_fns import Lift, lifted_pipeline

__all__ = ["NotScalar", "Vjp"]


class NotScalar(ValueError):
    """A grad of an output that is not a scalar loss under torch.func in a process group."""


def refuse_keyword(call: str, argnum: list[int], diff: list[bool]) -> None:
    if any(d and a == -1 for d, a in zip(diff, argnum)):
        raise ValueError(
            f"{call}: a keyword argument is differentiated under torch.func in a process "
            "group; fpipe differentiates positional arguments only. Pass it positionally."
        )


class Vjp(torch.autograd.Function):
    """A pipelined call under a Grad level whose output is batched: the value; backward pulls
    the cotangent back with one pipelined call of `vjp_lifted`."""

    @staticmethod
    def forward(c: Any, diff: list[bool], *tensors: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        refuse_keyword(c.piped.cfg.call, c.argnum, diff)
        with temporarily_clear_interpreter_stack():
            params, args, kwargs = c.rebuild(list(tensors))
            c.out_axes = _out_axes(c.piped, params, args, kwargs)
            vals, c.out_spec = tree.flatten(c.piped._forward(params, args, kwargs))
        c.n_vals = len(vals)
        return tuple(vals)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.c, ctx.diff, ctx.primals = inputs[0], inputs[1], inputs[2:]
        ctx.shapes = [tuple(o.shape) for o in output]
        ctx.mark_non_differentiable(*[o for o, a in zip(output, ctx.c.out_axes) if a is None])

    @staticmethod
    def backward(ctx: Any, *cts: Any) -> tuple[Any, ...]:  # type: ignore[override]
        c = ctx.c
        _check_cotangents(c, ctx.shapes, cts)
        primals = [grads_.peel(p) for p in ctx.primals]
        with temporarily_clear_interpreter_stack():
            grads = _pull_back(c, primals, list(cts), ctx.diff)
        return (None, None, *grads_.complete(c.piped, primals, ctx.diff, grads))


def _out_axes(
    piped: Any, params: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[int | None, ...]:
    """Per output leaf: its concatenation axis over microbatches (None: not differentiable);
    an output combined otherwise is refused (from the compiled plan: before any transfer)."""
    _, _, plan = piped._get(params, args, kwargs, None, False)
    n = plan.staged.n_outs
    axes: list[int | None] = []
    for i, r in enumerate(plan.reductions[:n]):
        dtype = plan.staged.meta[plan.staged.out_names[i]][1]
        if not (dtype.is_floating_point or dtype.is_complex):
            axes.append(None)
        elif isinstance(r, int):
            axes.append(r)
        else:
            raise ValueError(
                f"{piped.cfg.call}: torch.func.vjp of output {i} (of {n}), which is combined over "
                f"microbatches by {r!r}, in a process group; fpipe pulls a cotangent back through "
                "outputs concatenated over microbatches (per-example losses, logits: out_axes an int "
                "axis), or takes the grad of a scalar loss returned first. Return the output per "
                "example and reduce it outside the pipelined function, or return (loss, aux)."
            )
    return tuple(axes)


def _check_cotangents(c: Any, shapes: list[tuple[int, ...]], cts: tuple[Any, ...]) -> None:
    """Refuse a cotangent this call cannot pull back, before any transfer."""
    call = c.piped.cfg.call
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if torch._C._functorch.peek_interpreter_stack() is not None or any(
        t is not None and wrapped(t) for t in cts
    ):
        raise ValueError(
            f"{call}: the vjp function of a batched output called under a torch.func transform "
            "(jacrev, or vmap over the vjp function) in a process group; fpipe pulls back one "
            "cotangent per pipelined call. Call the vjp function once per cotangent, or pipeline "
            "the transformed function itself (fpipe.pipeline(lambda p, x: torch.func.jacrev(...)))."
        )
    for i, (t, shape) in enumerate(zip(cts, shapes)):
        if t is not None and c.out_axes[i] is not None and tuple(t.shape) != shape:
            raise ValueError(
                f"{call}: the cotangent of output {i} has shape {tuple(t.shape)}, the output "
                f"{shape}; pass a cotangent shaped like the output."
            )


def _pull_back(c: Any, primals: list[torch.Tensor], cts: list[Any], diff: list[bool]) -> list[Any]:
    """One pipelined call of the gradient of `vjp_lifted`: per tensor leaf, its part of the vjp
    on this rank (None: not computed here)."""
    piped = c.piped
    params, args, kwargs = c.rebuild(primals)
    axes = inputs_.flatten(piped.cfg, params, args, kwargs).axes
    n_p = len(primals) - len(axes)
    full = [None] * n_p + list(axes)
    source = tuple(
        "p" if i < n_p else ("bd" if full[i] is not None else "we")[diff[i]] for i in range(len(primals))
    )
    lift = Lift("vjp", c.spec, c.statics, c.is_tensor, source, (), axes=tuple(full), out_axes=c.out_axes)

    def pick(k: str) -> tuple[torch.Tensor, ...]:
        return tuple(
            x.movedim(full[i] or 0, 0) if k in "bd" else x for i, x in enumerate(primals) if source[i] == k
        )

    ct = tuple(t.movedim(a, 0) for t, a in zip(cts, c.out_axes) if a is not None)
    nums = (0, *(n for n, k in ((4, "d"), (5, "e")) if k in source))
    pipe = lifted_pipeline(piped, "vjp")
    _, g = pipe._value_and_grad(
        params, (lift, pick("b"), pick("w"), pick("d"), pick("e"), ct), {}, nums, False
    )
    piped._last = pipe._last
    out = grads_.grads_by_leaf(c, primals, [0], (g[0],))
    got = {k: iter(gk) for k, gk in zip([k for _, k in ((4, "d"), (5, "e")) if k in source], g[1:])}
    for i, s in enumerate(source):
        if s in got:
            x = next(got[s])
            out[i] = x.movedim(0, full[i] or 0) if s == "d" else x
    return out
