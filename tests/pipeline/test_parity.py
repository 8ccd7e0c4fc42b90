"""Pipelined loss and gradients equal `torch.func.grad_and_value` of the unsplit function.

For every model of the zoo, every pair of stages in {1, 2, 3, 4} and microbatches in {1, 4, 8},
with GPipe and 1F1B alternating over the pairs (each schedule meets every stage count and every
microbatch count of every model; tests/schedules/test_schedule_parity.py runs every schedule at every
microbatch count): `fpipe.value_and_grad(fpipe.pipeline(f, ...))(params, *args)` against the
reference computed on the same weights without any `stage_boundary` (fp64 within 1e-10; fp32 spot
checks within 1e-5).
Stages come from boundaries written in the model ("marked") or from `stages=S` alone ("auto").
Every loss is a mean over the batch, so the mean over microbatches is the full-batch loss --
except with BatchNorm in training mode, whose statistics are per microbatch: there the reference
runs the unsplit model on each microbatch in order.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import GPT, MLP, ConvBN, KwargsNet, TiedLM, assert_trees_close, compiled, lm_loss

import fpipe

STAGES = [1, 2, 3, 4]
MICROBATCHES = [1, 4, 8]
SCHEDULES = ["gpipe", "1f1b"]
BATCH = 8


@dataclasses.dataclass
class Case:
    """A loss function of a functionalized model, its inputs and its module."""

    f: Callable[..., torch.Tensor]
    params: dict[str, torch.Tensor]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    module: torch.nn.Module


def _data(kind: str, dtype: torch.dtype) -> tuple[tuple[Any, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(1)
    if kind.startswith("mlp"):
        return (
            torch.randn(BATCH, 6, generator=g, dtype=dtype),
            torch.randn(BATCH, 3, generator=g, dtype=dtype),
        ), {}
    if kind.startswith(("gpt", "tied")):
        return (
            torch.randint(0, 11, (BATCH, 5), generator=g),
            torch.randint(0, 11, (BATCH, 5), generator=g),
        ), {}
    if kind.startswith("kwargs"):
        x = torch.randn(BATCH, 6, generator=g, dtype=dtype)
        mask = (torch.rand(BATCH, 8, generator=g) > 0.3).to(dtype)
        return (x,), {"mask": mask, "scale": 0.5}
    raise AssertionError(kind)


def _module(kind: str, stages: int | None, dtype: torch.dtype) -> torch.nn.Module:
    """The model of `kind`; the same weights for every `stages` (boundaries only for 'marked')."""
    marked = stages if kind.endswith("marked") else None
    torch.manual_seed(0)
    if kind.startswith("mlp"):
        return MLP(stages=marked).to(dtype)
    if kind.startswith("gpt"):
        return GPT(stages=marked).to(dtype)
    if kind.startswith("tied"):
        return TiedLM(stages=marked).to(dtype)
    if kind.startswith("kwargs"):
        return KwargsNet(stages=marked).to(dtype)
    raise AssertionError(kind)


def _loss_fn(kind: str, fn: fpipe.Functionalized) -> Callable[..., torch.Tensor]:
    if kind.startswith("mlp"):

        def mlp_loss(params, x, y):
            return (fn(params, x) - y).pow(2).sum(-1).mean()

        return mlp_loss
    if kind.startswith(("gpt", "tied")):

        def gpt_loss(params, idx, targets):
            return lm_loss(fn(params, idx), targets)

        return gpt_loss

    def kwargs_loss(params, x, *, mask, scale):
        out = fn(params, x, mask=mask, scale=scale)
        return out["out"].pow(2).sum(-1).mean() + out["hidden"].sin().mean()

    return kwargs_loss


class Zoo:
    """Builds each case and its reference once per test module."""

    def __init__(self) -> None:
        self._cases: dict[tuple[Any, ...], Case] = {}
        self._refs: dict[tuple[Any, ...], Any] = {}

    def case(self, kind: str, stages: int | None, dtype: torch.dtype) -> Case:
        key = (kind, stages if kind.endswith("marked") else None, dtype)
        if key not in self._cases:
            module = _module(kind, key[1], dtype)
            fn, params = fpipe.functionalize(module)
            args, kwargs = _data(kind, dtype)
            self._cases[key] = Case(_loss_fn(kind, fn), params, args, kwargs, module)
        return self._cases[key]

    def reference(self, kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, grads) of the unsplit function: the model without boundaries, same weights."""
        key = (kind, dtype)
        if key not in self._refs:
            c = self.case(kind, None, dtype)
            grads, loss = torch.func.grad_and_value(c.f)(c.params, *c.args, **c.kwargs)
            self._refs[key] = (loss, grads)
        return self._refs[key]


@pytest.fixture(scope="module")
def zoo() -> Zoo:
    return Zoo()


KINDS = ["mlp-auto", "mlp-marked", "gpt-marked", "tied-marked", "kwargs-auto"]


def _run(
    zoo: Zoo, kind: str, stages: int, microbatches: int, schedule: str, dtype: torch.dtype, **options: Any
):
    case = zoo.case(kind, stages, dtype)
    ref_params = zoo.case(kind, None, dtype).params
    assert_trees_close(case.params, ref_params, dtype)  # the boundaries changed no weight
    piped = fpipe.pipeline(case.f, stages=stages, microbatches=microbatches, schedule=schedule, **options)
    loss, grads = fpipe.value_and_grad(piped)(case.params, *case.args, **case.kwargs)
    ref_loss, ref_grads = zoo.reference(kind, dtype)
    assert_trees_close(loss, ref_loss, dtype)
    assert_trees_close(grads, ref_grads, dtype)
    assert compiled(piped).staged.n_stages == stages
    return piped


def _schedule_of(stages: int, microbatches: int, offset: int = 0) -> str:
    """GPipe or 1F1B, alternating over the (stages, microbatches) grid: along every row and every
    column of it both appear. The schedule changes only the order in which one process runs the
    same programs (traced once per case, the cost of a case), so both schedules on every pair
    would trace every program twice for that order alone."""
    return SCHEDULES[(stages + MICROBATCHES.index(microbatches) + offset) % 2]


def _matrix(kinds):
    """Every (stages, microbatches) pair of every kind, the schedule alternating (shifted by one
    from kind to kind: each pair meets both schedules over the kinds)."""
    return [
        (kind, s, m, _schedule_of(s, m, k))
        for k, kind in enumerate(kinds)
        for s in STAGES
        for m in MICROBATCHES
    ]


@pytest.mark.parametrize(("kind", "stages", "microbatches", "schedule"), _matrix(KINDS))
def test_value_and_grad_fp64(zoo, kind, stages, microbatches, schedule):
    _run(zoo, kind, stages, microbatches, schedule, torch.float64)


@pytest.mark.parametrize(
    ("kind", "stages", "microbatches", "schedule"),
    [
        ("mlp-auto", 4, 8, "gpipe"),
        ("gpt-marked", 3, 4, "1f1b"),
        ("tied-marked", 4, 8, "1f1b"),
        ("kwargs-auto", 2, 4, "gpipe"),
    ],
)
def test_value_and_grad_fp32(zoo, kind, stages, microbatches, schedule):
    _run(zoo, kind, stages, microbatches, schedule, torch.float32)


@pytest.mark.parametrize(("kind", "schedule"), [("gpt-marked", "1f1b"), ("tied-marked", "zb-h1")])
def test_programs_accumulate_the_gradients(zoo, monkeypatch, kind, schedule):
    """With several microbatches each parameter's gradient is added into its running sum inside
    the program that computes it (`run.accumulating`): every rewritten program runs, no summed
    gradient passes through the runtime's own sum, and the result equals the reference. Each
    Linear weight's gradient is added inside its matrix product (`addmm_`); the tied matrix's
    gradient has one part per stage (NOTE [tied gradients] in split_tied.py): the head's product is
    added inside the product too, the lookup's after it, into the same running sum."""
    from fpipe._src.runtime import run

    rewritten, put, programs = [], [], {}
    accumulating, results_put = run.accumulating, run.Results.put

    def spy_accumulating(prog, names, *widen):
        gm, done = accumulating(prog, names, *widen)
        rewritten.extend(name for name, _ in done)
        programs[id(gm)] = gm
        return gm, done

    def spy_put(self, mb, i, value):
        if i in self.summed:
            put.append(i)
        results_put(self, mb, i, value)

    monkeypatch.setattr(run, "accumulating", spy_accumulating)
    monkeypatch.setattr(run.Results, "put", spy_put)
    piped = _run(zoo, kind, 2, 4, schedule, torch.float64)
    staged = compiled(piped).staged
    grads = staged.out_names[staged.n_outs :]
    assert sorted(set(rewritten)) == sorted(set(grads)), "every gradient is summed by its program"
    assert len(rewritten) == 4 * len(grads) and not put
    in_product = [
        n for gm in programs.values() for n in gm.graph.nodes if n.target is torch.ops.aten.addmm_.default
    ]
    module = zoo.case(kind, 2, torch.float64).module
    tied_heads = 1 if kind.startswith("tied") else 0
    assert len(in_product) == sum(isinstance(m, torch.nn.Linear) for m in module.modules()) + tied_heads


def test_compiled_programs(zoo, monkeypatch):
    """compile=True: every program that runs is compiled, the variants that add gradients into
    their running sums included (zb-h1: I and W programs), and the result equals the reference."""
    from fpipe._src.runtime import run

    compiled_variants, compile_ = [], torch.compile

    def spy_compile(gm, **kwargs):
        compiled_variants.append(gm)
        return compile_(gm, **kwargs)

    monkeypatch.setattr(run.torch, "compile", spy_compile)
    piped = _run(zoo, "mlp-marked", 2, 2, "zb-h1", torch.float64, compile=True)
    programs = compiled(piped).staged.programs
    assert sorted(programs) == [("F", 0), ("F", 1), ("I", 0), ("I", 1), ("W", 0), ("W", 1)]
    for prog in programs.values():
        assert prog.compile == {}
        assert prog.__dict__.get("_compiled"), f"{prog.place} ran uncompiled"
    rewritten = [
        gm for prog in programs.values() for gm, _ in prog.__dict__.get("_accumulating", {}).values()
    ]
    assert rewritten and all(gm is not None and gm in compiled_variants for gm in rewritten)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_gpt_auto_partition(zoo, stages):
    """The GPT without boundaries, cut by fpipe: also the reference of 'gpt-marked'."""
    _run(zoo, "gpt-auto", stages, 4, "1f1b", torch.float64)


@pytest.mark.parametrize("stages", [3, 4])
def test_gpt_skip_crosses_boundaries(zoo, stages):
    """The embedding output is read again by the last stage: a value from F0 consumed at F(S-1)."""
    staged = compiled(_run(zoo, "gpt-marked", stages, 4, "1f1b", torch.float64)).staged
    crossing = [
        v
        for v, places in staged.consumers.items()
        if staged.producer.get(v) == ("F", 0) and ("F", stages - 1) in places
    ]
    assert crossing, staged.describe()


@pytest.mark.parametrize("stages", [2, 4])
def test_tied_weight_used_by_first_and_last_stage(zoo, stages):
    case = zoo.case("tied-marked", stages, torch.float64)
    staged = compiled(_run(zoo, "tied-marked", stages, 4, "gpipe", torch.float64)).staged
    leaves = fpipe._src.tracing.tree.flatten(case.params)[0]
    name = staged.param_inputs[next(i for i, t in enumerate(leaves) if t is case.params["tok.weight"])]
    assert {("F", 0), ("F", stages - 1)} <= set(staged.consumers[name])
    assert [k for k, v in case.params.items() if v.shape == (11, 8)] == ["tok.weight"]


@pytest.mark.parametrize("stages", [2, 4])
def test_tied_gradient_contributions_stay_on_their_stages(zoo, stages):
    """NOTE [tied gradients]: the head's and the lookup's contributions to the tied matrix's
    gradient are two step outputs, each summed over microbatches on its own stage; no value of
    the matrix's shape crosses from one program to another (once per microbatch, as the joint
    graph's addition on stage 0 would need)."""
    staged = compiled(_run(zoo, "tied-marked", stages, 4, "1f1b", torch.float64)).staged
    case = zoo.case("tied-marked", stages, torch.float64)
    j = next(
        i
        for i, t in enumerate(fpipe._src.tracing.tree.flatten(case.params)[0])
        if t is case.params["tok.weight"]
    )
    i = staged.n_outs + j
    parts = staged.parts_of(i)
    assert sorted(staged.producer[n][1] for n in parts) == [0, stages - 1], (parts, staged.partial_of)
    crossing = [
        v
        for v, places in staged.consumers.items()
        if v in staged.producer and any(p != staged.producer[v] for p in places)
    ]
    assert crossing and not [v for v in crossing if staged.meta[v][0] == (11, 8)], crossing


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_boundaries_decide_stages_when_stages_is_none(zoo, stages):
    case = zoo.case("mlp-marked", stages, torch.float64)
    piped = fpipe.pipeline(case.f, microbatches=4)
    loss, grads = fpipe.value_and_grad(piped)(case.params, *case.args)
    assert compiled(piped).staged.n_stages == stages
    ref_loss, ref_grads = zoo.reference("mlp-marked", torch.float64)
    assert_trees_close((loss, grads), (ref_loss, ref_grads))


@pytest.mark.parametrize("kind", KINDS)
def test_forward_call_equals_function(zoo, kind):
    """Calling the pipelined function (no gradient) returns f's value."""
    case = zoo.case(kind, 3, torch.float64)
    piped = fpipe.pipeline(case.f, stages=3, microbatches=4)
    assert_trees_close(
        piped(case.params, *case.args, **case.kwargs), case.f(case.params, *case.args, **case.kwargs)
    )


def test_second_call_reuses_the_program_with_new_values(zoo):
    """The compiled program is cached per signature; new parameter and data values flow through."""
    case = zoo.case("gpt-marked", 3, torch.float64)
    piped = fpipe.pipeline(case.f, stages=3, microbatches=4)
    vg = fpipe.value_and_grad(piped)
    vg(case.params, *case.args)
    params = {k: v + 0.01 * torch.randn_like(v) for k, v in case.params.items()}
    idx, targets = (torch.randint(0, 11, a.shape) for a in case.args)
    loss, grads = vg(params, idx, targets)
    assert len(piped._cache) == 1
    ref_grads, ref_loss = torch.func.grad_and_value(case.f)(params, idx, targets)
    assert_trees_close((loss, grads), (ref_loss, ref_grads))


# -- BatchNorm in training mode --------------------------------------------------------------------


@dataclasses.dataclass
class BNRef:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]  # after the reference step


class BNZoo:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.base = ConvBN().to(torch.float64).train()
        g = torch.Generator().manual_seed(2)
        self.x = torch.randn(BATCH, 3, 6, 6, generator=g, dtype=torch.float64)
        self.y = torch.randint(0, 3, (BATCH,), generator=g)
        self._refs: dict[int, BNRef] = {}

    def reference(self, microbatches: int) -> BNRef:
        """The unsplit model on each microbatch in order, params and buffers passed explicitly."""
        if microbatches not in self._refs:
            module = copy.deepcopy(self.base)
            params = {k: v.detach() for k, v in module.named_parameters()}
            buffers = {k: v.clone() for k, v in module.named_buffers()}

            def loss(params, buffers, x, y):
                losses = [
                    F.cross_entropy(torch.func.functional_call(module, (params, buffers), (xc,)), yc)
                    for xc, yc in zip(x.chunk(microbatches), y.chunk(microbatches))
                ]
                return sum(losses) / microbatches

            grads, value = torch.func.grad_and_value(loss)(params, buffers, self.x, self.y)
            self._refs[microbatches] = BNRef(value, grads, buffers)
        return self._refs[microbatches]

    def eager_statistics(self, microbatches: int) -> dict[str, torch.Tensor]:
        """Running statistics after eager training steps over the microbatches, in order."""
        module = copy.deepcopy(self.base)
        for xc in self.x.chunk(microbatches):
            module(xc)
        return {k: v.detach() for k, v in module.named_buffers()}


@pytest.fixture(scope="module")
def bn() -> BNZoo:
    return BNZoo()


@pytest.mark.parametrize(
    ("stages", "microbatches", "schedule"),
    [(s, m, _schedule_of(s, m)) for s in STAGES for m in MICROBATCHES],
)
def test_batchnorm_training(bn, stages, microbatches, schedule):
    module = ConvBN(stages=stages).to(torch.float64).train()
    module.load_state_dict(bn.base.state_dict())
    fn, params = fpipe.functionalize(module)

    def loss_fn(params, x, y):
        return F.cross_entropy(fn(params, x), y)

    piped = fpipe.pipeline(loss_fn, stages=stages, microbatches=microbatches, schedule=schedule)
    loss, grads = fpipe.value_and_grad(piped)(params, bn.x, bn.y)
    assert compiled(piped).staged.n_stages == stages
    ref = bn.reference(microbatches)
    assert_trees_close(loss, ref.loss)
    assert_trees_close(grads, ref.grads)
    buffers = dict(module.named_buffers())
    eager = bn.eager_statistics(microbatches)
    for name, value in buffers.items():
        if value.is_floating_point():
            assert_trees_close(value, ref.buffers[name])
            assert_trees_close(value, eager[name])
        else:
            assert value.item() == ref.buffers[name].item() == eager[name].item() == microbatches, name
    assert not torch.equal(buffers["bn1.running_mean"], bn.base.bn1.running_mean)  # it did train
