"""Coming over from torch.distributed.pipelining (TDP) unchanged (NOTE [pipe_split] in
fpipe/_src/tracing/cut_at.py; NOTE [cuts by module path] in fpipe/_src/tracing/cuts.py): a model's `pipe_split()`
calls and a `split_spec` dict cut where they say -- stage count and each stage's parameters --
and the gradients are `torch.func.grad_and_value`'s of the unsplit function (float64). The same
zoo on 2 gloo ranks: tests/runtime/test_trust_dist.py (the shared `trust_launch`)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.pipelining.schedules as S
from dist_launch import read_json
from models import compiled
from tdp_models import TWO_RANKS, ZOO, D, build, forward_ops, stage_params
from torch.distributed.pipelining import SplitPoint, pipe_split
from torch.distributed.pipelining.stage import _PipelineStageBase

import fpipe
from fpipe._src.runtime.agree import fingerprint

TOL = 1e-12


def _step(loss, params, data, **options):
    piped = fpipe.pipeline(loss, microbatches=2, **options)
    value, grads = fpipe.value_and_grad(piped)(params, *data)
    return piped, value, grads


def _assert_exact(loss, params, data, value, grads):
    ref_grads, ref = torch.func.grad_and_value(loss)(params, *data)
    assert abs(float(value - ref)) < TOL
    assert sorted(grads) == sorted(ref_grads)
    assert max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads) < TOL


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_models_cut_where_their_markers_say_with_exact_gradients(name):
    loss, params, data = build(name)
    _, options, per_stage = ZOO[name]
    piped, value, grads = _step(loss, params, data, **options)
    c = compiled(piped)
    assert c.staged.n_stages == len(per_stage)
    assert stage_params(c) == per_stage
    _assert_exact(loss, params, data, value, grads)


def test_a_pipe_split_is_a_boundary_on_what_crosses_it():
    """`pipe_split()` after `h = ...` stages exactly as `stage_boundary(h)` when only `h` is
    read after it: the same programs, cut and schedule (the fingerprint the ranks compare)."""
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(D, D, generator=g, dtype=torch.float64) for k in ("a", "b")}
    x = torch.randn(8, D, generator=g, dtype=torch.float64)

    def by_split(p, x):
        h = torch.tanh(x @ p["a"])
        pipe_split()
        return (h @ p["b"]).sin().sum()

    def by_marker(p, x):
        return (fpipe.stage_boundary(torch.tanh(x @ p["a"])) @ p["b"]).sin().sum()

    prints = []
    for f in (by_split, by_marker):
        piped, value, grads = _step(f, params, (x,))
        _assert_exact(f, params, (x,), value, grads)
        c = compiled(piped)
        prints.append(fingerprint(c.staged, c.runner.schedule))
    assert prints[0] == prints[1]


def _mixed(p, x):
    h = fpipe.stage_boundary(torch.tanh(x @ p["a"]))
    h = torch.tanh(h @ p["b"])
    pipe_split()
    return (h @ p["c"]).pow(2).mean()


def test_pipe_split_and_stage_boundary_mix_each_adding_a_stage():
    g = torch.Generator().manual_seed(1)
    params = {k: torch.randn(D, D, generator=g, dtype=torch.float64) for k in ("a", "b", "c")}
    data = (torch.randn(8, D, generator=g, dtype=torch.float64),)
    piped, value, grads = _step(_mixed, params, data)
    c = compiled(piped)
    assert c.staged.n_stages == 3 and stage_params(c) == [["a"], ["b"], ["c"]]
    _assert_exact(_mixed, params, data, value, grads)
    wrong = fpipe.pipeline(_mixed, stages=2, microbatches=2)
    with pytest.raises(ValueError, match=r"stage_boundary \(or pipe_split\(\)\) calls make 3 stages"):
        fpipe.value_and_grad(wrong)(params, *data)


def test_pipe_split_composes_with_grad_and_vmap_inside_the_function():
    """pipe_split() is a no-op under torch.func transforms and make_fx records it in program order:
    inside a vmap it still cuts (a stage_boundary there is dropped), and inside a gradient the
    function takes (a gradient penalty) the cut stays where it was called, so that gradient's work
    runs on the later stage; the values are exact."""
    g = torch.Generator().manual_seed(2)
    params = {k: torch.randn(D, D, generator=g, dtype=torch.float64) for k in ("a", "b")}
    data = (torch.randn(8, D, generator=g, dtype=torch.float64),)

    def one(p, x):
        h = torch.tanh(x @ p["a"])
        pipe_split()
        return (h @ p["b"]).sin().sum()

    def vmapped(p, x):
        return torch.func.vmap(one, in_dims=(None, 0))(p, x).mean()

    def penalty(p, x):
        return torch.func.grad(lambda x: one(p, x))(x).pow(2).mean()

    for f in (vmapped, penalty):
        piped, value, grads = _step(f, params, data)
        assert compiled(piped).staged.n_stages == 2
        _assert_exact(f, params, data, value, grads)
    programs = compiled(piped).staged.programs  # the penalty's: its inner backward is on stage 1
    inner = [[n for n in programs["F", s].gm.graph.nodes if "tanh_backward" in str(n.target)] for s in (0, 1)]
    assert not inner[0] and inner[1]


def test_pipe_split_with_cuts_is_refused():
    loss, params, data = build("buffer_across")
    piped = fpipe.pipeline(loss, microbatches=2, cuts=["lin1"])
    with pytest.raises(
        ValueError,
        match=r"calls torch.distributed.pipelining's pipe_split\(\) \(1 call\(s\)\) and passes cuts=",
    ):
        fpipe.value_and_grad(piped)(params, *data)


def test_a_pipe_split_that_nothing_crosses_is_refused():
    def f(p, x):
        pipe_split()  # nothing computed from x is read after it
        return p["a"].pow(2).sum()

    params = {"a": torch.ones(D, dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"pipe_split\(\) call 1 of 1 has no value computed from the inputs"):
        _step(f, params, (torch.ones(8, D, dtype=torch.float64),))


def test_split_spec_end_cuts_after_a_module_returning_a_tuple():
    """SplitPoint.END passes the module's output tensors through the boundary (a tuple here)."""

    class Pair(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = torch.nn.Linear(D, D), torch.nn.Linear(D, D)

        def forward(self, x):
            return self.first(x), x

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pair, self.head = Pair(), torch.nn.Linear(D, 1)

        def forward(self, x):
            h, skip = self.pair(x)
            return self.head(torch.tanh(h) + skip)

    torch.manual_seed(0)
    fn, params = fpipe.functionalize(Net().double())
    data = (torch.randn(8, D, dtype=torch.float64),)

    def loss(p, x):
        return fn(p, x).pow(2).mean()

    piped, value, grads = _step(loss, params, data, cuts={"pair": SplitPoint.END})
    c = compiled(piped)
    assert c.staged.n_stages == 2
    assert stage_params(c) == [["pair.first.bias", "pair.first.weight"], ["head.bias", "head.weight"]]
    _assert_exact(loss, params, data, value, grads)


@pytest.mark.parametrize(
    ("cuts", "error", "message"),
    [
        ({"layers.9": SplitPoint.END}, ValueError, "does not have: 'layers.9' (closest: ['layers.3', "),
        ({"layers.1": "BEGINNING"}, TypeError, "or torch.distributed.pipelining's split_spec"),
        ({"layers": True}, TypeError, "must be a non-empty list of module paths"),
    ],
)
def test_a_bad_split_spec_is_refused(cuts, error, message):
    loss, params, data = build("split_spec")
    with pytest.raises(error) as err:
        _step(loss, params, data, cuts=cuts)
    assert message in str(err.value)


def test_split_spec_and_every_kth_entry_in_one_dict():
    """`{"layers": 3, "layers.0": SplitPoint.END}`: after layers.0 and before layers.3."""
    loss, params, data = build("split_spec")
    piped, value, grads = _step(loss, params, data, cuts={"layers": 3, "layers.0": SplitPoint.END})
    c = compiled(piped)
    layers = [[k for k in sorted(params) if k.startswith(f"layers.{i}.")] for i in range(4)]
    assert stage_params(c) == [layers[0], layers[1] + layers[2], layers[3]]
    _assert_exact(loss, params, data, value, grads)


@pytest.mark.parametrize("name", sorted(TWO_RANKS))
def test_zoo_models_on_two_gloo_ranks(trust_launch, name):
    """The shared 2-rank launch (`trust_launch`): the ranks cover every stage, each cut as in one
    process (each stage's forward operations), and each returns the gradients of the parameters
    its stages read, equal to the unsplit function's."""
    out, _ = trust_launch
    records = [read_json(out / f"rank{r}.json")["tdp_zoo"] for r in range(2)]
    assert all("error" not in rec and "error" not in rec[name] for rec in records), records
    options, per_stage = TWO_RANKS[name]
    loss, params, data = build(name)
    ops = forward_ops(compiled(_step(loss, params, data, **options)[0]))
    assert sorted(s for rec in records for s in rec[name]["stages"]) == list(range(len(per_stage)))
    for rec in records:
        mine = rec[name]
        assert {int(s): n for s, n in mine["ops"].items()} == {s: ops[s] for s in mine["stages"]}
        assert sorted(mine["grads"]) == sorted({k for s in mine["stages"] for k in per_stage[s]})
        assert mine["loss"] < TOL and all(e < TOL for e in mine["grads"].values()), mine


class _StageStub(_PipelineStageBase):
    """What TDP's multi-stage schedules read of a stage to build their `pipeline_order` (no
    process group, no module: the orders are computed at construction)."""

    _create_grad_recv_info = _prepare_backward_infra = _prepare_forward_infra = lambda *a, **k: None

    def __init__(self, index: int, n: int, pp: int, rank: int) -> None:  # no super(): no group
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, n, pp, rank
        self.submod = torch.nn.Module()

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def _orders(tdp_class, name: str, pp: int, m: int) -> tuple[list[list[str]], list[list[str]]]:
    """Per rank, TDP's actions and fpipe's, both in TDP's text form (`2F0`), 2 stages per rank."""
    v = name in ("zbv", "dualpipev")
    tdp = []
    for r in range(pp):
        stages = [_StageStub(r, 2 * pp, pp, r), _StageStub(2 * pp - 1 - r if v else r + pp, 2 * pp, pp, r)]
        tdp.append([str(a) for a in tdp_class(stages, n_microbatches=m).pipeline_order[r] if a is not None])
    mine = fpipe.schedules.build(name, pp=pp, microbatches=m, stages=2 * pp)
    return tdp, [[f"{a.stage}{a.kind}{a.mb}" for a in acts] for acts in mine.ranks]


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (3, 6), (4, 8)])
def test_the_guides_schedule_table_against_tdps_own_orders(pp, m):
    """docs/guide/from-torch-pipelining.md, "Schedules": what it says of each TDP schedule's
    action order against fpipe's built-in of the same name."""
    tdp, mine = _orders(S.ScheduleInterleaved1F1B, "interleaved-1f1b", pp, m)
    assert tdp == mine
    tdp, mine = _orders(S.ScheduleLoopedBFS, "looped-bfs", pp, m)
    for theirs, ours in zip(tdp, mine):
        assert [a for a in theirs if "F" in a] == [a for a in ours if "F" in a]
        back = [a for a in ours if "B" in a]  # per chunk, the microbatches in the reverse order
        assert [a for a in theirs if "B" in a] == [
            b for i in range(0, len(back), m) for b in back[i : i + m][::-1]
        ]
    tdp, mine = _orders(S.ScheduleZBVZeroBubble, "zbv", pp, m)
    assert (tdp == mine) == (pp == 2)
    tdp, mine = _orders(S.ScheduleDualPipeV, "dualpipev", pp, m)
    assert any("OVERLAP_F_B" in a for acts in tdp for a in acts) and tdp != mine
