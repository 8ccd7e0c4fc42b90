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

A path that does not exist is refused with the closest real ones; a rule that matches no
module is refused; `cuts` together with `stage_boundary` calls in `f` is refused (one way to
say where stages begin). A module called twice begins a stage at each call.
"""

from __future__ import annotations

import difflib
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


def resolve(call: str, cuts: Any, module: nn.Module) -> list[str]:
    """The module paths `cuts` names in `module`, in module order."""
    paths = [p for p, _ in module.named_modules() if p]
    if isinstance(cuts, re.Pattern):
        found = [p for p in paths if cuts.fullmatch(p)]
        if not found:
            raise ValueError(
                f"{call}: cuts={cuts.pattern!r} matches none of {type(module).__name__}'s module "
                f"paths ({_some(paths)}); the pattern must match a whole path."
            )
        return found
    if isinstance(cuts, dict):
        return [p for name, k in cuts.items() for p in _every(call, module, name, k)]
    missing = [p for p in cuts if p not in paths]
    if missing:
        hints = {p: difflib.get_close_matches(p, paths, n=3, cutoff=0.5) for p in missing}
        said = "; ".join(f"{p!r} (closest: {hints[p] or _some(paths)})" for p in missing)
        raise ValueError(
            f"{call}: cuts names module path(s) that {type(module).__name__} does not have: "
            f"{said}. Paths are those of module.named_modules()."
        )
    return [p for p in paths if p in set(cuts)]


def _every(call: str, module: nn.Module, name: str, k: int) -> list[str]:
    try:
        entries = module.get_submodule(name)
    except AttributeError:
        entries = None
    if not isinstance(entries, (nn.ModuleList, nn.Sequential)):
        lists = [p for p, m in module.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and p]
        raise ValueError(
            f"{call}: cuts={{{name!r}: {k}}} needs {name!r} to be a ModuleList or Sequential of "
            f"{type(module).__name__}; its lists are {_some(lists)}."
        )
    found = [f"{name}.{i}" for i in range(k, len(entries), k)]
    if not found:
        raise ValueError(
            f"{call}: cuts={{{name!r}: {k}}}: {name!r} has {len(entries)} entries, so no entry "
            f"is the k-th; use k < {len(entries)}."
        )
    return found


def _some(paths: list[str], n: int = 6) -> str:
    return ", ".join(paths[:n]) + (", ..." if len(paths) > n else "")


class Cutter:
    """The hooks one forward trace installs for `cuts` (`trace.note_module` calls `install`)."""

    def __init__(self, call: str, cuts: Any) -> None:
        self.call, self.cuts = call, cuts
        self.handles: list[Any] = []
        self.modules: set[int] = set()
        self.placed = 0  # boundaries the hooks inserted

    def install(self, module: nn.Module) -> None:
        if id(module) in self.modules:
            return
        self.modules.add(id(module))
        for path in resolve(self.call, self.cuts, module):
            hook = module.get_submodule(path).register_forward_pre_hook(self._cut, with_kwargs=True)
            self.handles.append(hook)

    def _cut(self, _module: nn.Module, args: Any, kwargs: Any) -> Any:
        """The module's tensor inputs through one `stage_boundary` (other inputs as they are)."""
        leaves, spec = tree.flatten((args, kwargs))
        at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if not at:
            return None
        self.placed += 1
        for i, t in zip(at, stage_boundary([leaves[i] for i in at])):
            leaves[i] = t
        return tree.unflatten(leaves, spec)

    def check(self, markers: list[Any]) -> None:
        """After the trace: the cuts took effect, and they are the function's only markers."""
        if not self.modules:
            raise ValueError(
                f"{self.call}: cuts= names module paths, but the function called no module "
                "wrapped by fpipe.functionalize while it was traced; call the model through the "
                "fn that functionalize returned, or mark stages with fpipe.stage_boundary."
            )
        if self.placed == 0:
            raise ValueError(
                f"{self.call}: cuts={self.cuts!r}: the named modules exist but never ran (or "
                "received no tensor) in the traced call, so no stage begins there."
            )
        if len(markers) > self.placed:
            raise ValueError(
                f"{self.call}: the function calls fpipe.stage_boundary and passes cuts=; mark "
                "stages one way: remove the stage_boundary calls, or the cuts argument."
            )

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _has_tensor(tree: Any) -> bool:
    if isinstance(tree, torch.Tensor):
        return True
    if isinstance(tree, (list, tuple)):
        return any(_has_tensor(t) for t in tree)
    if isinstance(tree, dict):
        return any(_has_tensor(t) for t in tree.values())
    return False
