"""Measure: the cost of each forward operation, timed on the device that will run it.

`pipeline(f, stages=N, partition="measure")` cuts by these times instead of the static estimate
(`partition.node_cost`), which misjudges operations whose time is not their flops or the
elements they write (attention on CPU, cross-entropy, a matrix inverse). Each operation of the
forward graph runs on its own, at one microbatch's shapes, forward and then backward
(`torch.autograd.grad` with respect to its floating-point inputs); its cost is the fastest of a
few repetitions of the two together. Values flow through the graph as in a real forward, so
integer intermediates (indices) are valid. Parameters and buffers are stood in for by random
tensors (zeros if integer) created when an operation first reads them and freed after its last
reader: the caller's tensors are never touched (some operations update buffers in place without
saying so in their schema -- `native_batch_norm`), a model still on the meta device (too big for
one process) is measured too, and memory stays near one microbatch's activations plus a few
operations' weights.

In a process group every rank measures and the times are averaged over the pipeline ranks (one
all-reduce), so every rank cuts at the same places.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from ..tracing import Forward, written
from .partition import node_cost

__all__ = ["measure_costs"]


def _arguments(node: fx.Node, value: Any) -> Any:
    """`node`'s arguments, each one it writes a copy (NOTE [effects]): the caller's tensors and
    the values later operations read stay as they are."""
    mine = written([node])
    return tree_map(
        lambda n: value(n).clone() if isinstance(n, fx.Node) and n in mine else value(n),
        (node.args, node.kwargs),
    )


def _stand_in(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real tensor shaped like a meta one: small random floats, zeros otherwise (valid indices)."""
    if meta.is_floating_point() or meta.is_complex():
        return torch.randn(meta.shape, dtype=meta.dtype, device=device) * 0.02
    return torch.zeros(meta.shape, dtype=meta.dtype, device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_node(target: Any, args: Any, kwargs: Any, device: torch.device, reps: int) -> tuple[float, Any]:
    """Fastest of `reps` runs of the operation, forward then backward; and its output. An
    operation that can't be differentiated with respect to some input (SDPA's float mask) is
    timed forward only, its backward taken as twice that (a matrix product's ratio)."""
    leaves, _ = tree_flatten((args, kwargs))
    diff = [t for t in leaves if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]
    best, out, backward = float("inf"), None, bool(diff)
    for _ in range(reps):
        if backward:
            try:
                seconds, out = _timed(device, _forward_backward, target, args, kwargs, diff)
            except RuntimeError:
                backward = False
        if not backward:
            seconds, out = _timed(device, _forward, target, args, kwargs, diff)
            seconds *= 3
        best = min(best, seconds)
    return best, tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, out)


def _timed(device: torch.device, run: Any, *args: Any) -> tuple[float, Any]:
    """Wall seconds of `run(*args)` (the device synchronised around it), and its result."""
    _sync(device)
    start = time.perf_counter()
    out = run(*args)
    _sync(device)
    return time.perf_counter() - start, out


def _forward(target: Any, args: Any, kwargs: Any, diff: list[torch.Tensor]) -> Any:
    with torch.no_grad():
        return target(*args, **kwargs)


def _forward_backward(target: Any, args: Any, kwargs: Any, diff: list[torch.Tensor]) -> Any:
    ins = {id(t): t.detach().requires_grad_() for t in diff}
    a, k = tree_map(lambda v: ins.get(id(v), v), (args, kwargs))
    with torch.enable_grad():
        out = target(*a, **k)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        if outs:
            torch.autograd.grad(
                outs, list(ins.values()), [torch.ones_like(o) for o in outs], allow_unused=True
            )
    return out


def _harness_overhead(device: torch.device, reps: int) -> float:
    """What timing an operation costs by itself (Python, autograd): timed on a one-element add,
    and taken off every measurement, so many small operations don't outweigh a few large ones."""
    one = torch.ones(1, device=device)
    return min(_time_node(torch.ops.aten.add.Tensor, (one, one), {}, device, reps)[0] for _ in range(3))


def measure_costs(
    fwd: Forward,
    inputs: Sequence[torch.Tensor],
    device: torch.device,
    pg: Any = None,
    timeout: float = 600.0,
    reps: int = 3,
) -> dict[fx.Node, float]:
    """Seconds of forward + backward of each call in `fwd.gm`, at the shapes of `inputs`
    (`[*params, *data]` of one microbatch; the parameters only lend their shapes and dtypes)."""
    graph = fwd.gm.graph
    nodes = list(graph.nodes)
    last_use = {}
    for i, n in enumerate(nodes):
        for d in n.all_input_nodes:
            last_use[d] = i
    placeholders = [n for n in nodes if n.op == "placeholder"]
    real = [*inputs, *fwd.consts]
    env: dict[fx.Node, Any] = {}
    costs: dict[fx.Node, float] = {}

    def value(n: Any) -> Any:
        if not isinstance(n, fx.Node):
            return n
        if n not in env:  # a meta parameter: stood in for, for as long as its readers run
            env[n] = _stand_in(real[placeholders.index(n)], device)
        return env[n]

    overhead = _harness_overhead(device, reps)
    with torch.no_grad():  # data as it is; parameters always stood in for (never touched)
        for i, (ph, t) in enumerate(zip(placeholders, real)):
            if i >= fwd.n_params and not t.is_meta:
                env[ph] = t.to(device) if i < fwd.n_params + fwd.n_data else t.to(device, copy=True)
    for i, node in enumerate(nodes):
        if node.op != "call_function":
            continue
        args, kwargs = _arguments(node, value)
        if node.target is operator.getitem:
            env[node] = operator.getitem(*args)
            costs[node] = 0.0
        elif node_cost(node) == 0.0:  # a view: free in the static model, and here
            env[node] = node.target(*args, **kwargs)  # type: ignore[operator]
            costs[node] = 0.0
        else:
            seconds, env[node] = _time_node(node.target, args, kwargs, device, reps)
            costs[node] = max(seconds - overhead, 0.0)
        for d in node.all_input_nodes:
            if last_use.get(d) == i:
                env.pop(d, None)
    if pg is not None:
        order = list(costs)
        vec = torch.tensor([costs[n] for n in order], dtype=torch.float64, device=pg.device)
        work = dist.all_reduce(vec, group=pg.group, async_op=True)
        pg.wait_all([work], timeout, lambda: "averaging measured operation costs over the ranks")
        costs = dict(zip(order, (vec / pg.size).tolist()))
    return costs
