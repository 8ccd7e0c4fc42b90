"""`fpipe.generate`'s refusals: what the cached pipeline cannot do the model's way is an error
that names it and the fix, raised before anything is traced or sent."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import PPGroup

__all__ = ["check_call", "eos_and_pad", "stage_count"]


def check_call(
    model: nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    new: int,
    microbatches: int,
    stages: int | None,
    pg: PPGroup | None,
) -> str:
    """Refuse what `generate` cannot honour; return the call as errors quote it."""
    call = f"fpipe.generate({type(model).__name__}, microbatches={microbatches}, stages={stages})"
    _check_model(call, model)
    if ids.dim() != 2 or ids.dtype != torch.long:
        raise ValueError(
            f"{call}: input_ids must be a [batch, prompt] long tensor, not {ids.dtype} of shape {tuple(ids.shape)}."
        )
    if mask is not None and mask.shape != ids.shape:
        raise ValueError(
            f"{call}: attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}; pass one of the same shape."
        )
    if not isinstance(new, int) or new < 1:
        raise ValueError(f"{call}: max_new_tokens={new!r} must be a positive int.")
    if ids.shape[0] % microbatches:
        raise ValueError(
            f"{call}: batch size {ids.shape[0]} is not divisible by microbatches={microbatches}; "
            f"use a batch that is a multiple of {microbatches}, or a microbatch count that divides it."
        )
    _check_rope(call, model, ids, mask, new, microbatches, pg)
    return call


# rotary embeddings whose frequencies do not depend on the positions of the call
_STATIC_ROPE = {"default", "linear", "yarn", "llama3", "proportional"}
# the transformers modules whose prepare_inputs_for_generation refills the cache (NOTE [a refill])
_REFILLING = {"transformers.models.phi3.modeling_phi3", "transformers.models.phimoe.modeling_phimoe"}


def refill_step(model: nn.Module, prompt: int, new: int) -> int | None:
    """The step at which transformers feeds the whole sequence again, if it does.

    # NOTE [a refill]
    Phi-3's `longrope` uses the short factor while the sequence fits
    `original_max_position_embeddings` (L) and the long one past it (decided per forward from
    the largest position id). Keys cached with the short factor would be wrong past L, so
    transformers' Phi-3 (and PhiMoE) `prepare_inputs_for_generation` drops the cache at the
    step where the sequence reaches L + 1 tokens (prompt + step = L + 1) and feeds the whole
    sequence, prompt and every token so far, from position 0. fpipe does the same at that step
    (`Feed.refill`): a program traced for that length rewrites every K/V buffer from position 0.
    """
    where = getattr(getattr(type(model), "prepare_inputs_for_generation", None), "__module__", None)
    limit = getattr(model.config, "original_max_position_embeddings", None)
    if where not in _REFILLING or limit is None:
        return None
    step = limit + 1 - prompt
    return step if 1 <= step < new else None


def _check_rope(
    call: str,
    model: nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    new: int,
    microbatches: int,
    pg: PPGroup | None,
) -> None:
    """A rope whose frequencies depend on the sequence: "longrope" decides per forward from the
    largest position id of the rows it sees, so microbatches of left-padded prompts would decide
    apart from the batch (refused); "dynamic" recomputes them in Python, which a trace cannot
    follow (refused)."""
    cfg: Any = model.config
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    per_type = params.values() if all(isinstance(v, dict) for v in params.values()) and params else [params]
    for rope in per_type:
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind in _STATIC_ROPE:
            continue
        limit = rope.get("original_max_position_embeddings") or getattr(
            cfg, "original_max_position_embeddings", None
        )
        if kind == "longrope" and pg is not None:
            raise ValueError(
                f"{call}: the model's rope_type='longrope' rewrites its rotary inv_freq buffer in "
                "place at every step; under torchrun such a generation stalled in testing (a "
                "stage's receive never completed), so it is not supported on ranks. Run it in "
                "one process (stages=N), or use model.generate."
            )
        length = ids.shape[1] + new
        padded = mask is not None and bool((mask == 0).any())
        if kind == "longrope" and (limit is None or length <= limit or microbatches == 1 or not padded):
            continue
        if kind == "longrope":
            raise ValueError(
                f"{call}: the model's rope_type='longrope' switches from the short to the long "
                f"factor where the largest position of the rows in one forward passes "
                f"original_max_position_embeddings={limit} (prompt + max_new_tokens = {length}); "
                "with left-padded prompts each microbatch would switch at its own step, not the "
                "batch's. Pass microbatches=1, or prompts of one length."
            )
        raise ValueError(
            f"{call}: the model's rope_type={kind!r} computes its frequencies from the sequence "
            "length at every step, which fpipe.generate's traced step cannot follow (it supports "
            f"{sorted(_STATIC_ROPE)} and 'longrope'). Use model.generate for this model."
        )


def _check_model(call: str, model: nn.Module) -> None:
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "generation_config"):
        raise TypeError(
            f"{call}: the model must be a transformers causal LM (a PreTrainedModel with a generation_config)."
        )
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError(
            f"{call}: encoder-decoder models are not supported (only decoder-only causal LMs); use model.generate."
        )
    layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(
            f"{call}: the model has {sorted(layer_types - {'full_attention'})} layers; fpipe.generate's "
            "cache holds full-attention layers only (no sliding-window or linear-attention cache). "
            "Use model.generate for this model."
        )
    if model.training:
        raise ValueError(
            f"{call}: the model is in training mode (dropout would be active); call model.eval() first."
        )


def stage_count(call: str, model: nn.Module, stages: int | None, pg: PPGroup | None) -> int:
    """One process: `stages` (default 1). A process group: `stages` a multiple of the ranks
    (default one per rank), stage s on rank s mod ranks (NOTE [several stages per rank])."""
    if pg is None:
        return 1 if stages is None else stages
    if stages is None or stages == pg.size:
        return pg.size
    if stages % pg.size:
        raise ValueError(
            f"{call}: under torchrun each rank runs the same number of stages, but stages={stages} "
            f"is not a multiple of the pipeline's {pg.size} ranks; pass stages=None (one per rank) "
            f"or a multiple of {pg.size}."
        )
    backend = dist.get_backend(pg.group)
    if backend != "gloo":
        raise ValueError(
            f"{call}: several stages per rank (stages={stages} on {pg.size} ranks) keeps each pair "
            f"of stages on a channel of its own, a tag, which the {backend!r} backend does not "
            "match by; pass stages=None (one per rank), or use gloo."
        )
    return stages


def eos_and_pad(model: nn.Module, eos_token_id: Any) -> tuple[list[int], int | None]:
    """The EOS ids (the argument, else the generation_config's) and the pad token a finished
    sequence gets (generation_config.pad_token_id, else the first EOS id, as transformers does)."""
    gc: Any = model.generation_config
    eos = gc.eos_token_id if eos_token_id is None else eos_token_id
    ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    pad = gc.pad_token_id if gc.pad_token_id is not None else (ids[0] if ids else None)
    return ids, pad
