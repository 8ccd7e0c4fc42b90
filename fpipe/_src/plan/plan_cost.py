"""Plan costs: what `fpipe.plan` measures on this machine, and per-rank memory from a plan.

# NOTE [what the planner measures]
- Per-operation costs (`measure.measure_costs`, forward + backward of each operation at one
  microbatch's shapes), once per microbatch size; `auto_partition` cuts by them, and the same
  table is handed to `pipeline(f, plan=p)` (`Config.costs`), so the pipeline built from a plan
  has the cuts that were timed.
- Per-stage action times: the candidate's stages run in this process (a local pipeline, every
  stage here, even under torchrun) for a few value-and-grad steps; the timeline gives each
  stage's mean F, B, I and W time, and the step's time outside actions (inputs, outputs).
  This process's thread count is what is timed: under torchrun, each rank's.
- Links: the latency and bandwidth of a point-to-point transfer and of an all-reduce. In a
  process group, between ranks 0 and 1 of it; in one process, between two threads on gloo
  loopback (`ProcessGroupGloo` over a `HashStore`: no process is started) -- the transport a
  CPU job on one host uses, but not NCCL, NVLink or a network between hosts.
- The optimizer step: `torch.optim` over copies of the parameters, timed once.

In a process group every rank measures, and the figures are averaged over the ranks (one
all-reduce per table), so every rank makes the same plan.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from ..memory import MemoryReport, predict
from ..parallel import Groups
from ..pipeline import Pipelined, value_and_grad
from ..runtime import DEFAULT_TIMEOUT, DistRunner, LocalRunner, group_of
from ..schedules import Schedule
from .plan_tp import tp_groups

__all__ = [
    "Links",
    "StageTimes",
    "agree",
    "measure_links",
    "measure_stages",
    "optimizer_seconds",
    "rank_memory",
]

_ACTION = re.compile(r"^([FBIW])(\d+)\.(\d+)$")


def world() -> tuple[int, int]:
    """(rank, size) of the default process group; (0, 1) without one."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def agree(values: list[float], op: str = "mean") -> list[float]:
    """`values` averaged (or their max) over the ranks of the default group; as they are alone."""
    if world()[1] == 1 or not values:
        return values
    pg = group_of(dist.group.WORLD)
    assert pg is not None
    vec = torch.tensor(values, dtype=torch.float64, device=pg.device)
    what = "fpipe.plan: the ranks' measurements"  # under fpipe's deadline (NOTE [failures never hang])
    pg.all_reduce(vec, DEFAULT_TIMEOUT, what, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return (vec if op == "max" else vec / world()[1]).cpu().tolist()


def agree_costs(store: dict[Any, list[float]]) -> None:
    """Average a per-operation cost table (`Compiler._measured`) over the ranks, in place."""
    keys = list(store)
    flat = agree([x for k in keys for x in store[k]])
    for k in keys:
        store[k], flat = flat[: len(store[k])], flat[len(store[k]) :]


# -- stages ---------------------------------------------------------------------------------------


def local_pipeline(f: Callable[..., Any], tp_mesh: Any = None, **settings: Any) -> Pipelined:
    """A pipeline whose stages all run in this process, even in a process group; with `tp_mesh`,
    its programs run their tensor-parallel collectives with the other ranks of that mesh."""
    piped = Pipelined(f, **settings)
    groups = Groups(None, None) if tp_mesh is None else tp_groups(tp_mesh, piped.cfg.timeout)
    piped.__dict__["_groups"] = groups  # the cached_property, looked up already
    return piped


@dataclasses.dataclass
class StageTimes:
    """Mean seconds of each action kind per stage ({kind: [per stage]}), the step's seconds
    outside actions, and the compiled plan that was timed."""

    kinds: dict[str, list[float]]
    overhead: float
    compiled: Any


def measure_stages(
    f: Callable[..., Any],
    params: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    reps: int,
    **settings: Any,
) -> StageTimes:
    """Time `reps` value-and-grad steps of a local pipeline (after one to compile and warm up)."""
    piped = local_pipeline(f, **settings)
    step = value_and_grad(piped)
    for _ in range(2):  # the first steps compile and warm up (variants, allocator)
        step(params, *args, **kwargs)
    samples: dict[tuple[str, int], list[float]] = {}
    overhead = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        step(params, *args, **kwargs)
        wall = time.perf_counter() - start
        events = piped.timeline.events  # type: ignore[union-attr]
        overhead = min(overhead, max(wall - sum(e - s for _n, _r, s, e, _k in events), 0.0))
        for name, _r, s, e, _k in events:
            m = _ACTION.match(name)
            if m:
                samples.setdefault((m[1], int(m[2])), []).append(e - s)
    n = settings["stages"]  # per stage: the median of its actions' times (robust to a busy host)
    kinds = {k: [statistics.median(samples.get((k, s), [0.0])) for s in range(n)] for k in "FBIW"}
    return StageTimes(kinds, overhead, piped._last)


@dataclasses.dataclass(frozen=True)
class _RankView:
    """What predicting one pipeline rank's step reads of its process group: a `DistRunner` built
    over it plans its transfers and is replayed (`memory.predict`), never run."""

    rank: int
    device: torch.device


def rank_memory(c: Any, sched: Schedule, n_mb: int) -> list[MemoryReport]:
    """Each pipeline rank's predicted memory for `sched` over the compiled plan `c`, before any
    process group: `memory.predict` of the runner the rank will run -- a `DistRunner` over a view
    of the rank (its receive buffers and the values it sends counted, as `pipeline`'s own
    prediction counts them), a `LocalRunner` at pp = 1."""
    st = c.staged
    summed = frozenset(st.n_outs + j for j in range(len(c.diff)))  # params: passed whole, summed
    if sched.pp == 1:
        return [predict(st, LocalRunner(st, sched), summed, n_mb)]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (the group's backend)
    views = [DistRunner(st, sched, _RankView(r, device), 0.0) for r in range(sched.pp)]  # type: ignore[arg-type]
    return [predict(st, view, summed, n_mb) for view in views]


def crossing_bytes(c: Any, sched: Schedule) -> tuple[int, int]:
    """Bytes per microbatch of values that cross between ranks, and how many transfers carry them."""
    st = c.staged
    total = transfers = 0
    for name, places in st.consumers.items():
        src = st.producer.get(name)
        if src is None:
            continue
        dests = {sched.stage_rank[p[1]] for p in places} - {sched.stage_rank[src[1]]}
        if not dests:  # (a value kept on its rank: some, between a stage's I and W, have no meta)
            continue
        shape, dtype = st.meta[name][:2]
        total += len(dests) * dtype.itemsize * int(torch.Size(shape).numel())
        transfers += len(dests)
    return total, transfers


# -- links ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Links:
    """Seconds per transfer: `latency + bytes / bandwidth`, point-to-point and all-reduce."""

    p2p_latency: float
    p2p_bandwidth: float  # bytes per second
    allreduce_latency: float
    allreduce_bandwidth: float  # algorithm bandwidth of a 2-rank all-reduce, bytes per second
    how: str

    def p2p(self, nbytes: float) -> float:
        return self.p2p_latency + nbytes / self.p2p_bandwidth

    def allreduce(self, nbytes: float, ranks: int) -> float:
        """A ring all-reduce over `ranks` moves 2 (ranks - 1) / ranks of the bytes per rank; the
        2-rank figure measured moves 1."""
        if ranks <= 1:
            return 0.0
        return self.allreduce_latency + nbytes * 2 * (ranks - 1) / ranks / self.allreduce_bandwidth


_BIG = 1 << 20  # floats: 4 MiB


def _pingpong(pg: Any, rank: int, peer: int, reps: int = 3) -> list[float]:
    """[one-way seconds of 4 bytes, of 4 MiB, all-reduce seconds of 4 bytes, of 4 MiB]."""
    out = []
    for n in (1, _BIG):
        t, best = torch.ones(n), float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            if rank == 0:
                pg.send([t], peer, 0).wait()
                pg.recv([t], peer, 0).wait()
            else:
                pg.recv([t], peer, 0).wait()
                pg.send([t], peer, 0).wait()
            best = min(best, (time.perf_counter() - start) / 2)
        out.append(best)
    for n in (1, _BIG):
        t, best = torch.ones(n), float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            pg.allreduce([t]).wait()
            best = min(best, time.perf_counter() - start)
        out.append(best)
    return out


def _links(t: list[float], how: str) -> Links:
    big = 4.0 * _BIG
    return Links(t[0], big / max(t[1] - t[0], 1e-9), t[2], big / max(t[3] - t[2], 1e-9), how)


def measure_links() -> Links:
    """Measure the links (NOTE [what the planner measures]); the same figures on every rank."""
    rank, size = world()
    if size > 1:
        pg = dist.distributed_c10d._get_default_group()
        backend = dist.get_backend()
        if backend != "gloo" or size != 2:  # ping-pong between two ranks of a 2-rank group only
            return _links(agree(_group_figures(rank)), f"{backend}, ranks 0 and 1 of {size}")
        return _links(agree(_pingpong(pg, rank, 1 - rank)), "gloo between the 2 ranks of this job")
    return _links(_threads(), "gloo loopback between two threads of this process")


def _group_figures(rank: int) -> list[float]:
    """Ranks 0 and 1 of a larger (or non-gloo) group ping-pong on a 2-rank subgroup."""
    sub = dist.new_group([0, 1], backend="gloo")
    if rank < 2:
        figures = _pingpong(sub, rank, 1 - rank)  # type: ignore[arg-type]
    else:
        figures = [0.0] * 4
    return [x * world()[1] / 2 for x in figures]  # the mean over all ranks is theirs


def _threads() -> list[float]:
    store = dist.HashStore()
    res: dict[int, list[float]] = {}

    def run(r: int) -> None:
        pg = dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=60))
        res[r] = _pingpong(pg, r, 1 - r)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [max(a, b) for a, b in zip(res[0], res[1])]


# -- the optimizer --------------------------------------------------------------------------------

OPTIMIZERS: dict[str, tuple[Callable[..., Any] | None, int]] = {
    # name: (torch.optim class, state bytes per parameter byte)
    "adamw": (torch.optim.AdamW, 2),
    "adam": (torch.optim.Adam, 2),
    "sgd": (torch.optim.SGD, 0),
    "none": (None, 0),
}


def optimizer_seconds(name: str, params: Any) -> float:
    """Seconds of one step of optimizer `name` over copies of `params` (the second step timed)."""
    cls = OPTIMIZERS[name][0]
    leaves = [p for p in tree_flatten(params)[0] if isinstance(p, torch.Tensor) and p.is_floating_point()]
    if cls is None or not leaves:
        return 0.0
    copies = [p.detach().clone().requires_grad_() for p in leaves]
    for p in copies:
        p.grad = torch.zeros_like(p)
    opt = cls(copies, lr=1e-3)
    opt.step()
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start
