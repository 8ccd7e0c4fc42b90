"""Outputs: what a step returns, and which rank owns what.

Per output, the microbatch values are reduced as the compile step chose ('mean', 'sum', or
concatenated along an axis) on the rank that produced them, and broadcast to the others in a
process group. Gradients come back for `argnums`: summed over microbatches as the step ran
(parameters, and arguments passed whole) or concatenated (split arguments), rebuilt into the
structure of the argument they belong to. In a group a parameter's gradient is returned on the
ranks that use it (broadcast when several do, e.g. a tied embedding); `param_owner` names the
lowest such rank, the one that counts it (for `clip_grad_norm_`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..parallel import broadcast_shard, mean_of, reduce_values
from ..runtime import PPGroup, Results
from ..tracing import like, local, tree
from . import inputs as inputs_
from .compiler import Compiled
from .inputs import Inputs


def values(
    pg: PPGroup | None, dp: PPGroup | None, c: Compiled, results: list[list[Any]], m: int, timeout: float
) -> list[torch.Tensor]:
    """Reduce each value output over microbatches; in a group, broadcast it from its rank; with
    replicas, reduce the scalar ones over them (NOTE [gradients over replicas])."""
    out = _values(pg, c, results, m, timeout)
    return out if dp is None else reduce_values(dp, out, c.reductions[: len(out)], timeout)


class _NoBackward(torch.autograd.Function):
    """An output of a pipelined call in a process group: the identity forward; a backward raises
    (each rank holds only its stages' graph, so autograd would silently miss the others')."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(
            "fpipe: backward() through the output of a pipelined call in a process group: each "
            "rank holds only its own stages, so autograd cannot reach the others' parameters. "
            "Use fpipe.value_and_grad(piped) (or fpipe.grad), which runs the backward through "
            "every stage."
        )


def refuse_backward(vals: list[torch.Tensor], inp: Inputs) -> list[torch.Tensor]:
    """In a process group, with grad mode on and inputs requiring grad: outputs whose backward
    raises a clear error instead of giving gradients of this rank's stages only."""
    anchor = next((t for t in [*inp.param_leaves, *inp.data_leaves] if t.requires_grad), None)
    if anchor is None or not torch.is_grad_enabled():
        return vals
    return [_NoBackward.apply(v, anchor) if v.is_floating_point() else v for v in vals]


def _values(
    pg: PPGroup | None, c: Compiled, results: list[list[Any]], m: int, timeout: float
) -> list[torch.Tensor]:
    n = c.staged.n_outs
    if pg is None:
        return reduce([r[:n] for r in results], c.reductions)
    out = []
    for i in range(n):
        src = c.runner.rank_of(c.staged.producer[c.staged.out_names[i]])
        shape, dtype = _reduced_meta(c, i, m)  # what every rank expects: the traced dtype
        if src == pg.rank:
            val = reduce([[r[i]] for r in results], [c.reductions[i]])[0].contiguous()
            assert (val.shape, val.dtype) == (shape, dtype), (i, val.shape, val.dtype, shape, dtype)
        else:
            val = torch.empty(shape, dtype=dtype, device=pg.device)
        out.append(pg.broadcast(val, src, timeout, f"receiving output {i} from rank {src}"))
    return out


def cotangent(c: Compiled, parts: int) -> float:
    """The loss cotangent: 1/parts for a 'mean' loss over `parts` microbatches (x replicas), else 1."""
    return 1.0 / parts if c.reductions[0] == "mean" else 1.0


def reduce(per_mb: list[list[torch.Tensor]], reductions: Sequence[str | int]) -> list[torch.Tensor]:
    """Combine each output's microbatch values: their mean, their sum, or concatenated -- in
    their dtype (NOTE [outputs keep their dtype] in out_reduce.py)."""
    out = []
    for i, r in enumerate(reductions):
        vals = [mb[i] for mb in per_mb]
        if r == "mean":
            out.append(mean_of(_sum(vals), len(vals)))
        elif r == "sum":
            out.append(_sum(vals))
        else:
            out.append(torch.cat(vals, dim=int(r)))
    return out


def _sum(gs: list[torch.Tensor]) -> torch.Tensor:
    acc = gs[0]
    for g in gs[1:]:
        acc = acc + g
    return acc


def _reduced_meta(c: Compiled, i: int, m: int) -> tuple[torch.Size, torch.dtype]:
    """Output `i`'s shape and dtype once reduced over `m` microbatches (its traced dtype)."""
    shape, dtype = c.staged.meta[c.staged.out_names[i]]
    r = c.reductions[i]
    if isinstance(r, int):
        return torch.Size([d * m if k == r else d for k, d in enumerate(shape)]), dtype
    return shape, dtype


def grads(
    pg: PPGroup | None, inp: Inputs, c: Compiled, results: Results, nums: tuple[int, ...], timeout: float
) -> list[Any]:
    """The gradient pytree of each argument in `nums` (0: the params)."""
    m = len(results.per_mb)
    flat = {pos: _grad_of(pg, inp, c, results, j, pos, m, timeout) for j, pos in enumerate(c.diff)}
    for pos, spec in enumerate(inp.tp or ()):  # tensor-parallel: as a DTensor like its parameter
        if spec is not None and flat.get(pos) is not None:
            flat[pos] = spec.wrap(flat[pos])
    return [
        _rebuild_grad_tree(inp, num, [flat[p] for p in inputs_.positions_of_argnum(inp, num)]) for num in nums
    ]


def _grad_of(
    pg: PPGroup | None, inp: Inputs, c: Compiled, results: Results, j: int, pos: int, m: int, timeout: float
) -> torch.Tensor | None:
    """One input's gradient over all microbatches (see the module docstring for who gets it)."""
    axis, st = inp.axis_of(pos), c.staged
    i = st.n_outs + j
    name = st.out_names[i]
    srcs = set() if pg is None else {c.runner.rank_of(st.producer[n]) for n in st.parts_of(i)}
    src = min(srcs, default=None)
    g = None
    if pg is None or pg.rank in srcs:
        g = results.sums.get(i) if axis is None else torch.cat([r[i] for r in results.per_mb], dim=axis)
    if pg is None:
        return g
    users = {c.runner.rank_of(p) for p in st.consumers.get((st.param_inputs + st.data_inputs)[pos], [])}
    is_param = pos < len(inp.param_leaves)
    if is_param and len(users | srcs) == 1:
        return g
    if len(srcs) > 1:  # contributions of several ranks (NOTE [tied gradients] in split_tied.py)
        g = _sum_over_ranks(pg, g, inp.param_leaves[pos], timeout, results.dtypes.get(i))
        return g if pg.rank in users else None
    if is_param and isinstance(inp.param_leaves[pos], DTensor):
        g = broadcast_shard(pg, g, inp.param_leaves[pos], src, timeout)  # type: ignore[arg-type]
        return g if pg.rank in users else None
    if g is None:
        shape, dtype = st.meta[name][0], results.dtypes.get(i, st.meta[name][1])
        if axis is not None:
            shape = torch.Size([d * m if k == axis else d for k, d in enumerate(shape)])
        g = torch.empty(shape, dtype=dtype, device=pg.device)
    g = pg.broadcast(g.contiguous(), src, timeout, f"receiving a gradient from rank {src}")  # type: ignore[arg-type]
    return g if (not is_param or pg.rank in users) else None


def _sum_over_ranks(pg: PPGroup, g: Any, param: torch.Tensor, timeout: float, dtype: Any = None) -> Any:
    """A gradient whose contributions several pipeline ranks hold, summed: by one all-reduce over
    the pipeline group per step (a rank holding none adds zeros). A sharded one (a DTensor
    reduce-scattered over dp already) sums its shards: every rank at one dp position holds the
    same shard."""
    mine = local(param)
    dt = dtype or mine.dtype
    part = torch.zeros(mine.shape, dtype=dt, device=pg.device) if g is None else local(g).contiguous()
    pg.all_reduce(part, timeout, "summing a gradient's contributions over pipeline ranks")
    return like(part, param)


def _rebuild_grad_tree(inp: Inputs, num: int, grads: list[torch.Tensor | None]) -> Any:
    if num == 0:
        out = tree.unflatten(grads, inp.param_spec)
        return {k: v for k, v in out.items() if v is not None} if isinstance(out, dict) else out
    leaf_ids, spec = tree.flatten(inp.args_template()[num - 1])
    it = iter(grads)
    return tree.unflatten([next(it) if inp.is_tensor[i] else None for i in leaf_ids], spec)


# -- who owns what ------------------------------------------------------------------------------


def local_inputs(pg: PPGroup | None, c: Compiled, names: list[str]) -> set[int]:
    """Positions of the inputs in `names` that this rank's programs read."""
    if pg is None:
        return set(range(len(names)))
    return {
        i
        for i, n in enumerate(names)
        if any(c.runner.rank_of(p) == pg.rank for p in c.staged.consumers.get(n, []))
    }


def param_owner(cache: dict[Any, Compiled]) -> dict[str, int]:
    """For a params dict: the lowest pipeline rank that uses each parameter (from the compiled
    programs); a parameter several ranks share is counted by its owner alone."""
    out: dict[str, int] = {}
    for c in cache.values():
        keys = c.param_keys
        for i, name in enumerate(c.staged.param_inputs):
            ranks = [c.runner.rank_of(p) for p in c.staged.consumers.get(name, [])]
            if ranks and i < len(keys):
                out[keys[i]] = min(ranks)
    return out


def local_stages(pg: PPGroup | None, c: Compiled | None) -> list[int]:
    """The stages this rank runs (all of them in one process)."""
    if c is None:
        return []
    rank = pg.rank if pg is not None else None
    return [s for s, r in enumerate(c.runner.schedule.stage_rank) if rank is None or r == rank]
