"""Plan: choose dp x pp, microbatches, schedule and cuts for `world_size` ranks from measurements.

# NOTE [how fpipe.plan predicts]
Layouts: every dp x pp = world_size / tp whose dp divides the batch, tp taken from the
parameters (1, or the size of the "tp" mesh DTensor parameters lie on: NOTE [planning with tensor
parallelism] in plan_tp.py); per layout a few microbatch counts (divisors of the per-replica
batch, at least pp); per count every registered schedule that builds for pp ranks. Cuts:
`auto_partition` over measured per-operation costs (with tp, between the entries of the model's
ModuleList, from measured segment times). Each candidate's stages are timed in this process, with
tp in every tp group at once (plan_cost.py: NOTE [what the planner measures]); then

- step = simulate(schedule, measured F / I / W per stage, comm = one transfer's time)
  + time outside actions (measured, shared over the pp ranks) + the optimizer step of the
  busiest rank's parameters + the all-reduce of its gradient bytes over dp (not overlapped:
  an upper bound; fpipe launches buckets as the pipeline drains);
- peak = the busiest rank's predicted working memory (memory.py: `pipeline`'s prediction of
  that rank's step, its receive buffers and sent values included; plan_cost.rank_memory)
  + its parameters, their optimizer state (AdamW: 2x), and with dp > 1 a copy of its gradients
  for the all-reduce buckets.

Candidates whose peak is over `memory_limit` less the headroom `pipeline(memory_limit=)` keeps
(`remat_choose.target_of`: 15 % for what the prediction does not see) are dropped; the rest are
ranked by predicted step. Under torchrun `plan` starts the process group as `pipeline` does
(`group_start.start_group`): the ranks then measure together and agree on every figure, so every rank
makes the same plan.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from ..memory import HEADROOM_PERCENT, least_limit, target_of
from ..runtime import DEFAULT_TIMEOUT, start_group
from ..schedules import Schedule, build, names
from ..schedules import simulate as simulate_
from .plan_cost import OPTIMIZERS, Links, StageTimes, crossing_bytes, rank_memory, world
from .plan_measure import CACHE, Measured, measure, signature, tp_builds
from .plan_table import table
from .plan_tp import tp_layout
from .plan_verify import verify as verify_

__all__ = ["Plan", "plan"]


# pipeline()'s defaults of the arguments a plan sets
_PLANNED: dict[str, Any] = dict(
    stages=None, microbatches=1, schedule="1f1b", mesh=None, partition="estimate", cuts=None
)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A layout and its predictions; `candidates` (on the chosen plan) ranks every layout that
    fits, best first, and `dropped` lists the others with why. `str(plan)` is `plan.table()`."""

    dp: int
    pp: int
    tp: int
    microbatches: int
    schedule: str
    stages: int
    cuts: tuple[str, ...]  # where each stage after the first begins (plan.py: _cuts)
    predicted_step_s: float
    predicted_peak_bytes: int
    bubble: float  # the simulated idle fraction, averaged over the pp ranks
    serial_s: float  # predicted step with every stage in one process (what one process measures)
    parts: dict[str, float] = dataclasses.field(default_factory=dict)  # step: makespan, comm, ...
    candidates: tuple[Plan, ...] = ()
    dropped: tuple[tuple[Plan, str], ...] = ()
    measure_s: float = 0.0  # seconds spent measuring (0.0 when cached)
    links: Links | None = None
    costs: Any = dataclasses.field(default=None, repr=False, compare=False)
    measured_step_s: float = float("nan")  # a real step on the job's ranks (NOTE [plan verification])
    verified: int = 0  # on the chosen plan: how many candidates were timed for real
    tp_mesh: Any = dataclasses.field(default=None, repr=False, compare=False)  # the parameters'
    # what to pipeline: `pipeline(p.function, plan=p)(p.params, ...)` (with `tensor_parallel=`,
    # the model built for this candidate's tp; otherwise plan's own f and params)
    function: Any = dataclasses.field(default=None, repr=False, compare=False)
    params: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def layout(self) -> str:
        tp = f" tp={self.tp}" if self.tp > 1 else ""
        return f"dp={self.dp} pp={self.pp}{tp} m={self.microbatches} {self.schedule}"

    def table(self) -> str:
        """The ranked candidates and the dropped ones, and why the winner won."""
        return table(self)

    def __str__(self) -> str:
        return self.table()

    def settings(self, given: dict[str, Any]) -> dict[str, Any]:
        """`pipeline(f, plan=self, ...)`'s arguments: the plan's stages, microbatches, schedule and
        cuts (its measured costs; with tp, its module paths) and, under torchrun with dp > 1 or
        tp > 1, a ("dp", "pp"), ("pp", "tp") or ("dp", "pp", "tp") mesh, tp innermost."""
        clash = [k for k, v in _PLANNED.items() if given.get(k, v) is not v and given.get(k) != v]
        if clash:
            raise ValueError(
                f"pipeline(plan=...): the plan sets {', '.join(_PLANNED)}; do not pass "
                f"{', '.join(f'{k}={given[k]!r}' for k in clash)} too (plan again to change them)."
            )
        out = dict(given, stages=self.stages, microbatches=self.microbatches, schedule=self.schedule)
        if self.stages > 1 and self.tp > 1:
            out.update(cuts=list(self.cuts))
        elif self.stages > 1:
            out.update(partition="measure", costs=self.costs)
        size = world()[1]
        if size > 1:
            if size != self.dp * self.pp * self.tp:
                raise ValueError(
                    f"pipeline(plan=...): the plan is for dp={self.dp} x pp={self.pp} x tp={self.tp} "
                    f"= {self.dp * self.pp * self.tp} ranks but this job has {size}; plan with "
                    f"world_size={size}."
                )
            dims = {
                k: n for k, n in (("dp", self.dp), ("pp", self.pp), ("tp", self.tp)) if n > 1 or k == "pp"
            }
            if len(dims) > 1:
                out["mesh"] = _mesh(dims, self.tp_mesh)
        return out


def _mesh(dims: dict[str, int], tp_mesh: Any) -> Any:
    """The job's mesh of `dims` (tp innermost); its "tp" dimension is the parameters' own mesh
    and process group, whose collectives the traced function runs (plan_tp.py checked that its
    ranks are this layout's)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, tuple(dims.values()), mesh_dim_names=tuple(dims))
    if "tp" not in dims:
        return mesh
    groups = [tp_mesh.get_group() if d == "tp" else mesh.get_group(d) for d in dims]
    return DeviceMesh.from_group(groups, device, mesh=mesh.mesh, mesh_dim_names=tuple(dims))


@dataclasses.dataclass(frozen=True)
class _Candidate:
    dp: int
    pp: int
    m: int
    name: str
    sched: Schedule

    @property
    def config(self) -> tuple[int, int, int, frozenset[int]]:
        """What is timed: (dp, microbatches... as the microbatch's rows), stages, I/W stages."""
        iw = frozenset(a.stage for a in self.sched.actions() if a.kind in "IW")
        return (self.dp * self.m, self.m, self.sched.n_stages, iw)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _batch(call: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    raise ValueError(f"{call}: no example argument is a tensor with a batch dimension (dim 0).")


def _schedules(pp: int, m: int) -> Iterator[tuple[str, Schedule]]:
    for name in ["1f1b"] if pp == 1 else names():
        try:
            yield name, build(name, pp=pp, microbatches=m)
        except ValueError:
            continue


def _candidates(call: str, world_size: int, batch: int) -> tuple[list[_Candidate], list[str]]:
    out, skipped = [], []
    for dp in _divisors(world_size):
        pp = world_size // dp
        if batch % dp:
            skipped.append(f"dp={dp} pp={pp}: batch {batch} is not divisible by dp={dp}")
            continue
        ms = [d for d in _divisors(batch // dp) if d >= pp][:3]
        if not ms:
            skipped.append(f"dp={dp} pp={pp}: the per-replica batch {batch // dp} is smaller than pp={pp}")
        out += [_Candidate(dp, pp, m, n, s) for m in ms for n, s in _schedules(pp, m)]
    if not out:
        raise ValueError(f"{call}: no layout of {world_size} ranks fits: {'; '.join(skipped)}.")
    return out, skipped


def _cuts(c: Any) -> tuple[str, ...]:
    """Where each stage after the first begins, for people: the first parameter its forward reads
    (`blocks.2.ln1.weight`: a cut near `pipeline(cuts=["blocks.2"])`), or for a stage that reads
    none, its first operation (`op mm_16`). `pipeline(plan=p)` reproduces the cut exactly."""
    keys = dict(zip(c.staged.param_inputs, c.param_keys or ()))
    out = []
    for s in range(1, c.staged.n_stages):
        prog = c.staged.programs.get(("F", s))
        nodes = [] if prog is None else [n for n in prog.gm.graph.nodes if n.op == "call_function"]
        read = (str(keys[a.name]) for n in nodes for a in n.all_input_nodes if a.name in keys)
        out.append(next(read, f"op {nodes[0].name}" if nodes else "?"))
    return tuple(out)


def _predict(c: _Candidate, t: StageTimes, ms: Measured, opt_factor: int) -> Plan:
    k = t.kinds
    iw = c.config[3]
    n = c.sched.n_stages
    backward = [k["I"][s] if s in iw else k["B"][s] for s in range(n)]
    weight = [k["W"][s] if s in iw else 0.0 for s in range(n)]
    nbytes, transfers = crossing_bytes(t.compiled, c.sched)
    comm = ms.links.p2p(nbytes / transfers) if transfers else 0.0
    sim = simulate_.simulate(c.sched, forward=k["F"], backward=backward, weight=weight, comm=comm)
    reports = rank_memory(t.compiled, c.sched, c.m)
    grads = [sum(s.grads for s in r.stages) for r in reports]
    busiest = max(range(c.pp), key=lambda r: grads[r])
    total_grads = max(sum(grads), 1)
    parts = {
        "makespan": sim.makespan,
        "outside actions": t.overhead / c.pp,
        "optimizer": ms.optimizer_s * grads[busiest] / total_grads,
        "dp all-reduce": ms.links.allreduce(grads[busiest], c.dp),
        "comm per transfer": comm,
    }
    step = sum(v for key, v in parts.items() if key != "comm per transfer")
    peaks = [r.peak + g * (1 + opt_factor) + (g if c.dp > 1 else 0) for r, g in zip(reports, grads)]
    serial = sum(c.m * (k["F"][s] + backward[s] + weight[s]) for s in range(n)) + t.overhead
    cuts = ms.paths.get(c.config, ()) if ms.tp > 1 else _cuts(t.compiled)
    return Plan(
        dp=c.dp, pp=c.pp, tp=ms.tp, microbatches=c.m, schedule=c.name, stages=n, cuts=cuts,
        predicted_step_s=step, predicted_peak_bytes=max(peaks), bubble=sum(sim.bubble) / c.pp,
        serial_s=serial, parts=parts, links=ms.links, costs=ms.costs,
    )  # fmt: skip


def _check(call: str, params: Any, world_size: Any, optimizer: str, verify: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"{call}: world_size must be a positive int (the number of ranks), got {world_size!r}."
        )
    size = world()[1]
    if size > 1 and world_size != size:
        raise ValueError(f"{call}: this job has {size} ranks; plan for world_size={size}.")
    if size > 1 and verify > 0 and not isinstance(params, dict):
        raise ValueError(
            f"{call}: verify={verify} times real steps, which needs params as a dict (as "
            f"fpipe.functionalize returns); got {type(params).__name__}. Pass verify=0 to skip."
        )
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"{call}: unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZERS)}.")


def plan(
    f: Callable[..., Any],
    params: Any,
    *example_args: Any,
    world_size: int,
    memory_limit: int | None = None,
    optimizer: str = "adamw",
    budget_s: float = 120.0,
    verify: int = 3,
    tensor_parallel: Callable[[Any], tuple[Callable[..., Any], Any]] | None = None,
    **example_kwargs: Any,
) -> Plan:
    """Choose how to run `value_and_grad(pipeline(f, ...))` on `world_size` ranks, from
    measurements on this machine (NOTE [how fpipe.plan predicts] in plan.py).

    Args:
        f: the function to pipeline, `f(params, *args, **kwargs)` returning a scalar loss.
        params, example_args, example_kwargs: a step's inputs; tensors are split along dim 0
            (the global batch: each of dp replicas gets its share).
        world_size: the number of ranks (the job's size under torchrun).
        memory_limit: bytes per rank; layouts predicted to need more than the limit less 15 %
            (the headroom `pipeline(memory_limit=)` keeps) are dropped.
        optimizer: "adamw", "adam", "sgd" or "none": whose step time and state are counted.
        budget_s: seconds of measuring after which candidates not yet timed are dropped (the
            first of each dp x pp layout is always timed).
        verify: under torchrun, time this many of the best predicted candidates as real steps
            on the job's ranks and choose the fastest measured (NOTE [plan verification] in
            plan_verify.py): one build and 4 steps each; in one process nothing is verified.
        tensor_parallel: under torchrun, `tensor_parallel(tp_mesh) -> (f, params)` builds the
            model parallelized on a 1-D "tp" DeviceMesh (e.g. `parallelize_module` of a fresh
            model, then `functionalize`); every tp > 1 dividing world_size is then planned too,
            alongside tp = 1 (`f`, `params`: plain). A build that raises drops its tp, saying
            why. Without it, tp is the one `params` already have (NOTE [planning with tensor
            parallelism] in plan_tp.py).

    Returns:
        The best `Plan`; `pipeline(p.function, plan=p)` builds it, to be called with
        `p.params` (`f` and `params` themselves unless another tp was built). Measurements are cached per input
        signature, and in a process group averaged over the ranks (the same plan everywhere).

    Raises:
        ValueError: a bad world_size or optimizer, DTensor parameters that are not on one
            consecutive "tp" mesh, or no layout under `memory_limit` (naming the least memory
            reachable).
    """
    call = f"plan({getattr(f, '__name__', repr(f))}, world_size={world_size!r})"
    start_group(DEFAULT_TIMEOUT)  # under torchrun, as pipeline() does: the ranks plan together
    _check(call, params, world_size, optimizer, verify)
    tp, tp_mesh = tp_layout(call, params, world_size)
    batch = _batch(call, example_args, example_kwargs)
    builds, failed = [(f, params, tp, tp_mesh)], list[tuple[int, str]]()
    if tensor_parallel is not None:
        if tp > 1:
            raise ValueError(f"{call}: with tensor_parallel=, pass the plain model's f and params (tp = 1).")
        builds += tp_builds(call, tensor_parallel, world_size, failed)
    notes = [(_note(world_size, t), f"tp={t}: {why}") for t, why in failed]
    start, seconds = time.perf_counter(), 0.0
    fits, dropped, steps = list[Plan](), list[tuple[Plan, str]](), dict[Any, float]()
    for f_t, p_t, t, mesh in builds:
        try:
            cands, skipped = _candidates(call, world_size // t, batch)
        except ValueError as err:  # (another tp may fit)
            if len(builds) == 1:
                raise
            notes.append((_note(world_size, t), str(err).split(": ", 1)[-1]))
            continue
        key = signature(f, params, example_args, example_kwargs, world_size, optimizer, budget_s, t)
        if key not in CACHE:
            CACHE[key] = measure(
                f_t, p_t, example_args, example_kwargs, cands, optimizer, budget_s, batch, mesh, start
            )
            seconds = time.perf_counter() - start
        ms = CACHE[key]
        at = dict(tp_mesh=mesh, function=f_t, params=p_t)
        fit, drop = _rank(cands, ms, memory_limit, OPTIMIZERS[optimizer][1], skipped)
        fits += [dataclasses.replace(c, **at) for c in fit]
        dropped += drop
        steps = ms.steps if t == tp else steps  # (verified steps: cached with the first build)
    best = _best(call, fits, dropped + notes, memory_limit, seconds)
    return verify_(example_args, example_kwargs, best, verify, optimizer, steps)


def _note(world_size: int, tp: int) -> Plan:
    return _unmeasured_layout(f"dp={world_size // tp} pp=1: ", tp)


def _best(
    call: str, fits: list[Plan], dropped: list[tuple[Plan, str]], limit: int | None, seconds: float
) -> Plan:
    """The fastest predicted of `fits`, holding the ranked list and the dropped ones."""
    if not fits:
        least = min((p for p, _ in dropped if p.predicted_peak_bytes), key=lambda p: p.predicted_peak_bytes)
        raise ValueError(
            f"{call}: no layout fits memory_limit={limit} bytes; the least memory reachable is "
            f"{least.predicted_peak_bytes} bytes ({least.predicted_peak_bytes / 2**20:.1f} MiB, "
            f"{least.layout}), so the least limit planned under is "
            f"memory_limit={least_limit(least.predicted_peak_bytes)} (a plan keeps "
            f"{HEADROOM_PERCENT}% below the limit for what its prediction does not see); raise "
            "memory_limit or use more ranks."
        )
    fits.sort(key=lambda p: p.predicted_step_s)
    return dataclasses.replace(fits[0], candidates=tuple(fits), dropped=tuple(dropped), measure_s=seconds)


def _rank(
    cands: list[_Candidate], ms: Measured, limit: int | None, opt_factor: int, skipped: list[str]
) -> tuple[list[Plan], list[tuple[Plan, str]]]:
    """The candidates that fit `limit` (predicted), and the others with why."""
    fits, dropped = [], []
    for c in cands:
        if c.config in ms.skipped:
            dropped.append((_unmeasured(c, ms.tp), ms.skipped[c.config]))
            continue
        p = _predict(c, ms.times[c.config], ms, opt_factor)
        if limit is not None and p.predicted_peak_bytes > target_of(limit):
            why = f"peak {p.predicted_peak_bytes / 2**20:.1f} MiB > limit {limit / 2**20:.1f} MiB"
            dropped.append((p, f"{why} less {HEADROOM_PERCENT}%"))
        else:
            fits.append(p)
    return fits, dropped + [(_unmeasured_layout(s, ms.tp), s) for s in skipped]


def _unmeasured(c: _Candidate, tp: int) -> Plan:
    return Plan(
        dp=c.dp, pp=c.pp, tp=tp, microbatches=c.m, schedule=c.name, stages=c.sched.n_stages, cuts=(),
        predicted_step_s=float("nan"), predicted_peak_bytes=0, bubble=float("nan"), serial_s=float("nan"),
    )  # fmt: skip


def _unmeasured_layout(text: str, tp: int) -> Plan:
    dp, pp = (int(x.split("=")[1]) for x in text.split(":")[0].split())
    return Plan(
        dp=dp, pp=pp, tp=tp, microbatches=0, schedule="-", stages=pp, cuts=(), predicted_step_s=float("nan"),
        predicted_peak_bytes=0, bubble=float("nan"), serial_s=float("nan"),
    )  # fmt: skip
