"""Kernel workspaces: what an operation's kernel allocates and frees while it runs, by operation.

# NOTE [kernel workspaces]
memory_graph.py counts the storages a program's nodes return; a few kernels allocate more, for
as long as they run, and hand back only their outputs. `workspace(node)` is those bytes, from
the rule `WORKSPACES` registers for the node's operation (0 for the others), read from the fake
tensors the trace left; `memory_graph.profile` holds them during the node. The rules, measured on
this CPU build (torch 2.13, oneDNN 3.12; resident-set growth of one call, glibc's mmap threshold
at 128 KiB) and read from the kernels that `torch._C._select_conv_backend` names:

- convolution on oneDNN (`Mkldnn`: float32 and bfloat16 on CPU, most shapes): the forward
  copies its input into oneDNN's blocked layout (channels padded to 16) and computes its output
  in that layout before copying it back: max(blocked input, output); the backward, asked for the
  input's gradient, the blocked input and the larger of the blocked output gradient and a
  blocked input gradient (a strided convolution's is the larger), and asked for the weight's
  alone, the input and the blocked output gradient. Measured on 0.4-8 MiB layers of 3-32
  channels, stride 1 and 2: within 0.2 MiB, or over by up to 0.8 MiB (3-channel inputs).
- convolution on torch's own kernels (`Slow2d`, `Slow3d`: float64, and small float32 shapes):
  im2col's columns, (input channels per group x kernel elements) x output positions for every
  example at once, in the forward and the backward alike; none for a 1x1 kernel at stride 1
  without padding (the input is the columns). The dilated and transposed kernels fill the
  columns of one example at a time.

Other kernels' workspaces (a matrix product's packing buffers: 0.2-0.7 MiB per program in the
tests' GPT), allocator slack and per-thread scratch stay outside the prediction: the headroom a
memory limit keeps (remat_choose.HEADROOM_PERCENT) is for them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

__all__ = ["WORKSPACES", "workspace"]

Rule = Callable[[fx.Node], int]
WORKSPACES: dict[Any, Rule] = {}

aten = torch.ops.aten


def register(*ops: Any) -> Callable[[Rule], Rule]:
    def add(rule: Rule) -> Rule:
        for op in ops:
            WORKSPACES[op] = rule
        return rule

    return add


def workspace(node: fx.Node) -> int:
    """The bytes `node`'s kernel allocates and frees while it runs (NOTE [kernel workspaces])."""
    rule = WORKSPACES.get(node.target)
    return rule(node) if rule is not None else 0


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, fx.Node) else None


def _bytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _blocked(t: torch.Tensor) -> int:
    """Bytes of `t` in oneDNN's blocked layout: channels (dim 1) padded to a multiple of 16."""
    c = t.shape[1] if t.dim() > 1 else 1
    return _bytes(t) * (-(-c // 16) * 16) // max(c, 1)


def _backend(x: Any, w: Any, conv: tuple[Any, ...]) -> str:
    """The kernel torch runs this convolution with (`ConvBackend` name), '' if it cannot say."""
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)):
        return ""
    stride, padding, dilation, transposed, output_padding, groups = conv
    try:
        return str(
            torch._C._select_conv_backend(  # type: ignore[attr-defined]
                x, w, None, stride, padding, dilation, transposed, output_padding, groups, None
            ).name
        )
    except (RuntimeError, TypeError):
        return ""


def _columns(backend: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, conv: tuple[Any, ...]) -> int:
    """im2col's columns of torch's own convolution kernels (NOTE [kernel workspaces])."""
    stride, padding = conv[0], conv[1]
    kernel = math.prod(w.shape[2:])
    if backend in ("Slow2d", "Slow3d"):
        if kernel == 1 and all(s == 1 for s in stride) and not any(padding):
            return 0
        return out.shape[0] * w.shape[1] * kernel * math.prod(out.shape[2:]) * out.element_size()
    if backend.startswith(("SlowDilated", "SlowTranspose")):
        rows = w.shape[0] if backend.startswith("SlowTranspose") else w.shape[1]  # (weight: in, out/g)
        spatial = x.shape[2:] if backend.startswith("SlowTranspose") else out.shape[2:]
        return rows * kernel * math.prod(spatial) * out.element_size()
    return 0


@register(aten.convolution.default)
def _convolution(node: fx.Node) -> int:
    x, w, out = _val(node.args[0]), _val(node.args[1]), _val(node)
    conv = tuple(node.args[3:9])
    backend = _backend(x, w, conv)
    if backend == "Mkldnn":
        return max(_blocked(x), _bytes(out))
    return _columns(backend, x, w, out, conv) if isinstance(out, torch.Tensor) else 0


@register(aten.convolution_backward.default)
def _convolution_backward(node: fx.Node) -> int:
    gy, x, w = (_val(a) for a in node.args[:3])
    conv, mask = tuple(node.args[4:10]), node.args[10]
    backend = _backend(x, w, conv)
    if backend == "Mkldnn":
        wants_input = bool(mask[0]) if isinstance(mask, (list, tuple)) else True
        if not wants_input:
            return _bytes(x) + _blocked(gy)
        return _blocked(x) + max(_blocked(gy), _blocked(x))
    return _columns(backend, x, w, gy, conv) if isinstance(gy, torch.Tensor) else 0
