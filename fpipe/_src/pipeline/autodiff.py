"""`value_and_grad` and `grad` of a pipelined function: the backward through every stage.

Both call `Pipelined.value_and_grad`, which runs the staged joint programs (forward and backward
actions per microbatch) and returns the value and the gradients; `grad` is built on
`value_and_grad`, as torch.func's and JAX's are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .api import Pipelined

__all__ = ["value_and_grad", "grad"]


def value_and_grad(
    piped: Pipelined, argnums: int | tuple[int, ...] = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """`torch.func.grad_and_value`'s meaning, computed by the pipeline schedule, value first.

    Returns a function `(params, *args, **kwargs) -> (value, grads)`; with `has_aux=True`, `f`
    returns `(loss, aux)` and value is `(loss, aux)`. `grads` mirrors `argnums` (an int gives
    one pytree, a tuple gives a tuple). Per microbatch each stage runs one forward and one
    backward action; gradients are accumulated over microbatches.

    Example:
        >>> import torch, fpipe
        >>> piped = fpipe.pipeline(lambda w, x: (x @ w).sum(), microbatches=2, out_axes="sum")
        >>> loss, g = fpipe.value_and_grad(piped)(torch.ones(3), torch.ones(4, 3))
        >>> g
        tensor([4., 4., 4.])
    """
    if not isinstance(piped, Pipelined):
        raise TypeError(
            f"value_and_grad(piped): expected the result of fpipe.pipeline, got {type(piped).__name__}."
        )

    @functools.wraps(piped)
    def vg(params: Any, *args: Any, **kwargs: Any) -> Any:
        return piped.value_and_grad(argnums, has_aux, params, args, kwargs)

    return vg


def grad(piped: Pipelined, argnums: int | tuple[int, ...] = 0, has_aux: bool = False) -> Callable[..., Any]:
    """Like `value_and_grad`, returning only the gradients (with `has_aux`, `(grads, aux)`)."""
    vg = value_and_grad(piped, argnums, has_aux)

    @functools.wraps(piped)
    def g(*args: Any, **kwargs: Any) -> Any:
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return g
