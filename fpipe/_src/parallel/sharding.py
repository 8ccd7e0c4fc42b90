"""Sharded parameters (ZeRO/FSDP-style): DTensors placed `Shard(0)` on the mesh's "dp" sub-mesh.

# NOTE [gathered stage by stage]
A step gathers a sharded parameter just before the first action of this rank that reads it
(`Gatherer.before`): every parameter that action's stage reads is gathered in one all-gather
per dtype, and the next stage's gather is launched at once, so it travels while this stage
computes (one stage ahead, as FSDP prefetches). After the last action of this rank that reads
a parameter, its whole tensor is dropped (`Gatherer.after`): with two stages on a rank (an
interleaved or V schedule), each stage's parameters are whole from its first action to its last,
not for the whole step. The gradient comes back reduce-scattered to the parameter's own
placement (`replicas.GradReducer`, in buckets: `launch_reduce_scatter`), so a stock optimizer
steps 1/dp of each parameter and keeps 1/dp of its state. A parameter two pipeline ranks share
(a tied embedding and head) has each rank's contribution reduce-scattered, then the shards summed
over those ranks (outputs.py); one read on several ranks but differentiated on one is sent to the
others as its shard (`broadcast_shard`).

Shard(0) splits dim 0 as `torch.chunk` does: c = ceil(n / dp) rows per rank, the last ranks
fewer (or none). Collectives move every shard padded to c rows, so one flat buffer holds each
rank's piece of several parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ..runtime import PPGroup, action_place
from ..schedules import Action
from ..tracing import like, local


def check_sharded(call: str, dp_mesh: Any, params: list[torch.Tensor], keys: list[Any]) -> None:
    """DTensor parameters must be sharded `Shard(0)` over the mesh's "dp" sub-mesh (the layout
    torch's `fully_shard` uses): refused otherwise, before any collective."""
    for i, p in enumerate(params):
        if not isinstance(p, DTensor):
            continue
        name = repr(keys[i]) if i < len(keys) else f"leaf {i}"
        if dp_mesh is None:
            raise ValueError(
                f"{call}: parameter {name} is a DTensor, but this pipeline has no data-parallel "
                "replicas (no 'dp' mesh dimension, or one of size 1), so there is nothing to "
                "shard it over; pass it as a plain tensor (its .full_tensor())."
            )
        if p.device_mesh != dp_mesh or tuple(p.placements) != (Shard(0),):
            raise ValueError(
                f"{call}: parameter {name} is a DTensor on mesh {p.device_mesh} with placements "
                f"{tuple(p.placements)}; fpipe shards parameters over data-parallel replicas only as "
                "Shard(0) on the pipeline mesh's 'dp' sub-mesh: distribute_tensor(t, mesh['dp'], "
                "[Shard(0)]), and over tensor-parallel ranks on its 'tp' sub-mesh "
                "(parallelize_module(model, mesh['tp'], plan)); both at once is not supported yet."
            )


def local_leaves(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter as this rank holds it: a sharded one as its shard (`Gatherer` puts the
    whole tensor in its place while this rank's programs read it)."""
    return [local(p) for p in params]


# -- the padded flat layout ------------------------------------------------------------------------


def _rows(p: DTensor) -> int:
    """Rows of one padded shard of `p`: ceil(dim 0 / dp)."""
    return -(-p.shape[0] // p.device_mesh.size())


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` with zero rows appended up to `rows`."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def _segments(params: list[DTensor]) -> list[tuple[int, int]]:
    """Each parameter's (offset, length) in one rank's piece of a flat buffer."""
    out, off = [], 0
    for p in params:
        n = _rows(p) * math.prod(p.shape[1:])
        out.append((off, n))
        off += n
    return out


def launch_gather(dp: PPGroup, params: list[DTensor]) -> tuple[Any, torch.Tensor]:
    """Start one all-gather of `params` (one dtype): (work, the gathered buffer)."""
    mine = torch.cat([_padded(p.to_local(), _rows(p)).reshape(-1) for p in params])
    out = mine.new_empty(dp.size * mine.numel())
    return dist.all_gather_single(out, mine, group=dp.group, async_op=True), out


def unpack_gather(out: torch.Tensor, params: list[DTensor]) -> list[torch.Tensor]:
    """The whole tensors of `params` from their gathered buffer."""
    k = params[0].device_mesh.size()
    by_rank = out.view(k, -1)
    return [
        by_rank[:, off : off + n].reshape(k * _rows(p), *p.shape[1:])[: p.shape[0]].contiguous()
        for p, (off, n) in zip(params, _segments(params))
    ]


def launch_reduce_scatter(
    dp: PPGroup, grads: list[torch.Tensor], params: list[DTensor]
) -> tuple[Any, torch.Tensor]:
    """Start one reduce-scatter (a sum) of whole gradients of `params` (one dtype): (work, this
    rank's buffer)."""
    k = dp.size
    pieces = [_padded(g, k * _rows(p)).reshape(k, -1) for g, p in zip(grads, params)]
    flat = torch.cat(pieces, dim=1)  # row r: rank r's piece of every gradient
    if dist.get_backend(dp.group) != "nccl":
        # gloo's reduce-scatter work reports neither completion nor a finished result when
        # waited on (torch 2.13: `wait()` returns before the output is written), so it cannot be
        # waited on with a deadline; an all-reduce of the same buffer gives every rank its row.
        work = dist.all_reduce(flat, group=dp.group, async_op=True)
        return work, flat[dp.rank]
    out = flat.new_empty(flat.shape[1])
    return dist.reduce_scatter_single(out, flat.reshape(-1), group=dp.group, async_op=True), out


def unpack_scatter(out: torch.Tensor, params: list[DTensor]) -> list[DTensor]:
    """This rank's gradient shards, as DTensors placed like `params`."""
    shards: list[DTensor] = []
    for p, (off, n) in zip(params, _segments(params)):
        local = out[off : off + n].view(_rows(p), *p.shape[1:])[: p.to_local().shape[0]]
        shards.append(like(local, p))  # type: ignore[arg-type]
    return shards


# -- stage by stage ------------------------------------------------------------------------------


@dataclasses.dataclass
class _Gather:
    work: Any
    out: torch.Tensor
    names: list[str]


class Gatherer:
    """Runner hooks that make sharded parameters whole while this rank's programs read them
    (NOTE [gathered stage by stage])."""

    def __init__(
        self,
        dp: PPGroup,
        params: dict[str, DTensor],
        consumers: dict[str, list[Any]],
        actions: list[Action],
        glob: dict[str, torch.Tensor],
        timeout: float,
        keep: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        """`consumers`: the places that read each parameter; `keep`: parameters never dropped
        back to their shards (the step returns them)."""
        self.dp, self.params, self.glob, self.timeout = dp, params, glob, timeout
        self.first: dict[Action, list[str]] = {}
        self.last: dict[Action, list[str]] = {}
        for name in params:
            places = set(consumers.get(name, ()))
            readers = [a for a in actions if action_place(a) in places]
            if readers:
                self.first.setdefault(readers[0], []).append(name)
                if name not in keep:
                    self.last.setdefault(readers[-1], []).append(name)
        order = [a for a in actions if a in self.first]
        self.next = dict(zip(order, order[1:]))  # the first reader of the next stage's parameters
        self.pending: dict[Action, list[_Gather]] = {}

    def before(self, a: Action) -> None:
        """Make whole what `a` is the first to read, and start the next stage's gather."""
        if a not in self.first:
            return
        self._launch(a)
        if a in self.next:
            self._launch(self.next[a])
        for g in self.pending.pop(a):
            what = f"gathering {len(g.names)} sharded parameter(s) over {self.dp.size} replicas"
            self.dp.wait_all([g.work], self.timeout, functools.partial(str, what), poll=True)
            self.glob.update(zip(g.names, unpack_gather(g.out, [self.params[n] for n in g.names])))

    def after(self, a: Action, _results: Any = None) -> None:
        """Drop the whole tensors `a` was the last to read (back to their shards); the
        runner's after-action hook."""
        for name in self.last.get(a, ()):
            self.glob[name] = self.params[name].to_local()

    def _launch(self, a: Action) -> None:
        if a in self.pending:
            return
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name in self.first[a]:
            by_dtype.setdefault(self.params[name].dtype, []).append(name)
        self.pending[a] = []
        for names in by_dtype.values():
            work, out = launch_gather(self.dp, [self.params[n] for n in names])
            self.pending[a].append(_Gather(work, out, names))


def broadcast_shard(pg: PPGroup, g: Any, param: DTensor, src: int, timeout: float) -> DTensor:
    """A sharded gradient from pipeline rank `src` to this rank, as a DTensor placed like `param`
    (both ranks have the same position on their own "dp" sub-mesh, so the same shard)."""
    shard = param.to_local()
    local = g.to_local().contiguous() if g is not None else torch.empty_like(shard)
    pg.broadcast(local, src, timeout, f"receiving a sharded gradient from rank {src}")
    return like(local, param)  # type: ignore[return-value]
