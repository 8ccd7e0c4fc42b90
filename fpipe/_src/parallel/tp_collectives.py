"""The tensor-parallel collectives of the stage programs, run by fpipe with failure-aware waits.

# NOTE [collectives in stage programs]
A tensor-parallel trace (tp.py) records DTensor's redistributions as functional collectives:
`_c10d_functional.all_reduce(x, "sum", group)` and so on, each followed by a `wait_tensor` at
the first use of its result. `rewrite` replaces each pair by one call of fpipe's own collective
on the pipeline's "tp" group (`TP_OPS`), before the joint graph is cut into programs, so

* a collective and its wait are never split between two programs (the cut follows data, and the
  wait follows the collective at once);
* a program's collectives are waited on the way fpipe waits on its transfers (`PPGroup.wait_all`):
  a failure another rank reports, or the pipeline's timeout, ends the wait with an error that
  names the rank, instead of blocking inside a collective for the process group's timeout;
* the programs name the group by role (`"tp"`), not by the process group's name, which differs
  from one pipeline rank to the next: every pipeline rank compares the same program text.

Every tp rank of a pipeline rank runs the same schedule, hence the same programs in the same
order (the I/W split included): their collectives match by order, as the stages' transfers do.
Gloo's reduce-scatter cannot be waited on with a deadline (sharding.py), so on gloo it is an
all-reduce of which each rank keeps its chunk.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from ..runtime import PPGroup

__all__ = ["TP_OPS", "activate", "rewrite"]

_C10D = torch.ops._c10d_functional
_WAIT = _C10D.wait_tensor.default
_ACTIVE: dict[str, tuple[PPGroup, float]] = {}  # "tp" -> this process's tp group and timeout
_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def activate(group: PPGroup, timeout: float) -> None:
    """Make `group` the "tp" group the programs' collectives run on: set by each call of a
    pipeline before it runs (a call holds its pipeline's lock; its failure reports and timeout
    are that pipeline's)."""
    _ACTIVE["tp"] = (group, timeout)


def _group() -> tuple[PPGroup, float]:
    if "tp" not in _ACTIVE:  # a program traced with tp ran after its pipeline was dropped
        raise RuntimeError("fpipe: a tensor-parallel program ran with no active 'tp' group")
    return _ACTIVE["tp"]


def _wait(work: Any, what: str) -> None:
    g, timeout = _group()
    g.wait_all([work], timeout, functools.partial(str, f"{what} over the tensor-parallel group"), poll=True)


def tp_all_reduce(x: torch.Tensor, op: str, _role: str) -> torch.Tensor:
    out = x.contiguous().clone()
    g, _ = _group()
    _wait(dist.all_reduce(out, _OPS[op], group=g.group, async_op=True), f"all-reduce ({op})")
    return out


def tp_all_gather(x: torch.Tensor, size: int, _role: str) -> torch.Tensor:
    """The shards of every tp rank concatenated along dim 0 (functional all_gather_into_tensor)."""
    g, _ = _group()
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    if dist.get_backend(g.group) == "nccl":
        _wait(dist.all_gather_into_tensor(out, x, group=g.group, async_op=True), "all-gather")
        return out
    parts = list(out.chunk(size))
    _wait(dist.all_gather(parts, x, group=g.group, async_op=True), "all-gather")
    return out


def tp_reduce_scatter(x: torch.Tensor, op: str, size: int, _role: str) -> torch.Tensor:
    """This rank's chunk (dim 0) of the reduction of `x` over the tp ranks."""
    g, _ = _group()
    x = x.contiguous()
    if dist.get_backend(g.group) == "nccl":
        out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
        _wait(dist.reduce_scatter_tensor(out, x, _OPS[op], group=g.group, async_op=True), "reduce-scatter")
        return out
    whole = x.clone()
    _wait(dist.all_reduce(whole, _OPS[op], group=g.group, async_op=True), "reduce-scatter")
    return whole.chunk(size)[g.rank].clone()


def tp_all_to_all(x: torch.Tensor, out_sizes: list[int], in_sizes: list[int], _role: str) -> torch.Tensor:
    g, _ = _group()
    x = x.contiguous()
    out = x.new_empty((sum(out_sizes) if out_sizes else x.shape[0], *x.shape[1:]))
    work = dist.all_to_all_single(out, x, out_sizes or None, in_sizes or None, group=g.group, async_op=True)
    _wait(work, "all-to-all")
    return out


def tp_broadcast(x: torch.Tensor, src: int, _role: str) -> torch.Tensor:
    g, _ = _group()
    out = x.contiguous().clone()
    _wait(dist.broadcast(out, g.global_rank(src), group=g.group, async_op=True), "broadcast")
    return out


# functional collective -> (fpipe's, position of its group argument)
TP_OPS: dict[Any, tuple[Any, int]] = {
    _C10D.all_reduce.default: (tp_all_reduce, 2),
    _C10D.all_gather_into_tensor.default: (tp_all_gather, 2),
    _C10D.reduce_scatter_tensor.default: (tp_reduce_scatter, 3),
    _C10D.all_to_all_single.default: (tp_all_to_all, 3),
    _C10D.broadcast.default: (tp_broadcast, 2),
}


def _alone(x: torch.Tensor, *_args: Any) -> torch.Tensor:
    """Any of the collectives over a tp dimension of size 1: the value itself."""
    return x.clone()


def _same_ranks(name: Any, tp_group_name: str | None) -> bool:
    """The traced collective's group is the tp group, or has its ranks: DTensor takes meshes of
    the same ranks and layout for one (`DeviceMesh.__eq__`, its sharding cache), so a model
    parallelized on one such mesh may trace collectives on the group of another."""
    if name == tp_group_name or tp_group_name is None or not isinstance(name, str):
        return name == tp_group_name
    resolve: Any = dist.distributed_c10d._resolve_process_group  # (takes a group name)
    try:
        theirs = dist.get_process_group_ranks(resolve(name))
    except (KeyError, ValueError, RuntimeError):
        return False
    return bool(theirs == dist.get_process_group_ranks(resolve(tp_group_name)))


def rewrite(call: str, gm: fx.GraphModule, tp_group_name: str | None, alone: bool = False) -> fx.GraphModule:
    """Each functional collective on the tp group -> fpipe's collective (`alone`: a tp dimension
    of size 1, the value itself); its waits -> nothing (NOTE [collectives in stage programs]).
    A collective on another group is refused."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _WAIT:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            continue
        if node.target not in TP_OPS:
            if str(getattr(node.target, "namespace", "")) == "_c10d_functional":
                raise ValueError(
                    f"{call}: the traced function runs {node.target}, a collective fpipe does not "
                    "run inside stage programs; tensor parallelism through DTensor uses all-reduce, "
                    "all-gather, reduce-scatter, all-to-all and broadcast."
                )
            continue
        fn, at = TP_OPS[node.target]
        if not _same_ranks(node.args[at], tp_group_name):
            raise ValueError(
                f"{call}: the traced function runs a collective on process group "
                f"{node.args[at]!r}, which is not the pipeline mesh's 'tp' dimension "
                f"({tp_group_name!r}); inside a pipelined function, DTensors must live on "
                "mesh['tp'] (collectives on other groups would not be ordered with the stages)."
            )
        node.target = _alone if alone else fn
        node.args = (*node.args[:at], "tp", *node.args[at + 1 :])
    gm.graph.lint()
    gm.recompile()
    return gm
