"""`fpipe.Generator`: a request loop over `fpipe.generate`'s pipelined step (continuous batching).

# NOTE [the request loop]
Requests wait in a queue and join free cache slots at step boundaries. One `step()`: (1) the
waiting requests take the free slots, first come first served; (2) each joining request's
prompt runs through the pipeline (a prefill at its length bucket, NOTE [slots] in
generator_cache.py), giving its first token; (3) one decode pass feeds every running request's
last token (one traced program for all slots, idle slots included), giving each its next
token; (4) a request that drew an EOS id or reached its `max_new_tokens` leaves and frees its
slot for the next step. Nothing runs in the background: the caller drives the loop (`step()`,
`run()`, or iterating a handle, which steps until its next token is there).

Under torchrun every rank gets the same stream: each calls `submit` with the same prompts and
settings, in the same order between the same `step()` calls. Each step the ranks first compare
a digest of what joins (one all-gather; a difference names the step and the ranks), then run
their stages, and the last rank's tokens reach every rank (one broadcast), so every rank's
handles hold the same tokens and every rank decides alike who leaves.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..generate import (
    TRACES,
    Selector,
    Shapes,
    StepTraces,
    check_call,
    eos_and_pad,
    group_of,
    kv_layout,
    refill_step,
    resolve,
    seed_of,
    stage_count,
    stage_cuts,
)
from ..runtime import DEFAULT_TIMEOUT, check_same_values
from ..tracing import functionalize as functionalize_
from .generator_run import LocalPasses, RankPasses
from .generator_slots import (
    SlotBuffers,
    bucket_of,
    decode_data,
    default_buckets,
    prefill_data,
    slot_bytes,
)

__all__ = ["Generator", "Request"]


class Request:
    """A submitted prompt: its tokens as they come (`new_tokens`), `done` once it has ended.

    Iterating it yields its new tokens, stepping the generator until each is there;
    `result()` steps until it has ended and returns `[prompt + n]` tokens."""

    def __init__(
        self, gen: Generator, index: int, prompt: torch.Tensor, new: int, select: Selector, eos: list[int]
    ) -> None:
        self.index, self.prompt, self.max_new_tokens, self.eos = index, prompt, new, eos
        self.new_tokens: list[int] = []
        self.done = False
        self.slot: int | None = None  # the cache slot it holds (set when it joins)
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self._gen, self._select = gen, select

    def __iter__(self) -> Iterator[int]:
        seen = 0
        while True:
            while seen < len(self.new_tokens):
                seen += 1
                yield self.new_tokens[seen - 1]
            if self.done:
                return
            self._gen.step()

    def result(self) -> torch.Tensor:
        while not self.done:
            self._gen.step()
        new = torch.tensor(self.new_tokens, dtype=self.prompt.dtype, device=self.prompt.device)
        return torch.cat([self.prompt, new])

    def __repr__(self) -> str:
        state = "done" if self.done else f"{len(self.new_tokens)} tokens so far"
        return f"Request({self.index}, prompt of {self.prompt.numel()} tokens, {state})"


@dataclasses.dataclass
class _Joining:
    request: Request
    digest: Any  # what every rank must agree on


class Generator:
    """Continuous batching over `fpipe.generate`'s pipeline: requests join free K/V cache slots
    at step boundaries and leave at EOS or `max_new_tokens` (NOTE [the request loop]).

    Greedy tokens of each request equal `model.generate(prompt[None], max_new_tokens=...,
    do_sample=False)` run for that request alone; a sampled request with a `seed` draws as
    `fpipe.generate(..., seed=seed)` of that prompt alone does (NOTE [draws that do not depend
    on the pipeline]), whatever else runs beside it.

    Args:
        model: a transformers causal LM in eval mode, full attention (as `fpipe.generate`).
        max_len: cache positions per slot: every request needs prompt + max_new_tokens - 1 <=
            max_len (and its prompt bucket <= max_len).
        max_batch: cache slots (requests decoded at once); or
        memory_limit: bytes the K/V slots may take in this process (under torchrun: on the
            rank that holds the most layers): slots = memory_limit // (its K/V bytes per
            slot), read from the K/V layout the model's attention stores (`slot_bytes`). Pass one of the two (both: `max_batch`
            must fit under the limit).
        stages: pipeline stages (one process: default 1; under torchrun: the number of ranks).
        mesh: a DeviceMesh whose "pp" dimension is the pipeline (default: every rank).
        buckets: prompt lengths the prefill is traced at (a prompt is right-padded to the
            smallest that holds it); default powers of two from 8, then `max_len`; `None`
            traces each prompt length apart.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_len: int,
        max_batch: int | None = None,
        memory_limit: int | None = None,
        stages: int | None = None,
        mesh: Any = None,
        buckets: Sequence[int] | None | str = "default",
    ) -> None:
        self.model, self.max_len, self._pg = model, max_len, group_of(mesh)
        self.call = f"fpipe.Generator({type(model).__name__}, max_len={max_len})"
        device = next(model.parameters()).device
        call = check_call(model, torch.zeros(1, 1, dtype=torch.long), None, 1, 1, stages, self._pg)
        _refuse_longrope(self.call, model)
        self.stages = stage_count(call, model, stages, self._pg)
        _refuse_layouts(self.call, model, self.stages, self._pg)
        self.buckets = _buckets(self.call, buckets, max_len)
        layout = kv_layout(model, device)
        per_stage = _stage_layers(model, self.stages, len(layout) // 2)
        # what one process holds: every stage here, else one stage per rank
        held = [sum(per_stage, [])] if self._pg is None else per_stage
        mine = held[0] if self._pg is None else per_stage[self._pg.rank]
        worst = max(slot_bytes(layout, layers, max_len) for layers in held)
        self.max_batch = _slots(self.call, max_batch, memory_limit, worst)
        self.cache = SlotBuffers(layout, mine, self.max_batch, max_len, device)
        _, params = functionalize_.functionalize(model)
        self._passes = (
            LocalPasses(params) if self._pg is None else RankPasses(params, self._pg, DEFAULT_TIMEOUT)
        )
        self._traces: StepTraces = TRACES.setdefault(model, StepTraces())
        self._device = device
        self._queue: deque[_Joining] = deque()
        self._slots: list[Request | None] = [None] * self.max_batch
        self.steps, self.submitted = 0, 0
        self.shapes: set[Shapes] = set()  # the step signatures this Generator has run

    def submit(
        self,
        prompt_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | list[int] | None = None,
    ) -> Request:
        """Queue a prompt (`[prompt]` or `[1, prompt]` long token ids, no padding); it joins a free
        slot at the next step. The settings are `fpipe.generate`'s, checked the same way
        (NOTE [generation settings]); everything it refuses is refused here."""
        ids = prompt_ids.reshape(1, -1) if prompt_ids.dim() == 1 else prompt_ids
        call = f"{self.call}.submit(prompt of {ids.shape[-1]} tokens, max_new_tokens={max_new_tokens})"
        check_call(self.model, ids, None, max_new_tokens, 1, self.stages, self._pg)
        self._check_length(call, ids, max_new_tokens)
        rule, warp = resolve(call, self.model, do_sample, temperature, top_k, top_p)
        given = dataclasses.replace(rule, seed=int(seed) if seed is not None else 0)
        rule = dataclasses.replace(rule, seed=seed_of(seed) if rule.do_sample else 0)
        eos, pad = eos_and_pad(self.model, eos_token_id)
        req = Request(self, self.submitted, ids[0], max_new_tokens, Selector(rule, warp, 1, eos, pad), eos)
        self.submitted += 1
        self._queue.append(_Joining(req, (ids[0].tolist(), max_new_tokens, eos, pad, given)))
        return req

    def _check_length(self, call: str, ids: torch.Tensor, new: int) -> None:
        n = ids.shape[1]
        if ids.shape[0] != 1:
            raise ValueError(f"{call}: submit one prompt at a time, not a batch of {ids.shape[0]}.")
        if n + new - 1 > self.max_len or bucket_of(n, self.buckets) > self.max_len:
            raise ValueError(
                f"{call}: the prompt's {n} tokens and {new} new ones need {n + new - 1} cache "
                f"positions, more than max_len={self.max_len}; pass a shorter prompt or fewer "
                "new tokens, or make a Generator with a larger max_len."
            )
        if refill_step(self.model, n, new) is not None:
            raise ValueError(
                f"{call}: the model's rope switches to its long factor within this request "
                "(NOTE [a refill]), which the request loop does not do; use fpipe.generate."
            )

    @property
    def idle(self) -> bool:
        """No request waiting or running."""
        return not self._queue and not any(self._slots)

    def run(self) -> None:
        """Step until every submitted request has ended."""
        while not self.idle:
            self.step()

    def step(self) -> bool:
        """One step boundary (NOTE [the request loop]); returns whether requests remain."""
        if self.idle:
            return False
        joining = self._join()
        running = {
            s: r
            for s, r in enumerate(self._slots)
            if r is not None and all(j.request is not r for _, j in joining)
        }
        with torch.no_grad():
            tokens = self._passes.guard(lambda: self._run(joining, running))
        self._record(joining, running, tokens)
        self.steps += 1
        return not self.idle

    def _join(self) -> list[tuple[int, _Joining]]:
        free = [s for s, r in enumerate(self._slots) if r is None]
        joining = list(zip(free, list(self._queue)[: len(free)]))
        if self._pg is not None:  # before any change: a refused step leaves the queue as it was
            self._pg.begin_call()
            parts = {
                f"requests joining at step {self.steps} (prompts and settings)": [
                    j.digest for _, j in joining
                ],
                "Generator settings (max_len, max_batch, buckets)": (
                    self.max_len,
                    self.max_batch,
                    self.buckets,
                ),
            }
            fix = "every rank must submit the same prompts with the same settings in the same order."
            check_same_values(self.call, self._pg, parts, DEFAULT_TIMEOUT, fix)
        for s, j in joining:
            self._queue.popleft()
            self._slots[s], j.request.slot = j.request, s
        return joining

    def _run(self, joining: list[tuple[int, _Joining]], running: dict[int, Request]) -> torch.Tensor:
        """Each joining prompt's first token, then every running request's next; -1 elsewhere."""
        out = torch.full((len(joining) + self.max_batch,), -1, dtype=torch.long)
        for i, (slot, j) in enumerate(joining):
            prompt = j.request.prompt
            shapes = Shapes(1, bucket_of(prompt.numel(), self.buckets), self.max_len, True)
            env = {**prefill_data(prompt, shapes.q, self.max_len), **self.cache.row(slot)}
            what = f"step {self.steps} (prefill of request {j.request.index})"
            logits = self._passes.run(self._programs(shapes), env, what)
            if logits is not None:
                out[i] = int(j.request._select(logits, slice(0, 1)))
        if running:
            rows = {
                s: (r.new_tokens[-1], r.prompt.numel() + len(r.new_tokens) - 1) for s, r in running.items()
            }
            env = {**decode_data(rows, self.max_batch, self.max_len, self._device), **self.cache.buffers}
            shapes = Shapes(self.max_batch, 1, self.max_len, True)
            logits = self._passes.run(self._programs(shapes), env, f"step {self.steps} (decode)")
            for s, r in running.items():
                if logits is not None:
                    out[len(joining) + s] = int(r._select(logits[s : s + 1], slice(0, 1)))
        return self._passes.share(out)

    def _programs(self, shapes: Shapes) -> Any:
        """The programs of `shapes`, from `generate`'s trace cache at every pass: the one trace
        key (NOTE [trace key]) decides whether the model's step is traced again."""
        try:
            progs = self._traces.get(self.model, shapes, self.stages, self._device)
        except (RuntimeError, ValueError, TypeError) as err:
            raise ValueError(
                f"{self.call}: tracing the model's step with every slot at its own position "
                f"(NOTE [slots]: a prepared 4-D attention mask) failed: {type(err).__name__}: "
                f"{err}. The request loop needs a model whose attention takes a 4-D mask as "
                "given (not one that derives more from the 2-D mask, as Bloom's ALiBi "
                "does); use fpipe.generate for this model."
            ) from err
        self.shapes.add(shapes)
        return progs

    def _record(
        self, joining: list[tuple[int, _Joining]], running: dict[int, Request], tokens: torch.Tensor
    ) -> None:
        got = [(s, j.request, int(tokens[i])) for i, (s, j) in enumerate(joining)]
        got += [(s, r, int(tokens[len(joining) + s])) for s, r in running.items()]
        now = time.perf_counter()
        for slot, req, token in got:
            req.new_tokens.append(token)
            req.first_token_at = req.first_token_at or now
            if token in req.eos or len(req.new_tokens) >= req.max_new_tokens:
                req.done = True
                self._slots[slot] = None


def _refuse_longrope(call: str, model: nn.Module) -> None:
    """Phi-3's `longrope` picks its factor per forward from the largest position of the rows it
    sees (NOTE [a refill]): one slot past the original length would switch every other slot's."""
    cfg: Any = model.config
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kinds = [
        p.get("rope_type", p.get("type"))
        for p in (
            params.values() if all(isinstance(v, dict) for v in params.values()) and params else [params]
        )
    ]
    if "longrope" in kinds:
        raise ValueError(
            f"{call}: the model's rope_type='longrope' chooses its frequencies per forward from "
            "the largest position among the rows, so a request in one slot would change the "
            "tokens of the others; use fpipe.generate for this model."
        )


def _refuse_layouts(call: str, model: nn.Module, stages: int, pg: Any) -> None:
    """What `fpipe.generate` serves and the Generator does not (yet): several stages per rank,
    and a model on the meta device (stage-local weights, `generate(weights=...)`)."""
    if pg is not None and stages != pg.size:
        raise ValueError(
            f"{call}: stages={stages} on {pg.size} ranks; the Generator runs one stage per rank. "
            f"Pass stages={pg.size} (several stages per rank are fpipe.generate's, not yet the Generator's)."
        )
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(
            f"{call}: {len(meta)} parameters are on the meta device (e.g. {meta[0]}); the Generator "
            "needs the model's weights. Load them first (stage-local weights are fpipe.generate(weights=...)'s)."
        )


def _stage_layers(model: nn.Module, stages: int, n_layers: int) -> list[list[int]]:
    """The decoder layers of each stage (decode.stage_cuts: equal runs of blocks)."""
    bounds = [0, *stage_cuts(model, stages), n_layers]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def _slots(call: str, max_batch: int | None, limit: int | None, per_slot: int) -> int:
    """The slot count: `max_batch`, or as many as fit `limit` bytes (both: checked against it)."""
    if max_batch is None and limit is None:
        raise ValueError(f"{call}: pass max_batch=N (cache slots) or memory_limit=BYTES for the K/V cache.")
    if max_batch is not None and (not isinstance(max_batch, int) or max_batch < 1):
        raise ValueError(f"{call}: max_batch={max_batch!r} must be a positive int.")
    fits = None if limit is None else int(limit) // per_slot
    if fits is not None and fits < (max_batch or 1):
        raise ValueError(
            f"{call}: memory_limit={limit} bytes holds {fits} cache slots of {per_slot} bytes "
            f"(the K/V buffers of one process's layers, or of the rank with the most), fewer than "
            f"{max_batch or 1}; raise the limit, or lower max_len or max_batch."
        )
    return max_batch if max_batch is not None else int(fits or 0)


def _buckets(call: str, buckets: Sequence[int] | None | str, max_len: int) -> tuple[int, ...] | None:
    if buckets == "default":
        return default_buckets(max_len)
    if buckets is None:
        return None
    got = tuple(sorted(int(b) for b in buckets))  # type: ignore[union-attr]
    if not got or got[0] < 1 or got[-1] != max_len:
        raise ValueError(
            f"{call}: buckets={buckets!r} must be positive prompt lengths whose largest is "
            f"max_len={max_len} (so every prompt has one), or None for one trace per length."
        )
    return got
