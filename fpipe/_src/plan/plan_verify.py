"""Verify a plan's best candidates by timing real steps on the job's ranks.

# NOTE [plan verification]
The predictions (NOTE [how fpipe.plan predicts] in plan.py) ran 0-33 % under the measured steps
on a shared 2-core host, and the top layouts often lie within 10 % of each other: closer than
the error, so a ranking by prediction alone picks among them by noise. Under torchrun,
`plan(..., verify=k)` builds each of the k best predicted candidates as the job will run it
(`pipeline(c.function, plan=c)`, its mesh and the replica's share of the batch) and times it:
value-and-grad plus the optimizer's step over this rank's gradients, one warm-up step and
`_STEPS` timed, the median, the slowest rank's (every rank times the same steps, so every rank
gets the same figures and the same pick). The fastest measured becomes the plan; the verified
candidates come first in `candidates`, by measured step, the rest after them by prediction.
Its cost is bounded by k: one build and 1 + `_STEPS` steps per candidate, outside `budget_s`
(which bounds the measuring before it). In one process there is no job to time on, and nothing is verified.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..pipeline import pipeline, value_and_grad
from ..training import set_grads
from .plan_cost import OPTIMIZERS, agree, world

__all__ = ["verify"]

_STEPS = 3


def _replica(args: Any, c: Any) -> Any:
    """This rank's replica's rows of every batched tensor (a ("dp", "pp", "tp") mesh: rank =
    (dp index * pp + pp index) * tp + tp index)."""
    i = world()[0] // (c.pp * c.tp)

    def rows(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        n = t.shape[0] // c.dp
        return t[i * n : (i + 1) * n]

    return tree_map(rows, args)


def step_seconds(f: Any, params: Any, args: Any, kwargs: Any, c: Any, optimizer: str) -> float:
    """The median seconds of a real step of candidate `c` on this job, the slowest rank's."""
    piped = value_and_grad(pipeline(f, plan=c))
    args, kwargs = _replica((args, kwargs), c)
    mine = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    cls = OPTIMIZERS[optimizer][0]
    opt: torch.optim.Optimizer | None = None
    times = []
    for i in range(1 + _STEPS):
        agree([0.0])  # the ranks start each step together (an all-reduce under fpipe's deadline)
        start = time.perf_counter()
        _, grads = piped(mine, *args, **kwargs)
        if cls is not None and grads:  # (a rank whose stages read no parameter has none)
            set_grads(mine, grads)
            opt = opt or cls([mine[k] for k in grads], lr=1e-3)
            opt.step()
            opt.zero_grad()
        if i:
            times.append(time.perf_counter() - start)
    return agree([statistics.median(times)], "max")[0]


def verify(args: Any, kwargs: Any, best: Any, k: int, optimizer: str, steps: dict[Any, float]) -> Any:
    """`best` (a ranked Plan) with its first `k` candidates timed on this job and the fastest of
    them chosen (NOTE [plan verification]); unchanged in one process or with k = 0. `steps`
    caches the measured seconds by (layout, stages) for a later call with the same inputs."""
    if k <= 0 or world()[1] == 1:
        return best
    timed: list[Any] = []
    start = time.perf_counter()
    for c in best.candidates[:k]:
        key = (c.layout, c.stages)
        if key not in steps:
            steps[key] = step_seconds(c.function, c.params, args, kwargs, c, optimizer)
        timed.append(dataclasses.replace(c, measured_step_s=steps[key]))
    timed.sort(key=lambda c: c.measured_step_s)
    rest = best.candidates[len(timed) :]
    return dataclasses.replace(
        timed[0], candidates=tuple(timed) + rest, dropped=best.dropped, verified=len(timed),
        measure_s=best.measure_s + (time.perf_counter() - start if best.measure_s else 0.0),
    )  # fmt: skip
