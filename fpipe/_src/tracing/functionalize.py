"""`functionalize`: an nn.Module as a pure function of its parameters."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .trace import note_module

__all__ = ["functionalize", "Functionalized"]


class Functionalized:
    """`fn(params, *args, **kwargs) == module(*args, **kwargs)` with `params` swapped in.

    Buffers stay with the module and are updated in place as in eager training (BatchNorm's
    running statistics). Calling it with a params dict whose keys differ from the module's
    parameter names is an error: a missing key would otherwise silently use the module's own
    tensor.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.param_names = tuple(name for name, _ in module.named_parameters())
        self._name_set = frozenset(self.param_names)

    def __call__(self, params: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        self._check_keys(params)
        note_module(self.module)
        return torch.func.functional_call(self.module, params, args, kwargs, tie_weights=True)

    def _check_keys(self, params: Any) -> None:
        if not isinstance(params, dict):
            raise TypeError(
                f"{self!r}(params, ...): params must be a dict of tensors keyed by parameter "
                f"name, got {type(params).__name__}; pass the dict that functionalize returned."
            )
        if params.keys() == self._name_set:
            return
        missing = [k for k in self.param_names if k not in params]
        extra = [k for k in params if k not in self._name_set]
        parts = []
        if missing:
            parts.append(f"is missing {len(missing)} key(s) {_head(missing)}")
        if extra:
            parts.append(f"has {len(extra)} unexpected key(s) {_head(extra)}")
        raise ValueError(
            f"{self!r}(params, ...): params {' and '.join(parts)}; it must hold exactly the "
            f"{len(self.param_names)} parameters of the module. Pass the dict returned by "
            "functionalize (or by materialize), updated by your optimizer but with the same keys."
        )

    def __repr__(self) -> str:
        return f"functionalize({type(self.module).__name__})"


def _head(keys: list[str], n: int = 5) -> str:
    shown = ", ".join(repr(k) for k in keys[:n])
    return f"[{shown}{', ...' if len(keys) > n else ''}]"


def functionalize(module: nn.Module) -> tuple[Functionalized, dict[str, torch.Tensor]]:
    """Turn a module into a pure function of its parameters.

    Args:
        module: any `nn.Module`, including one built on the meta device.

    Returns:
        `(fn, params)`: `fn(params, *args, **kwargs)` computes `module(*args, **kwargs)` through
        `torch.func.functional_call`; `params` maps each parameter's name to the tensor (a
        parameter shared by two submodules appears once, under its first name).

    Example:
        >>> import torch, fpipe
        >>> lin = torch.nn.Linear(3, 1)
        >>> fn, params = fpipe.functionalize(lin)
        >>> x = torch.ones(2, 3)
        >>> torch.equal(fn(params, x), lin(x))
        True
        >>> grads = torch.func.grad(lambda p: fn(p, x).sum())(params)
        >>> sorted(grads)
        ['bias', 'weight']
    """
    fn = Functionalized(module)
    params = {name: p.detach() for name, p in module.named_parameters()}
    return fn, params
