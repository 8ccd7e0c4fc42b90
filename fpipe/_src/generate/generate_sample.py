"""The next token from the last stage's logits: argmax or a seeded draw, EOS and padding as
transformers does them.

# NOTE [draws that do not depend on the pipeline]
A sampled token is drawn from a generator of its own sequence, seeded by (`seed`, the
sequence's row in the batch), one draw per step. Which stage holds the logits, how many
microbatches the batch is cut into and in which order they reach the last stage change none of
the draws, so `fpipe.generate(..., seed=s)` gives the same tokens at any stage count and any
`microbatches`, in one process or across ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

__all__ = ["Sampling", "Selector"]


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The decoding rule: greedy (`do_sample=False`) or temperature/top-k/top-p sampling, as
    resolved from the call and the model's generation_config (generate_settings.py)."""

    do_sample: bool = False
    temperature: float | None = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0


class Selector:
    """Picks each microbatch's next tokens and tracks which sequences have finished."""

    def __init__(
        self,
        rule: Sampling,
        warp: Callable[[torch.Tensor], torch.Tensor],
        batch: int,
        eos: list[int],
        pad: int | None,
    ) -> None:
        self.rule, self.warp, self.eos, self.pad = rule, warp, torch.tensor(eos, dtype=torch.long), pad
        self.unfinished = torch.ones(batch, dtype=torch.bool)
        self.gens = (
            [torch.Generator().manual_seed(_mix(rule.seed, row)) for row in range(batch)]
            if rule.do_sample
            else []
        )

    def __call__(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        """The next token of sequences `rows` ([rows, 1], long) from their logits [rows, vocab]."""
        scores = (
            logits.detach().float() if logits.dtype in (torch.float16, torch.bfloat16) else logits.detach()
        )
        tokens = self._draw(scores, rows) if self.rule.do_sample else scores.argmax(-1)
        alive = self.unfinished[rows]
        if self.pad is not None:  # a finished sequence gets the pad token, as transformers does
            tokens = torch.where(alive, tokens, torch.full_like(tokens, self.pad))
        if self.eos.numel():
            self.unfinished[rows] = alive & ~torch.isin(tokens, self.eos)
        return tokens.view(-1, 1)

    def _draw(self, scores: torch.Tensor, rows: slice) -> torch.Tensor:
        probs = torch.softmax(self.warp(scores), dim=-1)  # transformers' warpers
        gens = self.gens[rows]
        return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, gens)])


def _mix(seed: int, row: int) -> int:
    """A 63-bit seed for row `row` of a generation seeded by `seed` (splitmix64's finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + row + 1) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) & (2**63 - 1)
