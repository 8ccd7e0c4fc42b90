"""torch.func transforms around a pipelined call under torchrun (NOTE [transforms in a group]):
grad, grad_and_value, vjp of a scalar and of batched outputs, vmap, per-sample gradients (vmap over grad) and
ensembles (vmap over stacked parameters, of torch.func.grad and of fpipe.grad) give on every rank
what the unsplit function gives under torch.func in float64, and each rank runs only its stages.
They used to be refused ("a transform sees only this rank's stages"). Other transforms are
refused by name. The cases run in existing launches (tests/support/transforms_worker.py): 2 ranks
(`trust_launch`: pp=2 with 1F1B and ZB-H1, 4 stages interleaved) and 4 ranks (`four_ranks`:
dp=2 x pp=2, dp=4 x pp=1, pp=4)."""

from __future__ import annotations

from typing import Any

import pytest
from dist_launch import read_json, report

TOL = 1e-12
CASES = [
    "grad",
    "grad_and_value",
    "vjp",
    "vjp_batched",
    "vjp_tuple",
    "vmap",
    "per_sample",
    "ensemble",
    "ensemble_fpipe_grad",
    "jvp",
    "hvp",
    "inner_vmap_grad",
]


@pytest.fixture(scope="module")
def two(trust_launch) -> list[dict[str, Any]]:
    out, procs = trust_launch
    missing = [r for r in range(2) if not (out / f"rank{r}.json").exists()]
    assert not missing, f"ranks {missing} wrote no record\n" + report(procs)
    return [read_json(out / f"rank{r}.json")["transforms"] for r in range(2)]


@pytest.fixture(scope="module")
def four(four_ranks) -> list[dict[str, Any]]:
    return four_ranks("trust")


def _check(rec: dict[str, Any], case: str, stages: list[int]) -> None:
    res = rec[case]
    assert "error" not in res, res
    assert res["err"] < TOL, res
    assert res["stages"] == stages, res


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved-1f1b"])
def test_transforms_on_two_ranks_match_the_unsplit_function(two, schedule, case):
    for r, rec in enumerate(two):
        _check(rec[schedule], case, [r, r + 2] if schedule == "interleaved-1f1b" else [r])


@pytest.mark.parametrize("case", CASES)
def test_transforms_on_four_pipeline_ranks(four, case):
    for r, rec in enumerate(four):
        _check(rec["transforms_pp4"]["1f1b"], case, [r])


@pytest.mark.parametrize("case", CASES)
def test_transforms_on_a_dp_pp_mesh(four, case):
    """dp=2 x pp=2: each replica passes its half; grad is the whole batch's, batched results
    the replica's examples."""
    for r, rec in enumerate(four):
        _check(rec["transforms"], case, [r % 2])


@pytest.mark.parametrize("case", CASES)
def test_transforms_on_replicas_alone(four, case):
    for rec in four:
        _check(rec["transforms_dp_only"], case, [0])


@pytest.mark.parametrize(
    "name, says",
    [
        ("jacrev", "called under torch.func transforms (grad over vmap, outermost first) in a process group"),
        ("vmap_jvp", "(vmap over jvp, outermost first)"),
        ("vjp_summed", "torch.func.vjp of output 0 (of 1), which is combined over microbatches by 'sum'"),
        ("vjp_mixed", "torch.func.vjp of output 1 (of 2), which is combined over microbatches by 'mean'"),
        ("jacrev_batched", "the vjp function of a batched output called under a torch.func transform"),
        ("vjp_ct_shape", "Mismatch in shape"),
        ("grad_of_grad", "(grad over grad, outermost first)"),
        ("vmap_randomness", "called under vmap(..., randomness='different') in a process group"),
    ],
)
def test_transforms_fpipe_does_not_distribute_are_refused_by_name(two, four, name, says):
    for rec in [*(r["1f1b"] for r in two), *(r["transforms"] for r in four)]:
        assert says in rec["refused"][name], rec["refused"][name]


@pytest.mark.parametrize("case", ["grad", "hvp"])
def test_transforms_with_other_ranks_parameters_on_the_meta_device(two, case):
    """Each rank passes the other's parameters on the meta device (as `materialize` leaves
    them): its own parameters' gradients match, the others' come back as meta zeros."""
    for r, rec in enumerate(two):
        res = rec["meta"][case]
        assert "error" not in res, res
        assert res["err"] < TOL and res["stages"] == [r], res
        assert res["meta"] == [f"b{1 - r}", f"w{1 - r}"], res


def test_per_sample_gradients_of_meta_parameters_are_refused(two):
    for rec in two:
        assert (
            "per-sample gradients (vmap over grad) of parameters passed on the meta device"
            in (rec["meta"]["per_sample_refused"])
        )
