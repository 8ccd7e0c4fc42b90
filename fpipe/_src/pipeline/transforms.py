"""torch.func transforms around a pipelined call in a process group.

# NOTE [transforms in a group]
In one process a transform sees every stage, so `grad(piped)` and `vmap(piped)` pass through the
pipeline like any function. In a process group each rank holds only its stages, so a transform
applied to one rank's programs would miss the others' part. Instead, at the call, fpipe reads the
active torch.func interpreters (outermost first), unwraps the inputs level by level, computes the
transformed result with ONE pipelined call of an equivalent plain function (same stages, same
schedule, same ranks) and wraps the results back:
- `grad` / `grad_and_value` / `vjp` of a scalar (a Grad level): `_Grad`, an autograd.Function
  whose forward runs `fpipe.value_and_grad` of the pipeline one level down and whose backward
  returns those gradients times the incoming cotangent;
- `vjp` of batched outputs (a Grad level alone, the first output not a scalar loss): `Vjp` in
  transforms_vjp.py, the forward now and, at `vjp_fn(ct)`, one pipelined call of the gradient
  of `sum((f * ct).sum())` (the forward recomputed);
- `vmap(piped)` (a Vmap level): a pipeline of `torch.func.vmap(f)` whose microbatches cut the
  vmapped dimension (`transforms_fns.Lift`, kind "vmap");
- `vmap(grad(piped))` (per-sample gradients; ensembles over stacked parameters): `_Grad`'s
  forward, vmapped by torch.func (`generate_vmap_rule`), meets the Vmap level and computes the
  gradient of the sum of the per-example losses with respect to the batched inputs and to a zero
  probe per example on each unbatched differentiated input (kind "per_sample"): exact.
Every other stack of interpreters (jvp, grad of grad, nested vmap, vmap with randomness) is
refused by name before any transfer (`check_stack`). Gradients come back as
`fpipe.value_and_grad` computes them (on every rank that passes the input as a real tensor; a
meta input gets zeros on the meta device).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import (
    retrieve_all_functorch_interpreters,
    temporarily_clear_interpreter_stack,
)

from ..tracing import tree
from . import inputs as inputs_
from . import transforms_fns as grads_
from . import transforms_vjp as vjp_
from .transforms_fns import Lift, lifted_pipeline, probe, reductions_of

__all__ = ["lifted_call"]

SUPPORTED = {("Grad",), ("Vmap",), ("Vmap", "Grad"), ("Jvp",), ("Jvp", "Grad")}  # around piped(...)
SUPPORTED_VG = {("Vmap",)}  # around fpipe.value_and_grad(piped)(...)


def lifted_call(piped: Any) -> Callable[..., Any] | None:
    """The call of `piped` under the active torch.func transforms in a process group (None: no
    transform is active, or every stage runs in this process)."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return None
    g = piped._groups
    if not (g.pp or g.dp or g.tp):
        return None
    return functools.partial(_call, piped)


def check_stack(call: str, tp: bool, vg: bool = False) -> list[Any]:
    """The active interpreters, outermost first, if fpipe distributes them exactly; else refused
    (`vg`: around `fpipe.value_and_grad(piped)`, which only vmap may wrap)."""
    stack = retrieve_all_functorch_interpreters()
    kinds = tuple(i.key().name for i in stack)
    if kinds not in (SUPPORTED_VG if vg else SUPPORTED) or tp:
        names = " over ".join(k.lower() for k in kinds)
        raise ValueError(
            f"{call}: called under torch.func transforms ({names}, outermost first) in a process "
            f"group{' with tensor parallelism' if tp else ''}; fpipe distributes exactly only grad / "
            "grad_and_value / vjp (of a scalar loss or of batched outputs), vmap, vmap over grad (per-sample gradients, "
            "ensembles), jvp and jvp over grad (Hessian-vector products), and vmap around "
            "fpipe.value_and_grad, of a pipeline without tensor parallelism (docs/guide/"
            "transforms.md). Compute this one as fpipe.value_and_grad of a pipeline of the "
            "transformed function (e.g. pipeline(lambda p, x: jvp(f, ...)))."
        )
    for i in stack:
        drawn = i.randomness() if i.key() == TransformType.Vmap else "error"  # type: ignore[attr-defined]
        if drawn != "error":
            raise ValueError(
                f"{call}: called under vmap(..., randomness={drawn!r}) in a process group; "
                "the pipeline cuts the batch into microbatches and cannot reproduce vmap's random "
                "draws. Use randomness='error' (the default) with a function without random "
                "operations (dropout off: model.eval())."
            )
    return stack


class _Ctx:
    """One transformed call: the pipeline and the structure of its arguments and outputs."""

    def __init__(self, piped: Any, spec: Any, leaves: list[Any]) -> None:
        self.piped, self.spec = piped, spec
        self.is_tensor = tuple(isinstance(x, torch.Tensor) for x in leaves)
        self.statics = tuple(x for x in leaves if not isinstance(x, torch.Tensor))
        self.out_spec: Any = None
        self.n_vals = 0
        self.argnum: list[int] = []  # per tensor leaf: its argnum (0: params; -1: a keyword)
        self.out_axes: tuple[int | None, ...] = ()  # per output leaf, under a vjp of a batched output

    def rebuild(self, tensors: list[torch.Tensor]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        ten, stat = iter(tensors), iter(self.statics)
        return tree.unflatten([next(ten) if t else next(stat) for t in self.is_tensor], self.spec)


def _call(
    piped: Any,
    params: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    argnums: Any = None,
    has_aux: bool = False,
) -> Any:
    """`piped(params, *args, **kwargs)`, or with `argnums` `fpipe.value_and_grad(piped, argnums)`'s
    call, under the active transforms."""
    check_stack(piped.cfg.call, piped._groups.tp is not None, argnums is not None)
    leaves, spec = tree.flatten((params, args, kwargs))
    ctx = _Ctx(piped, spec, leaves)
    ctx.argnum = _argnum_of_tensors(params, args, kwargs)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if argnums is None:
        outs = _solve(ctx, "value", tensors, None)
        return tree.unflatten(list(outs[: ctx.n_vals]), ctx.out_spec)
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    outs = _solve(ctx, "vg", tensors, [a in nums for a in ctx.argnum])
    value = tree.unflatten(list(outs[: ctx.n_vals]), ctx.out_spec)
    grads = list(outs[ctx.n_vals :])
    per_num = [_rebuild(ctx, tensors, grads, num) for num in nums]
    return value, (per_num[0] if isinstance(argnums, int) else tuple(per_num))


def _rebuild(ctx: _Ctx, tensors: list[torch.Tensor], grads: list[Any], num: int) -> Any:
    """Argument `num`'s gradient pytree (None at its non-tensor leaves)."""
    params, args, _ = ctx.rebuild(tensors)
    arg = params if num == 0 else args[num - 1]
    leaves, spec = tree.flatten(arg)
    it = iter(g for g, a in zip(grads, ctx.argnum) if a == num)
    return tree.unflatten([next(it) if isinstance(x, torch.Tensor) else None for x in leaves], spec)


def _argnum_of_tensors(params: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int]:
    """For each tensor leaf of (params, args, kwargs): its argnum (0: params; -1: a keyword)."""
    out = [0 for x in tree.flatten(params)[0] if isinstance(x, torch.Tensor)]
    for k, a in enumerate(args):
        out += [k + 1 for x in tree.flatten(a)[0] if isinstance(x, torch.Tensor)]
    return out + [-1 for x in tree.flatten(kwargs)[0] if isinstance(x, torch.Tensor)]


def _solve(ctx: _Ctx, mode: str, tensors: list[torch.Tensor], diff: list[bool] | None) -> tuple[Any, ...]:
    """The outputs (and in mode "vg" the gradients) at the innermost active level."""
    stack = retrieve_all_functorch_interpreters()
    if not stack:
        with temporarily_clear_interpreter_stack():
            return _plain(ctx, mode, tensors, diff)
    top = stack[-1]
    if top.key() == TransformType.Grad:
        level = top.level()
        # grad wraps every argument at its level; those it differentiates require grad there
        mine = [torch._C._functorch.maybe_get_level(t) == level and t.requires_grad for t in tensors]
        try:
            return _Grad.apply(ctx, mine, *tensors)
        except vjp_.NotScalar:  # a vjp of a batched output: only directly (transforms_vjp.py)
            if len(stack) > 1:
                raise
            return vjp_.Vjp.apply(ctx, mine, *tensors)
    if top.key() == TransformType.Jvp:
        return _Jvp.apply(ctx, *tensors)
    return _vmapped(ctx, mode, tensors, diff, top)


def _plain(ctx: _Ctx, mode: str, tensors: list[torch.Tensor], diff: list[bool] | None) -> tuple[Any, ...]:
    piped = ctx.piped
    params, args, kwargs = ctx.rebuild(tensors)
    if mode == "value":
        vals, ctx.out_spec = tree.flatten(piped._forward(params, args, kwargs))
        ctx.n_vals = len(vals)
        return tuple(vals)
    assert diff is not None
    nums = sorted({ctx.argnum[i] for i, d in enumerate(diff) if d})
    vjp_.refuse_keyword(piped.cfg.call, ctx.argnum, diff)
    try:  # (has_aux=True: a first output that is a scalar loss, any others aux)
        value, grads = piped._value_and_grad(params, args, kwargs, tuple(nums), True)
    except ValueError as err:
        if "must return a scalar loss" not in str(err):
            raise
        raise vjp_.NotScalar(
            f"{piped.cfg.call}: grad or vjp of an output that is not a scalar under torch.func in a "
            "process group, inside another transform; fpipe pulls back a batched output only for "
            "torch.func.vjp(piped, ...) itself (transforms_vjp.py), else differentiates a scalar "
            "loss (the first output). Reduce the output to a scalar inside the function (e.g. "
            "(out * ct).sum()) and take its grad."
        ) from err
    vals, ctx.out_spec = tree.flatten(value)
    ctx.n_vals = len(vals)
    by_leaf = grads_.grads_by_leaf(ctx, tensors, nums, grads)
    return (*vals, *grads_.complete(piped, tensors, diff, by_leaf))


class _Grad(torch.autograd.Function):
    """A pipelined call under a Grad level: the value, with the gradients computed by the
    pipeline one level down; backward scales them by the cotangent of the (scalar) value."""

    generate_vmap_rule = True

    @staticmethod
    def forward(ctx_: Any, diff: list[bool], *tensors: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        out = _solve(ctx_, "vg", list(tensors), diff)
        return tuple(torch.zeros(()) if g is None else g for g in out)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        c, diff = inputs[0], inputs[1]
        ctx.c, ctx.diff = c, diff
        ctx.set_materialize_grads(False)
        grads = output[c.n_vals :]
        ctx.save_for_backward(*[g if d else None for g, d in zip(grads, diff)])
        ctx.primals = inputs[2:]
        ctx.mark_non_differentiable(*[g for g, d in zip(grads, diff) if not d])

    @staticmethod
    def backward(ctx: Any, *gouts: Any) -> tuple[Any, ...]:  # type: ignore[override]
        c = ctx.c
        if any(g is not None for g in gouts[1:]):
            raise ValueError(
                f"{c.piped.cfg.call}: differentiated with respect to an output other than the first "
                "(a vjp of several outputs, an aux output, or a gradient of the gradients) under "
                "torch.func in a process group; fpipe differentiates the scalar loss only. Use "
                "fpipe.value_and_grad of a pipeline of the function you differentiate."
            )
        ct = gouts[0]
        saved = ctx.saved_tensors
        grads = [None if (s is None or ct is None) else s * ct for s in saved]
        return (None, None, *grads)

    @staticmethod
    def jvp(ctx: Any, _c: Any, _diff: Any, *tangents: Any) -> tuple[Any, ...]:
        """jvp over grad: the tangent of the loss and the Hessian-vector products."""
        c, diff = ctx.c, ctx.diff
        if any(d and a != 0 for d, a in zip(diff, c.argnum)):
            raise ValueError(
                f"{c.piped.cfg.call}: jvp over grad with respect to an argument other than the "
                "params in a process group; fpipe computes Hessian-vector products for the params "
                "(argnums=0). Differentiate with respect to the params."
            )
        primals = [grads_.peel(p) for p in ctx.primals]
        tangent, hvp = _forward_mode(c, "hvp", primals, list(tangents))
        by_leaf = grads_.grads_by_leaf(c, primals, [0], (hvp,))
        return (tangent, *grads_.complete(c.piped, primals, diff, by_leaf))


class _Jvp(torch.autograd.Function):
    """A pipelined call under a Jvp level: the value one level down; its tangent from one
    pipelined call of `jvp(f)` (a second call: the tangents arrive after the forward)."""

    @staticmethod
    def forward(ctx_: Any, *tensors: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return _solve(ctx_, "value", list(tensors), None)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.c, ctx.primals = inputs[0], inputs[1:]

    @staticmethod
    def jvp(ctx: Any, _c: Any, *tangents: Any) -> tuple[Any, ...]:
        _, tangent = _forward_mode(ctx.c, "jvp", list(ctx.primals), list(tangents))
        return tuple(tree.flatten(tangent)[0])

    @staticmethod
    def backward(ctx: Any, *gouts: Any) -> Any:  # type: ignore[override]
        raise AssertionError("unreachable: _Jvp is only applied under a Jvp level")


def _forward_mode(ctx: _Ctx, kind: str, primals: list[torch.Tensor], tangents: list[Any]) -> tuple[Any, Any]:
    """One pipelined call of `jvp(f)` (kind "jvp": outputs and tangents) or of the gradient of
    its tangent (kind "hvp": the loss's tangent and the params' Hessian-vector products)."""
    primals = [grads_.peel(p) for p in primals]  # setup_context saw them wrapped at the Jvp level
    tangents = [grads_.tangent(p, t) for p, t in zip(primals, tangents)]
    with temporarily_clear_interpreter_stack():
        params, args, kwargs = ctx.rebuild(primals)
        axes = inputs_.flatten(ctx.piped.cfg, params, args, kwargs).axes
        n_p = len(primals) - len(axes)
        full = [None] * n_p + list(axes)
        source = tuple("p" if i < n_p else ("w" if full[i] is None else "b") for i in range(len(primals)))
        lift = Lift(kind, ctx.spec, ctx.statics, ctx.is_tensor, source, (), axes=tuple(full))

        def parts(xs: list[torch.Tensor]) -> tuple[Any, ...]:
            p = tree.unflatten(xs[:n_p], tree.flatten(params)[1])
            split = tuple(x.movedim(full[i] or 0, 0) for i, x in enumerate(xs) if source[i] == "b")
            return p, split, tuple(x for i, x in enumerate(xs) if source[i] == "w")

        p, split, whole = parts(primals)
        targs = parts(tangents)
        reductions = reductions_of(ctx.piped, params, args, kwargs)
        pipe = lifted_pipeline(
            ctx.piped, kind, reductions if kind == "jvp" else tree.flatten(reductions)[0][0]
        )
        if kind == "jvp":
            out, tangent = pipe._forward(p, (lift, split, whole, *targs), {})
        else:
            out, tangent = pipe._value_and_grad(p, (lift, split, whole, *targs), {}, 0, False)
        ctx.piped._last = pipe._last
    if kind == "jvp":
        ctx.out_spec, ctx.n_vals = tree.flatten(out)[1], len(tree.flatten(out)[0])
    return out, tangent


def _vmapped(
    ctx: _Ctx, mode: str, tensors: list[torch.Tensor], diff: list[bool] | None, interp: Any
) -> tuple[Any, ...]:
    """A Vmap level: one pipelined call of the lifted function (kind "vmap" or "per_sample")."""
    level, batch = interp.level(), interp.batch_size()
    plain, batched = [], []
    for t in tensors:
        v, bdim = torch._C._functorch._unwrap_batched(t, level)
        batched.append(bdim is not None)
        plain.append(v.movedim(bdim, 0) if bdim is not None else v)
    if not any(batched):  # vmapped over something else: the call itself is not batched
        with temporarily_clear_interpreter_stack():
            return _plain(ctx, mode, plain, diff)
    call, m = ctx.piped.cfg.call, ctx.piped.cfg.microbatches
    if batch % m:
        raise ValueError(
            f"{call}: vmap over {batch} examples, which microbatches={m} do not divide; the pipeline "
            f"cuts the vmapped dimension into microbatches. Use a batch that is a multiple of {m}."
        )
    kind = "vmap" if mode == "value" else "per_sample"
    d = diff or [False] * len(tensors)
    probed = tuple(i for i, (b, di) in enumerate(zip(batched, d)) if di and not b)
    source = tuple(
        ("d" if di else "b") if b else ("p" if a == 0 else "w") for b, di, a in zip(batched, d, ctx.argnum)
    )
    if any(plain[i].is_meta for i in probed):
        raise ValueError(
            f"{call}: per-sample gradients (vmap over grad) of parameters passed on the meta device "
            "in a process group; each example's parameter copy is computed on the first stage that "
            "reads the batch, which may not hold them. Pass every parameter as a real tensor."
        )
    lift = Lift(kind, ctx.spec, ctx.statics, ctx.is_tensor, source, probed)
    pipe = lifted_pipeline(ctx.piped, kind)
    dev = ctx.piped.pg.device if ctx.piped.pg is not None else torch.device("cpu")
    params, split, whole, dsplit = (tuple(x for x, s in zip(plain, source) if s == k) for k in "pbwd")
    dsplit += tuple(probe(plain[i], batch, dev) for i in probed)
    with temporarily_clear_interpreter_stack():
        if kind == "vmap":
            vals, ctx.out_spec = tree.flatten(pipe._forward(params, (lift, split, whole, dsplit), {}))
            grads: list[Any] = []
        else:
            value, g_split = pipe._value_and_grad(params, (lift, split, whole, dsplit), {}, 4, True)
            vals, ctx.out_spec = tree.flatten(value[1])
            grads = grads_.per_example_grads(plain, source, probed, list(g_split), d)
        ctx.piped._last = pipe._last
    ctx.n_vals = len(vals)
    wrap = torch._C._functorch._add_batch_dim
    return (*[wrap(v, 0, level) for v in vals], *[None if g is None else wrap(g, 0, level) for g in grads])
