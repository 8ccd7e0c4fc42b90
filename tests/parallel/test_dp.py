"""Data x pipeline parallelism on one DeviceMesh (NOTE [gradients over replicas] in
fpipe/_src/parallel/replicas.py, sharded parameters in fpipe/_src/parallel/sharding.py): 4 gloo ranks under
torchrun, dp=2 x pp=2, each passing its dp slice of one global batch. One launch runs every case
of `tests/support/dp_worker.py` (its part of the 4-rank launch of tests/support/four_ranks_worker.py, shared with
other modules); each compares with `torch.func.grad_and_value` of the unsplit function over the
global batch, in fp64. Cases "sharded-*" pass the parameters as
DTensors placed Shard(0) on the "dp" sub-mesh."""

from __future__ import annotations

from typing import Any

import pytest

TOL = 1e-12
SHARDED = ["sharded-1f1b", "sharded-zbv", "sharded-tied", "sharded-uneven"]
CASES = ["1f1b", "gpipe", "interleaved", "zbv", "sum", "tied", *SHARDED]
ADAMW = ["1f1b", "tied", "sharded-1f1b", "sharded-tied", "sharded-uneven"]
UNEVEN = ("sharded-uneven", "sharded-tied")  # first dimensions dp=2 does not divide (5, 1; 7)
EXPECTED_KEYS = {
    "tied": ["emb", "w"],
    "uneven": ["b0", "b1", "scale", "w0", "w1"],
    "mlp": [f"{k}{i}" for k in "bw" for i in range(4)],
}


@pytest.fixture(scope="module")
def ranks(four_ranks) -> list[dict[str, Any]]:
    """Each rank's record of `dp_worker`'s part of the 4-rank launch that this module shares with
    others (the `four_ranks` fixture of tests/conftest.py)."""
    return four_ranks("dp")


@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradients_are_those_of_the_global_batch(ranks, case):
    """The loss is the global one on every rank; each rank's gradients are the global loss's
    (a 'mean' loss: the mean over replicas; out_axes='sum': the sum)."""
    for rec in ranks:
        res = rec[case]
        assert "error" not in res, (rec["rank"], res)
        assert res["loss_err"] < TOL * 100, (rec["rank"], res)
        assert res["keys"] and max(res["grad_err"].values()) < TOL * 100, (rec["rank"], res)


@pytest.mark.parametrize("case", CASES)
def test_replicas_are_bitwise_identical(ranks, case):
    assert all(rec[case]["replicas_equal"] for rec in ranks), [rec[case] for rec in ranks]


@pytest.mark.parametrize("case", CASES)
def test_every_parameter_gradient_is_returned_by_each_replica(ranks, case):
    """Within each replica (one pipeline), the pipeline ranks' gradients cover every parameter."""
    expected = EXPECTED_KEYS.get(case.removeprefix("sharded-"), EXPECTED_KEYS["mlp"])
    for dp in (0, 1):
        keys = {k for rec in ranks if rec["dp"] == dp for k in rec[case]["keys"]}
        assert sorted(keys) == sorted(expected), (dp, keys)


@pytest.mark.parametrize("case", ADAMW)
def test_three_adamw_steps_equal_single_process_training(ranks, case):
    for rec in ranks:
        assert rec[case]["adamw"]["err"] < 1e-12, (rec["rank"], rec[case])


@pytest.mark.parametrize("case", CASES)
def test_clip_grad_norm_spans_dp_and_pp_counting_each_parameter_once(ranks, case):
    for rec in ranks:
        assert rec[case]["norm_err"] < 1e-12, (rec["rank"], rec[case])


@pytest.mark.parametrize("case", SHARDED)
def test_sharded_gradients_keep_the_parameters_placement_and_adamw_keeps_half_the_state(ranks, case):
    """Gradients come back as DTensors placed Shard(0) like their parameters, so AdamW on the
    DTensor parameters holds 1/dp of its state on each rank (its shards' share where dp does
    not divide a first dimension: UNEVEN)."""
    for rec in ranks:
        assert rec[case]["placements"] == ["(Shard(dim=0),)"], rec[case]
        if case in ADAMW:
            adamw = rec[case]["adamw"]
            assert adamw["state_fraction"] == adamw["shard_fraction"], rec[case]
            assert case in UNEVEN or adamw["state_fraction"] == 0.5, rec[case]
    if case in UNEVEN:  # the two replicas of one pipeline rank hold the whole state
        for pp in (0, 1):
            assert sum(r[case]["adamw"]["state_fraction"] for r in ranks if r["pp"] == pp) == pytest.approx(
                1.0
            )


def test_replicated_parameters_keep_the_whole_state(ranks):
    for rec in ranks:
        assert rec["1f1b"]["placements"] == ["plain"] and rec["1f1b"]["adamw"]["state_fraction"] == 1.0


def test_dtensor_parameters_not_sharded_over_dp_are_refused(ranks):
    for rec in ranks:
        msg = rec["wrong_placement"]
        assert "is a DTensor on mesh" in msg and "Shard(0) on the pipeline mesh's 'dp' sub-mesh" in msg, msg


def test_replicas_passing_slices_of_different_shapes_fail_naming_ranks_and_argument(ranks):
    for rec in ranks:
        msg = rec["mismatch"]
        assert "data-parallel ranks [" in msg and "argument 'x'" in msg, msg
        assert "split the global batch evenly over the 'dp' dimension" in msg, msg


def test_each_rank_does_about_a_quarter_of_the_matrix_multiply_work(ranks):
    """dp=2 x pp=2 on an MLP of four equal layers: each rank's FLOPs are a quarter of the unsplit
    step's over the global batch (FlopCounterMode)."""
    shares = [rec["matmul_share"] for rec in ranks]  # stage 0 skips layer 0's input gradient: 5:6
    assert all(0.2 < s < 0.3 for s in shares), shares
    assert 0.99 < sum(shares) < 1.01, shares  # no work done twice


def test_a_mesh_dimension_fpipe_does_not_know_is_refused(ranks):
    for rec in ranks:
        msg = rec["unknown_dimension"]
        assert "the mesh has dimensions ('dp', 'ep')" in msg and "unknown: ['ep']" in msg, msg


def test_a_mesh_that_does_not_hold_every_rank_is_refused(ranks):
    for rec in ranks:
        msg = rec["not_the_whole_world"]
        assert "the mesh (dp=2 x pp=1) holds 2 ranks but the job has 4" in msg, msg


def test_a_batch_that_dp_times_microbatches_does_not_divide_is_refused(ranks):
    for rec in ranks:
        msg = rec["indivisible"]
        assert "has 8 rows on this rank, its slice of the global batch over dp=2 replicas" in msg, msg
        assert "a multiple of dp x microbatches = 6" in msg, msg


def test_sharded_parameters_are_whole_only_while_their_stage_reads_them(ranks):
    """NOTE [gathered stage by stage]: on zbv (two stages per rank), over two steps, each sharded
    parameter is gathered once per step, with its stage's other parameters in one all-gather
    (one per stage, the next stage's launched one stage ahead), made whole just before the first
    action of this rank that reads it and dropped right after the last one."""
    for rec in ranks:
        log = rec["gather_log"]
        readers, events = log["readers"], log["events"]
        assert len(readers) == 4 and len({r[0] for r in readers.values()}) == 2, log  # 2 stages here
        gathers = [e for e in events if e[0] == "gathered"]
        assert [int(e[1]) for e in gathers] == [2, 2] * 2, log  # w and b of each stage, per step
        for name, reads in readers.items():
            whole = [k for e, n, k in events if n == name and e == "whole"]
            dropped = [k for e, n, k in events if n == name and e == "dropped"]
            assert whole == [reads[0]] * 2 and dropped == [reads[-1]] * 2, (name, reads, log)


def test_dtensor_parameters_without_replicas_are_refused_saying_why(ranks):
    """A (dp=1, pp=4) mesh: the message used to ask for the placement the user had given."""
    for rec in ranks:
        msg = rec["no_replicas"]
        assert "is a DTensor, but this pipeline has no data-parallel replicas" in msg, msg


def test_plan_is_the_same_on_every_rank_verified_and_exact(ranks):
    """fpipe.plan under torchrun: one plan on every rank (measurements averaged, verified steps
    the slowest rank's), chosen as the fastest of the candidates it timed as real steps, and
    `pipeline(f, plan=p)` on each replica's share gives the global batch's loss and gradients."""
    recs = [rec["plan"] for rec in ranks]
    assert all("error" not in r for r in recs), recs
    assert all(r["layout"] == recs[0]["layout"] and r["verified"] == recs[0]["verified"] for r in recs)
    verified = recs[0]["verified"]
    assert len(verified) == 2, verified
    measured = [m for _, _, m in verified]
    assert all(m > 0 for m in measured) and measured == sorted(measured), verified
    assert recs[0]["measured"] == measured[0] and recs[0]["layout"][0] == verified[0][0]
    for r in recs:
        assert r["loss_err"] < TOL and r["grad_err"] < TOL, r
    assert all(r["again"] == [0.0, True, True] for r in recs), recs  # a second call: all cached
    covered = set().union(*(r["keys"] for r in recs))  # every parameter's gradient on some rank
    assert covered == set(EXPECTED_KEYS["mlp"])


def test_a_sum_loss_over_replicas_is_read_at_one_microbatch(ranks):
    """No out_axes and microbatches=1 on 2 replicas: the loss is a sum, read from the graph, and
    the replicas' values are added (as the unsplit function's), not averaged."""
    for rec in ranks:
        assert rec["sum_m1"]["loss_err"] < TOL * 100 and rec["sum_m1"]["grad_err"] < TOL * 100, rec["sum_m1"]
