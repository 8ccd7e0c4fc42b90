"""Greedy generation where every decode step is a forward-only call of the pipeline.

No KV cache: each step recomputes the whole prefix through the pipelined forward (`piped(params,
ids)`, no gradients) and appends the argmax of the last position. Two ways to feed the steps
(docs/MODELS.md measures both against `model.generate`):

- growing: the prefix grows by one token per step, so every step is a new input signature and
  fpipe traces and splits the program again (one compiled program per length);
- fixed: the prompt is right-padded to its final length once, and the position to read is a
  tensor argument, so one trace serves every step. In a causal LM, position t never attends to
  positions after t, so the padding cannot change the logits read (the attention mask is passed
  for models whose padding could matter; here it changes nothing).

Both produce exactly the tokens of `model.generate(..., do_sample=False)` on the unsplit model.
They work for any function; for transformers causal LMs `fpipe.generate` is the cached path
(tests/generate/test_generate_cache.py), and bench/generate.py times both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fpipe

transformers = pytest.importorskip("transformers")

VOCAB, PROMPT, NEW, BATCH = 64, 5, 6, 4


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, initializer_range=0.3)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, **common)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, **common,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(torch.float64).eval()


def prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(3))


def reference(model: nn.Module, ids: torch.Tensor, new: int = NEW) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)


# -- the two decode loops (also used by scripts/models_table.py --generation) ----------------------
def growing(fn: Callable[..., Any], stages: int, microbatches: int) -> tuple[fpipe.Pipelined, Callable]:
    """Each step: the logits of the last position of the whole prefix (a new length each step)."""

    def last_logits(params, ids):
        return fn(params, input_ids=ids, use_cache=False).logits[:, -1]

    piped = fpipe.pipeline(last_logits, stages=stages, microbatches=microbatches)

    def generate(params: dict[str, torch.Tensor], ids: torch.Tensor, new: int) -> torch.Tensor:
        for _ in range(new):
            ids = torch.cat([ids, piped(params, ids).argmax(-1, keepdim=True)], dim=1)
        return ids

    return piped, generate


def fixed(fn: Callable[..., Any], stages: int, microbatches: int) -> tuple[fpipe.Pipelined, Callable]:
    """Each step: the whole padded buffer; the position read is a tensor, so the signature stays."""

    def logits_at(params, ids, mask, pos):
        logits = fn(params, input_ids=ids, attention_mask=mask, use_cache=False).logits
        index = pos.view(-1, 1, 1).expand(-1, 1, logits.shape[-1])
        return logits.gather(1, index).squeeze(1)

    piped = fpipe.pipeline(logits_at, stages=stages, microbatches=microbatches)

    def generate(params: dict[str, torch.Tensor], ids: torch.Tensor, new: int) -> torch.Tensor:
        b, p = ids.shape
        buf = torch.cat([ids, ids.new_zeros(b, new)], dim=1)
        mask = torch.cat([torch.ones_like(ids), ids.new_zeros(b, new)], dim=1)
        for t in range(p, p + new):
            pos = torch.full((b,), t - 1)
            buf[:, t] = piped(params, buf, mask, pos).argmax(-1)
            mask[:, t] = 1
        return buf

    return piped, generate


@pytest.mark.parametrize(  # growing traces once per length: GPT-2 alone (the suite's time)
    ("loop", "name", "stages"), [(growing, "gpt2", 2), (fixed, "gpt2", 2), (fixed, "llama", 3)]
)
def test_greedy_generation_equals_generate(name, stages, loop):
    model = build(name)
    ids = prompt()
    expected = reference(model, ids)
    fn, params = fpipe.functionalize(model)
    piped, generate = loop(fn, stages=stages, microbatches=2)
    with torch.no_grad():
        out = generate(params, ids, NEW)
    assert torch.equal(out, expected), (out, expected)
    assert len(set(expected[:, PROMPT:].flatten().tolist())) > 3  # not a constant continuation
    traces = len(piped._cache)  # one compiled program per input signature
    assert traces == (NEW if loop is growing else 1)
    n_stages = {c.staged.n_stages for c in piped._cache.values()}
    assert n_stages == {stages}


def test_decode_step_builds_no_autograd_graph():
    model = build("gpt2")
    fn, params = fpipe.functionalize(model)
    piped, _ = growing(fn, stages=2, microbatches=2)
    logits = piped(params, prompt())  # not under no_grad
    assert not logits.requires_grad and logits.grad_fn is None
