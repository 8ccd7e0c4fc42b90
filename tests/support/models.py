"""A small model zoo shared by the tests: plain torch, free-form Python, optional stage boundaries.

Every model that takes `stages` places `stages - 1` calls to `fpipe.stage_boundary` in its
forward (none for `stages=None` or 1), so the same model serves the hand-cut and the automatic
(`pipeline(f, stages=S)` with no boundaries) paths. Dimensions are tiny: the tests check exact
parity, not speed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

import fpipe


def _cut_after(n_segments: int, stages: int | None) -> set[int]:
    """Indices of the segments (of `n_segments`) after which a boundary goes, for `stages` stages."""
    if not stages or stages == 1:
        return set()
    if stages > n_segments:
        raise ValueError(f"{stages} stages need at least {stages} segments, the model has {n_segments}")
    # Segment i runs on stage i * stages // n_segments; cut where that changes.
    return {i for i in range(n_segments - 1) if i * stages // n_segments != (i + 1) * stages // n_segments}


def _boundary(x, i: int, cuts: set[int]):
    return fpipe.stage_boundary(x) if i in cuts else x


class MLP(nn.Module):
    """`n_layers` Linear + tanh layers; a boundary after evenly spaced layers."""

    def __init__(
        self, d_in: int = 6, hidden: int = 8, d_out: int = 3, n_layers: int = 4, stages: int | None = None
    ):
        super().__init__()
        dims = [d_in] + [hidden] * (n_layers - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.cuts = _cut_after(n_layers, stages)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
            x = _boundary(x, i, self.cuts)
        return x


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int, seq: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        # A captured (non-persistent) buffer: the traced program must take it as a constant.
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_head)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class Block(nn.Module):
    """A pre-LN transformer block."""

    def __init__(self, d: int, n_head: int, seq: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head, seq)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embedding, `n_layer` blocks, final LN and head.

    The embedding output `x0` is added again before the head: a skip connection that is *not*
    passed through `stage_boundary` and so crosses every boundary between the first and the
    last stage. Segments are [embedding, block 0, ..., block n-1, final LN + head]; boundaries go
    between them.
    """

    def __init__(
        self,
        vocab: int = 11,
        d: int = 8,
        n_head: int = 2,
        n_layer: int = 2,
        seq: int = 5,
        stages: int | None = None,
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, n_head, seq) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.cuts = _cut_after(n_layer + 2, stages)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x0 = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        x = _boundary(x0, 0, self.cuts)
        for i, block in enumerate(self.blocks):
            x = _boundary(block(x), i + 1, self.cuts)
        x = self.ln_f(x) + x0
        return self.head(x)


class TiedLM(nn.Module):
    """Embedding -> `n_layers` Linear + tanh -> logits through the embedding matrix (tied).

    The embedding matrix is read by the first stage (lookup) and the last (head). Boundaries
    carry a tuple `(h, x0)`: a pytree through `stage_boundary`, with the skip `x0` explicit.
    """

    def __init__(self, vocab: int = 11, d: int = 8, n_layers: int = 3, stages: int | None = None):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layers))
        self.head_bias = nn.Parameter(torch.zeros(vocab))
        self.cuts = _cut_after(n_layers + 1, stages)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x0 = self.tok(idx)
        h, x0 = _boundary((x0, x0), 0, self.cuts)
        for i, layer in enumerate(self.layers):
            h, x0 = _boundary((torch.tanh(layer(h)), x0), i + 1, self.cuts)
        return (h + x0) @ self.tok.weight.t() + self.head_bias


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class KwargsNet(nn.Module):
    """`forward(x, *, mask, scale=1.0) -> {"out", "hidden"}`: keyword tensors, a static float, a dict."""

    def __init__(self, d: int = 6, hidden: int = 8, stages: int | None = None):
        super().__init__()
        self.inp = nn.Linear(d, hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, 2)
        self.cuts = _cut_after(3, stages)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, scale: float = 1.0) -> dict[str, torch.Tensor]:
        h = torch.sin(self.inp(x)) * mask
        h = _boundary(h, 0, self.cuts)
        h2 = torch.tanh(self.mid(h)) * scale + h
        h2 = _boundary(h2, 1, self.cuts)
        return {"out": self.out(h2), "hidden": h2}


class ConvBN(nn.Module):
    """Two conv + BatchNorm2d + ReLU blocks, a pooled linear head; boundaries between segments."""

    def __init__(self, c: int = 3, width: int = 4, n_classes: int = 3, stages: int | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(c, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, width, 3, padding=1)
        self.fc = nn.Linear(width, n_classes)
        self.cuts = _cut_after(4, stages)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _boundary(F.relu(self.bn1(self.conv1(x))), 0, self.cuts)
        x = _boundary(F.relu(self.bn2(self.conv2(x))), 1, self.cuts)
        x = _boundary(torch.tanh(self.conv3(x)), 2, self.cuts)
        return self.fc(x.mean(dim=(2, 3)))


class StepCounter(nn.Module):
    """A module buffer written in place (`self.step.add_(1)`) and read by every layer: issue 24's
    case of a recomputation reading the buffer after the write. One boundary after `cut` layers."""

    def __init__(self, d: int = 8, n_layers: int = 6, cut: int = 3, dtype: torch.dtype = torch.float64):
        super().__init__()
        self.ws = nn.ParameterList(
            nn.Parameter(torch.randn(d, d, dtype=dtype) * 0.3) for _ in range(n_layers)
        )
        self.register_buffer("step", torch.zeros((), dtype=dtype))
        self.cut = cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step.add_(1)
        h = x
        for i, w in enumerate(self.ws):
            h = torch.tanh(h @ w + self.step * 0.25) + h
            h = _boundary(h, i + 1, {self.cut})
        return h.pow(2).mean()


# -- checks shared by the tests -------------------------------------------------------------------

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def assert_trees_close(actual, expected, dtype: torch.dtype = torch.float64) -> None:
    """Same pytree structure, dtypes and shapes; values within `TOL[dtype]` relative.

    Relative to the largest magnitude in `expected` (a norm-wise check): a gradient leaf that is
    near zero is compared at the scale of the whole tree, not at its own.
    """
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    assert a_spec == e_spec, f"structure differs:\n{a_spec}\n!=\n{e_spec}"
    tol = TOL[dtype]
    scale = max((e.detach().abs().max().item() for e in e_leaves if e.numel()), default=1.0)
    for a, e in zip(a_leaves, e_leaves):
        assert a.dtype == e.dtype == dtype, (a.dtype, e.dtype, dtype)
        torch.testing.assert_close(a, e, rtol=tol, atol=tol * max(scale, 1e-30))


def compiled(piped: fpipe.Pipelined):
    """The one compiled program a test's single call left in the (private) cache of `piped`."""
    entries = list(piped._cache.values())
    assert len(entries) == 1, f"expected one compiled signature, found {len(entries)}"
    return entries[0]
