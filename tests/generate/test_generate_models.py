"""`fpipe.generate` on what a model's config does not say: its dtype after `model.to(...)`, the
K/V layout its attention stores (Falcon's multi-query), a float32 mixture of experts (Mixtral),
and Phi-3's long rope. Tiny configs, a few tokens each, compared with the unsplit
`model.generate(..., do_sample=False)`."""

from __future__ import annotations

import pytest
import torch

import fpipe

transformers = pytest.importorskip("transformers")

import fpipe._src.generate.generate as generate_module  # noqa: E402

VOCAB, NEW = 64, 5
COMMON = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=None, eos_token_id=None)
SIZES = dict(
    num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def prompt() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))


def check(model: torch.nn.Module, ids: torch.Tensor, new: int = NEW, stages: int = 2) -> None:
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    out = fpipe.generate(model, ids, max_new_tokens=new, stages=stages)
    assert torch.equal(out, expected), (out, expected)


def test_a_model_moved_to_another_dtype_is_traced_again():
    """Case 8: the decode trace was keyed by device and shapes, not dtype: float32 -> bfloat16
    crashed in index_copy_ (buffers of one dtype, keys of the other), float32 -> float64 ran the
    float32 trace's casts. One trace key (NOTE [trace key]) for pipeline and generate."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, **COMMON)).eval()
    ids = prompt()
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float32):
        check(model.to(dtype), ids)
    traces = generate_module.TRACES[model]
    assert len(traces.forwards) == 2 * 3  # prefill and decode per dtype; float32 again: reused
    assert {dt for progs in traces.programs.values() for _, _, dt in progs.layout} == {
        torch.float32, torch.float64, torch.bfloat16,
    }  # fmt: skip


def test_falcon_multi_query_buffers_sized_from_what_attention_stores():
    """Case 11: falcon-7b's layout (multi_query, one K/V head for 4 query heads): the buffers
    were sized from num_attention_heads and index_copy_ failed."""
    torch.manual_seed(0)
    cfg = transformers.FalconConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, multi_query=True,
        new_decoder_architecture=False, **COMMON,
    )  # fmt: skip
    model = transformers.FalconForCausalLM(cfg).eval()
    check(model, prompt())
    progs = next(iter(generate_module.TRACES[model].programs.values()))
    assert {heads for heads, _, _ in progs.layout} == {1}


def test_mixtral_in_float32():
    """Case 11: a float32 mixture of experts failed inside the trace, "Expected inputs of BF16
    type": torch's fake (meta) kernel of grouped_mm accepts bfloat16 only, though its CPU
    kernel runs float32. The trace takes transformers' own torch.compile path for non-bfloat16
    experts (`traceable_experts`)."""
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2, **COMMON)
    check(transformers.MixtralForCausalLM(cfg).eval(), prompt())


def phi3_longrope(original: int) -> torch.nn.Module:
    torch.manual_seed(0)
    half = 4  # head_dim 8
    rope = dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * half,
        long_factor=[1.0 + 3 * i for i in range(half)], original_max_position_embeddings=original,
    )  # fmt: skip
    cfg = transformers.Phi3Config(
        **SIZES, original_max_position_embeddings=original, rope_parameters=rope, **COMMON,
        initializer_range=0.3,
    )  # fmt: skip
    return transformers.Phi3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("prompt_len", [5, 9])  # the switch after the prompt; the prompt past it
def test_phi3_longrope_past_the_original_length_equals_generate(prompt_len):
    """Case 9: past original_max_position_embeddings transformers switches to the long factor
    and feeds the whole sequence again; fpipe kept the short factor (every row differed from
    there). NOTE [a refill]: left-padded prompts, 2 stages, the switch at step 4 (5 + 4 = 8 + 1)."""
    model = phi3_longrope(original=8)
    ids = torch.randint(1, VOCAB, (2, prompt_len), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    out = fpipe.generate(model, ids, attention_mask=mask, max_new_tokens=8, stages=2)
    assert torch.equal(out, expected), (out, expected)
    with pytest.raises(
        ValueError,
        match=r"fpipe.generate\(Phi3ForCausalLM.*rope_type='longrope' switches .* "
        r"original_max_position_embeddings=8 .*each microbatch would switch at its own step.*"
        r"Pass microbatches=1, or prompts of one length",
    ):
        fpipe.generate(model, ids, attention_mask=mask, max_new_tokens=8, stages=2, microbatches=2)


def test_a_rope_recomputed_from_the_length_in_python_is_refused():
    """ "dynamic" rope: a raw DataDependentOutputException from inside the trace."""
    torch.manual_seed(0)
    rope = dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)
    cfg = transformers.LlamaConfig(**SIZES, rope_parameters=rope, **COMMON)
    with pytest.raises(
        ValueError, match=r"rope_type='dynamic' computes its frequencies .* Use model.generate"
    ):
        fpipe.generate(transformers.LlamaForCausalLM(cfg).eval(), prompt(), max_new_tokens=2)
