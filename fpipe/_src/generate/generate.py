"""`fpipe.generate`: a transformers causal LM's generation, pipelined, with a K/V cache per stage.

The data path: check the call -> trace the model's step once per shape and cut it at decoder
blocks (decode.py; cached per model) -> allocate this rank's K/V buffers (decode_run.py) -> run
prefill and one decode step per token over microbatches in flight (NOTE [the decode schedule])
-> the tokens (greedy, or drawn as NOTE [draws that do not depend on the pipeline] says) back to
stage 0 and, at the end, to every rank.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..runtime import DEFAULT_TIMEOUT, PPGroup, check_same_values, pp_group
from ..tracing import functionalize as functionalize_
from .decode import Programs, Shapes
from .decode_run import Feed, StageCaches, run_local, run_rank
from .decode_traces import StepTraces
from .generate_check import check_call, eos_and_pad, refill_step, stage_count
from .generate_sample import Sampling, Selector
from .generate_settings import resolve
from .stage_weights import check_weights, load_stage_weights

__all__ = ["generate"]

# traced programs per model and trace key: a later generation of the same key traces nothing
TRACES: weakref.WeakKeyDictionary[nn.Module, StepTraces] = weakref.WeakKeyDictionary()
_GROUPS: dict[Any, PPGroup] = {}  # one PPGroup (and send thread) per process group


def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int,
    microbatches: int = 1,
    stages: int | None = None,
    mesh: Any = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    streamer: Any = None,
    weights: str | os.PathLike[str] | None = None,
) -> torch.Tensor:
    """Generate up to `max_new_tokens` tokens per sequence through a pipeline of the model's
    decoder blocks, each stage keeping the K/V cache of its own layers.

    Greedy decoding (`do_sample=False`) gives the tokens of `model.generate(input_ids,
    attention_mask=..., max_new_tokens=..., do_sample=False)`, with left-padded prompts of
    different lengths and EOS per sequence (a finished sequence gets the pad token; generation
    ends when every sequence has finished). Sampling draws each sequence's tokens from a
    generator seeded by (`seed`, its row), so a seed gives the same tokens at any stage count
    and any number of microbatches.

    Under torchrun each rank runs `stages / ranks` stages (stage s on rank s mod ranks; one per
    rank by default), holds only its layers' K/V buffers, and gets the full sequences; pass the
    same arguments on every rank. With `microbatches=m` the batch is cut into m groups of rows
    that are in flight at once: stage s decodes group i while stage s+1 decodes group i-1. A
    group whose sequences have all ended stops on every rank. A model built on the meta
    device is loaded from `weights`, each rank reading only what its stages read.

    Args:
        model: a transformers causal LM (`...ForCausalLM`) in eval mode, full attention.
        input_ids: `[batch, prompt]` token ids, left-padded where `attention_mask` is 0.
        attention_mask: `[batch, prompt]`, 1 for real tokens (default: all ones).
        max_new_tokens: how many tokens to generate at most.
        microbatches: groups of rows in flight; must divide the batch.
        stages: pipeline stages (one process: default 1; under torchrun: the number of ranks).
        mesh: a DeviceMesh whose "pp" dimension is the pipeline (default: every rank).
        do_sample, temperature, top_k, top_p: the decoding rule, as in transformers: each left
            None takes the model's generation_config value, else transformers' default (top_k
            50 when sampling); checked and applied by transformers' warpers. Any other
            generation_config setting that changes the tokens is refused by name
            (NOTE [generation settings]).
        seed: the sampling seed (default: drawn from torch's global generator).
        eos_token_id: an id or ids that end a sequence (default: the model's generation_config).
        streamer: an object with `put(tokens)` and `end()` (transformers' `TextStreamer`): `put`
            gets the prompt, then each step's new tokens `[batch]`, then `end()` is called. Under
            torchrun only rank 0's streamer is called (rank 0 has each step's tokens first);
            another rank's gets no call at all.
        weights: for a model built on the meta device: a `save_pretrained` folder or an
            `fpipe.save` checkpoint; each rank materialises and reads only the parameters and
            buffers its stages read (NOTE [stage-local weights], docs/GENERATION.md).

    Returns:
        `[batch, prompt + n]` long tensor: the prompts and the n <= max_new_tokens new tokens.

    Example:
        >>> import torch, transformers, fpipe
        >>> cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64)
        >>> model = transformers.GPT2LMHeadModel(cfg).eval()
        >>> ids = torch.randint(0, 64, (2, 5))
        >>> out = fpipe.generate(model, ids, max_new_tokens=4, stages=2)
        >>> torch.equal(out, model.generate(ids, attention_mask=torch.ones_like(ids),
        ...     max_new_tokens=4, do_sample=False, pad_token_id=0))
        True
    """
    pg = group_of(mesh)
    call = check_call(model, input_ids, attention_mask, max_new_tokens, microbatches, stages, pg)
    n_stages = stage_count(call, model, stages, pg)
    path = check_weights(call, model, weights)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(torch.long)
    eos, pad = eos_and_pad(model, eos_token_id)
    rule, warp = resolve(call, model, do_sample, temperature, top_k, top_p)
    rule = dataclasses.replace(rule, seed=seed_of(seed) if rule.do_sample else 0)
    feed = _feed(
        input_ids, mask, max_new_tokens, microbatches, refill_step(model, input_ids.shape[1], max_new_tokens)
    )
    programs = _programs(model, feed, n_stages, input_ids.device)
    mine = list(range(n_stages)) if pg is None else [s for s in range(n_stages) if s % pg.size == pg.rank]
    selector = Selector(rule, warp, input_ids.shape[0], eos, pad)
    progress = _Progress(input_ids, eos, streamer if pg is None or pg.rank == 0 else None)
    with torch.no_grad():
        if pg is not None:
            pg.begin_call()
            _same_on_every_rank(
                call, pg, input_ids, mask, (max_new_tokens, microbatches, eos, pad), rule, seed
            )
        if path is not None:  # NOTE [stage-local weights]: after the checks, before any value moves
            steps = sorted({0, min(1, max_new_tokens - 1), feed.refill or 0})
            _failing_on(pg, "loading its stage weights", lambda: load_stage_weights(
                call, model, [programs(t) for t in steps], mine, path, input_ids.device))  # fmt: skip
        _, params = functionalize_.functionalize(model)
        caches = StageCaches(programs(0), mine, feed)
        progress.start()
        select = _select(selector, feed)
        if pg is None:
            tokens = run_local(programs, params, feed, caches, select, progress.step)
            new = torch.cat([torch.cat(row) for row in tokens], dim=1)
        else:
            tokens = run_rank(
                programs, params, feed, caches, select, pg, DEFAULT_TIMEOUT, progress.step, (eos, pad)
            )
            new = _everywhere(pg, tokens, input_ids.shape[0], max_new_tokens, pad)
    progress.end()
    return torch.cat([input_ids, new[:, : progress.length(new)].to(input_ids.dtype)], dim=1)


def _same_on_every_rank(
    call: str, pg: PPGroup, ids: torch.Tensor, mask: torch.Tensor, settings: Any, rule: Sampling, seed: Any
) -> None:
    """Every rank must pass the same prompts and settings (each computes positions and masks
    from its own; rank 0 feeds its prompts): one all-gather of a digest per part, before any
    transfer; a difference names the part. An unseeded draw's seed matters on the last rank only."""
    rule = rule if seed is not None else dataclasses.replace(rule, seed=0)
    parts = {
        "shapes or dtypes of input_ids and attention_mask": [(t.shape, t.dtype) for t in (ids, mask)],
        "values of input_ids (the prompts' tokens)": ids,
        "values of attention_mask": mask,
        "max_new_tokens, microbatches, EOS or pad ids": settings,
        "decoding settings (do_sample, temperature, top_k, top_p, seed)": rule,
    }
    fix = "pass the same prompts and generation arguments on every rank."
    check_same_values(call, pg, parts, DEFAULT_TIMEOUT, fix)


def group_of(mesh: Any) -> PPGroup | None:
    found = pp_group(mesh)
    if found is None:
        return None
    return _GROUPS.setdefault(found.group, found)


def seed_of(seed: int | None) -> int:
    return int(torch.randint(0, 2**62, ())) if seed is None else int(seed)


def _feed(ids: torch.Tensor, mask: torch.Tensor, new: int, microbatches: int, refill: int | None) -> Feed:
    """The prompt, its positions (as transformers numbers left-padded prompts) and the mask over
    the whole buffer (ones after the prompt: causality masks what is not written yet)."""
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    full = torch.cat([mask, mask.new_ones(mask.shape[0], new)], dim=1)
    return Feed(ids, full, positions, microbatches, new, refill)


def _programs(model: nn.Module, feed: Feed, stages: int, device: torch.device) -> Callable[[int], Programs]:
    """Step -> its programs: the prefill's (prompt length) at step 0, the decode's after, a
    refill's (NOTE [a refill]); each traced at its first use, and kept for the model's later
    generations of the same trace key (NOTE [trace key]: a model moved to another dtype is
    traced again)."""
    traces = TRACES.setdefault(model, StepTraces())
    max_len = feed.mask.shape[1]
    got: dict[int, Programs] = {}

    def get(step: int) -> Programs:
        q = feed.q(step)
        if q not in got:
            got[q] = traces.get(model, Shapes(feed.rows, q, max_len), stages, device)
        return got[q]

    return get


def _select(selector: Selector, feed: Feed) -> Callable[[torch.Tensor, int, int], torch.Tensor]:
    def select(logits: torch.Tensor, step: int, mb: int) -> torch.Tensor:
        return selector(logits, slice(mb * feed.rows, (mb + 1) * feed.rows))

    return select


def _everywhere(
    pg: PPGroup, tokens: list[list[torch.Tensor]], batch: int, new: int, pad: int | None
) -> torch.Tensor:
    """Rank 0's tokens [batch, new] on every rank (one broadcast); the steps after every
    sequence ended (not run: NOTE [ranks stop together]) hold the pad token."""
    out = torch.full((batch, new), 0 if pad is None else pad, dtype=torch.long)
    if tokens:
        ran = torch.cat([torch.cat(row) for row in tokens], dim=1)
        out[:, : ran.shape[1]] = ran
    return pg.broadcast(out.contiguous(), 0, DEFAULT_TIMEOUT, "broadcasting the generated tokens from rank 0")


def _failing_on(pg: PPGroup | None, what: str, fn: Callable[[], None]) -> None:
    """`fn()`; under torchrun a failure is reported to every rank (which stop naming this one)."""
    if pg is None:
        fn()
        return
    try:
        fn()
    except Exception as err:
        pg.report_failure(f"{pg.me} failed {what}: {type(err).__name__}: {err}")
        raise


class _Progress:
    """Which sequences have finished, step by step; the streamer's calls."""

    def __init__(self, prompt: torch.Tensor, eos: list[int], streamer: Any) -> None:
        self.eos, self.streamer = torch.tensor(eos, dtype=torch.long), streamer
        self.unfinished = torch.ones(prompt.shape[0], dtype=torch.bool)
        self.prompt = prompt

    def start(self) -> None:
        """The prompt to the streamer, as transformers puts it first (the call was checked)."""
        if self.streamer is not None:
            self.streamer.put(self.prompt.cpu())

    def step(self, step: int, row: list[torch.Tensor]) -> bool:
        """Step `step`'s tokens of every microbatch are known; True once every sequence ended."""
        if not self.unfinished.any():
            return True
        tokens = torch.cat(row).view(-1)
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())
        if self.eos.numel():
            self.unfinished &= ~torch.isin(tokens, self.eos)
        return not self.unfinished.any()

    def length(self, new: torch.Tensor) -> int:
        """New tokens up to the step after which every sequence had ended (transformers stops there)."""
        if not self.eos.numel():
            return new.shape[1]
        ended = torch.isin(new, self.eos)
        if not ended.any(dim=1).all():
            return new.shape[1]
        return int(ended.int().argmax(dim=1).max()) + 1

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()
