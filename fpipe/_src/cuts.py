"""Cuts by module path: `pipeline(f, cuts=...)` begins a new stage at named modules.

# NOTE [cuts by module path]
While the forward trace runs, each module that `cuts` names gets a forward pre-hook that passes
the module's inputs through `stage_boundary`, so a new stage begins at the module's first
operation and everything downstream (stage count, split, schedule) is the path of ordinary
markers: `cuts=["blocks.2"]` gives the same stages, programs and gradients as
`x = stage_boundary(x)` written before `self.blocks[2](x)`. The paths are those of the module
that `fpipe.functionalize` wrapped (`module.named_modules()`). The forms:

* a list of paths: `["blocks.4", "blocks.8"]`;
* a compiled regex, matched in full against every path: `re.compile(r"blocks\\.(4|8)")`;
* `{ModuleList path: k}`: before every k-th entry, `{"blocks": 4}` = blocks.4, blocks.8, ...
  (`""`: the model itself, an `nn.Sequential`).

A path that does not exist is refused with the closest real ones; a rule that matches no
module is refused; `cuts` together with `stage_boundary` calls in `f` is refused (one way to
say where stages begin). A model that calls several functionalized modules resolves each path in
whichever of them has it. A named module that receives no tensor, or a cut that makes no stage
(inside `torch.func.vmap`, where boundaries are dropped), is refused. A module called twice
begins a stage at each call.
"""

from __future__ import annotations

import difflib
import functools
import re
from typing import Any

import torch
from torch import nn

from . import tree
from .marker import stage_boundary

__all__ = ["check_cuts", "Cutter"]


def check_cuts(call: str, cuts: Any) -> None:
    """Refuse a `cuts` argument of the wrong form at `pipeline(...)`."""
    if cuts is None or isinstance(cuts, re.Pattern):
        return
    if isinstance(cuts, dict):
        bad = {k: v for k, v in cuts.items() if not isinstance(k, str) or not isinstance(v, int) or v < 1}
        if not bad:
            return
    elif isinstance(cuts, (list, tuple)) and cuts and all(isinstance(p, str) for p in cuts):
        return
    raise TypeError(
        f"{call}: cuts={cuts!r} must be a non-empty list of module paths (['blocks.4']), a "
        "compiled regex over module paths (re.compile(r'blocks\\.(4|8)')), or {ModuleList "
        "path: k} to cut before every k-th entry ({'blocks': 4})."
    )


def _named(cuts: Any, module: nn.Module) -> list[str]:
    """The paths `cuts` names in `module` (none, if it names another module's)."""
    paths = [p for p, _ in module.named_modules() if p]
    if isinstance(cuts, re.Pattern):
        return [p for p in paths if cuts.fullmatch(p)]
    if isinstance(cuts, dict):
        return [p for name, k in cuts.items() for p in _every(module, name, k)]
    return [p for p in paths if p in set(cuts)]


def _entries(module: nn.Module, name: str) -> nn.ModuleList | nn.Sequential | None:
    """The ModuleList or Sequential at `name` ("" the module itself), or None."""
    try:
        found = module.get_submodule(name) if name else module
    except AttributeError:
        return None
    return found if isinstance(found, (nn.ModuleList, nn.Sequential)) else None


def _every(module: nn.Module, name: str, k: int) -> list[str]:
    entries = _entries(module, name)
    prefix = f"{name}." if name else ""
    return [f"{prefix}{i}" for i in range(k, len(entries), k)] if entries is not None else []


def _some(paths: list[str], n: int = 6) -> str:
    return ", ".join(paths[:n]) + (", ..." if len(paths) > n else "")


class Cutter:
    """The hooks one forward trace installs for `cuts` (`trace.note_module` calls `install`), and
    the check, after the trace, that each cut took effect."""

    def __init__(self, call: str, cuts: Any) -> None:
        self.call, self.cuts = call, cuts
        self.handles: list[Any] = []
        self.modules: list[nn.Module] = []
        self.named: list[str] = []  # the paths found, over every module the trace called
        self.empty: set[str] = set()  # named modules that received no tensor
        self.placed = 0  # boundaries the hooks inserted

    def install(self, module: nn.Module) -> None:
        if any(m is module for m in self.modules):
            return
        self.modules.append(module)
        for path in _named(self.cuts, module):
            hook = functools.partial(self._cut, path)
            self.handles.append(module.get_submodule(path).register_forward_pre_hook(hook, with_kwargs=True))
            self.named.append(path)

    def _cut(self, path: str, _module: nn.Module, args: Any, kwargs: Any) -> Any:
        """The module's tensor inputs through one `stage_boundary` (other inputs as they are)."""
        leaves, spec = tree.flatten((args, kwargs))
        at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if not at:
            self.empty.add(path)
            return None
        self.placed += 1
        for i, t in zip(at, stage_boundary([leaves[i] for i in at])):
            leaves[i] = t
        return tree.unflatten(leaves, spec)

    def check(self, markers: list[Any]) -> None:
        """After the trace: every cut names a module, took effect, and is the only kind of marker."""
        if not self.modules:
            raise ValueError(
                f"{self.call}: cuts= names module paths, but the function called no module "
                "wrapped by fpipe.functionalize while it was traced; call the model through the "
                "fn that functionalize returned, or mark stages with fpipe.stage_boundary."
            )
        self._check_named()
        if self.empty:
            raise ValueError(
                f"{self.call}: cuts name module(s) {sorted(self.empty)} that receive no tensor, so "
                "no stage can begin at them; cut at a module that reads their output instead."
            )
        if self.placed == 0:
            raise ValueError(
                f"{self.call}: cuts={self.cuts!r}: the named modules exist but never ran in the "
                "traced call, so no stage begins there."
            )
        if len(markers) > self.placed:
            raise ValueError(
                f"{self.call}: the function calls fpipe.stage_boundary and passes cuts=; mark "
                "stages one way: remove the stage_boundary calls, or the cuts argument."
            )
        if len(markers) < self.placed:
            raise ValueError(
                f"{self.call}: {self.placed - len(markers)} of the cuts at {sorted(set(self.named))} "
                "made no stage: a boundary inside torch.func.vmap (or another transform) is "
                "dropped. Cut at a module called outside the transform."
            )

    def _check_named(self) -> None:
        paths = [p for m in self.modules for p, _ in m.named_modules() if p]
        names = " and ".join(type(m).__name__ for m in self.modules)
        if isinstance(self.cuts, re.Pattern) and not self.named:
            raise ValueError(
                f"{self.call}: cuts={self.cuts.pattern!r} matches none of {names}'s module paths "
                f"({_some(paths)}); the pattern must match a whole path."
            )
        if isinstance(self.cuts, dict):
            for name, k in self.cuts.items():
                self._check_every(name, k, names)
        elif not isinstance(self.cuts, re.Pattern):
            missing = [p for p in self.cuts if p not in paths]
            if missing:
                hints = {p: difflib.get_close_matches(p, paths, n=3, cutoff=0.5) for p in missing}
                said = "; ".join(f"{p!r} (closest: {hints[p] or _some(paths)})" for p in missing)
                raise ValueError(
                    f"{self.call}: cuts names module path(s) that {names} does not have: {said}. "
                    "Paths are those of module.named_modules()."
                )

    def _check_every(self, name: str, k: int, names: str) -> None:
        lists = [e for e in (_entries(m, name) for m in self.modules) if e is not None]
        if not lists:
            found = [
                p
                for m in self.modules
                for p, x in m.named_modules()
                if isinstance(x, (nn.ModuleList, nn.Sequential))
            ]
            raise ValueError(
                f"{self.call}: cuts={{{name!r}: {k}}} needs {name!r} to be a ModuleList or "
                f"Sequential of {names}; its lists are {_some([p or repr('') for p in found])}."
            )
        n = max(len(e) for e in lists)
        if k >= n:
            raise ValueError(
                f"{self.call}: cuts={{{name!r}: {k}}}: {name!r} has {n} entries, so no entry is the "
                f"k-th; use k < {n}."
            )

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
