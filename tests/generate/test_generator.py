"""`fpipe.Generator`: a request loop (continuous batching) whose tokens equal `model.generate`'s.

A tiny Llama (4 decoder blocks, hidden 32, fp64). A mixed stream (`generate_worker.STREAM`:
prompts of 3 to 12 tokens submitted at different steps, 2 cache slots so later requests join
slots freed by earlier ones, an EOS id that ends requests mid-stream) gives each request the
greedy tokens of `model.generate` run for that request alone: in one process at 1 and 2 stages,
with and without length buckets, and on 2 gloo ranks (the case runs in tests/support/generate_worker.py,
in the shared 4-rank launch). A seeded sampled request draws the same tokens whatever runs
beside it, and as `fpipe.generate(..., seed=)` of it alone; a stream of many prompt lengths is
served by a bounded number of traces; what `fpipe.generate` refuses stays refused.
"""

from __future__ import annotations

import pytest
import torch

import fpipe

transformers = pytest.importorskip("transformers")

from generate_worker import (  # noqa: E402  (after the importorskip)
    NEW,
    SAMPLING,
    STREAM,
    STREAM_LEN,
    STREAM_SLOTS,
    build,
    generator_stream,
    stream_prompts,
)

import fpipe._src.generate.generate as generate_module  # noqa: E402
from fpipe._src.generate.decode_traces import kv_layout  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
_MODEL: list[torch.nn.Module] = []


def llama() -> torch.nn.Module:
    if not _MODEL:
        _MODEL.append(build("llama"))
    return _MODEL[0]


def alone(model: torch.nn.Module, prompt: torch.Tensor, new: int, eos: int | None = None) -> list[int]:
    """The request run alone through the unsplit `model.generate`: its new tokens."""
    ids = prompt[None]
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
        eos_token_id=eos, pad_token_id=0,
    )  # fmt: skip
    return out[0, prompt.numel() :].tolist()


def check_stream(got: dict, model: torch.nn.Module, eos: int | None = None) -> None:
    for i, (prompt, (n, at, new)) in enumerate(zip(stream_prompts(), STREAM)):
        assert got["tokens"][i] == alone(model, prompt, new, eos), f"request {i} ({n} tokens, step {at})"
    assert len(set(got["slots"])) == STREAM_SLOTS  # 6 requests through 2 slots: freed slots reused


@pytest.mark.parametrize(
    "family, stages, buckets",
    [
        ("llama", 1, "default"),
        ("llama", 2, "default"),
        ("llama", 2, None),
        ("gpt2", 2, "default"),
        ("qwen2", 2, "default"),
    ],
)
def test_each_request_of_a_mixed_stream_equals_generate_alone(family, stages, buckets):
    model = llama() if family == "llama" else build(family)
    greedy = generator_stream(model, stages=stages, buckets=buckets)
    check_stream(greedy, model)
    eos = greedy["tokens"][0][2]  # ends request 0 at its third token (or before), mid-stream
    ended = generator_stream(model, eos, stages=stages, buckets=buckets)
    check_stream(ended, model, eos)
    first = greedy["tokens"][0]
    assert ended["tokens"][0] == first[: first.index(eos) + 1] and ended["steps"] < greedy["steps"]


def test_a_handle_streams_its_tokens_as_they_come():
    model = llama()
    gen = fpipe.Generator(model, max_len=STREAM_LEN, max_batch=2, stages=2)
    prompt = stream_prompts()[2]
    other = gen.submit(stream_prompts()[0], max_new_tokens=3)
    handle = gen.submit(prompt, max_new_tokens=5)
    seen = []
    for token in handle:  # each token as its step ends: one step per token
        seen.append((token, gen.steps, len(handle.new_tokens)))
    assert [t for t, _, _ in seen] == alone(model, prompt, 5)
    assert [(s, n) for _, s, n in seen] == [(k, k) for k in range(1, 6)]
    assert other.done and handle.result().tolist() == [*prompt.tolist(), *handle.new_tokens]


def test_a_seeded_request_draws_the_same_tokens_whatever_runs_beside_it():
    """NOTE [draws that do not depend on the pipeline]: one generator per request, seeded as
    `fpipe.generate` seeds row 0 of a batch of one."""
    model = llama()
    prompts = stream_prompts()
    sampling = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=5, max_new_tokens=6)
    first = fpipe.Generator(model, max_len=STREAM_LEN, max_batch=2)
    a = first.submit(prompts[3], **sampling)
    first.run()
    second = fpipe.Generator(model, max_len=STREAM_LEN, max_batch=3, stages=2)
    greedy = second.submit(prompts[0], max_new_tokens=4)
    second.step()
    b = second.submit(prompts[3], **sampling)
    other_seed = second.submit(prompts[3], **{**sampling, "seed": 6})
    second.run()
    assert a.new_tokens == b.new_tokens != other_seed.new_tokens
    assert greedy.new_tokens == alone(model, prompts[0], 4)
    ref = fpipe.generate(model, prompts[3][None], **sampling)
    assert ref[0, prompts[3].numel() :].tolist() == a.new_tokens


def test_many_prompt_lengths_are_served_by_a_bounded_number_of_traces():
    """Prompts of 1..20 tokens: right-padded to the buckets 8, 16, 24 (max_len), three prefill
    programs and one decode program; `buckets=None` traces one prefill per length."""
    model = build("llama")  # a fresh model: its own trace cache
    gen = fpipe.Generator(model, max_len=STREAM_LEN, max_batch=4, stages=2)
    assert gen.buckets == (8, 16, 24)
    prompts = [torch.randint(1, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in range(1, 21)]
    handles = [gen.submit(p, max_new_tokens=2) for p in prompts]
    gen.run()
    for p, h in zip(prompts, handles):
        assert h.new_tokens == alone(model, p, 2)
    assert {(s.rows, s.q) for s in gen.shapes} == {(1, 8), (1, 16), (1, 24), (4, 1)}
    assert len(generate_module.TRACES[model].forwards) == 4  # the one trace cache (NOTE [trace key])


def test_cache_slots_from_a_memory_limit():
    """Slots = limit // the K/V bytes per slot this process holds (every layer's K and V of 2
    heads x 24 positions x 8 dims in fp64; under torchrun: the rank with the most layers')."""
    model = llama()
    per_layer = sum(
        h * STREAM_LEN * d * dt.itemsize for h, d, dt in kv_layout(model, torch.device("cpu"))[:2]
    )
    assert per_layer == 2 * 2 * STREAM_LEN * 8 * 8
    gen = fpipe.Generator(model, max_len=STREAM_LEN, memory_limit=5 * 4 * per_layer + 7, stages=2)
    assert gen.max_batch == 5 and gen.cache.nbytes() == 5 * 4 * per_layer  # one process: both stages' layers
    with pytest.raises(ValueError, match=r"memory_limit=100 bytes holds 0 cache slots of 24576 bytes"):
        fpipe.Generator(model, max_len=STREAM_LEN, memory_limit=100, stages=2)
    with pytest.raises(ValueError, match=r"pass max_batch=N \(cache slots\) or memory_limit=BYTES"):
        fpipe.Generator(model, max_len=STREAM_LEN)


def test_what_generate_refuses_stays_refused():
    model = build("llama")
    gen = fpipe.Generator(model, max_len=STREAM_LEN, max_batch=2)
    prompt = stream_prompts()[0]
    with pytest.raises(ValueError, match=r"need 28 cache positions, more than max_len=24"):
        gen.submit(prompt, max_new_tokens=24)
    with pytest.raises(ValueError, match=r"top_p outside|temperature=-1"):
        gen.submit(prompt, max_new_tokens=2, do_sample=True, temperature=-1.0)
    model.generation_config.repetition_penalty = 1.3
    with pytest.raises(ValueError, match=r"sets repetition_penalty=1.3, which changes the tokens"):
        gen.submit(prompt, max_new_tokens=2)
    with pytest.raises(TypeError, match="num_beams"):
        gen.submit(prompt, max_new_tokens=2, num_beams=2)  # type: ignore[call-arg]
    assert gen.idle and gen.step() is False  # nothing was queued
    bloom = transformers.BloomConfig(n_layer=2, hidden_size=32, n_head=4, vocab_size=64, pad_token_id=0)
    gen = fpipe.Generator(transformers.BloomForCausalLM(bloom).eval(), max_len=STREAM_LEN, max_batch=2)
    gen.submit(prompt, max_new_tokens=2)
    with pytest.raises(
        ValueError, match=r"with every slot at its own position \(NOTE \[slots\]: a prepared 4-D"
    ):
        gen.step()  # ALiBi from the 2-D mask: the trace fails, named
    with pytest.raises(ValueError, match=r"rope_type='longrope' chooses its frequencies per forward"):
        fpipe.Generator(build("phi3"), max_len=STREAM_LEN, max_batch=2)  # slots share one forward
    with torch.device("meta"):
        on_meta = build("llama")
    with pytest.raises(ValueError, match=r"parameters are on the meta device .*generate\(weights=\.\.\.\)"):
        fpipe.Generator(on_meta, max_len=STREAM_LEN, max_batch=2)  # stage-local weights are generate's


# -- on 2 gloo ranks: tests/support/generate_worker.py's `stream_case`, in the shared 4-rank launch ---------


@pytest.fixture(scope="module")
def on_ranks(four_ranks) -> list[dict]:
    """Each rank's `generator` record: the stream on the two 2-rank pipelines of a (dp=2, pp=2)
    mesh (the `four_ranks` fixture of tests/conftest.py)."""
    return [rec["generator"] for rec in four_ranks("generate")]


def test_on_two_ranks_several_stages_per_rank_are_refused_naming_the_fix(on_ranks):
    for res in on_ranks:
        assert "stages=4 on 2 ranks; the Generator runs one stage per rank. Pass stages=2" in res["stages4"]


def test_on_two_ranks_each_request_of_the_stream_equals_generate_alone(on_ranks):
    model = llama()
    for rank, res in enumerate(on_ranks):
        check_stream(res["greedy"], model)
        check_stream(res["eos"], model, res["eos_id"])
        first = res["greedy"]["tokens"][0]
        assert res["eos"]["tokens"][0] == first[: first.index(res["eos_id"]) + 1], rank
        assert res["eos"]["steps"] < res["greedy"]["steps"], rank


def test_on_two_ranks_a_seeded_request_draws_as_generate_alone(on_ranks):
    """Drawn on the last rank, broadcast: every rank holds the tokens of `fpipe.generate(...,
    seed=)` of that prompt alone in one process."""
    model, prompts = llama(), stream_prompts()
    ref = fpipe.generate(model, prompts[3][None], max_new_tokens=NEW, **SAMPLING)
    for res in on_ranks:
        assert res["sampled"] == ref[0, prompts[3].numel() :].tolist()
        assert res["beside"] == alone(model, prompts[0], 4)


def test_a_stream_that_differs_across_ranks_is_refused_naming_the_step(on_ranks):
    """Rank 1 submits another prompt than rank 0: both refuse before any transfer, and the queue
    is left as it was; the other pipeline (ranks 2 and 3) runs."""
    for rank in (0, 1):
        err = on_ranks[rank]["differ"]
        # step 8: the Generator ran the sampled request's 8 steps before
        assert "the requests joining at step 8 (prompts and settings) differ between ranks" in err, err
        assert err.endswith(
            "every rank must submit the same prompts with the same settings in the same order."
        )
    assert on_ranks[2]["differ"] == on_ranks[3]["differ"] == "ran"
