"""`fpipe.generate`'s settings: the call's arguments over the model's `generation_config`, as
transformers resolves them, checked against what fpipe applies.

# NOTE [generation settings]
`model.generate` reads every `GenerationConfig` attribute; `fpipe.generate` applies a few. The
check is an allowlist over the attributes transformers defines (`vars(GenerationConfig())`):
those fpipe applies (`APPLIED`: the decoding rule, the length, EOS and padding) and those that
cannot change the tokens it returns (`INERT`: what else `generate` returns, the cache and
compilation, speculative-decoding knobs that act only with an assistant model, settings of
modes refused elsewhere) pass; any other attribute set to a value other than transformers'
default (`None`, or `GenerationConfig._get_default_generation_params()`) is refused by name,
whether listed in `REFUSED` or new in a later transformers (tests/generate/test_generate_settings.py
fails until it is classified). Attributes that act only when sampling (`SAMPLING_ONLY`) are
refused only when the call samples. A call's `do_sample`, `temperature`, `top_k`, `top_p` left at
None take the generation_config's value, else transformers' default (so `top_k` is 50 when
sampling, as in `model.generate`), and are checked by transformers' own logits warpers, built
under transformers' conditions (`top_k=0` disables top-k); fpipe then applies those warpers.
One stricter rule: `top_p` outside [0, 1] is refused (transformers skips its warper for any
`top_p >= 1`, so 1.5 would run silently).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .generate_sample import Sampling

__all__ = ["APPLIED", "INERT", "REFUSED", "SAMPLING_ONLY", "resolve"]

APPLIED = frozenset(
    {"do_sample", "temperature", "top_k", "top_p", "max_new_tokens", "eos_token_id", "pad_token_id"}
)
INERT = frozenset(
    {
        # returned alongside the tokens, or metadata
        "output_attentions", "output_hidden_states", "output_scores", "output_logits",
        "return_dict_in_generate", "transformers_version",
        # the cache and how the step runs (fpipe's own cache; the same tokens)
        "use_cache", "cache_implementation", "cache_config", "max_cache_len", "compile_config",
        "disable_compile", "prefill_chunk_size", "low_memory", "continuous_batching_config",
        # act only with an assistant model or prompt lookup, which fpipe.generate never runs
        "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
        "assistant_lookbehind", "target_lookbehind", "max_matching_ngram_size",
        "assistant_ensemble_weight",
        # only without a prompt, or encoder-decoder (refused), or beam search (refused)
        "bos_token_id", "decoder_start_token_id", "early_stopping", "length_penalty",
        # max_new_tokens (required) overrides it, as in transformers
        "max_length",
        # a log-softmax after the warpers: neither the argmax nor the distribution changes
        "renormalize_logits",
    }
)  # fmt: skip
SAMPLING_ONLY = frozenset({"min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff"})
REFUSED = frozenset(
    {
        "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens",
        "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens",
        "sequence_bias", "exponential_decay_length_penalty", "remove_invalid_values",
        "watermarking_config", "guidance_scale", "num_beams", "num_beam_groups",
        "diversity_penalty", "constraints", "force_words_ids", "penalty_alpha", "dola_layers",
        "num_return_sequences", "token_healing", "stop_strings", "max_time", "is_assistant",
        "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp", "speculation_type",
    }
)  # fmt: skip

Warp = Callable[[torch.Tensor], torch.Tensor]


def resolve(
    call: str, model: nn.Module, do_sample: Any, temperature: Any, top_k: Any, top_p: Any
) -> tuple[Sampling, Warp]:
    """The decoding rule (the arguments over the model's generation_config, as transformers
    resolves them) and the logits warpers that apply it; refuses every setting that changes
    the tokens and that fpipe does not apply (NOTE [generation settings])."""
    from transformers import GenerationConfig

    gc = copy.deepcopy(model.generation_config)
    asked = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
    for name, given in asked.items():
        if given is not None:
            setattr(gc, name, given)
    defaults = GenerationConfig._get_default_generation_params()

    def value(name: str) -> Any:
        got = getattr(gc, name, None)
        return defaults.get(name) if got is None else got

    rule = Sampling(bool(value("do_sample")), value("temperature"), value("top_k"), value("top_p"))
    _refuse_unapplied(call, gc, defaults, rule.do_sample)
    return rule, _warpers(call, rule)


def _refuse_unapplied(call: str, gc: Any, defaults: dict[str, Any], sampling: bool) -> None:
    from transformers import GenerationConfig

    known = [n for n in vars(GenerationConfig()) if not n.startswith("_")]
    passing = APPLIED | INERT | (frozenset() if sampling else SAMPLING_ONLY)
    unapplied = {
        n: getattr(gc, n, None)
        for n in known
        if n not in passing and getattr(gc, n, None) not in (None, defaults.get(n))
    }
    if unapplied:
        shown = ", ".join(f"{n}={v!r}" for n, v in unapplied.items())
        fix = "; ".join(f"model.generation_config.{n} = {defaults.get(n)!r}" for n in unapplied)
        raise ValueError(
            f"{call}: the model's generation_config sets {shown}, which changes the tokens "
            "model.generate returns and which fpipe.generate does not apply (it applies "
            f"{sorted(APPLIED)}). Set {fix} to generate without it, or use model.generate."
        )


def _warpers(call: str, rule: Sampling) -> Warp:
    """transformers' temperature, top-k and top-p warpers, built as `model.generate` builds
    them (each checks its argument), in its order."""
    if not rule.do_sample:
        return lambda scores: scores
    from transformers.generation import logits_process as lp

    try:
        built: list[Any] = []
        if rule.temperature is not None and rule.temperature != 1.0:
            built.append(lp.TemperatureLogitsWarper(rule.temperature))
        if rule.top_k is not None and rule.top_k != 0:
            built.append(lp.TopKLogitsWarper(top_k=rule.top_k, min_tokens_to_keep=1))
        if rule.top_p is not None:
            top_p = lp.TopPLogitsWarper(top_p=rule.top_p, min_tokens_to_keep=1)  # checks [0, 1]
            built += [top_p] if rule.top_p < 1.0 else []
    except ValueError as err:
        raise ValueError(
            f"{call}: do_sample=True with temperature={rule.temperature!r}, top_k={rule.top_k!r}, "
            f"top_p={rule.top_p!r}: {err} (transformers' check of the sampling arguments)"
        ) from None

    def warp(scores: torch.Tensor) -> torch.Tensor:
        for w in built:
            scores = w(None, scores)
        return scores

    return warp
