"""`fpipe.generate`'s settings (NOTE [generation settings]): what the model's generation_config
and the call ask is applied as transformers applies it, or refused by name; an allowlist over
every attribute transformers' `GenerationConfig` defines. GPT-2, 2 blocks, a few tokens."""

from __future__ import annotations

import pytest
import torch

import fpipe

transformers = pytest.importorskip("transformers")

from fpipe._src.generate.generate_settings import APPLIED, INERT, REFUSED, SAMPLING_ONLY  # noqa: E402

VOCAB, NEW = 64, 4


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=VOCAB, bos_token_id=None,
        eos_token_id=None, pad_token_id=0, initializer_range=0.3,
    )  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield transformers.GPT2LMHeadModel(cfg).to(torch.float64).eval()
    torch.set_num_threads(threads)


@pytest.fixture
def gc(model):
    """The model's generation_config, restored after the test."""
    saved = model.generation_config
    model.generation_config = transformers.GenerationConfig(**saved.to_dict())
    yield model.generation_config
    model.generation_config = saved


IDS = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))


def ours(model, **kw) -> torch.Tensor:
    return fpipe.generate(model, IDS, max_new_tokens=NEW, stages=2, **kw)


def theirs(model, **kw) -> torch.Tensor:
    return model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=NEW, **kw)


def test_every_generation_config_setting_is_classified():
    """Fails when transformers adds a setting: classify it (applied, inert, refused)."""
    known = {n for n in vars(transformers.GenerationConfig()) if not n.startswith("_")}
    classes = [APPLIED, INERT, REFUSED, SAMPLING_ONLY]
    assert known == set().union(*classes), (known - set().union(*classes), set().union(*classes) - known)
    assert sum(map(len, classes)) == len(known)  # disjoint


def test_exponential_decay_length_penalty_is_refused(model, gc):
    """Case 10: model.generate stopped after 5 new tokens, fpipe returned 10."""
    gc.eos_token_id = int(theirs(model, do_sample=False)[0, -1])
    plain = theirs(model)
    gc.exponential_decay_length_penalty = (1, 3.0)
    penalised = theirs(model)
    assert penalised.shape != plain.shape or not torch.equal(penalised, plain)  # it changes the tokens
    with pytest.raises(
        ValueError,
        match=r"fpipe.generate\(GPT2LMHeadModel.*generation_config sets exponential_decay_length_penalty="
        r"\(1, 3.0\), which changes the tokens .* Set model.generation_config.exponential_decay_length_penalty = None",
    ):
        ours(model)


REFUSED_VALUES = {
    "repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "min_new_tokens": 2, "suppress_tokens": [5],
    "num_beams": 2, "max_time": 5.0, "sequence_bias": {(5,): 1.0}, "remove_invalid_values": True,
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_a_setting_fpipe_does_not_apply_is_refused_by_name(model, gc, name):
    setattr(gc, name, REFUSED_VALUES[name])
    with pytest.raises(
        ValueError, match=rf"generation_config sets {name}=.*model.generation_config.{name} ="
    ):
        ours(model)


def test_inert_and_greedy_ignored_settings_pass(model, gc):
    """Settings that do not change the tokens, and sampling-only ones under greedy decoding,
    give model.generate's tokens."""
    gc.output_scores, gc.renormalize_logits, gc.min_p, gc.typical_p = True, True, 0.2, 0.5
    assert torch.equal(ours(model), theirs(model, do_sample=False))
    with pytest.raises(ValueError, match=r"sets min_p=0.2, typical_p=0.5"):
        ours(model, do_sample=True, seed=0)


def test_the_generation_configs_sampling_settings_apply(model, gc):
    """do_sample/temperature/top_k from the generation_config, as model.generate reads them
    (they were ignored: greedy tokens)."""
    gc.do_sample, gc.temperature, gc.top_k = True, 0.7, 10
    got = ours(model, seed=5)
    assert torch.equal(got, ours(model, do_sample=True, temperature=0.7, top_k=10, seed=5))
    assert not torch.equal(got, ours(model, do_sample=False))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(top_k=-1), r"`top_k` has to be a strictly positive integer, but is -1"),
        (
            dict(temperature=0.0),
            r"`temperature` \(=0.0\) has to be a strictly positive float.*do_sample=False",
        ),
        (dict(temperature=-1.0), r"`temperature` \(=-1.0\) has to be a strictly positive float"),
        (dict(top_p=1.5), r"`top_p` has to be a float > 0 and < 1, but is 1.5"),
    ],
)
def test_sampling_arguments_are_checked_as_transformers_does(model, kw, message):
    """Case 12: raw IndexError / RuntimeError / multinomial errors, or silently run."""
    with pytest.raises(
        ValueError, match=r"fpipe.generate\(GPT2LMHeadModel.*do_sample=True with .*" + message
    ):
        ours(model, do_sample=True, seed=0, **kw)


def test_top_k_zero_disables_top_k_as_in_transformers(model):
    """Case 12: top_k=0 raised IndexError; transformers reads it as no top-k filtering."""
    assert torch.equal(
        ours(model, do_sample=True, top_k=0, seed=3), ours(model, do_sample=True, top_k=VOCAB, seed=3)
    )
