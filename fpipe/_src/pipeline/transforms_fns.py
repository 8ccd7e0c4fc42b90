"""The plain functions a transformed pipelined call is computed by (NOTE [transforms in a group]
in transforms.py).

`Lift` is a hashable description of one transformed call: where each tensor leaf of the user's
`(params, args, kwargs)` goes (kept a parameter, cut with the batch, passed whole) and which
leaves get a per-example gradient probe. It is passed to the lifted function as a non-tensor
argument, so the trace key holds it like any static argument (NOTE [trace key]): one lifted
pipeline per kind, one trace per (description, signature), through the compiler's one cache.

The lifted function runs the user's function per example under `torch.func.vmap`:
- "vmap": returns the batched outputs (concatenated over microbatches along the batch);
- "per_sample": returns `(sum of the per-example losses, the per-example outputs)`; the
  gradient of the sum with respect to the batched inputs, and to a zero probe `z` added to each
  unbatched differentiated input (`p + z[b]` for example b), is exactly each example's gradient;
- "vjp" (`vjp_lifted`, not vmapped): `sum((f(...) * ct).sum())`, whose gradient is the vjp at `ct`.

And the gradients of a transformed call, leaf by leaf: `value_and_grad`'s pytrees mapped back to
the call's tensor leaves, a rank's missing ones fetched from the rank that has them, per-example
ones picked out of the lifted pipeline's, and tensors freed of torch.func's wrappers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

from ..tracing import tree
from .config import fn_name


@dataclasses.dataclass(frozen=True)
class Lift:
    """One transformed call: its kind, the user's structure, and where each tensor leaf goes."""

    kind: str  # "vmap", "per_sample", "jvp", "hvp" or "vjp"
    spec: Any  # the treespec of (params, args, kwargs)
    statics: tuple[Any, ...]  # the non-tensor leaves, in order
    is_tensor: tuple[bool, ...]
    # per tensor leaf: "p" (a parameter), "b" (batched), "w" (whole), "d" (batched, differentiated),
    # "e" (whole, differentiated: "vjp")
    source: tuple[str, ...]
    probed: tuple[int, ...]  # tensor leaves that get a per-example probe (per_sample)
    randomness: str = "error"
    axes: tuple[int | None, ...] = ()  # per tensor leaf: its microbatch split axis ("jvp", "hvp", "vjp")
    out_axes: tuple[int | None, ...] = ()  # per output: its concat axis, None: no cotangent ("vjp")

    def data(self, split: Any, whole: Any) -> list[torch.Tensor]:
        """The data leaves in order, each split one with its split axis back in place."""
        s, w = iter(split), iter(whole)
        out = []
        for src, axis in zip(self.source, self.axes):
            if src == "b":
                out.append(next(s).movedim(0, axis))
            elif src == "w":
                out.append(next(w))
        return out

    def __repr__(self) -> str:  # the same on every rank (the signature digest reads it)
        return f"Lift({self.kind}, {self.spec}, {self.statics}, {self.source}, {self.probed})"

    def run(self, f: Callable[..., Any], params: Any, batched: Any, whole: Any, diff: Any) -> Any:
        """`f` per example under vmap over `batched` and `diff` (the differentiated batched
        leaves, then the probes)."""
        n_b, n_d = len(batched), len(diff) - len(self.probed)

        def one(*b: torch.Tensor) -> Any:
            src = {"p": iter(params), "b": iter(b[:n_b]), "w": iter(whole), "d": iter(b[n_b : n_b + n_d])}
            tensors = [next(src[s]) for s in self.source]
            for k, i in enumerate(self.probed):
                tensors[i] = tensors[i] + b[n_b + n_d + k]
            stat, ten = iter(self.statics), iter(tensors)
            leaves = [next(ten) if t else next(stat) for t in self.is_tensor]
            p, args, kwargs = tree.unflatten(leaves, self.spec)
            return f(p, *args, **kwargs)

        vals = torch.func.vmap(one, randomness=self.randomness)(*batched, *diff)
        if self.kind == "vmap":
            return vals
        loss = tree.flatten(vals)[0][0]
        if loss.dim() != 1:
            raise ValueError(
                f"vmap over grad of {fn_name(f)} in a process group: each example's output has shape "
                f"{tuple(loss.shape[1:])}, not a scalar; fpipe differentiates a scalar loss per "
                "example (a vjp or jacrev of a batched output is not distributed). Reduce the "
                "output to a scalar, or use fpipe.value_and_grad of a pipeline of that function."
            )
        return loss.sum(), vals


def lifted(f: Callable[..., Any], kind: str) -> Callable[..., Any]:
    """The pipelined function of one kind of transformed call: `(params, lift, batched, whole,
    diff)`; "per_sample" differentiates `diff` (argnums=4)."""

    def run(params: Any, lift: Lift, batched: Any, whole: Any, diff: Any) -> Any:
        return lift.run(f, params, batched, whole, diff)

    run.__name__ = f"{'vmap' if kind == 'vmap' else 'vmap(grad)'}({fn_name(f)})"
    return run


def jvp_lifted(f: Callable[..., Any], kind: str) -> Callable[..., Any]:
    """The pipelined function of a forward-mode call, `(params, lift, split, whole, tparams,
    tsplit, twhole)` (split leaves and their tangents: split axis moved to dim 0) -> kind "jvp":
    (outputs, their tangents); kind "hvp": the tangent of the scalar loss, whose gradient with
    respect to the params is the Hessian-vector product (reverse over forward)."""

    def run(params: Any, lift: Lift, split: Any, whole: Any, tparams: Any, tsplit: Any, twhole: Any) -> Any:
        data, tdata = lift.data(split, whole), lift.data(tsplit, twhole)
        fl = [i for i, d in enumerate(data) if d.is_floating_point() or d.is_complex()]

        def g(p: Any, fdata: tuple[Any, ...]) -> Any:
            d = list(data)
            for i, x in zip(fl, fdata):
                d[i] = x
            stat, ten = iter(lift.statics), iter([*tree.flatten(p)[0], *d])
            leaves = [next(ten) if t else next(stat) for t in lift.is_tensor]
            q, args, kwargs = tree.unflatten(leaves, lift.spec)
            return f(q, *args, **kwargs)

        primals = (params, tuple(data[i] for i in fl))
        out, tangent = torch.func.jvp(g, primals, (tparams, tuple(tdata[i] for i in fl)))[:2]
        return (out, tangent) if kind == "jvp" else tangent

    run.__name__ = f"{kind}({fn_name(f)})"
    return run


def vjp_lifted(f: Callable[..., Any]) -> Callable[..., Any]:
    """The pipelined function of a vjp of batched outputs, `(params, lift, split, whole, dsplit,
    dwhole, cts)` (split leaves and cotangents: split axis moved to dim 0) -> the scalar
    `sum((out * ct).sum())` over the output leaves that have a cotangent, whose gradient is the vjp."""

    def run(params: Any, lift: Lift, *parts: Any) -> Any:
        src = {"p": iter(tree.flatten(params)[0]), **{k: iter(v) for k, v in zip("bwde", parts)}}
        tensors = [next(src[s]) for s in lift.source]
        tensors = [x.movedim(0, a) if s in "bd" else x for x, s, a in zip(tensors, lift.source, lift.axes)]
        stat, ten = iter(lift.statics), iter(tensors)
        leaves = [next(ten) if t else next(stat) for t in lift.is_tensor]
        q, args, kwargs = tree.unflatten(leaves, lift.spec)
        cts, total = iter(parts[4]), None
        for out, axis in zip(tree.flatten(f(q, *args, **kwargs))[0], lift.out_axes):
            if axis is None:
                continue
            ct = next(cts).movedim(0, axis)
            if ct.shape != out.shape:  # (vjp_fn checked the whole shapes: a microbatch's cannot differ)
                raise AssertionError(f"a microbatch's cotangent {tuple(ct.shape)}, output {tuple(out.shape)}")
            term = (out * ct).sum()
            total = term if total is None else total + term
        return total

    run.__name__ = f"vjp({fn_name(f)})"
    return run


def probe(t: torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """A zero per example, shaped like `t` (a view of one zero: no memory)."""
    return torch.zeros((), dtype=t.dtype, device=device).expand(batch, *t.shape)


def reductions_of(piped: Any, params: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """How the function's outputs combine over microbatches (its compiled plan's, a pytree like
    its outputs): a tangent combines as its output does."""
    _, _, c = piped._get(params, args, kwargs, None, False)
    return tree.unflatten(list(c.reductions[: c.staged.n_outs]), c.out_spec)


def lifted_pipeline(piped: Any, kind: str, reductions: Any = None) -> Any:
    """The pipeline of the lifted function of `kind`: piped's settings, its process groups; the
    microbatches cut the batch (dim 0 of `batched`). Its traces are keyed by `Lift` (a static);
    a forward-mode one's outputs combine over microbatches as `reductions` say."""
    pipes = piped.__dict__.setdefault("_lifted", {})
    key = (kind, repr(reductions))
    if key not in pipes:
        cfg = piped.cfg
        settings = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "f"}
        if kind == "vjp":
            settings.update(in_axes=(None, 0, None, 0, None, 0), out_axes="sum")
            fn = vjp_lifted(cfg.f)
        elif kind in ("jvp", "hvp"):
            outs = (reductions, reductions) if kind == "jvp" else reductions
            settings.update(in_axes=(None, 0, None, None, 0, None), out_axes=outs)
            fn = jvp_lifted(cfg.f, kind)
        else:
            settings.update(in_axes=(None, 0, None, 0), out_axes=0 if kind == "vmap" else ("sum", 0))
            fn = lifted(cfg.f, kind)
        new = type(piped)(fn, **settings)
        new.__dict__["_groups"] = piped._groups
        pipes[key] = new
    return pipes[key]


def grads_by_leaf(
    ctx: Any, tensors: list[torch.Tensor], nums: list[int], grads: tuple[Any, ...]
) -> list[torch.Tensor | None]:
    """`value_and_grad`'s gradient pytrees, one entry per tensor leaf (None: not on this rank)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    params = ctx.rebuild(tensors)[0]
    for num, g in zip(nums, grads):
        idx = [i for i, a in enumerate(ctx.argnum) if a == num]
        if num == 0 and isinstance(params, dict) and isinstance(g, dict):
            got = [g.get(k) for k, v in params.items() if isinstance(v, torch.Tensor)]
        else:
            got = tree.flatten(g)[0]
        for i, x in zip(idx, got):
            out[i] = x
    return out


def complete(
    piped: Any, tensors: list[torch.Tensor], diff: list[bool], grads: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """Each differentiated leaf's gradient on every rank that passes it as a real tensor (sent
    by the lowest rank that has it; zeros where no stage reads it); zeros on the meta device for
    a meta leaf; None for the others."""
    if piped.pg is not None:
        with temporarily_clear_interpreter_stack():  # (from a jvp rule: the Jvp level is active)
            fetch(piped, tensors, diff, grads)
    out: list[torch.Tensor | None] = []
    for t, g, d in zip(tensors, grads, diff):
        if d and t.is_meta:
            g = torch.zeros(g.shape if g is not None else t.shape, dtype=t.dtype, device="meta")
        out.append(g if d else None)
    return out


def fetch(
    piped: Any, tensors: list[torch.Tensor], diff: list[bool], grads: list[torch.Tensor | None]
) -> None:
    """Fill in `grads` (in place) where this rank passes a real input its stages do not read."""
    pg, timeout = piped.pg, piped.cfg.timeout
    want = [i for i, (t, g, d) in enumerate(zip(tensors, grads, diff)) if d and g is None and not t.is_meta]
    have = [i for i, g in enumerate(grads) if g is not None]
    seen = pg.gather_objects((want, have), timeout, "agreeing which gradients to send")
    for i in sorted({i for w, _ in seen for i in w}):
        srcs = [r for r, (_, h) in enumerate(seen) if i in h]
        g = grads[i]
        if not srcs:  # no stage reads it: its gradient is zero
            grads[i] = torch.zeros_like(tensors[i]) if i in want else g
            continue
        mine = pg.rank == srcs[0] and g is not None
        buf = g.contiguous() if mine and g is not None else torch.empty_like(tensors[i], device=pg.device)
        got = pg.broadcast(buf, srcs[0], timeout, f"receiving a gradient from rank {srcs[0]}")
        grads[i] = got if i in want else g


def per_example_grads(
    plain: list[torch.Tensor],
    source: tuple[str, ...],
    probed: tuple[int, ...],
    g_split: list[Any],
    diff: list[bool],
) -> list[torch.Tensor | None]:
    """Each differentiated leaf's per-example gradient (batch first): a batched leaf's own
    gradient, an unbatched one's probe's; zeros on the meta device for a meta leaf."""
    at = {i: k for k, i in enumerate(i for i, s in enumerate(source) if s == "d")}
    out: list[torch.Tensor | None] = []
    for i, d in enumerate(diff):
        g = None
        if d:
            g = g_split[at[i]] if i in at else g_split[len(at) + probed.index(i)]
            if plain[i].is_meta:
                g = torch.zeros(g.shape, dtype=g.dtype, device="meta")
        out.append(g)
    return out


def tangent(primal: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
    """A tangent as a plain tensor (forward AD passes a zero one as None or as an immutable
    ZeroTensor, which no transfer may write)."""
    t = None if t is None else peel(t)
    return torch.zeros_like(primal) if t is None or t._is_zerotensor() else t


def peel(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under a tensor's torch.func wrappers."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t
