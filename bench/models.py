"""Models shared by the benchmarks: a GPT-like decoder, its heavy-output-head variant, and the
same model cut into per-stage modules for `torch.distributed.pipelining`.

One `GPT` serves both libraries. fpipe sees the whole model with `fpipe.stage_boundary` after
the blocks named by `cuts`; torch sees `StageModule`s that hold the *same kind of* submodules
(copied from one reference model, so the initial weights are identical) under the same names,
so a parameter is called `blocks.3.attn.weight` in the fpipe params dict and in the torch stage
module, and gradients compare key by key.

Stage s of S holds blocks [s * L // S, (s + 1) * L // S); stage 0 also holds the embeddings,
the last stage the final LayerNorm and the output head. The head is not tied to the embedding:
torch.distributed.pipelining has no cross-stage weight tying.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import fpipe


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab: int = 1024
    seq: int = 128
    d_model: int = 256
    heads: int = 8
    layers: int = 8

    def __post_init__(self) -> None:
        if self.d_model % self.heads:
            raise ValueError(f"GPTConfig: d_model={self.d_model} is not divisible by heads={self.heads}.")


BASE = GPTConfig()
# The output head dominates: vocab 8192 makes head + cross-entropy about as costly as 4 blocks,
# so with 4 blocks per stage the last stage does ~1.5-2x the work of the first.
HEAVY_HEAD = GPTConfig(vocab=8192)
CONFIGS = {"base": BASE, "heavy-head": HEAVY_HEAD}


class Block(nn.Module):
    """A pre-LN transformer block with causal scaled-dot-product attention."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.attn, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.attn(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (b, heads, t, d_head)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Embeddings, `layers` blocks, final LayerNorm, untied head. `cuts`: the block indices
    after which `fpipe.stage_boundary` goes (empty: no boundaries)."""

    def __init__(self, cfg: GPTConfig, cuts: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.cfg, self.cuts = cfg, frozenset(cuts)
        self.tok, self.pos = nn.Embedding(cfg.vocab, cfg.d_model), nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i in self.cuts:
                x = fpipe.stage_boundary(x)
        return self.head(self.ln(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def layer_ranges(layers: int, stages: int) -> list[tuple[int, int]]:
    """[lo, hi) block ranges of each stage: equal shares, in order."""
    if not 1 <= stages <= layers:
        raise ValueError(f"layer_ranges: {stages} stages need 1..{layers} of the {layers} blocks.")
    return [(s * layers // stages, (s + 1) * layers // stages) for s in range(stages)]


def cuts_for(cfg: GPTConfig, stages: int) -> frozenset[int]:
    """The `GPT(cuts=...)` that makes the same split as `stage_modules(..., stages)`."""
    return frozenset(hi - 1 for _, hi in layer_ranges(cfg.layers, stages)[:-1])


class StageModule(nn.Module):
    """Blocks [lo, hi) of a GPT (plus embeddings on the first stage, LN + head on the last),
    under the GPT's own parameter names."""

    def __init__(self, gpt: GPT, lo: int, hi: int) -> None:
        super().__init__()
        self.first, self.last = lo == 0, hi == gpt.cfg.layers
        if self.first:
            self.tok, self.pos = gpt.tok, gpt.pos
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in range(lo, hi)})
        if self.last:
            self.ln, self.head = gpt.ln, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln(x)) if self.last else x


def stage_modules(gpt: GPT, stages: int) -> list[StageModule]:
    """A deep copy of `gpt` cut into `stages` modules (its own parameters, the same values)."""
    gpt = copy.deepcopy(gpt)
    gpt.cuts = frozenset()
    return [StageModule(gpt, lo, hi) for lo, hi in layer_ranges(gpt.cfg.layers, stages)]


def make_batch(cfg: GPTConfig, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and next-token targets (the same on every rank for one seed)."""
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(cfg.vocab, (batch, cfg.seq + 1), generator=gen)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def fpipe_revision() -> str:
    """The fpipe commit a figure was measured on, '+dirty' if fpipe/ has uncommitted changes."""
    import subprocess
    from pathlib import Path

    root = Path(fpipe.__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "fpipe")
    except OSError:
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")
