"""Tensor parallelism inside stages (NOTE [tensor-parallel tracing] in fpipe/_src/parallel/tp.py): a GPT
parallelized with `parallelize_module` on mesh["tp"], pipelined on 4 gloo ranks (pp=2 x tp=2) and
on 8 (dp=2 x pp=2 x tp=2). One launch of `tests/support/tp_worker.py` per world size runs every case;
each compares with `torch.func.grad_and_value` of the unsplit, unparallelized model over the
global batch, in fp64."""

from __future__ import annotations

from typing import Any

import pytest
import tp_worker
from dist_launch import read_json, report, run_torchrun, torchrun_cmd

TOL = 1e-9
DEADLINE_S = 420.0


def _launch(tmp_path_factory: Any, n: int) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp(f"tp{n}")
    procs = run_torchrun([torchrun_cmd("tp_worker.py", n, "--out", str(out))], out, DEADLINE_S)
    missing = [r for r in range(n) if not (out / f"rank{r}.json").exists()]
    assert not missing and all(p.rc == 0 for p in procs), f"ranks {missing} wrote no record\n" + report(procs)
    return [read_json(out / f"rank{r}.json") for r in range(n)]


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[int, list[dict[str, Any]]]:
    return {4: _launch(tmp_path_factory, 4), 8: _launch(tmp_path_factory, 8)}


RUNS = [(4, c) for c in tp_worker.CASES] + [(8, c) for c in tp_worker.ON_8_RANKS]


@pytest.mark.parametrize(("world", "case"), RUNS)
def test_loss_and_dtensor_gradients_equal_the_unsplit_model(launches, world, case):
    """The global loss on every rank; each rank's gradients, DTensors with their parameters'
    placements, made whole equal the unsplit model's (tp with heads and MLP columns split; sp
    adds sequence-parallel norms and a residual stream crossing stages sharded on the sequence)."""
    for rec in launches[world]:
        res = rec[case]
        assert "error" not in res, (rec["rank"], res)
        assert res["loss_err"] < TOL, (rec["rank"], res)
        assert res["keys"] and max(res["grad_err"].values()) < TOL, (rec["rank"], res)
        assert res["placements_equal"] and res["dtensor_grads"] > 0, (rec["rank"], res)


@pytest.mark.parametrize(("world", "case"), RUNS)
def test_a_plain_call_returns_the_unsplit_loss_and_sum_losses_are_read(launches, world, case):
    """A plain (forward) call gives the loss; a sum loss ("tp-sum") is read as a sum through the
    tp collectives (all-reduces, and the gathers of a column-parallel head and of sequence
    parallelism), not averaged over microbatches, and no case needed the warning fpipe gives
    when it cannot read a tensor-parallel reduction."""
    for rec in launches[world]:
        res = rec[case]
        assert res["forward_err"] < TOL, (rec["rank"], res)
        assert not res["warned_reduction"], (rec["rank"], res)


def test_a_tp_dimension_of_size_one_gives_the_unsplit_model(launches):
    for rec in launches[4]:
        res = rec["tp_of_one"]
        assert "error" not in res, res
        assert res["loss_err"] < TOL and res["grad_err"] < TOL and res["dtensor_grads"] > 0, res


@pytest.mark.parametrize(("world", "case"), RUNS)
def test_each_pipeline_covers_every_parameter_once_per_tp_rank(launches, world, case):
    """Within each (dp, tp) column, the pipeline ranks' gradients cover every parameter."""
    expected = sorted(n for n, _ in tp_worker.reference().named_parameters())
    columns = {(rec.get("dp", 0), rec["tp"]) for rec in launches[world]}
    for col in columns:
        keys = [
            k for rec in launches[world] if (rec.get("dp", 0), rec["tp"]) == col for k in rec[case]["keys"]
        ]
        assert sorted(keys) == expected, (col, keys)


@pytest.mark.parametrize(("world", "case"), RUNS)
def test_values_cross_stages_as_local_shards(launches, world, case):
    """Megatron's layout: the residual stream is replicated over tp, so stage 0 sends it whole
    (from every tp rank); sequence parallelism shards it on the sequence: half of it each."""
    b, t, d = tp_worker.BATCH // tp_worker.M // (2 if world == 8 else 1), tp_worker.SEQ, tp_worker.D
    want = [b, t // 2, d] if case.startswith("sp") else [b, t, d]
    for rec in launches[world]:
        shapes = rec[case]["crossing"]
        assert shapes and all(s == want for s in shapes), (rec["rank"], shapes)


@pytest.mark.parametrize(("world", "case"), RUNS)
def test_clip_grad_norm_spans_pp_and_tp_counting_replicated_parameters_once(launches, world, case):
    for rec in launches[world]:
        assert rec[case]["norm_err"] < TOL, (rec["rank"], rec[case])


@pytest.mark.parametrize(("world", "case"), [(w, c) for w, c in RUNS if c in tp_worker.ADAMW])
def test_two_adamw_steps_equal_single_process_training(launches, world, case):
    for rec in launches[world]:
        assert rec[case]["adamw_err"] < 1e-10, (rec["rank"], rec[case])


@pytest.mark.parametrize("world", [4, 8])
def test_each_rank_does_about_one_over_pp_times_tp_of_its_slices_matrix_multiply_work(launches, world):
    """Against the unsplit step over the rank's dp slice: stage 0 holds the embedding (no matrix
    product), stage 1 the head, so the shares are a little under and over 1/4."""
    shares = [rec["matmul_share"] for rec in launches[world]]
    assert all(0.2 < s < 0.3 for s in shares), shares
    assert abs(sum(shares) / len(shares) - 0.25) < 0.01, shares


def test_a_model_built_on_meta_allocates_only_this_ranks_shards_of_its_stages(launches):
    for rec in launches[4]:
        res = rec["on_meta"]
        assert "error" not in res, res
        assert res["real_keys"] == res["grad_keys"], res  # only what this rank's stages read
        assert 0.25 < res["allocated_fraction"] < 0.3, res  # ~1/(pp x tp), plus replicated norms
        assert res["loss_err"] < TOL and res["grad_err"] < TOL, res


REFUSALS = {  # worker record: (launch, what its error must say)
    "mismatch": (
        4,
        [
            "tensor-parallel ranks [0] were called with inputs whose shapes",
            "differ from tensor-parallel ranks [1]",
        ],
    ),
    "sharded_tensor": (4, ["parameter 'w' is a ShardedTensor", "parallelize_module"]),
    "auto_partition": (
        4,
        ["fpipe cannot yet choose the cuts of a tensor-parallel function", "cuts={'blocks': k}"],
    ),
    "pipe_split": (
        4,
        [
            "calls torch.distributed.pipelining's pipe_split() (1 call(s)), but a tensor-parallel "
            "function's gradient is traced in one piece",
            "Mark the stages with fpipe.stage_boundary(x)",
        ],
    ),
    "dtensor_data": (4, ["a data argument is a DTensor", "pass the data as plain tensors"]),
    "dp_and_tp": (8, ["is a DTensor on mesh", "both at once is not supported yet"]),
}


@pytest.mark.parametrize("what", REFUSALS)
def test_bad_input_is_refused_before_the_step_saying_why(launches, what):
    """tp ranks passing batches of different shapes; a ShardedTensor parameter; stages=N with no
    cuts; a pipe_split() call; a DTensor data argument; a parameter sharded over dp and tp at once."""
    world, needles = REFUSALS[what]
    for rec in launches[world]:
        msg = rec[what]
        assert all(n in msg for n in needles), msg


def test_a_tp_rank_failing_mid_step_stops_every_rank_at_once_naming_it(launches):
    """Global rank 1 fails inside a stage program while its tp peer waits in a collective: the
    peer, and the next stage's ranks (which learn it through the peer), stop with an error naming
    global rank 1, in seconds rather than at the 120 s timeout."""
    for rec in launches[4]:
        res = rec["failure"]
        assert "injected failure on global rank 1" in res["error_text"], (rec["rank"], res)
        assert "rank 0 (global rank 1) failed at action" in res["error_text"], (rec["rank"], res)
        assert res["seconds"] < 30, (rec["rank"], res)


def test_plan_chooses_dp_x_pp_around_the_models_tp_and_its_pipelines_are_exact(launches):
    """fpipe.plan with parameters parallelized on mesh["tp"] (NOTE [planning with tensor
    parallelism]): tp = 2 from their layout, dp x pp = 2 enumerated around it, both layouts timed,
    stages cut between blocks (`blocks.1`; 4 stages dropped: the model has 2 blocks), 2 verified,
    the same plan on every rank; `pipeline(plan=c)` builds a ("pp", "tp") or ("dp", "pp", "tp")
    mesh over the parameters' tp group and gives the unsplit model's loss and gradients."""
    recs = [rec["plan"] for rec in launches[4]]
    assert all("error" not in r for r in recs), recs
    assert all(r["layout"] == recs[0]["layout"] and r["candidates"] == recs[0]["candidates"] for r in recs)
    layout, tp, cuts, measured, verified = recs[0]["layout"]
    assert tp == 2 and verified == 2 and measured > 0, recs[0]["layout"]
    assert cuts == (["blocks.1"] if "pp=2" in layout else []), recs[0]["layout"]
    cands = recs[0]["candidates"]
    assert {(dp, pp) for _, dp, pp, _, _ in cands} == {(1, 2), (2, 1)}
    assert all(t == 2 and c == (["blocks.1"] if pp == 2 else []) for _, _, pp, t, c in cands), cands
    four = [why for lay, why in recs[0]["dropped"] if lay.endswith(("zbv", "dualpipev", "interleaved-1f1b"))]
    assert four and all("entries of a ModuleList: 2 found" in w for w in four), recs[0]["dropped"]
    for r in recs:
        for name, (loss_err, grad_err, dims, shape) in r["layouts"].items():
            assert loss_err < TOL and grad_err < TOL, (name, r)
            assert dims[-1] == "tp" and shape[-1] == 2 and len(dims) == (3 if "dp=2" in name else 2), (
                name,
                dims,
            )
    assert len(recs[0]["layouts"]) == 2 and layout in recs[0]["layouts"]  # the plan's own, run


def test_plan_refuses_a_tp_mesh_its_layouts_cannot_rebuild(launches):
    for rec in launches[4]:
        msg = rec["plan_scattered"]
        assert "each tp group to be consecutive ranks" in msg and "(world_size // tp, tp)" in msg, msg


def test_plan_enumerates_tp_with_a_function_that_parallelizes_the_model(launches):
    """`fpipe.plan(..., tensor_parallel=build)` on 4 ranks: tp = 1, 2 and 4 planned together
    (each built by `build(tp_mesh)`), the 2 best verified as real steps, the same plan on every
    rank; the best candidate of tp = 2 and of tp = 4, `pipeline(c.function, plan=c)(c.params,
    ...)`, gives the unsplit model's loss and gradients."""
    recs = [rec["plan_over_tp"] for rec in launches[4]]
    assert all("error" not in r for r in recs), recs
    first = recs[0]
    assert all(r["layout"] == first["layout"] and r["verified"] == first["verified"] for r in recs), recs
    assert first["tps"] == [1, 2, 4] and first["layout"][2] == 2 and len(set(first["verified"])) == 2, first
    assert sorted(k.split()[2] for k in first["runs"]) == ["tp=2", "tp=4"], first["runs"]
    for r in recs:
        for name, (loss_err, grad_err) in r["runs"].items():
            assert loss_err < TOL and grad_err < TOL, (name, r["runs"])
