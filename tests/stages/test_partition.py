"""Automatic cuts: `stages=N` on a function without boundaries, by the static estimate or by
measured times (`partition="measure"`).

The function below is built so that the two disagree: a batched matrix inverse (cubic work, a
small output) after a matrix product, then a chain of elementwise operations. The static
estimate rates the product far above the rest (flops vs elements written: 42.5 M of 59 M) and
cuts right after it; measured, the product is the smallest part (an `asinh` takes about as long
per element as the product per output element, and the chain has eight; 8-22x the product's
time, measured with one thread on a loaded machine), so the cut moves past the inverse. Either
way the gradients equal the unsplit function's (cuts never change results).

One intra-op thread (the `one_thread` fixture): with two on a loaded machine, each timing also
holds the other thread's wait at every parallel region, the timings swing several-fold and the
chain measured as little as 2x the product (a chain of `tanh` once measured under it).
"""

from __future__ import annotations

import copy

import pytest
import torch
from models import assert_trees_close, compiled

import fpipe

DT = torch.float64
N = 96
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py; timings without a 2nd thread's waits


def heavy_then_cheap(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = torch.linalg.inv(x @ w + 4 * torch.eye(N, dtype=x.dtype))
    for _ in range(8):
        h = torch.asinh(h) * 1.01
    return h.pow(2).mean()


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, N, generator=g, dtype=DT) / 10, torch.randn(48, N, N, generator=g, dtype=DT)


def _stage_of_inverse(piped: fpipe.Pipelined) -> int:
    staged = compiled(piped).staged
    return next(
        s
        for (kind, s), prog in staged.programs.items()
        if kind == "F" and any("linalg_inv" in str(n.target) for n in prog.gm.graph.nodes)
    )


@pytest.mark.parametrize(("partition", "inverse_on"), [("estimate", 1), ("measure", 0)])
def test_measured_costs_move_the_cut_past_the_heavy_operation(inputs, partition, inverse_on):
    piped = fpipe.pipeline(heavy_then_cheap, stages=2, microbatches=2, partition=partition)
    loss, grad = fpipe.value_and_grad(piped)(*inputs)
    assert_trees_close((loss, grad), torch.func.grad_and_value(heavy_then_cheap)(*inputs)[::-1])
    assert _stage_of_inverse(piped) == inverse_on
    costs = compiled(piped).stage_costs
    assert len(costs) == 2 and min(costs) > 0


@pytest.mark.parametrize("stages", [2, 3])
def test_measured_partition_of_a_gpt_matches_the_reference(stages):
    from models import GPT

    torch.manual_seed(0)
    fn, params = fpipe.functionalize(GPT().to(DT))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 11, (8, 5), generator=g), torch.randint(0, 11, (8, 5), generator=g)

    def loss(p, x, y):
        return torch.nn.functional.cross_entropy(fn(p, x).flatten(0, 1), y.flatten())

    piped = fpipe.pipeline(loss, stages=stages, microbatches=4, partition="measure")
    got = fpipe.value_and_grad(piped)(params, x, y)
    assert_trees_close(got, torch.func.grad_and_value(loss)(params, x, y)[::-1])
    assert compiled(piped).staged.n_stages == stages


def test_forward_and_value_and_grad_share_one_measurement(monkeypatch):
    """A plain call (or `materialize`) and `value_and_grad` compile separately; their cuts must
    agree -- `materialize` hands each rank the parameters of its stages -- so the operations are
    measured once and both cut from those times (timings vary between measurements)."""
    from models import GPT

    from fpipe._src.pipeline import compiler as api

    calls = []
    measure = api.measure_costs

    def counting(*args, **kwargs):
        calls.append(1)
        return measure(*args, **kwargs)

    monkeypatch.setattr(api, "measure_costs", counting)
    torch.manual_seed(0)
    fn, params = fpipe.functionalize(GPT().to(DT))
    x, y = torch.randint(0, 11, (8, 5)), torch.randint(0, 11, (8, 5))

    def loss(p, x, y):
        return torch.nn.functional.cross_entropy(fn(p, x).flatten(0, 1), y.flatten())

    piped = fpipe.pipeline(loss, stages=3, microbatches=2, partition="measure")
    piped(params, x, y)
    fpipe.value_and_grad(piped)(params, x, y)
    assert len(piped._cache) == 2 and len(calls) == 1
    reads = [  # per stage, the parameters (by position) its forward program reads
        {
            s: [i for i, name in enumerate(c.staged.param_inputs) if name in prog.inputs]
            for (kind, s), prog in c.staged.programs.items()
            if kind == "F"
        }
        for c in piped._cache.values()
    ]
    assert reads[0] == reads[1] and len(reads[0]) == 3 and all(reads[0].values())


def test_measuring_leaves_the_callers_buffers_alone():
    """Operations that update state in place (BatchNorm's running statistics) are not run by
    the measurement: after one step the buffers equal eager's after one forward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
    ).to(DT)
    eager = copy.deepcopy(model)
    fn, params = fpipe.functionalize(model)
    x = torch.randn(16, 4, dtype=DT)
    piped = fpipe.pipeline(lambda p, x: fn(p, x).pow(2).mean(), stages=2, microbatches=1, partition="measure")
    fpipe.value_and_grad(piped)(params, x)
    eager(x)
    got, want = dict(model.named_buffers()), dict(eager.named_buffers())
    assert int(got.pop("1.num_batches_tracked")) == int(want.pop("1.num_batches_tracked")) == 1
    assert_trees_close(got, want)


def test_operations_timed_at_zero_still_count_as_work(monkeypatch, inputs):
    """Tiny operations can time at 0 s (the clock's resolution, the measuring overhead taken
    off). They still exist: a measured cut into more stages than the operations timed above 0
    must work -- it once raised "stages=2 but the function has only 1 operations", on one rank
    of a job and not the others (found by fpipe.plan on 4 ranks)."""
    from fpipe._src.pipeline import compiler as api

    measure = api.measure_costs

    def one_timed(*args, **kwargs):
        times = measure(*args, **kwargs)
        top = max(times, key=times.get)
        return {n: (t if n is top else 0.0) for n, t in times.items()}

    monkeypatch.setattr(api, "measure_costs", one_timed)
    piped = fpipe.pipeline(heavy_then_cheap, stages=3, microbatches=2, partition="measure")
    loss, grad = fpipe.value_and_grad(piped)(*inputs)
    assert_trees_close((loss, grad), torch.func.grad_and_value(heavy_then_cheap)(*inputs)[::-1])
    assert compiled(piped).staged.n_stages == 3
