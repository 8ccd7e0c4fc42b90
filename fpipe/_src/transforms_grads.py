"""Gradients of a transformed pipelined call, leaf by leaf (NOTE [transforms in a group] in
transforms.py): `value_and_grad`'s pytrees mapped back to the call's tensor leaves, a rank's
missing ones fetched from the rank that has them, per-example ones picked out of the lifted
pipeline's, and tensors freed of torch.func's wrappers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

from . import tree


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
