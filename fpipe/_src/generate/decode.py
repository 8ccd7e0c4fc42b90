"""Stage programs for generation: a causal LM's forward with a `SlotCache`, traced and cut at
decoder blocks, once per shape (prefill of a prompt length; decode of one token).

# NOTE [stage-resident state]
The traced step is `logits(params, ids, mask, positions, offset, kv)` -> the last position's
logits, with every layer's K/V buffers and the position `offset` as *inputs* (NOTE [a cache
whose position is data] in kv_cache.py). Cut at decoder blocks, each stage's program reads the
K/V inputs of its own layers only and writes them in place (`inplace_cache_writes`); no program
outputs them, so they never cross stages -- only the values the model hands from block to
block do (the hidden state, plus what the model computes once at its top and every block reads:
the mask, rotary cos/sin). The buffers themselves are allocated by the runner, on the rank that
runs the stage, one set per microbatch (`Programs.cache_shapes`), and live across the calls of
one generation: state owned by a stage, split by microbatch, never sent.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..stages import Program, Staged
from ..stages import split as split_
from ..tracing import BOUNDARY, Forward, forward_as_joint, make_fakes, trace_forward
from ..tracing import functionalize as functionalize_
from .kv_writes import inplace_cache_writes

__all__ = ["Layout", "Programs", "Shapes", "decoder_blocks", "example", "trace_programs", "trace_step"]

DATA = ("ids", "mask", "positions", "offset")  # the data inputs before the K/V buffers
# the K/V buffers' layout: (heads, head dim, dtype) of k0, v0, k1, v1, ... (`decode_traces.kv_layout`)
Layout = list[tuple[int, int, torch.dtype]]


@dataclasses.dataclass(frozen=True)
class Shapes:
    """One traced signature: a microbatch of `rows` sequences, `q` new tokens per call (the
    prompt length, or 1), buffers of `max_len` positions; `per_row`: each row at its own
    position (`offset` of shape [rows]: `fpipe.Generator`'s slots, NOTE [slots] in
    generator_cache.py), else every row at one (`offset` of shape [])."""

    rows: int
    q: int
    max_len: int
    per_row: bool = False


@dataclasses.dataclass
class Programs:
    """The per-stage programs of one signature, and how to bind their inputs."""

    staged: Staged
    names: dict[str, str]  # data input ("ids", ..., "k3", "v3") -> placeholder name
    params: dict[str, str]  # placeholder name -> parameter name
    # placeholder name -> (the captured tensor as traced, the module buffer it is, or None)
    consts: dict[str, tuple[torch.Tensor, Any]]
    logits: str  # the output value's name
    layout: Layout  # of the K/V buffers, k0, v0, k1, ...

    def program(self, stage: int) -> Program:
        return self.staged.programs["F", stage]

    @functools.cached_property
    def data_of(self) -> dict[str, str]:
        """Placeholder name -> data input (`names` inverted)."""
        return {n: k for k, n in self.names.items()}

    def const(self, name: str) -> torch.Tensor:
        """A captured tensor's value now: a module buffer as the module holds it at this call."""
        traced, source = self.consts[name]
        return traced if source is None else source[0].get_buffer(source[1])

    def layers_of(self, stage: int) -> list[int]:
        """The decoder layers whose K/V buffers `stage`'s program reads."""
        reads = set(self.program(stage).inputs)
        return sorted({int(k[1:]) for k, n in self.names.items() if k[0] in "kv" and n in reads})


def decoder_blocks(model: nn.Module) -> tuple[str, int]:
    """The path and length of the model's list of decoder blocks (the longest ModuleList)."""
    lists = [(p, len(m)) for p, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    n_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    lists = [(p, n) for p, n in lists if n == n_layers] or lists
    if not lists:
        raise ValueError(
            f"fpipe.generate: {type(model).__name__} has no nn.ModuleList of decoder blocks to cut "
            "stages at; generate supports transformers causal LMs whose blocks are a ModuleList."
        )
    return max(lists, key=lambda pn: pn[1])


def stage_cuts(model: nn.Module, stages: int) -> list[int]:
    """The decoder blocks where stages 1..stages-1 begin: equal runs of blocks."""
    path, n = decoder_blocks(model)
    if stages > n:
        raise ValueError(
            f"fpipe.generate(stages={stages}): {type(model).__name__} has {n} decoder blocks "
            f"({path}); a stage needs at least one, so pass stages <= {n}."
        )
    return [(s * n) // stages for s in range(1, stages)]


def forward_kwargs(model: nn.Module) -> dict[str, Any]:
    """How this model's forward takes the cache (`cache`, or `past_key_values` before 5.x's
    rename) and whether it computes the logits of the last position only."""
    accepted = inspect.signature(model.forward).parameters
    extra: dict[str, Any] = {"use_cache": True}
    if "logits_to_keep" in accepted:
        extra["logits_to_keep"] = 1  # as model.generate does: the same product, the same logits
    return extra


def cache_kwarg(model: nn.Module) -> str:
    accepted = inspect.signature(model.forward).parameters
    return "cache" if "cache" in accepted else "past_key_values"


def trace_programs(model: nn.Module, fwd: Forward, stages: int, layout: Layout) -> Programs:
    """The traced step `fwd` cut into `stages` stages at decoder blocks, with each stage's
    cache writes in place (NOTE [stage-resident state]). The forward is traced once per key with
    a boundary before every block, and each stage count keeps the boundaries where its stages
    begin: changing `stages` traces nothing again."""
    call = f"fpipe.generate({type(model).__name__}, stages={stages})"
    staged = split_.split(call, forward_as_joint(_keeping(fwd, stage_cuts(model, stages))), stages)
    kv_names = [f"{kind}{i}" for i in range(len(layout) // 2) for kind in "kv"]
    data = dict(zip([*DATA, *kv_names], staged.data_inputs))
    written = {n for p in staged.programs.values() for n in inplace_cache_writes(p.gm)}
    missing = [k for k in kv_names if data[k] not in written]
    if missing:
        raise ValueError(
            f"{call}: the model did not write the key/value buffers {missing} through the cache "
            "once each; fpipe.generate supports models whose every decoder layer calls "
            "cache.update once per forward (full attention: no sliding-window, linear-attention "
            "or cross-attention layers). Use model.generate for this model."
        )
    names = [n for n, _ in _param_items(model)]
    consts = dict(zip(staged.const_inputs, zip(fwd.consts, fwd.sources)))
    params = dict(zip(staged.param_inputs, names))
    return Programs(staged, data, params, consts, staged.out_names[0], layout)


def _param_items(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(functionalize_.functionalize(model)[1].items())


def _keeping(fwd: Forward, cuts: list[int]) -> Forward:
    """A copy of `fwd` keeping only the boundaries before blocks `cuts` (the k-th boundary of
    the trace is the one before block k + 1); the others become identities."""
    graph = fx.Graph()
    out = graph.graph_copy(fwd.gm.graph, {})
    graph.output(out)
    markers = graph.find_nodes(op="call_function", target=BOUNDARY)
    for k, marker in enumerate(markers):
        if k + 1 in cuts:
            continue
        for use in list(marker.users):
            use.replace_all_uses_with(marker.args[0][use.args[1]])
            graph.erase_node(use)
        graph.erase_node(marker)
    return dataclasses.replace(fwd, gm=fx.GraphModule(fwd.gm, graph))


def trace_step(call: str, model: nn.Module, shapes: Shapes, device: torch.device, layout: Layout) -> Forward:
    """Trace the model's step at `shapes` on fake tensors (no memory), a boundary before
    every decoder block."""
    from .kv_cache import SlotCache  # (transformers: imported when a step is traced, not by fpipe)

    fn, params = functionalize_.functionalize(model)
    names = list(params)
    extra, cache_kw = forward_kwargs(model), cache_kwarg(model)

    def step(p: dict[str, torch.Tensor], ids: Any, mask: Any, positions: Any, offset: Any, *kv: Any) -> Any:
        cache = SlotCache(list(zip(kv[0::2], kv[1::2])), offset)
        out = fn(p, input_ids=ids, attention_mask=mask, position_ids=positions, **{cache_kw: cache}, **extra)
        return out.logits[:, -1]

    if shapes.per_row:
        from .generator_cache import row_step

        step = row_step(fn, extra, cache_kw, layout[0][2])

    def rebuild(leaves: list[torch.Tensor]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        return dict(zip(names, leaves[: len(names)])), tuple(leaves[len(names) :]), {}

    _, fakes = make_fakes([*params.values(), *example(shapes, layout)], device)
    path, n = decoder_blocks(model)
    every = [f"{path}.{i}" for i in range(1, n)] or None
    return trace_forward(call, step, rebuild, fakes, len(names), device, every)


def example(shapes: Shapes, layout: Layout) -> list[torch.Tensor]:
    """Meta tensors of one microbatch's step inputs (traced as fakes on the data's device)."""
    b, q, n = shapes.rows, shapes.q, shapes.max_len
    meta = torch.device("meta")
    offset = (b,) if shapes.per_row else ()
    data = [torch.empty(s, dtype=torch.long, device=meta) for s in [(b, q), (b, n), (b, q), offset]]
    return [*data, *(torch.empty(b, h, n, d, dtype=dt, device=meta) for h, d, dt in layout)]
