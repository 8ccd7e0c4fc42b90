"""Stage-local weights for `fpipe.generate`: a model built on the meta device gets, on each rank,
only the parameters and buffers its stages' programs read, read from a checkpoint.

# NOTE [stage-local weights]
`generate(model_on_meta, ..., weights=path)` traces the step on fake tensors (a meta tensor
traces like one on the data's device, NOTE [trace key]), then, before anything runs, asks the
traced programs which parameters and captured buffers this rank's stages read (the one answer
every pipelined feature uses: a program's inputs) and materialises exactly those
(`materialize_module`): the decoder blocks of its stages, the embedding where the first stage
is, the final norm and lm_head where the last is. A tied embedding (lm_head sharing the input
embedding) is one parameter read by the first and the last stage: both ranks hold a copy, read
from the files under its first name (`model.embed_tokens.weight`), as `save_pretrained` writes it.
Values come from `path` -- a `save_pretrained` folder (safetensors) or an `fpipe.save`
checkpoint -- through `fpipe.load`'s reader (`read_into`), cast to the meta model's dtypes.
Buffers the files lack (non-persistent ones: rotary `inv_freq`) are rebuilt by the model's own
`_init_weights` (as `from_pretrained` rebuilds them); a floating buffer is filled with NaN
first, and one still NaN after that is refused by name, as is a non-floating buffer the files
lack. The rest of the model stays on meta: a rank's resident weights are its stages' only.
A model is loaded from one path: a later call may add tensors a new stage split reads, from the
same path.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..pipeline import materialize_module
from ..training import read_into
from .decode import Programs

__all__ = ["load_stage_weights", "meta_tensors", "resident_bytes"]

_LOADED: weakref.WeakKeyDictionary[nn.Module, Path] = weakref.WeakKeyDictionary()


def meta_tensors(model: nn.Module) -> list[str]:
    """The names of the model's parameters and buffers on the meta device."""
    return [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]


def resident_bytes(model: nn.Module) -> tuple[int, int]:
    """(count, bytes) of the model's parameters and buffers that are not on meta, each storage once."""
    seen: dict[int, int] = {}
    for _, t in [*model.named_parameters(), *model.named_buffers()]:
        if not t.is_meta:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return len(seen), sum(seen.values())


def check_weights(call: str, model: nn.Module, weights: Any) -> Path | None:
    """The folder to load from, or None for a model without meta tensors; refuses the rest."""
    meta = meta_tensors(model)
    before = _LOADED.get(model)
    if weights is None:
        if meta and before is None:
            raise ValueError(
                f"{call}: the model's {meta[:3]} (and {max(len(meta) - 3, 0)} more) are on the meta "
                "device; pass weights=<a save_pretrained folder or an fpipe.save checkpoint> so that "
                "each rank loads the tensors its stages read, or build the model with real weights."
            )
        return before if meta else None
    path = Path(weights)
    if before is None and len(meta) < len([*model.named_parameters(), *model.named_buffers()]):
        raise ValueError(
            f"{call}: weights={str(weights)!r} loads into a model built on the meta device, but this "
            "model has real parameters or buffers (they would be overwritten); build it under "
            "`with torch.device('meta'):`, or drop weights= to generate with the weights it has."
        )
    if before is not None and before != path:
        raise ValueError(
            f"{call}: the model's stage weights were loaded from {str(before)!r}; weights="
            f"{str(weights)!r} differs. Build another model on meta to load other weights."
        )
    return path


def load_stage_weights(
    call: str, model: nn.Module, programs: Iterable[Programs], stages: list[int], path: Path,
    device: torch.device,
) -> None:  # fmt: skip
    """Materialise and load what `stages`' programs read (NOTE [stage-local weights])."""
    names: set[str] = set()
    buffers: dict[int, torch.Tensor] = {}
    for progs in programs:
        for s in stages:
            inputs = progs.program(s).inputs
            names |= {progs.params[n] for n in inputs if n in progs.params}
            for n in inputs:
                source = progs.consts.get(n, (None, None))[1]
                if source is not None:
                    buf = source[0].get_buffer(source[1])
                    buffers[id(buf)] = buf
    params = dict(model.named_parameters())
    todo = {n for n in names if params[n].is_meta}
    metas = [b for b in buffers.values() if b.is_meta]
    if not todo and not metas:
        _LOADED.setdefault(model, path)
        return
    replaced = materialize_module(model, todo, metas, device, None, init=_Rebuild(model))
    fresh = {id(t) for t in replaced.values()}
    new_bufs = {n: b for n, b in model.named_buffers() if id(b) in fresh}
    persistent = {n: b for n, b in new_bufs.items() if _persistent(model, n)}
    loaded = persistent_in(call, path, persistent)
    read_into(call, path, dict(model.named_parameters()), sorted(todo), loaded, buffers=loaded)
    _check_rebuilt(call, path, {n: b for n, b in new_bufs.items() if n not in loaded})
    _LOADED[model] = path


def persistent_in(call: str, path: Path, bufs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The persistent buffers the folder holds (a `save_pretrained` folder may lack some, as
    `from_pretrained` allows: those keep their rebuilt values); an fpipe checkpoint holds them all."""
    from ..training import checkpoint_hf as hf

    if not bufs or not hf.is_safetensors_dir(path):
        return bufs
    where = hf.safetensors_index(call, path)
    return {n: b for n, b in bufs.items() if n in where}


def _persistent(model: nn.Module, name: str) -> bool:
    owner, _, attr = name.rpartition(".")
    return attr not in model.get_submodule(owner)._non_persistent_buffers_set


class _Rebuild:
    """`materialize_module`'s init: a module's buffers NaN-filled (floating ones), then rebuilt
    by the model's `_init_weights` where it defines one; parameters are read from the files."""

    def __init__(self, model: nn.Module) -> None:
        self.init = getattr(model, "_init_weights", None)

    def __call__(self, sub: nn.Module) -> None:
        own = [b for b in sub.buffers(recurse=False) if b is not None and not b.is_meta]
        if not own:
            return
        for b in own:
            if b.is_floating_point():
                b.fill_(float("nan"))
        if self.init is not None:
            self.init(sub)


def _check_rebuilt(call: str, path: Path, bufs: dict[str, torch.Tensor]) -> None:
    """Every buffer the files lack must have been rebuilt (no NaN left, floating)."""
    bad = [n for n, b in bufs.items() if not b.is_floating_point() or bool(b.isnan().any())]
    if bad:
        raise ValueError(
            f"{call}: the buffers {bad} are not in {str(path)!r} and the model's _init_weights did "
            "not rebuild them; fpipe cannot know their values. Save them with the weights (make them "
            "persistent), or build the model with real weights instead of on meta."
        )
