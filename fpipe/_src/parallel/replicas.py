"""Data parallelism: replicas of the pipeline over the mesh's "dp" dimension.

# NOTE [gradients over replicas]
Each rank passes its own dp slice of the global batch (the torchrun/DDP convention). A step
returns the global loss (the mean over replicas for a 'mean' loss, the sum for 'sum') and the
gradients of the global loss: the loss cotangent is 1/(M x dp) for a 'mean' loss (1 for 'sum'),
so each replica's gradient sums are its share of the global gradient, and they are summed over
dp by all-reduces in buckets of at most `BUCKET_BYTES`. A bucket is launched asynchronously
right after the last action of this rank that writes its gradients (the stage's last B or W),
so it travels while other stages compute and the pipeline drains; the step waits for them only
before it returns. Sharded parameters' gradients are reduce-scattered instead, in buckets of
padded shards (sharding.py). Outputs concatenated over microbatches (per-example values) stay this
replica's own slice. Every replica reduces the same buckets in the same order, so the
collectives match.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from ..runtime import PPGroup, Precision, Results, action_place, for_reduce, group_of, pp_group
from ..schedules import Action
from ..stages import Staged
from .sharding import launch_reduce_scatter, unpack_scatter
from .tp_collectives import activate

BUCKET_BYTES = 25 * 2**20
OVERLAP = True  # False: launch every bucket after the last action (the benchmark's baseline)
MESH_DIMS = ("dp", "pp", "tp")


@dataclasses.dataclass
class Groups:
    """The pipeline's process groups: "pp" (stages), "dp" (replicas) and "tp" (tensor
    parallelism inside stages); None where absent."""

    pp: PPGroup | None
    dp: PPGroup | None
    dp_mesh: Any = None  # the mesh's "dp" sub-mesh, where sharded parameters live
    tp: PPGroup | None = None
    tp_mesh: Any = None  # the mesh's "tp" sub-mesh, where tensor-parallel parameters live
    timeout: float = 0.0

    def each(self) -> list[PPGroup]:
        return [g for g in (self.pp, self.dp, self.tp) if g is not None]

    @property
    def replicas(self) -> int:
        return self.dp.size if self.dp is not None else 1

    def begin_call(self) -> None:
        for g in self.each():
            g.begin_call()
        if self.tp is not None:  # the tp group this call's programs run their collectives on
            activate(self.tp, self.timeout)

    def report_failure(self, err: BaseException) -> None:
        for g in self.each():
            g.report_failure(f"{g.me} failed: {type(err).__name__}: {err}")

    def forward_failure(self, err: BaseException) -> None:
        """A peer's failure (or a timeout) seen through one group, told to this rank's other
        groups: with tensor or data parallelism, a rank's neighbours are in several groups,
        and the ones waiting on this rank learn why at once instead of at their timeout."""
        for g in self.each():
            g.report_failure(str(err))


def mesh_groups(mesh: Any, timeout: float) -> Groups:
    """The pipeline group and the data-parallel group of `mesh` (all ranks form one pipeline
    without a mesh)."""
    if mesh is None:
        return Groups(pp_group(None, timeout), None)
    names = tuple(mesh.mesh_dim_names or ())
    unknown = [n for n in names if n not in MESH_DIMS]
    if unknown or "pp" not in names:
        raise ValueError(
            f"pipeline(mesh=...): the mesh has dimensions {names}; fpipe needs one named 'pp' and "
            f"knows {list(MESH_DIMS)} (unknown: {unknown}). Build it with, e.g., "
            "init_device_mesh(device, (dp, pp, tp), mesh_dim_names=('dp', 'pp', 'tp'))."
        )
    _check_covers_the_world(mesh, names)
    dp = group_of(mesh.get_group("dp")) if "dp" in names else None
    tp = group_of(mesh.get_group("tp")) if "tp" in names else None
    tp_mesh = mesh["tp"] if "tp" in names else None  # at size 1 too: its DTensors are tp ones
    return Groups(pp_group(mesh, timeout), dp, mesh["dp"] if dp else None, tp, tp_mesh, timeout)


def _check_covers_the_world(mesh: Any, names: tuple[str, ...]) -> None:
    """The mesh must hold every rank of the job, each once: a rank outside it has no place in
    a pipeline or a replica (refused before any collective)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mesh.size() != world:
        shape = " x ".join(f"{n}={s}" for n, s in zip(names, mesh.shape))
        raise ValueError(
            f"pipeline(mesh=...): the mesh ({shape}) holds {mesh.size()} ranks but the job has "
            f"{world} (torchrun --nproc-per-node x --nnodes); build the mesh over every rank, e.g. "
            f"init_device_mesh(device, (dp, pp), mesh_dim_names=('dp', 'pp')) with dp x pp = {world}."
        )


class GradReducer:
    """Sums one step's gradient sums over dp, bucket by bucket, as soon as each is final."""

    def __init__(
        self,
        dp: PPGroup,
        st: Staged,
        local: list[Action],
        summed: frozenset[int],
        sharded: dict[int, DTensor],
        timeout: float,
        precision: Precision | None = None,
    ):
        self.dp, self.timeout, self.sharded = dp, timeout, sharded  # sharded: output -> its parameter
        self.precision = precision  # the reduction's dtype (NOTE [precision policy] in precision.py)
        last = {action_place(a): a for a in local}  # each place's last action here
        order = {a: k for k, a in enumerate(local)}
        self.at: dict[Action, list[int]] = {}
        for i in sorted(summed):  # after the last action here that writes it (or a contribution)
            writers = [last[p] for p in (st.producer.get(n) for n in st.parts_of(i)) if p in last]
            a = max(writers, key=order.__getitem__, default=None)
            self.at.setdefault(a, []).append(i)  # type: ignore[arg-type]
        self.pending: list[tuple[Any, Callable[[Results], None]]] = []

    def after(self, a: Action, results: Results) -> None:
        """The runner's hook: launch the buckets whose gradients `a` finished."""
        if OVERLAP and a in self.at:
            self._launch(self.at.pop(a), results)

    def finish(self, results: Results) -> None:
        """Launch what no action finished (inputs returned as outputs), wait, store the sums."""
        for idx in list(self.at.values()):
            self._launch(idx, results)
        self.at.clear()
        what = f"summing gradients over {self.dp.size} data-parallel replicas"
        for work, store in self.pending:
            self.dp.wait_all([work], self.timeout, functools.partial(str, what), poll=True)
            store(results)
        self.pending.clear()

    def _launch(self, idx: list[int], results: Results) -> None:
        present = [i for i in idx if results.sums.get(i) is not None]
        for bucket in _buckets([i for i in present if i not in self.sharded], results.sums):
            flat = for_reduce(self.precision, _flatten_dense_tensors([results.sums[i] for i in bucket]))
            work = dist.all_reduce(flat, group=self.dp.group, async_op=True)
            self.pending.append((work, functools.partial(_store_sums, flat, bucket)))
        for bucket in _buckets([i for i in present if i in self.sharded], results.sums):
            params = [self.sharded[i] for i in bucket]  # reduce-scattered to the params' shards
            sums = [for_reduce(self.precision, results.sums[i]) for i in bucket]
            work, out = launch_reduce_scatter(self.dp, sums, params)
            self.pending.append((work, functools.partial(_store_shards, out, bucket, params)))


def _store_sums(flat: torch.Tensor, idx: list[int], results: Results) -> None:
    tensors = [results.sums[i] for i in idx]
    for i, t in zip(idx, _unflatten_dense_tensors(flat, tensors)):
        results.sums[i] = t


def _store_shards(out: torch.Tensor, idx: list[int], params: list[DTensor], results: Results) -> None:
    for i, shard in zip(idx, unpack_scatter(out, params)):
        results.sums[i] = shard  # type: ignore[assignment]


def _buckets(idx: list[int], sums: dict[int, torch.Tensor]) -> list[list[int]]:
    """`idx` in buckets of one dtype and at most BUCKET_BYTES each (a larger tensor alone)."""
    done: list[list[int]] = []
    filling: dict[torch.dtype, list[int]] = {}
    size: dict[torch.dtype, int] = {}
    for i in idx:
        t = sums[i]
        n = t.numel() * t.element_size()
        if filling.get(t.dtype) and size[t.dtype] + n > BUCKET_BYTES:
            done.append(filling.pop(t.dtype))
        if t.dtype not in filling:
            filling[t.dtype], size[t.dtype] = [], 0
        filling[t.dtype].append(i)
        size[t.dtype] += n
    return done + list(filling.values())


def reduce_values(
    dp: PPGroup, vals: list[torch.Tensor], reductions: list[str | int], timeout: float
) -> list[torch.Tensor]:
    """The global value of each output reduced over microbatches by 'mean' or 'sum' (in its
    dtype: `mean_of`)."""
    out = []
    for v, r in zip(vals, reductions):
        if r in ("mean", "sum"):
            v = v.clone()
            work = dist.all_reduce(v, group=dp.group, async_op=True)
            dp.wait_all([work], timeout, functools.partial(str, "summing outputs over replicas"), poll=True)
            v = mean_of(v, dp.size) if r == "mean" else v
        out.append(v)
    return out


def mean_of(total: torch.Tensor, n: int) -> torch.Tensor:
    """`total / n` in `total`'s dtype (NOTE [outputs keep their dtype] in out_reduce.py: an
    integer is averaged only when its `n` values are equal, so the division is exact)."""
    if n == 1:
        return total
    if total.is_floating_point() or total.is_complex():
        return total / n
    return torch.div(total, n, rounding_mode="floor")
