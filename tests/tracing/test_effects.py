"""The effects analysis (fpipe/_src/tracing/effects.py, NOTE [effects]): which operations write what,
checked against torch's op list, and each pass that copies, moves or drops operations asking it.

Issue 24's cases 1-4 (a buffer written in place and read by recomputed values; BatchNorm's
running statistics under a limit; checkpoint regions with dropout or an in-place op; reentrant
checkpoints) each have a test here, against the unsplit function in float64.
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from models import ConvBN, StepCounter
from torch.fx.experimental.proxy_tensor import make_fx

import fpipe
import fpipe._src.generate.kv_writes as kv_writes
import fpipe._src.memory.memory_graph as memory_graph
import fpipe._src.memory.remat as remat
import fpipe._src.memory.remat_walk as remat_walk
from fpipe._src.stages import measure, partition, split, split_iw
from fpipe._src.tracing import effects, trace
from fpipe._src.tracing.rng import seeded

DT = torch.float64
aten = torch.ops.aten


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# -- the op list ------------------------------------------------------------------------------------

# An argument that looks like state an operation could keep between calls: running statistics,
# optimizer state, RNG state, a scale's growth tracker.
_STATE = re.compile(
    r"^running_|_state$|^state_|sobolstate|num_batches|exp_avg|found_inf|growth_tracker|momentum_buffer|philox"
)


def _unmarked_state(schema: Any) -> list[str]:
    """The tensor arguments of `schema` named like state that its schema does not mark written."""
    return [
        a.name
        for a in schema.arguments
        if "Tensor" in str(a.type)
        and not (a.alias_info is not None and a.alias_info.is_write)
        and _STATE.search(a.name)
    ]


def test_every_state_argument_in_torchs_op_list_is_classified():
    """Every aten operation taking state its schema does not mark written is classified: a hidden
    write (`HIDDEN_WRITES`) or read only (`READS_STATE`). A new torch operation of that shape
    fails here until it is classified."""
    unclassified = sorted(
        {
            s.name
            for s in torch._C._jit_get_all_schemas()
            if s.name.startswith("aten::") and _unmarked_state(s)
        }
        - effects.HIDDEN_WRITES.keys()
        - effects.READS_STATE.keys()
    )
    assert unclassified == [], f"classify these in fpipe/_src/tracing/effects.py: {unclassified}"
    both = effects.HIDDEN_WRITES.keys() & effects.READS_STATE.keys()
    assert not both


def test_hidden_writes_name_optional_arguments_of_real_operations():
    """Each hidden write names arguments the operation has, optional ones (a recomputation runs it
    with None there: `effects.replay`), and a bool condition the operation takes."""
    schemas = {}
    for s in torch._C._jit_get_all_schemas():
        schemas.setdefault(s.name, []).append(s)
    for name, (args, when) in effects.HIDDEN_WRITES.items():
        assert name in schemas, name
        for s in schemas[name]:
            types = {a.name: str(a.type) for a in s.arguments}
            assert all(types[a] == "Optional[Tensor]" for a in args), (name, s)
            assert when is None or types[when] == "bool", (name, s)


def _make_fx(f: Any, args: tuple[torch.Tensor, ...]) -> fx.GraphModule:
    return make_fx(f)(*args)


def test_writes_are_the_schemas_and_batchnorms_hidden_ones():
    """BatchNorm writes its running statistics in training only, and runs again without them;
    a `copy_` into an input writes it (and never runs again); the memory walk's alias."""
    x, rm, rv = torch.randn(4, 3), torch.zeros(3), torch.ones(3)

    def f(x, rm, rv, training):
        return aten.native_batch_norm(x, None, None, rm, rv, training, 0.1, 1e-5)[0]

    for training in [True, False]:
        gm = _make_fx(functools.partial(f, training=training), (x, rm, rv))
        (bn,) = gm.graph.find_nodes(op="call_function", target=aten.native_batch_norm.default)
        stats = bn.args[3:5]
        assert effects.writes(bn) == (list(stats) if training else [])
        assert effects.is_mutating(bn) == training
        assert effects.replay(bn)[0][3:5] == ((None, None) if training else stats)  # type: ignore[index]
    gm = trace.functional(_make_fx(lambda x, c: c.add_(x.sum()), (x, torch.zeros(()))), [x, torch.zeros(())])
    (cp,) = gm.graph.find_nodes(op="call_function", target=aten.copy_.default)
    assert effects.writes(cp) == [cp.args[0]] and effects.replay(cp) is None
    assert effects.written_inputs(gm.graph) == {cp.args[0]}
    assert effects.output_alias(cp) is cp.args[0]  # the memory walk: a write allocates nothing


def test_every_consumer_asks_the_effects_module():
    """One answer: the passes that copy, move or drop operations import it, none keeps its own."""
    assert split.is_mutating is split_iw.is_mutating is remat.is_mutating is effects.is_mutating
    assert remat_walk.replay is effects.replay and partition.is_mutating is effects.is_mutating
    assert split.written_inputs is remat_walk.written_inputs is effects.written_inputs
    assert measure.written is effects.written and memory_graph.output_alias is effects.output_alias
    assert kv_writes.writes is effects.writes
    assert not hasattr(trace, "is_mutating") or trace.is_mutating is effects.is_mutating


# -- consumers ------------------------------------------------------------------------------------


def test_split_computes_a_read_of_running_statistics_once():
    """A value read from a BatchNorm's running mean before the BatchNorm updates it, used on two
    stages: the split computes it once and sends it (a copy on the second stage would read the
    updated statistics)."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(4).to(DT)
    bn.running_mean.normal_()
    fn, params = fpipe.functionalize(bn)
    x = torch.randn(8, 4, dtype=DT)

    def f(p, x):
        c = bn.running_mean * 2.0
        h = fpipe.stage_boundary(fn(p, x) + c)
        return (h * c).pow(2).mean()

    start = bn.running_mean.clone()
    got = fpipe.pipeline(f, microbatches=1)(params, x)
    bn.running_mean.copy_(start)
    bn.num_batches_tracked.zero_()
    torch.testing.assert_close(got, f(params, x), rtol=0, atol=0)


@pytest.mark.parametrize("auto", [False, True], ids=["boundary", "partition"])
def test_a_batchnorm_run_for_its_statistics_alone_is_never_dropped(auto):
    """The split and the automatic partition drop dead work, never a write: a BatchNorm whose
    output nothing reads still updates its running statistics (base: not updated, its counter
    was)."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(8).to(DT)
    ref = copy.deepcopy(bn)
    fn, params = fpipe.functionalize(bn)
    params = {**params, "w": torch.randn(8, 8, dtype=DT)}
    x = torch.randn(16, 8, dtype=DT)

    def f(p, x):
        fn({k: v for k, v in p.items() if k != "w"}, x)  # for its statistics only
        h = torch.tanh(x @ p["w"])
        return torch.tanh((h if auto else fpipe.stage_boundary(h)) @ p["w"]).pow(2).mean()

    fpipe.value_and_grad(fpipe.pipeline(f, microbatches=2, stages=2 if auto else None))(params, x)
    for xb in x.chunk(2):
        ref(xb)
    torch.testing.assert_close(dict(bn.named_buffers()), dict(ref.named_buffers()), rtol=0, atol=1e-15)


def test_zero_bubble_keeps_batchnorm_statistics_exact():
    """The I/W split (zero-bubble schedules) and the split: the running statistics after a step
    equal the unsplit module's, microbatch by microbatch."""
    _, grads, stats, ref_grads, ref_stats = _convbn_step("zb-h1", None)
    torch.testing.assert_close(stats, ref_stats, rtol=0, atol=1e-12)
    torch.testing.assert_close(grads, ref_grads)


def test_measuring_runs_writes_on_copies():
    """`partition="measure"` times BatchNorm's update and a write into the data on copies: the
    caller's tensors are as they were, and the step is exact."""
    torch.manual_seed(0)
    model = ConvBN(stages=None).to(DT)
    fn, params = fpipe.functionalize(model)
    x = torch.randn(4, 3, 6, 6, dtype=DT)
    before = copy.deepcopy(model.state_dict())
    piped = fpipe.pipeline(lambda p, x: fn(p, x).pow(2).mean(), stages=2, microbatches=1, partition="measure")
    piped.memory(params, x)  # traces and measures only
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)


def test_decode_cache_writes_are_the_effects_answer():
    """kv_writes turns `index_copy` plus the write back into its input into one in-place write."""
    g = fx.Graph()
    buf, i, x = g.placeholder("buf"), g.placeholder("i"), g.placeholder("x")
    new = g.call_function(aten.index_copy.default, (buf, 0, i, x))
    g.call_function(aten.copy_.default, (buf, new))
    g.output(new)
    gm = fx.GraphModule({}, g)
    assert kv_writes.inplace_cache_writes(gm) == ["buf"]
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert node.target is aten.index_copy_.default and effects.writes(node) == [buf]


# -- case 1: a buffer written in place, read by recomputed values ------------------------------------


def _reference(
    model: torch.nn.Module, x: torch.Tensor, m: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of the unsplit module, microbatch by microbatch (its buffers written by
    each microbatch's forward in turn), averaged."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}
    total = sum(torch.func.functional_call(model, leaves, (xb,)) for xb in x.chunk(m)) / m
    return total.detach(), dict(zip(leaves, torch.autograd.grad(total, list(leaves.values()))))


def test_a_buffer_written_in_place_is_never_reread_by_a_recomputation():
    """Issue 24 case 1: `self.step.add_(1)` read by every layer, GPipe, 4 microbatches, a limit
    of 0.7 x the unconstrained peak: the recomputation keeps the values computed from the buffer
    before the write (base: stage-0 weight gradients 38-68 % off, loss exact, no warning)."""
    torch.manual_seed(0)
    model = StepCounter()
    fn, params = fpipe.functionalize(model)
    x = torch.randn(16, 8, dtype=DT)
    free = fpipe.pipeline(fn, microbatches=4, schedule="gpipe")
    limit = int(0.7 * free.memory(params, x))
    piped = fpipe.pipeline(fn, microbatches=4, schedule="gpipe", memory_limit=limit)
    assert piped.memory(params, x) <= limit
    loss, grads = fpipe.value_and_grad(piped)(params, x)
    assert model.step.item() == 4
    model.step.zero_()
    ref_loss, ref_grads = _reference(model, x, 4)
    torch.testing.assert_close((loss, grads), (ref_loss, ref_grads))
    assert _recomputed(piped, 0) > 0


def _recomputed(piped: fpipe.Pipelined, stage: int) -> int:
    """Operations of the stage's backward programs copied from its forward (RECOMPUTES)."""
    st = piped._last.staged  # type: ignore[union-attr]
    return sum(
        p.n_nodes
        for (k, s), p in st.programs.items()
        if k != "F" and s == stage and p.gm.meta.get(remat.RECOMPUTES)
    )


# -- case 2: BatchNorm's running statistics under a limit ----------------------------------------------


def _convbn_step(schedule: str, fraction: float | None) -> tuple[Any, ...]:
    """One step of a conv + BatchNorm model on 2 stages, 4 microbatches, float64; and the unsplit
    module's, microbatch by microbatch, from the same start."""
    torch.manual_seed(0)
    model = ConvBN(width=8, stages=2).to(DT)
    ref_model = copy.deepcopy(model)
    fn, params = fpipe.functionalize(model)
    x = torch.randn(16, 3, 8, 8, dtype=DT)

    def f(p, x):
        return fn(p, x).pow(2).mean()

    kw: dict[str, Any] = dict(microbatches=4, schedule=schedule)
    if fraction is not None:
        start = copy.deepcopy(model.state_dict())
        kw["memory_limit"] = int(fraction * fpipe.pipeline(f, **kw).memory(params, x))
        model.load_state_dict(start)
    piped = fpipe.pipeline(f, **kw)
    _, grads = fpipe.value_and_grad(piped)(params, x)
    _, ref_grads = _reference(_Squared(ref_model), x, 4)
    ref_grads = {k.removeprefix("m."): v for k, v in ref_grads.items()}
    return piped, grads, dict(model.named_buffers()), ref_grads, dict(ref_model.named_buffers())


class _Squared(torch.nn.Module):
    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(x).pow(2).mean()


def test_batchnorm_statistics_update_once_under_a_limit():
    """Issue 24 case 2: 1F1B, 2 stages, 4 microbatches, limit 0.9 x: the recomputed BatchNorm
    runs without its statistics update (base: running_var off by 0.2), gradients exact."""
    piped, grads, stats, ref_grads, ref_stats = _convbn_step("1f1b", 0.9)
    torch.testing.assert_close(stats, ref_stats, rtol=0, atol=1e-12)
    torch.testing.assert_close(grads, ref_grads)
    bn_again = [
        n
        for (k, _), p in piped._last.staged.programs.items()
        if k != "F"
        for n in p.gm.graph.nodes
        if n.target is aten.native_batch_norm.default
    ]
    assert bn_again and all(n.args[3] is None and n.args[4] is None for n in bn_again)


# -- cases 3 and 4: checkpoint regions ------------------------------------------------------------------


class _Blocks(torch.nn.Module):
    """Four residual blocks (dropout `p`), each in a checkpoint region if `ck` (reentrant or
    not); a boundary after two; `h += x` after every region if `inplace`."""

    def __init__(self, ck: str | None, p: float = 0.0, inplace: bool = False, d: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ws = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(d, 4 * d, dtype=DT) * 0.2) for _ in range(4)
        )
        self.vs = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(4 * d, d, dtype=DT) * 0.2) for _ in range(4)
        )
        self.inp = torch.nn.Parameter(torch.eye(d, dtype=DT))
        self.ck, self.p, self.inplace = ck, p, inplace

    def block(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return h + F.dropout(torch.tanh(h @ self.ws[i]), self.p, training=True) @ self.vs[i]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x0 = x @ self.inp  # a region input that requires grad (reentrant checkpoint asks it)
        for i in range(4):
            b = functools.partial(self.block, i)
            h = checkpoint.checkpoint(b, h, use_reentrant=self.ck == "reentrant") if self.ck else b(h)
            h = fpipe.stage_boundary(h) if i == 1 else h
        if self.inplace:
            h += x0
        return h.pow(2).mean()


def _blocks(ck: str | None, p: float = 0.0, inplace: bool = False) -> tuple[int, Any, Any]:
    """Predicted memory, gradients and the pipeline of one 1F1B step (seeded alike)."""
    fn, params = fpipe.functionalize(_Blocks(ck, p, inplace))
    piped = fpipe.pipeline(fn, microbatches=2, schedule="1f1b")
    x = torch.randn(64, 32, dtype=DT, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(3)
    _, grads = fpipe.value_and_grad(piped)(params, x)
    return piped.memory(params, x), grads, piped


@pytest.mark.parametrize("p, inplace", [(0.1, False), (0.0, True)], ids=["dropout", "in-place"])
def test_checkpoint_regions_are_kept_with_dropout_or_an_in_place_op(p, inplace):
    """Issue 24 case 3: training dropout, or one in-place op outside every region, no longer
    drops the regions (base: the checkpointed model held 1.00 x the plain one's memory, with a
    false warning about writing its inputs). The fraction is the plain function's at most; the
    recomputed dropout draws the forward's masks (gradients bit-equal to the plain model's)."""
    plain_fraction = _blocks("non-reentrant")[0] / _blocks(None)[0]
    ck_mem, ck_grads, piped = _blocks("non-reentrant", p, inplace)
    plain_mem, plain_grads, _ = _blocks(None, p, inplace)
    assert ck_mem / plain_mem <= plain_fraction + 0.01 < 0.85
    torch.testing.assert_close(ck_grads, plain_grads, rtol=0, atol=0)
    if p:
        again = [
            n for (k, _), prog in piped._last.staged.programs.items() if k != "F" for n in prog.gm.graph.nodes
        ]
        assert any(n.target is seeded for n in again)  # a dropout ran again in a backward


def test_a_batchnorm_in_a_checkpoint_region_updates_its_statistics_once():
    """A region with a BatchNorm in training: recomputed in the backward without the statistics
    update (torch.utils.checkpoint itself would update them twice): one update, as the function
    without checkpoint, and exact gradients."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(4).to(DT)
    ref_bn = copy.deepcopy(bn)
    fn, params = fpipe.functionalize(bn)
    x = torch.randn(8, 4, dtype=DT)

    def f(p, x):
        h = checkpoint.checkpoint(lambda a: torch.tanh(fn(p, a)) * 2, x, use_reentrant=False)
        return fpipe.stage_boundary(h).pow(2).mean()

    piped = fpipe.pipeline(f, microbatches=1)
    _, grads = fpipe.value_and_grad(piped)(params, x)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in ref_bn.named_parameters()}
    loss = (torch.tanh(torch.func.functional_call(ref_bn, leaves, (x,))) * 2).pow(2).mean()
    torch.testing.assert_close(grads, dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())))))
    torch.testing.assert_close(dict(bn.named_buffers()), dict(ref_bn.named_buffers()), rtol=0, atol=0)
    assert _recomputed(piped, 0) > 0


def test_reentrant_checkpoint_regions_are_recomputed():
    """Issue 24 case 4: `use_reentrant=True` regions are followed as the non-reentrant ones are
    (base: nothing recomputed, no warning): the same memory, exact gradients."""
    mem, grads, piped = _blocks("reentrant")
    assert mem == _blocks("non-reentrant")[0] < 0.85 * _blocks(None)[0]
    torch.testing.assert_close(grads, _blocks(None)[1])
    assert _recomputed(piped, 0) > 0 and _recomputed(piped, 1) > 0


def test_regions_lost_in_tracing_would_be_said_truthfully(monkeypatch):
    """The safety net: were a trace to lose every region's tag, the warning says so (and nothing
    about writes, which no longer lose them)."""
    from fpipe._src.pipeline import compiler

    monkeypatch.setattr(compiler, "tagged", lambda node: False)
    with pytest.warns(UserWarning, match="fpipe lost track of them while tracing") as got:
        _blocks("non-reentrant")
    assert "writes" not in str(got[0].message)
