"""`pipeline(..., memory_limit=bytes)` and `torch.utils.checkpoint` regions: values recomputed in
the backward programs (fpipe/_src/memory/remat.py, remat_choose.py).

Every case checks the gradients against `torch.func.grad` of the unsplit function in float64,
the prediction against the limit, and the bytes the runner really holds after every action
(`LocalRunner.record_memory`) against both the prediction and the limit. The resident-set growth
of real steps under a limit, and which rank recomputes more, are measured in tests/memory/test_memory.py
(its worker launches): in one process the limit is the process's peak, all stages together.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from memory_worker import CheckpointedGPT
from models import GPT, MLP, lm_loss

import fpipe
from fpipe._src.runtime import run as run_
from fpipe._src.tracing.rng import seeded

DT = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def gpt(stages: int, cls: type = GPT) -> tuple[Any, dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """Two blocks: embedding, block, block, head make up to 4 stages."""
    torch.manual_seed(0)
    fn, params = fpipe.functionalize(cls(vocab=32, d=32, n_head=2, n_layer=2, seq=16, stages=stages).to(DT))
    tokens = torch.randint(0, 32, (16, 16))
    return (lambda p, x, y: lm_loss(fn(p, x), y)), params, (tokens, tokens.roll(1, 1))


def mlp(stages: int) -> tuple[Any, dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    fn, params = fpipe.functionalize(MLP(d_in=32, hidden=64, d_out=8, n_layers=8, stages=stages).to(DT))
    x, y = torch.randn(512, 32, dtype=DT), torch.randn(512, 8, dtype=DT)
    return (lambda p, x, y: (fn(p, x) - y).pow(2).mean()), params, (x, y)


def _schedule(name: str, stages: int, m: int) -> Any:
    pp = stages // 2 if name == "zbv" else stages
    return fpipe.schedules.build(name, pp=pp, microbatches=m, stages=stages)


def _tensors(env: dict[str, Any]) -> dict[Any, torch.Tensor]:
    """A runner's values, the elements of tuple values too (as tests/memory/test_memory.py counts them)."""
    out: dict[Any, torch.Tensor] = {}
    for k, v in env.items():
        for i, t in enumerate(v if isinstance(v, (tuple, list)) else [v]):
            if isinstance(t, torch.Tensor):
                out[k, i] = t
    return out


def _held(piped: fpipe.Pipelined, params: Any, args: tuple[Any, ...]) -> list[tuple[str, int]]:
    """The bytes the runner holds after each action of one more step (its storages, once each)."""
    runner = piped._last.runner
    live = run_.live_bytes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(run_, "live_bytes", lambda envs, skip=(): live(map(_tensors, envs), skip))
        runner.record_memory = True
        fpipe.value_and_grad(piped)(params, *args)
        runner.record_memory = False
    return runner.memory


def _extra_ops(limited: fpipe.Pipelined, free: fpipe.Pipelined, stage: int) -> int:
    """Operations the limit added to the stage's backward programs (the recomputation)."""

    def ops(p: fpipe.Pipelined) -> int:
        st = p._last.staged
        return sum(prog.n_nodes for (k, s), prog in st.programs.items() if s == stage and k != "F")

    return ops(limited) - ops(free)


CASES = [("mlp", "gpipe", 4), ("gpt", "1f1b", 4), ("gpt", "zb-h1", 2), ("gpt", "zbv", 4)]


@pytest.mark.parametrize(("model", "schedule", "stages"), CASES)
def test_a_limit_is_met_with_exact_gradients(model, schedule, stages):
    loss, params, args = (gpt if model == "gpt" else mlp)(stages)
    sched = _schedule(schedule, stages, 8)
    free = fpipe.pipeline(loss, microbatches=8, schedule=sched)
    unconstrained = free.memory(params, *args)
    limit = int(0.7 * unconstrained)
    piped = fpipe.pipeline(loss, microbatches=8, schedule=sched, memory_limit=limit)
    report = piped.memory_report(params, *args)
    assert report.peak <= 0.85 * limit and limit < unconstrained  # 15 % headroom
    value, grads = fpipe.value_and_grad(piped)(params, *args)
    ref_grads, ref_value = torch.func.grad_and_value(loss)(params, *args)
    torch.testing.assert_close(value, ref_value)
    torch.testing.assert_close(grads, ref_grads)
    held = _held(piped, params, args)
    assert [(a, h) for a, _, h in report.actions] == held  # the prediction is the runner's account
    assert max(h for _, h in held) <= limit
    _, free_grads = fpipe.value_and_grad(free)(params, *args)
    torch.testing.assert_close(grads, free_grads, rtol=0, atol=0)  # bit for bit
    assert sum(_extra_ops(piped, free, s) for s in range(stages)) > 0


def _copies(piped: fpipe.Pipelined, place: Any) -> list[int]:
    """The positions, in backward program `place`, of the operations copied from the stage's
    forward (a copy carries its original's fake value)."""
    st = piped._last.staged
    forward = {id(n.meta.get("val")) for n in st.programs["F", place[1]].gm.graph.nodes if "val" in n.meta}
    nodes = [n for n in st.programs[place].gm.graph.nodes if n.op == "call_function"]
    return [i for i, n in enumerate(nodes) if id(n.meta.get("val")) in forward]


def _runs(positions: list[int]) -> int:
    """How many runs of consecutive positions."""
    return sum(1 for i, p in enumerate(positions) if i == 0 or positions[i - 1] != p - 1)


# Near the least each case reaches (these small models' gradient sums are a large share).
TIGHT = [("gpt", "1f1b", 4, 0.55), ("gpt", "zbv", 4, 0.6), ("gpt", "zb-h1", 2, 0.6)]


@pytest.mark.parametrize(("model", "schedule", "stages", "fraction"), TIGHT)
def test_a_tight_limit_is_met_recomputing_segment_by_segment(model, schedule, stages, fraction):
    """A limit near the least reachable: met (predicted, and held by the runner), gradients bit
    for bit the unconstrained pipeline's, and the backward recomputes segment by segment: from
    the anchors (the residual stream, a layer's output) it reads, in several runs, each just
    before the backward that needs it, so what it recomputes is never all alive at once."""
    from fpipe._src.memory.remat_segments import anchors

    loss, params, args = (gpt if model == "gpt" else mlp)(stages)
    sched = _schedule(schedule, stages, 8)
    free = fpipe.pipeline(loss, microbatches=8, schedule=sched)
    limit = int(fraction * free.memory(params, *args))
    piped = fpipe.pipeline(loss, microbatches=8, schedule=sched, memory_limit=limit)
    assert piped.memory(params, *args) <= 0.9 * limit
    _, grads = fpipe.value_and_grad(piped)(params, *args)
    _, free_grads = fpipe.value_and_grad(free)(params, *args)
    torch.testing.assert_close(grads, free_grads, rtol=0, atol=0)
    assert max(h for _, h in _held(piped, params, args)) <= limit
    st, base = piped._last.staged, piped._last.base
    segmented = 0
    for place, prog in st.programs.items():
        copies = _copies(piped, place) if place[0] != "F" else []
        if _runs(copies) > 1 and anchors(base, place[1]) & set(prog.inputs):
            segmented += 1
            most, total = _recomputed_alive(prog.gm, copies)
            assert most < total, (place, most, total)
    assert segmented > 0


def _recomputed_alive(gm: Any, copies: list[int]) -> tuple[int, int]:
    """The most bytes of recomputed storages alive at once in `gm`, and all of them."""
    import fpipe._src.memory.memory_graph as memory_graph

    nodes = list(gm.graph.nodes)
    ops = [n for n in nodes if n.op == "call_function"]
    walk = memory_graph._Walk()
    for i, n in enumerate(nodes):
        walk.visit(i, n)
    end = memory_graph._ends(nodes, walk)
    mine = {sid for i in copies for sid in walk.held.get(ops[i], ()) if sid in walk.sizes}
    alive = [sum(walk.sizes[s] for s in mine if walk.born[s] <= i <= end[s]) for i in range(len(nodes))]
    return max(alive), sum(walk.sizes[s] for s in mine)


def test_an_impossible_limit_is_refused_before_anything_runs():
    loss, params, args = gpt(2)
    piped = fpipe.pipeline(loss, microbatches=4, schedule="1f1b", memory_limit=1000)
    msg = (
        r"pipeline\(<lambda>, microbatches=4\): memory_limit=1000 bytes \(0.0 MiB\) cannot be met "
        r"on pipeline rank 0: recomputing in the backward what fpipe can, the least this rank's "
        r"step needs is (\d+) bytes \(.*\), so the least limit fpipe can meet is "
        r"memory_limit=(\d+) \(it keeps 15% below the limit"
    )
    with pytest.raises(ValueError, match=msg) as err:
        fpipe.value_and_grad(piped)(params, *args)
    assert piped.timeline is None  # nothing ran
    needs, least = map(int, re.search(msg, str(err.value)).groups())  # type: ignore[union-attr]
    fits = fpipe.pipeline(loss, microbatches=4, schedule="1f1b", memory_limit=least)
    assert fits.memory(params, *args) <= needs < least  # the least limit it names is met


def test_values_of_stages_holding_more_microbatches_are_dropped_first():
    """The ranking (NOTE [meeting a memory limit]): bytes x microbatches of the stage in flight at
    the peak / cost. Of two equal stages (an MLP's stages 1 and 2: two equal layers each), the
    one holding more microbatches drops first, and a stage holding none at the peak drops
    nothing."""
    import fpipe._src.memory.remat_choose as remat_choose
    from fpipe._src.memory.memory import MemoryReport, StageMemory

    loss, params, args = mlp(4)
    piped = fpipe.pipeline(loss, microbatches=4, schedule="1f1b")
    piped.memory(params, *args)
    st = next(iter(piped._cache.values())).staged

    def first(flight: list[int], excess: int = 1) -> set[int]:
        rows = tuple(StageMemory(s, s, 0, 0, 0, f, 0) for s, f in enumerate(flight))
        report = MemoryReport(0, "", rows, ())
        search = remat_choose._Search(st, set(), lambda _: report, list(range(4)), {}, report)
        return {p[1] for p, _ in search._batch(excess)}

    assert first([0, 3, 2, 0]) == {1}
    assert first([0, 2, 3, 0]) == {2}
    assert first([4, 3, 2, 0], 10**12) == {0, 1, 2}  # stage 3 holds nothing at the peak


def test_anchors_are_the_values_a_stage_carries_alone():
    """A layer stack carries one value past every operation: each is an anchor, every layer's
    output among them; a GPT's first stage's are the residual stream (between blocks and
    between a block's halves)."""
    from fpipe._src.memory.remat_segments import anchors

    loss, params, args = mlp(2)
    piped = fpipe.pipeline(loss, microbatches=4, schedule="1f1b")
    piped.memory(params, *args)
    st = next(iter(piped._cache.values())).staged
    for s in range(2):
        names = {n.name: n for n in st.programs["F", s].gm.graph.nodes}
        found = {names[a].target for a in anchors(st, s)}
        assert {torch.ops.aten.addmm.default, torch.ops.aten.tanh.default} <= found, found
        tanhs = {n for n, node in names.items() if node.target is torch.ops.aten.tanh.default}
        assert len(tanhs - anchors(st, s)) <= 1  # the stage's output: nothing after it reads it

    torch.manual_seed(0)
    fn, params = fpipe.functionalize(GPT(vocab=32, d=16, n_head=2, n_layer=4, seq=8, stages=2))
    tokens = torch.randint(0, 32, (8, 8))
    piped = fpipe.pipeline(lambda p, x, y: lm_loss(fn(p, x), y), microbatches=2, schedule="1f1b")
    piped.memory(params, tokens, tokens)
    st = next(iter(piped._cache.values())).staged
    adds = {n.name for n in st.programs["F", 0].gm.graph.nodes if n.target is torch.ops.aten.add.Tensor}
    assert anchors(st, 0) - adds == {"embedding"}  # the token embedding, before the position's
    assert len(anchors(st, 0) & adds) >= 4  # the embeddings' sum, and after each half-block


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_a_bad_limit_is_refused_at_once(bad):
    with pytest.raises(ValueError, match="memory_limit must be a positive int"):
        fpipe.pipeline(lambda p, x: x.sum(), microbatches=2, memory_limit=bad)


def test_recomputed_dropout_draws_the_same_mask():
    """A dropout recomputed in the backward draws the mask its forward drew (seeded per operation
    and microbatch): the gradients equal those of the same pipeline keeping every value."""
    torch.manual_seed(0)
    w1, w2 = torch.randn(32, 64, dtype=DT), torch.randn(64, 8, dtype=DT)
    x = torch.randn(64, 32, dtype=DT)

    def f(p, x):
        h = F.dropout(torch.tanh(x @ p["w1"]), 0.5, training=True)
        h = fpipe.stage_boundary(torch.tanh(h * 2.0))
        return (F.dropout(h, 0.3, training=True) @ p["w2"]).pow(2).mean()

    params = {"w1": w1, "w2": w2}
    free = fpipe.pipeline(f, microbatches=4, schedule="1f1b")
    limit = int(0.75 * free.memory(params, x))  # its target, less 15 %: 64 %
    piped = fpipe.pipeline(f, microbatches=4, schedule="1f1b", memory_limit=limit)
    assert piped.memory(params, x) <= limit
    torch.manual_seed(1)
    ref = fpipe.value_and_grad(free)(params, x)
    torch.manual_seed(1)
    got = fpipe.value_and_grad(piped)(params, x)
    assert any(
        n.target is seeded and k != "F"
        for (k, _), prog in piped._last.staged.programs.items()
        for n in prog.gm.graph.nodes
    )  # a dropout did run again in a backward program
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_checkpointed_blocks_are_recomputed(schedule):
    """torch.utils.checkpoint around every block: less memory held (predicted, and held by the
    runner), exact gradients, no warning."""
    loss, params, args = gpt(2, CheckpointedGPT)
    plain_loss, _, _ = gpt(2)
    ck = fpipe.pipeline(loss, microbatches=4, schedule=schedule)
    plain = fpipe.pipeline(plain_loss, microbatches=4, schedule=schedule)
    value, grads = fpipe.value_and_grad(ck)(params, *args)
    ref_grads, ref_value = torch.func.grad_and_value(plain_loss)(params, *args)
    torch.testing.assert_close((value, grads), (ref_value, ref_grads))
    fpipe.value_and_grad(plain)(params, *args)
    assert ck.memory(params, *args) < 0.8 * plain.memory(params, *args)
    assert max(h for _, h in _held(ck, params, args)) < 0.8 * max(h for _, h in _held(plain, params, args))


def test_each_checkpointed_region_is_recomputed_from_its_own_input():
    """Two checkpointed blocks on a stage: each is recomputed from its own input (the block
    before it keeps its output, as torch.utils.checkpoint does), just before its backward -- the
    recomputation runs in several pieces and is never all alive at once -- with exact
    gradients."""
    torch.manual_seed(0)
    model = CheckpointedGPT(vocab=32, d=32, n_head=2, n_layer=4, seq=16, stages=2).to(DT)
    fn, params = fpipe.functionalize(model)
    tokens = torch.randint(0, 32, (8, 16))
    args = (tokens, tokens.roll(1, 1))
    ck = fpipe.pipeline(lambda p, x, y: lm_loss(fn(p, x), y), microbatches=2, schedule="1f1b")
    _, grads = fpipe.value_and_grad(ck)(params, *args)
    plain_fn, _ = fpipe.functionalize(GPT(vocab=32, d=32, n_head=2, n_layer=4, seq=16, stages=2).to(DT))
    torch.testing.assert_close(
        grads, torch.func.grad(lambda p, x, y: lm_loss(plain_fn(p, x), y))(params, *args)
    )
    for place in [("B", 0), ("B", 1)]:
        copies = _copies(ck, place)
        assert _runs(copies) >= 2, place
        most, total = _recomputed_alive(ck._last.staged.programs[place].gm, copies)
        assert most < 0.5 * total, (place, most, total)  # (all at once before: 0.6 of it)


def test_checkpoint_and_limit_together():
    """A limit on a checkpointed model starts from the regions' recomputation (GPipe: all four
    microbatches in flight, room to recompute more than the regions)."""
    loss, params, args = gpt(2, CheckpointedGPT)
    ck = fpipe.pipeline(loss, microbatches=4, schedule="gpipe")
    limit = int(0.92 * ck.memory(params, *args))
    piped = fpipe.pipeline(loss, microbatches=4, schedule="gpipe", memory_limit=limit)
    _, grads = fpipe.value_and_grad(piped)(params, *args)
    plain_loss, _, _ = gpt(2)
    torch.testing.assert_close(grads, torch.func.grad(plain_loss)(params, *args))
    assert piped.memory(params, *args) <= limit
