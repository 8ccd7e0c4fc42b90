"""Outputs and clipping across ranks (issue 24, cases 14, 15, 17): the cases of
`tests/support/outputs_worker.py`, run inside the shared launches -- on 2 ranks (pp=2) by
`tests/support/trust_dist_worker.py` (the `trust_launch` fixture) and on 4 ranks (dp=2 x pp=2) by
`tests/support/dp_worker.py` (its part of the `four_ranks` launch). No launch of its own."""

from __future__ import annotations

from typing import Any

import pytest
from dist_launch import read_json, report

TOL = 1e-12


@pytest.fixture(scope="module")
def pp_ranks(trust_launch) -> list[dict[str, Any]]:
    out, procs = trust_launch
    missing = [r for r in range(2) if not (out / f"rank{r}.json").exists()]
    assert not missing, f"ranks {missing} wrote no record\n" + report(procs)
    return [read_json(out / f"rank{r}.json") for r in range(2)]


@pytest.fixture(scope="module")
def mesh_ranks(four_ranks) -> list[dict[str, Any]]:
    return [rec["outputs"] for rec in four_ranks("dp")]


def _check_count(res: dict[str, Any]) -> None:
    assert "error" not in res, res
    assert res["counts"] == [res["want"]] * 2, res  # plain call, value_and_grad
    assert res["dtypes"] == ["torch.int64"] * 2, res
    assert res["loss_err"] < TOL, res


@pytest.mark.parametrize("microbatches", [1, 2])
def test_an_integer_count_is_the_whole_batchs_int64_on_every_pipeline_rank(pp_ranks, microbatches):
    """Case 14: rank 0 read float32 8.0's bits as int64 (1090519040); the last stage averaged."""
    for rec in pp_ranks:
        assert "error" not in rec["outputs"], rec["outputs"]
        _check_count(rec["outputs"][f"m{microbatches}"])


def test_an_integer_count_is_summed_over_microbatches_and_replicas(mesh_ranks):
    """Case 14 on dp=2 x pp=2: every rank returns the global batch's count as an int64."""
    for rec in mesh_ranks:
        assert "error" not in rec, rec
        _check_count(rec["count"])


def test_the_sum_plus_decay_advice_counts_replicas_and_reproduces_the_function(mesh_ranks):
    """Case 17: under dp the advice divides the decay by microbatches x replicas (4); following
    it gives the unsplit function's loss and gradients."""
    for rec in mesh_ranks:
        (msg,) = rec["decay"]["messages"]
        assert "4 values (2 microbatches x 2 data-parallel replicas)" in msg, msg
        assert "divide that term by 4" in msg and "out_axes='sum'" in msg, msg
        assert rec["decay"]["loss_err"] < 1e-12 and rec["decay"]["grad_err"] < 1e-12, rec["decay"]


def test_the_inf_norm_counts_an_empty_shard_as_zero(mesh_ranks):
    """Case 15: a Shard(0) parameter of one row on dp=2 (dp rank 1 holds no row): the inf-norm
    is the unsplit gradients' largest entry on every rank (it raised `max(): Expected reduction
    dim` on the empty shard, and the other ranks lost their peer)."""
    assert sorted(
        r["inf_clip"]["shard_rows"] for r in mesh_ranks if r["inf_clip"]["shard_rows"] is not None
    ) == [0, 1]
    for rec in mesh_ranks:
        assert rec["inf_clip"]["err"] < TOL, rec["inf_clip"]


def test_a_rank_failing_in_clip_grad_norm_stops_its_peer_at_once_naming_it(pp_ranks):
    """Case 15: rank 1 refuses its arguments; rank 0, in the norm's all-reduce, raises within
    seconds naming rank 1's error (it waited with no deadline)."""
    r0, r1 = (rec["clip_failure"] for rec in pp_ranks)
    assert r1["error_type"] == "TypeError", r1
    assert r0["error_type"] == "PeerFailure", r0
    assert "rank 1 failed: TypeError: clip_grad_norm_(grads, pipeline=...)" in r0["error"], r0
    assert r0["seconds"] < 10, r0


@pytest.mark.parametrize("where", ["inside", "around"])
def test_loss_parallel_is_refused_by_name_with_the_fix(pp_ranks, where):
    """Case 16: torch's loss_parallel() inside the loss or around the call, on a tp=2 mesh: a
    ValueError naming the call, the setting and the fix, on every rank (refused, not supported)."""
    for rec in pp_ranks:
        msg = rec["loss_parallel"][where]
        assert msg.startswith("ValueError: pipeline(") and f"loss_parallel() {where} the" in msg, msg
        assert "ColwiseParallel(output_layouts=Replicate())" in msg and "F.cross_entropy" in msg, msg
