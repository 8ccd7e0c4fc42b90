"""Measuring for `fpipe.plan`: per-operation costs, each distinct configuration's stage times
(with tp, the segments between blocks first), the links and the optimizer, within a budget
(NOTE [what the planner measures] in plan_cost.py), cached per input signature."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .plan_cost import (
    Links,
    StageTimes,
    agree,
    agree_costs,
    local_pipeline,
    measure_links,
    measure_stages,
    optimizer_seconds,
    world,
)
from .plan_tp import entries, group, tp_layout

__all__ = ["Measured", "measure", "replica", "signature", "tp_builds", "CACHE"]


def replica(args: Any, rows: int) -> Any:
    """The first `rows` of every batched tensor: one replica's slice."""
    return tree_map(lambda t: t[:rows] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, args)


@dataclasses.dataclass
class Measured:
    times: dict[Any, StageTimes]
    links: Links
    optimizer_s: float
    costs: dict[Any, list[float]]
    skipped: dict[Any, str]  # config -> why it was not timed
    steps: dict[Any, float] = dataclasses.field(default_factory=dict)  # verified: (layout, stages) -> s
    paths: dict[Any, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # with tp: config -> cuts
    tp: int = 1


CACHE: dict[Any, Measured] = {}


def signature(f: Any, params: Any, args: Any, kwargs: Any, *settings: Any) -> Any:
    leaves = tree_flatten((params, args, kwargs))[0]
    shapes = tuple(
        (tuple(t.shape), t.dtype, str(getattr(t, "placements", "")))
        if isinstance(t, torch.Tensor)
        else repr(t)
        for t in leaves
    )
    return (f, shapes, *settings, world()[1])


def measure(
    f: Callable[..., Any], params: Any, args: Any, kwargs: Any, cands: list[Any],
    optimizer: str, budget_s: float, batch: int, tp_mesh: Any, start: float,
) -> Measured:  # fmt: skip
    """Time `cands`' distinct configurations: the first of each dp x pp layout always, the others
    while under `budget_s` seconds since `start` (the whole plan call's)."""
    costs: dict[Any, list[float]] = {}
    configs = {c.config: c for c in cands}
    sizes = {batch // k[0]: k for k in sorted(configs, key=lambda k: (k[0], k[1])) if k[2] > 1}
    segments: dict[int, list[float]] = {}  # with tp: microbatch rows -> seconds per segment
    paths, blocks = {}, entries(params) if tp_mesh is not None else []
    for rows, m, _, _ in sizes.values() if tp_mesh is None else ():  # per-operation costs, per
        sub = replica((args, kwargs), batch // rows * m)  # microbatch size
        piped = local_pipeline(f, stages=2, microbatches=m, partition="measure", costs=costs)
        piped.memory_report(params, *sub[0], **sub[1])
    agree_costs(costs)
    times: dict[Any, StageTimes] = {}
    skipped: dict[Any, str] = {}
    for key in _order(configs):
        c = configs[key]
        n = c.sched.n_stages
        if tp_mesh is not None and n > max(len(blocks), 1):
            skipped[key] = f"with tp, stages begin at entries of a ModuleList: {len(blocks)} found"
            continue
        first = all(k[0] // k[1] != c.dp for k in times)  # of its layout
        if not first and agree([time.perf_counter() - start], "max")[0] > budget_s:
            skipped[key] = f"not measured: budget_s={budget_s:g} spent"
            continue
        a, k = replica((args, kwargs), batch // c.dp)
        how: dict[str, Any] = dict(partition="measure" if n > 1 else "estimate", costs=costs)
        if tp_mesh is not None and n > 1:  # cuts between blocks, from measured segments
            rows = batch // key[0]
            if rows not in segments:
                segments[rows] = _segments(
                    f, params, replica((args, kwargs), rows * c.m), c.m, blocks, tp_mesh
                )
            paths[key] = tuple(blocks[i] for i in group(segments[rows], n)[1:])
            how = dict(partition="estimate", cuts=list(paths[key]))
        try:
            t = measure_stages(
                f, params, a, k, 3, stages=n, microbatches=c.m, schedule=c.sched, tp_mesh=tp_mesh, **how
            )
        except ValueError as err:  # (every rank skips it if one fails: the figures stay matched)
            skipped[key], t = str(err).split(": ", 1)[-1], None
        if agree([float(t is None)], "max")[0]:
            skipped.setdefault(key, "could not be built on another rank")
            continue
        assert t is not None
        flat = agree([x for kind in "FBIW" for x in t.kinds[kind]] + [t.overhead])
        t.kinds = {kind: flat[i * n : (i + 1) * n] for i, kind in enumerate("FBIW")}
        t.overhead, times[key] = flat[-1], t
    links = measure_links()
    opt = agree([optimizer_seconds(optimizer, params)])[0]
    tp = tp_mesh.size() if tp_mesh is not None else 1
    return Measured(times, links, opt, costs, skipped, paths=paths, tp=tp)


def _order(configs: dict[Any, Any]) -> list[Any]:
    """The order configs are timed in: breadth first over the dp x pp layouts, within one the
    fewest stages first."""
    by_dp: dict[int, list[Any]] = {}
    for k in sorted(configs, key=lambda k: (k[2], -k[0], sorted(k[3]))):
        by_dp.setdefault(k[0] // k[1], []).append(k)
    return [k for row in itertools.zip_longest(*by_dp.values()) for k in row if k is not None]


def _segments(f: Any, params: Any, sub: Any, m: int, blocks: list[str], tp_mesh: Any) -> list[float]:
    """Seconds of forward + backward of each segment between `blocks` (NOTE [planning with tensor
    parallelism]), averaged over the ranks: one local pipeline with a stage per segment."""
    if len(blocks) < 2:
        return [0.0] * len(blocks)
    t = measure_stages(
        f, params, sub[0], sub[1], 2, stages=len(blocks), microbatches=m, schedule="gpipe",
        cuts=blocks[1:], tp_mesh=tp_mesh,
    )  # fmt: skip
    return agree([fw + bw for fw, bw in zip(t.kinds["F"], t.kinds["B"])])


def tp_builds(call: str, build: Any, world_size: int, notes: list[Any]) -> list[Any]:
    """(f, params, tp, tp mesh) of `build(tp_mesh)` for every tp > 1 dividing `world_size`, each
    on a ("rest", "tp") mesh of (world_size // tp, tp); a tp whose build raises on any rank is
    left out, with (tp, why) in `notes`."""
    from torch.distributed.device_mesh import init_device_mesh

    if not callable(build):
        raise TypeError(f"{call}: tensor_parallel must be a function tp_mesh -> (f, params), got {build!r}.")
    if world()[1] == 1:
        notes.append((world_size, "tp > 1 is planned under torchrun only"))
        return []
    out = []
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    for tp in (t for t in range(2, world_size + 1) if world_size % t == 0):
        mesh = init_device_mesh(device, (world_size // tp, tp), mesh_dim_names=("rest", "tp"))["tp"]
        try:
            f, p = build(mesh)
            got, why = tp_layout(call, p, world_size)[0], ""
            if got != tp:
                why = f"tensor_parallel(tp_mesh) gave parameters of tp={got}, not on the mesh it was given"
        except Exception as err:  # (a model that does not divide by tp: its heads, its widths)
            why = f"tensor_parallel(tp_mesh) raised {type(err).__name__}: {err}"
        if agree([float(bool(why))], "max")[0]:
            notes.append((tp, why or "tensor_parallel(tp_mesh) failed on another rank"))
            continue
        out.append((f, p, tp, mesh))
    return out
