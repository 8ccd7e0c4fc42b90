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
  (`""`: the model itself, an `nn.Sequential`);
* torch.distributed.pipelining's `split_spec`, `{path: SplitPoint.BEGINNING or SplitPoint.END}`:
  BEGINNING is the pre-hook above; END passes the module's output tensors through
  `stage_boundary` (a forward hook), so the next stage begins after the module. One dict may
  hold both kinds of entry (`{"blocks": 4, "head": SplitPoint.BEGINNING}`).

A path that does not exist is refused with the closest real ones; a rule that matches no
module is refused; `cuts` together with `stage_boundary` or `pipe_split()` calls in `f` is
refused (one way to say where stages begin). A model that calls several functionalized modules
resolves each path in whichever of them has it. A named module that receives no tensor (or, at
SplitPoint.END, returns none), or a cut that makes no stage (inside `torch.func.vmap`, where
boundaries are dropped), is refused. A module called twice begins a stage at each call.
"""

from __future__ import annotations

import difflib
import functools
import re
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint

from . import tree
from .marker import stage_boundary

__all__ = ["check_cuts", "Cutter"]


def check_cuts(call: str, cuts: Any) -> None:
    """Refuse a `cuts` argument of the wrong form at `pipeline(...)`."""
    if cuts is None or isinstance(cuts, re.Pattern):
        return
    if isinstance(cuts, dict) and cuts:
        if all(isinstance(k, str) and _entry_ok(v) for k, v in cuts.items()):
            return
    elif isinstance(cuts, (list, tuple)) and cuts and all(isinstance(p, str) for p in cuts):
        return
    raise TypeError(
        f"{call}: cuts={cuts!r} must be a non-empty list of module paths (['blocks.4']), a "
        "compiled regex over module paths (re.compile(r'blocks\\.(4|8)')), {ModuleList "
        "path: k} to cut before every k-th entry ({'blocks': 4}), or torch.distributed."
        "pipelining's split_spec ({'layers.4': SplitPoint.BEGINNING}, SplitPoint.END)."
    )


def _entry_ok(v: Any) -> bool:
    """A value of a `cuts` dict: every k-th entry (an int k >= 1) or a `SplitPoint`."""
    return isinstance(v, SplitPoint) or (isinstance(v, int) and not isinstance(v, bool) and v >= 1)


def _named(cuts: Any, module: nn.Module) -> list[tuple[str, SplitPoint]]:
    """The paths `cuts` names in `module` (none, if it names another module's), each with where
    the stage begins: before the module (BEGINNING) or after it (END)."""
    paths = [p for p, _ in module.named_modules() if p]
    if isinstance(cuts, re.Pattern):
        return [(p, SplitPoint.BEGINNING) for p in paths if cuts.fullmatch(p)]
    if isinstance(cuts, dict):
        every = [p for name, k in _counts(cuts) for p in _every(module, name, k)]
        return [(p, SplitPoint.BEGINNING) for p in every] + [
            (p, cuts[p]) for p in _listed(cuts) if p in paths
        ]
    return [(p, SplitPoint.BEGINNING) for p in paths if p in set(cuts)]


def _counts(cuts: dict[str, Any]) -> list[tuple[str, int]]:
    """The `{ModuleList path: k}` entries of a `cuts` dict."""
    return [(name, k) for name, k in cuts.items() if not isinstance(k, SplitPoint)]


def _listed(cuts: Any) -> list[str]:
    """The module paths `cuts` names one by one (a list, or a split_spec's entries)."""
    if isinstance(cuts, dict):
        return [p for p, v in cuts.items() if isinstance(v, SplitPoint)]
    return [] if isinstance(cuts, re.Pattern) else list(cuts)


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
        for path, point in _named(self.cuts, module):
            sub = module.get_submodule(path)
            if point is SplitPoint.END:
                after = functools.partial(self._cut_after, path)
                self.handles.append(sub.register_forward_hook(after))
            else:
                hook = functools.partial(self._cut, path)
                self.handles.append(sub.register_forward_pre_hook(hook, with_kwargs=True))
            self.named.append(path)

    def _cut(self, path: str, _module: nn.Module, args: Any, kwargs: Any) -> Any:
        """The module's tensor inputs through one `stage_boundary` (other inputs as they are)."""
        return self._through(path, (args, kwargs))

    def _cut_after(self, path: str, _module: nn.Module, _args: Any, output: Any) -> Any:
        """SplitPoint.END: the module's output tensors through one `stage_boundary`."""
        marked = self._through(path, output)
        return output if marked is None else marked

    def _through(self, path: str, value: Any) -> Any:
        """`value` with its tensor leaves through one `stage_boundary`; None if it has none."""
        leaves, spec = tree.flatten(value)
        at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if not at:
            self.empty.add(path)
            return None
        self.placed += 1
        for i, t in zip(at, stage_boundary([leaves[i] for i in at])):
            leaves[i] = t
        return tree.unflatten(leaves, spec)

    def check(self, markers: list[Any], splits: int = 0) -> None:
        """After the trace: every cut names a module, took effect, and is the only kind of marker
        (`splits`: the `pipe_split()` calls the trace met)."""
        if not self.modules:
            raise ValueError(
                f"{self.call}: cuts= names module paths, but the function called no module "
                "wrapped by fpipe.functionalize while it was traced; call the model through the "
                "fn that functionalize returned, or mark stages with fpipe.stage_boundary."
            )
        self._check_named()
        if self.empty:
            raise ValueError(
                f"{self.call}: cuts name module(s) {sorted(self.empty)} that receive no tensor "
                "(or, at SplitPoint.END, return none), so no stage can begin at them; cut at a "
                "module that reads their output instead."
            )
        if splits:
            raise ValueError(
                f"{self.call}: the function calls torch.distributed.pipelining's pipe_split() "
                f"({splits} call(s)) and passes cuts=; mark stages one way: remove the pipe_split() "
                "calls, or the cuts argument."
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
            for name, k in _counts(self.cuts):
                self._check_every(name, k, names)
        missing = [p for p in _listed(self.cuts) if p not in paths]
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
