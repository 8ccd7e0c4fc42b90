"""Materialise only this rank's stage of a model built on the meta device.

A model too big for one host is built under `torch.device("meta")` (no memory), traced (fake
tensors, no memory), and then each rank allocates and initialises just the parameters and
buffers its stages read: by the owning modules' own `reset_parameters`, or from a state dict.
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..runtime import PPGroup
from ..tracing import like, local
from .compiler import Compiled
from .outputs import local_inputs

__all__ = ["materialize_module", "materialize_plan"]


def materialize_plan(
    module: nn.Module,
    pg: PPGroup | None,
    c: Compiled,
    plans: Iterable[Compiled],
    device: torch.device,
    state_dict: dict[str, torch.Tensor] | None,
    init: Callable[[nn.Module], None] | None,
) -> dict[str, torch.Tensor]:
    """`Pipelined.materialize`: materialise what this rank's stages of plan `c` read, point every
    compiled plan's captured buffers at the new tensors, return the new params dict."""
    local = local_inputs(pg, c, c.staged.param_inputs)
    names = {k for i, k in enumerate(c.param_keys) if i in local}
    const_local = local_inputs(pg, c, c.staged.const_inputs)
    buffers = [b for i, b in enumerate(c.consts) if i in const_local]
    replaced = materialize_module(module, names, buffers, device, state_dict, init)
    for compiled in plans:
        compiled.consts[:] = remap(compiled.consts, replaced)
    return {n: p.detach() for n, p in module.named_parameters()}


def _owners(module: nn.Module, tensors: dict[int, str]) -> dict[int, list[tuple[nn.Module, str, bool]]]:
    """id(tensor) -> every (submodule, attribute, is_param) holding it (tied weights have several)."""
    out: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    for sub in module.modules():
        for name, p in sub.named_parameters(recurse=False):
            if id(p) in tensors:
                out.setdefault(id(p), []).append((sub, name, True))
        for name, b in sub.named_buffers(recurse=False):
            if b is not None and id(b) in tensors:
                out.setdefault(id(b), []).append((sub, name, False))
    return out


def materialize_module(
    module: nn.Module,
    local_params: set[str],
    local_buffers: list[torch.Tensor],
    device: torch.device,
    state_dict: dict[str, torch.Tensor] | None,
    init: Callable[[nn.Module], None] | None = None,
) -> dict[int, torch.Tensor]:
    """Allocate and initialise the named parameters and the given buffers on `device`.

    Every direct parameter of a submodule that owns a local one is materialised too (its
    `reset_parameters` initialises them together). Returns id(old tensor) -> new tensor.
    """
    named = dict(module.named_parameters())
    targets = {id(named[n]): n for n in local_params}
    owning = {id(sub) for ids in _owners(module, targets).values() for sub, _, _ in ids}
    for sub in module.modules():
        if id(sub) in owning:
            targets.update({id(p): "" for _, p in sub.named_parameters(recurse=False)})
    buffer_names = {id(b): n for n, b in module.named_buffers()}
    targets.update({id(b): buffer_names.get(id(b), "") for b in local_buffers if b.is_meta})
    owners = _owners(module, targets)
    replaced: dict[int, torch.Tensor] = {}
    for key, holders in owners.items():
        old = getattr(holders[0][0], holders[0][1])
        if not old.is_meta:
            continue
        new = like(torch.empty_like(local(old), device=device), old)  # a DTensor: its shard only
        new = nn.Parameter(new, requires_grad=old.requires_grad) if holders[0][2] else new
        for sub, attr, _ in holders:
            setattr(sub, attr, new)
        replaced[key] = new
    _initialise(module, owners, replaced, state_dict, init)
    return replaced


def _initialise(
    module: nn.Module,
    owners: dict[int, list[tuple[nn.Module, str, bool]]],
    replaced: dict[int, torch.Tensor],
    state_dict: dict[str, torch.Tensor] | None,
    init: Callable[[nn.Module], None] | None,
) -> None:
    if state_dict is not None:
        full = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        with torch.no_grad():
            for name, t in full.items():
                if any(t is r for r in replaced.values()) and name in state_dict:
                    local(t).copy_(_piece(state_dict[name], t))
        return
    names = {id(sub): name for name, sub in module.named_modules()}
    subs = {id(sub): sub for key in replaced for sub, _, _ in owners[key]}
    base = torch.initial_seed()
    with torch.no_grad():
        for key in sorted(subs, key=lambda k: names.get(k, "")):
            sub = subs[key]
            # NOTE [materialised initialisation]: each module draws from a generator seeded by
            # its name, so a module held by two ranks (a tied embedding) gets the same values
            # on both, whatever else each rank initialises first.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_name_seed(base, names.get(key, "")))
                with _whole_while_initialised(sub):
                    _init_one(sub, init, any(is_p for k in replaced for s, _, is_p in owners[k] if s is sub))


@contextlib.contextmanager
def _whole_while_initialised(sub: nn.Module) -> Iterator[None]:
    """A submodule's tensor-parallel (DTensor) parameters made whole plain tensors while it is
    initialised, then each rank keeps its shard: the values do not depend on the tp degree (they
    are the ones a model without tensor parallelism draws from the same seed), and no DTensor
    random operation runs. One submodule's parameters are whole at a time."""
    dts = {n: p for n, p in sub.named_parameters(recurse=False) if isinstance(p, DTensor)}
    for n, p in dts.items():
        whole = torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device)
        setattr(sub, n, nn.Parameter(whole, requires_grad=p.requires_grad))
    try:
        yield
    finally:
        for n, p in dts.items():
            with torch.no_grad():
                p.to_local().copy_(_piece(getattr(sub, n).detach(), p))
            setattr(sub, n, p)


def _name_seed(base: int, name: str) -> int:
    digest = hashlib.blake2b(f"{base}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _init_one(sub: nn.Module, init: Callable[[nn.Module], None] | None, has_params: bool) -> None:
    if init is not None:
        init(sub)
        return
    reset = getattr(sub, "reset_parameters", None)
    if callable(reset):
        reset()
    elif has_params:
        warnings.warn(
            f"materialize: {type(sub).__name__} has no reset_parameters(); its parameters are left "
            "uninitialised. Pass init=..., state_dict=..., or give it reset_parameters().",
            stacklevel=4,
        )


def _piece(full: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The part of a whole tensor (a state dict's) that `t` holds: all of it, or a DTensor's shard
    (sliced here, no collective)."""
    if isinstance(full, DTensor):
        full = full.full_tensor()
    if not isinstance(t, DTensor):
        return full
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def remap(values: list[Any], replaced: dict[int, torch.Tensor]) -> list[Any]:
    return [replaced.get(id(v), v) for v in values]
