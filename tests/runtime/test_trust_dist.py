"""Agreement across ranks under torchrun (2 ranks, gloo): two pipelines in one process group,
called alternately, give the unsplit functions' results and keep their failure records apart;
ranks that trace different programs for the same inputs fail with a ValueError on every rank
(instead of gloo's "Received data size doesn't match expected size", or an NCCL hang), and the
group stays usable afterwards. One launch of `tests/support/trust_dist_worker.py` runs every case (the
`trust_launch` fixture of tests/conftest.py; tests/runtime/test_timeline.py reads the same launch)."""

from __future__ import annotations

from typing import Any

import pytest
from dist_launch import read_json, report

TOL = 1e-10  # fp64; the reference is torch.func.grad_and_value of the unsplit function
RANKS = 2
PARAMS = ["b", "w0", "w1"]  # both functions take all three (a does not read b: its gradient is 0)


@pytest.fixture(scope="module")
def launch(trust_launch) -> tuple[Any, list[Any]]:
    return trust_launch


@pytest.fixture(scope="module")
def ranks(launch) -> list[dict[str, Any]]:
    out, procs = launch
    missing = [r for r in range(RANKS) if not (out / f"rank{r}.json").exists()]
    assert not missing, f"ranks {missing} wrote no record\n" + report(procs)
    return [read_json(out / f"rank{r}.json") for r in range(RANKS)]


def test_the_launch_ends_normally(launch):
    """Every case's failure was caught by the worker: the launch exits 0 (none is forced to 1)."""
    _, procs = launch
    assert all(p.rc == 0 for p in procs), "the launch failed or hung\n" + report(procs)


def _check(results: list[dict[str, Any]], which: str) -> None:
    """Every rank's loss and gradients match the reference; every parameter's gradient is
    returned by some rank."""
    for r, res in enumerate(results):
        assert "error" not in res, (r, res)
        assert res["loss"] < TOL, (r, res)
        assert all(e < TOL for e in res["grads"].values()), (r, res)
    assert sorted({k for res in results for k in res["keys"]}) == PARAMS, results


@pytest.mark.parametrize("step", range(3))
@pytest.mark.parametrize("which", ["a", "b"])
def test_two_pipelines_called_alternately_match_the_unsplit_functions(ranks, which, step):
    _check([rec["alternate"]["steps"][step][which] for rec in ranks], which)


def test_each_pipeline_has_its_own_store_namespace_equal_on_every_rank(ranks):
    spaces = [rec["isolation"].get("namespaces") for rec in ranks]
    assert spaces[0] == spaces[1], spaces
    assert spaces[0][0] != spaces[0][1], spaces


def test_a_failure_report_of_one_pipeline_is_not_the_others(ranks):
    report_a = "rank 1 failed: injected report on pipeline a"
    assert [rec["isolation"].get("a_sees") for rec in ranks] == [report_a] * RANKS, ranks
    assert [rec["isolation"].get("b_sees") for rec in ranks] == [None] * RANKS, ranks
    _check([rec["isolation"]["b_after"] for rec in ranks], "b")


@pytest.mark.parametrize(
    ("case", "fn", "part"),
    [
        ("branch", "_branch", "stage 1's forward program"),
        ("constant", "_constant", "stage 0's forward program"),
    ],
)
def test_ranks_that_trace_different_programs_fail_alike_naming_the_ranks_and_program(ranks, case, fn, part):
    errors = [rec[case] for rec in ranks]
    expected = (
        f"pipeline({fn}, microbatches=2): ranks [0] staged a different program from ranks [1] for the "
        f"same inputs ({part} differs"  # and what follows from it, e.g. that stage's backward
    )
    for r, err in enumerate(errors):
        assert err["error_type"] == "ValueError", (r, err)
        assert err["error"].startswith(expected), (r, err)
        assert "Every pipeline rank must trace the same function" in err["error"], (r, err)
    assert errors[0] == errors[1], "every rank says the same"


def test_ranks_that_trace_different_functions_fail_before_averaging_measured_costs(ranks):
    """partition="measure" all-reduces per-operation times before the cut: a rank with one more
    operation would send a longer vector (gloo aborts, NCCL hangs). The traced functions are
    compared first."""
    errors = [rec["measured"] for rec in ranks]
    expected = (
        "pipeline(_measured, stages=2, microbatches=2): ranks [0] staged a different program from "
        "ranks [1] for the same inputs (the traced function differs)"
    )
    for r, err in enumerate(errors):
        assert err["error_type"] == "ValueError", (r, err)
        assert err["error"].startswith(expected), (r, err)
    assert errors[0] == errors[1], "every rank says the same"


def test_backward_through_a_pipelined_call_in_a_group_fails_clearly(ranks):
    for rec in ranks:
        err = rec["backward"]
        assert err["error_type"] == "RuntimeError", (rec["rank"], err)
        assert "backward() through the output of a pipelined call in a process group" in err["error"]
        assert "Use fpipe.value_and_grad(piped)" in err["error"], err


@pytest.mark.parametrize("which", ["a", "b"])
def test_the_group_is_usable_after_a_disagreement(ranks, which):
    _check([rec["after"][which] for rec in ranks], which)


def test_a_rank_that_fails_compiling_stops_the_others_at_once(ranks):
    """Rank 1 raises while tracing (and stays alive); rank 0 waits for it in the comparison of
    the staged programs and must stop with rank 1's reason well before the 20 s timeout."""
    failed, waiting = ranks[1]["compile_fails"], ranks[0]["compile_fails"]
    assert failed["error_type"] == "RuntimeError" and "rank 1 cannot trace this function" in failed["error"]
    assert waiting["error_type"] == "PeerFailure", waiting
    prefix = (
        "fpipe rank 0: stopping while comparing the staged programs before the first step: rank 1 failed: "
    )
    assert waiting["error"].startswith(prefix) and "rank 1 cannot trace this function" in waiting["error"]
    assert waiting["seconds"] < 10, waiting


# -- dp replicas: a (dp=2, pp=2) mesh on 4 ranks ---------------------------------------------------


@pytest.fixture(scope="module")
def mesh_ranks(four_ranks) -> list[dict[str, Any]]:
    """The `--mesh` cases, the first part of the 4-rank launch shared with two other modules
    (the `four_ranks` fixture of tests/conftest.py)."""
    return four_ranks("trust")


@pytest.mark.parametrize("what", ["step", "after"])
def test_dp_replicas_match_the_unsplit_function(mesh_ranks, what):
    for dp in (0, 1):
        _check([rec[what] for rec in mesh_ranks if rec["dp"] == dp], "a")


def test_dp_replicas_keep_their_failure_records_apart(mesh_ranks):
    sees = {rec["rank"]: rec["sees"] for rec in mesh_ranks}
    report_0 = "rank 1 of replica 0 failed: injected report"
    assert sees == {r: report_0 if mesh_ranks[r]["dp"] == 0 else None for r in range(4)}, sees
    spaces = {dp: {rec["namespace"] for rec in mesh_ranks if rec["dp"] == dp} for dp in (0, 1)}
    assert len(spaces[0]) == len(spaces[1]) == 1 and spaces[0] != spaces[1], spaces
