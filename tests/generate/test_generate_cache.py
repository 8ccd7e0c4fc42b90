"""`fpipe.generate`: pipelined generation with a K/V cache per stage equals `model.generate`.

GPT-2, Llama and Qwen2 (4 decoder blocks, hidden 32, fp64), left-padded prompts of lengths 6, 4,
5, 6, two microbatches in flight: on 1, 2 and 4 stages in one process, and on 2 and 4 gloo
ranks (`tests/support/generate_worker.py` runs every case in one 4-rank torchrun launch, shared with two
other modules). Greedy tokens equal the unsplit `model.generate(..., do_sample=False)`, with EOS per
sequence too; seeded sampling gives the same tokens at every stage count and on every rank
count; each stage's program reads and writes only its own layers' K/V buffers, in place, and
each rank allocates and runs only its stage's share; the streamer sees the prompt, each step's
tokens, then `end`; prefill and decode are traced once each.
"""

from __future__ import annotations

import json

import pytest
import torch

import fpipe

transformers = pytest.importorskip("transformers")

from generate_worker import (  # noqa: E402  (after the importorskip)
    FAILING_RANK,
    FAMILIES,
    FIT_LAYERS,
    FIT_LIMIT,
    LAYERS,
    MICROBATCHES,
    NEW,
    PROMPT,
    SAMPLING,
    Recorder,
    build,
    eos_of,
    fit_model,
    prompt,
    reference,
)

import fpipe._src.generate.generate as generate_module  # noqa: E402
from fpipe._src.generate.decode import DATA  # noqa: E402

STAGES = [1, 2, 4]
_MODELS: dict[str, torch.nn.Module] = {}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def model_of(name: str) -> torch.nn.Module:
    """One model per family for the module: its traced programs are reused across tests."""
    if name not in _MODELS:
        _MODELS[name] = build(name)
    return _MODELS[name]


def run(name: str, stages: int, **kw) -> torch.Tensor:
    ids, mask = prompt()
    return fpipe.generate(
        model_of(name),
        ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        microbatches=MICROBATCHES,
        stages=stages,
        **kw,
    )


@pytest.mark.parametrize("stages", STAGES)
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_equals_generate_with_left_padding(name, stages):
    ids, mask = prompt()
    expected = reference(model_of(name), ids, mask)
    out = run(name, stages)
    assert torch.equal(out, expected), (out, expected)
    assert (mask == 0).any() and len(set(expected[:, PROMPT:].flatten().tolist())) > 3
    programs = generate_module.TRACES[model_of(name)].programs
    traced = [k for k in programs if k[1] == stages]
    assert len(traced) == 2  # one prefill and one decode program serve all 8 steps
    assert {programs[k].staged.n_stages for k in traced} == {stages}


@pytest.mark.parametrize("name", FAMILIES)
def test_eos_per_sequence_equals_generate(name):
    ids, mask = prompt()
    eos = eos_of(reference(model_of(name), ids, mask))
    expected = reference(model_of(name), ids, mask, eos_token_id=eos)
    out = run(name, 2, eos_token_id=eos)
    assert torch.equal(out, expected), (out, expected)
    ended = (expected[0, PROMPT + 3 :] == 0).all()  # row 0 ended at its third token: pads after
    assert ended and expected[0, PROMPT + 2] == eos


def test_generation_stops_when_every_sequence_ended():
    """With an EOS every row emits, the output is as short as model.generate's (not max_new_tokens)."""
    name = "llama"
    ids, mask = prompt()
    plain = reference(model_of(name), ids, mask)
    eos = [int(t) for t in plain[:, PROMPT]]  # every row's first token ends it
    expected = reference(model_of(name), ids, mask, eos_token_id=eos)
    out = run(name, 2, eos_token_id=eos)
    assert torch.equal(out, expected) and out.shape[1] == PROMPT + 1


@pytest.mark.parametrize("name", FAMILIES)
def test_sampling_is_reproducible_by_seed_at_any_stage_count(name):
    outs = [run(name, stages, **SAMPLING) for stages in STAGES]
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), outs
    greedy = reference(model_of(name), *prompt())
    assert not torch.equal(outs[0], greedy)  # it did sample
    other = run(name, 2, **{**SAMPLING, "seed": 8})
    assert not torch.equal(other, outs[0])


def test_sampling_does_not_depend_on_microbatches():
    ids, mask = prompt()
    kw = dict(attention_mask=mask, max_new_tokens=NEW, stages=2, **SAMPLING)
    one = fpipe.generate(model_of("gpt2"), ids, microbatches=1, **kw)
    assert torch.equal(one, run("gpt2", 2, **SAMPLING))


def test_streamer_gets_the_prompt_each_step_then_end():
    rec = Recorder()
    out = run("gpt2", 2, streamer=rec)
    ids, _ = prompt()
    assert rec.calls[0] == ids.tolist() and rec.calls[-1] == "end"
    steps = rec.calls[1:-1]
    assert len(steps) == NEW
    assert torch.equal(torch.tensor(steps).T, out[:, PROMPT:])


@pytest.mark.parametrize("name", FAMILIES)
def test_each_stage_owns_its_layers_cache_written_in_place(name):
    run(name, 4)
    programs = generate_module.TRACES[model_of(name)].programs
    for key, progs in programs.items():
        if key[1] != 4:
            continue
        kv = {n: k for k, n in progs.names.items() if k not in DATA}
        for stage in range(4):
            assert progs.layers_of(stage) == [stage]  # 4 blocks, 4 stages
            prog = progs.program(stage)
            writes = [n for n in prog.gm.graph.nodes if n.target is torch.ops.aten.index_copy_.default]
            assert sorted(kv[str(w.args[0])] for w in writes) == [f"k{stage}", f"v{stage}"]
            assert not set(prog.outputs) & set(kv)  # a cache buffer never leaves its stage
            assert not any(n.target is torch.ops.aten.index_copy.default for n in prog.gm.graph.nodes)


def test_a_captured_counter_written_in_place_is_refused():
    """NOTE [writes into captured tensors]: the trace applied the counter's add_ at trace time
    and the program again at every call (returned 18 where eager gives 9), without an error."""
    counter = torch.tensor(0)

    def f(w, x):
        pos = torch.arange(x.shape[1]) + counter
        counter.add_(x.shape[1])
        return (x @ w).sum() + pos.sum()

    w, x = torch.eye(3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=r"writes in place into a 0-dim cpu torch.int64 tensor \(a counter\?\)"
    ):
        fpipe.pipeline(f, microbatches=1)(w, x)


def test_a_closed_over_static_cache_is_refused():
    """The experiment docs/MODELS.md described: transformers' StaticCache closed over by a
    decode step gave wrong tokens silently (its length is a captured 0-dim tensor)."""
    cfg = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()  # one block: the refusal comes after the trace
    fn, params = fpipe.functionalize(model)
    ids, _ = prompt()
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)  # prefill in eager

    def step(params, token):
        return fn(params, input_ids=token, cache=cache, use_cache=True).logits[:, -1]

    with pytest.raises(ValueError, match="writes in place into a 0-dim cpu torch.int64 tensor"):
        fpipe.pipeline(step, microbatches=1)(params, ids[:, -1:])


def test_refusals_name_what_is_unsupported():
    ids, mask = prompt()
    model = model_of("gpt2")
    with pytest.raises(ValueError, match="batch size 4 is not divisible by microbatches=3"):
        fpipe.generate(model, ids, max_new_tokens=2, microbatches=3)
    with pytest.raises(ValueError, match="a stage needs at least one, so pass stages <= 4"):
        fpipe.generate(model, ids, max_new_tokens=2, stages=5)
    model.train()
    try:
        with pytest.raises(ValueError, match=r"training mode .* call model.eval\(\) first"):
            fpipe.generate(model, ids, max_new_tokens=2)
    finally:
        model.eval()
    cfg = transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, sliding_window=4, layer_types=["sliding_attention"] * 2,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"\['sliding_attention'\] layers; .* full-attention layers only"):
        fpipe.generate(transformers.MistralForCausalLM(cfg).eval(), ids, max_new_tokens=2)


# -- on 2 and 4 gloo ranks -------------------------------------------------------------------------
WORLD = 4


@pytest.fixture(scope="module")
def on_ranks(four_ranks) -> list[dict]:
    """The worker's per-rank results: the last part of the one 4-rank torchrun launch (pp=4 over
    all of them; pp=2 as two pipelines on a (dp=2, pp=2) mesh) that this module shares with
    two others (the `four_ranks` fixture of tests/conftest.py)."""
    folder = four_ranks.folder["generate"]
    return [
        {**rec, "fail": json.loads((folder / f"fail{r}.json").read_text())}
        for r, rec in enumerate(four_ranks("generate"))
    ]


def test_a_failing_rank_stops_every_rank_naming_it(on_ranks):
    """NOTE [failures never hang]: rank 2's stage raises at step 2; it reports where, and every
    other rank stops within seconds naming rank 2 (the default timeout is 300 s)."""
    for rank, res in enumerate(on_ranks):
        err, where = res["fail"]["error"], f"rank {rank}: {res['fail']}"
        assert err is not None and res["fail"]["seconds"] < 60, where
        assert "rank 2 failed at step 2 (stage 2, microbatch 0): RuntimeError: injected failure" in err, where
        if rank == FAILING_RANK:
            assert err.startswith("RuntimeError: fpipe rank 2 failed"), where
        else:
            assert err.startswith(f"PeerFailure: fpipe rank {rank}: stopping while at step"), where


def test_longrope_on_ranks_is_refused(on_ranks):
    """Phi-3's long rope on 4 ranks stalled (a stage's receive never completed; the cause is
    not found): refused by name on every rank, before any collective."""
    for rank in range(WORLD):
        err = on_ranks[rank]["phi3_on_ranks"]
        assert "rope_type='longrope' rewrites its rotary inv_freq buffer" in err, err
        assert "not supported on ranks. Run it in one process" in err, err


def test_prompts_that_differ_in_value_across_ranks_are_refused_naming_values(on_ranks):
    """Case 13: the refusal blamed "shapes, dtypes or structure" for a one-token difference."""
    for rank in range(WORLD):
        err = on_ranks[rank]["values_differ"]
        assert (
            "the values of input_ids (the prompts' tokens) differ between ranks [1] and ranks [0, 2, 3]"
            in err
        )
        assert err.endswith("pass the same prompts and generation arguments on every rank."), err


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("pp", [2, 4])
def test_on_ranks_equals_generate_and_each_rank_does_its_share(on_ranks, pp, name):
    sampled_here = run(name, 1, **SAMPLING).tolist()
    ids, mask = prompt()
    expected = reference(model_of(name), ids, mask)
    eos_expected = reference(model_of(name), ids, mask, eos_token_id=eos_of(expected)).tolist()
    cfg = model_of(name).config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_layer = 2 * (4 // MICROBATCHES) * kv_heads * (PROMPT + NEW) * head_dim * 8  # K and V, fp64
    whole = LAYERS * MICROBATCHES * per_layer
    for first in range(0, WORLD, pp):  # each pipeline: ranks first .. first + pp - 1
        ops = []
        for stage in range(pp):
            rank = first + stage
            case, where = on_ranks[rank][f"{name}-pp{pp}"], f"{name}, pp={pp}, rank {rank}"
            assert case["greedy"] == expected.tolist(), where
            assert case["eos"] == eos_expected and eos_expected != expected.tolist(), where
            assert case["sampled"] == sampled_here, where  # the one-process draws, on every rank
            assert case["stages"] == {str(stage): 2 * NEW}, where  # its stage only, every (step, mb)
            per = LAYERS // pp
            assert case["layers"] == list(range(stage * per, (stage + 1) * per)), where
            assert case["cache_bytes"] == whole // pp, where  # its layers' share of the cache
            ops.append(case["ops"])
        assert all(0 < o < 0.75 * sum(ops) for o in ops), (name, pp, ops)
        head = on_ranks[first][f"{name}-pp{pp}"]
        streamed = head["streamer"]
        assert streamed[-1] == "end" and len(streamed) == NEW + 2
        for rank in range(first + 1, first + pp):  # case 13: only the head's streamer is called
            assert on_ranks[rank][f"{name}-pp{pp}"]["streamer"] == [], (name, pp, rank)
        assert torch.equal(torch.tensor(streamed[1:-1]).T, torch.tensor(head["greedy"])[:, PROMPT:])


# -- issue 28: stage-local weights, several stages per rank, early stop on ranks -------------------
def _layers_of(names: list[str]) -> set[int]:
    return {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}


def test_stage_local_weights_fit_a_model_bigger_than_a_ranks_limit(on_ranks):
    """The fit test: a meta Llama (4 blocks, tied embeddings, 283 MB in fp64) generates from a
    save_pretrained folder on two 2-rank pipelines (the (dp=2, pp=2) mesh) with the tokens of
    the unsplit model.generate; each rank materialises only its stage's blocks (and the tied
    embedding where the first or last stage is, the final norm on the last), and its peak
    resident growth over the whole call (VmHWM after, less VmRSS before: traces, weights, cache,
    activations) stays under 60 % of the model's bytes."""
    model = fit_model(meta=False)
    whole = sum(p.nbytes for p in model.parameters())  # each tensor once (tied: one)
    ids, mask = prompt()
    expected = reference(model, ids, mask).tolist()
    per_rank = FIT_LAYERS // 2
    for rank in range(WORLD):
        fit, stage = on_ranks[rank]["stage_local"]["fit"], rank % 2
        assert fit["tokens"] == expected, rank
        assert _layers_of(fit["real"]) == set(range(stage * per_rank, (stage + 1) * per_rank)), rank
        ends = {"model.embed_tokens.weight"} | ({"model.norm.weight"} if stage else set())
        assert {n for n in fit["real"] if not n.startswith("model.layers.")} == ends, rank
        mine = sum(p.nbytes for n, p in model.named_parameters() if n in fit["real"])
        assert mine <= fit["resident"][1] <= mine + 1024, (rank, fit["resident"], mine)  # + inv_freq
        assert fit["growth"] < FIT_LIMIT * whole, (rank, fit["growth"], whole)
    assert len(set(expected[0][PROMPT:])) > 2  # not a constant continuation


def test_several_stages_per_rank_equal_generate(on_ranks):
    """stages=4 on 2 ranks (from a save_pretrained folder): stage s on rank s mod 2, so each
    rank holds blocks {r, r + 2} of the small Llama, runs both of its stages at every (step,
    microbatch), and the tokens equal model.generate's."""
    ids, mask = prompt()
    expected = reference(model_of("llama"), ids, mask).tolist()
    for rank in range(WORLD):
        case, stage = on_ranks[rank]["stage_local"]["llama"], rank % 2
        assert case["tokens"] == expected, rank
        assert _layers_of(case["real"]) == {stage, stage + 2}, rank
        assert case["runs"] == {str(stage): 2 * NEW, str(stage + 2): 2 * NEW}, rank


@pytest.mark.parametrize("pp", [2, 4])
def test_ranks_stop_when_every_sequence_ended(on_ranks, pp):
    """Every row's first token is an EOS: model.generate stops after one token, and so does
    every rank -- each stage runs the prefill of each microbatch and nothing after (16 runs
    per stage without the stop); the stop rides on the values stage 0 sends on."""
    ids, mask = prompt()
    for rank in range(WORLD):
        case = on_ranks[rank][f"stop-pp{pp}"]
        expected = reference(model_of("llama"), ids, mask, eos_token_id=case["eos"])
        assert case["tokens"] == expected.tolist() and expected.shape[1] == PROMPT + 1, rank
        assert case["runs"] == {str(rank % pp): MICROBATCHES}, (rank, case["runs"])


def test_stage_counts_on_ranks_are_checked(on_ranks):
    for rank in range(WORLD):
        err = on_ranks[rank]["stage_counts"]
        assert "stages=3 is not a multiple of the pipeline's 2 ranks; pass stages=None" in err, err
