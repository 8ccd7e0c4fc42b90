"""`examples/train_gpt.py --dp 2` / `--tp 2`: data or tensor x pipeline parallel gives the
pipeline's loss curve.

Three torchrun launches of the example, started at once on the same global batches (`--batch` is
the global batch): 2 ranks forming one 2-stage pipeline (6 steps), 4 ranks as a 2 x 2
("dp", "pp") mesh (3 steps, then `--save`), and 4 ranks as 2 stages x 2 tensor-parallel ranks
(3 steps); a fourth launch resumes the checkpoint on 2 ranks for steps 4-6 (the
`train_gpt_launches` fixture of tests/conftest.py; tests/project/test_examples.py reads the 2-rank
launch's log). Rank 0 of each writes its per-step losses (`--loss-log`); they must agree to fp32 rounding
(each replica averages its half, then the replicas' losses and gradients are combined: a
different reduction order, the same mean). Also: a --dp that does not divide the world or the
batch is refused before any process group starts.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
from dist_launch import ROOT, read_json, report

TRAIN_GPT = str(ROOT / "examples" / "train_gpt.py")


@pytest.fixture(scope="module")
def losses(train_gpt_launches) -> dict[str, list[float]]:
    """Rank 0's per-step losses of each launch (the `train_gpt_launches` fixture of
    tests/conftest.py: pp2, dp2xpp2 and pp2xtp2 at once, then "resumed")."""
    out, procs = train_gpt_launches
    assert "resumed" in procs and all(p.rc == 0 for p in procs.values()), report(list(procs.values()))
    return {name: read_json(out / f"{name}.json")["losses"] for name in procs}


def test_dp_loss_curve_matches_pipeline(losses: dict[str, list[float]]) -> None:
    pp, dp = losses["pp2"][:3], losses["dp2xpp2"]
    assert len(pp) == len(dp) == 3, losses
    assert all(math.isfinite(v) for v in pp + dp), losses
    for step, (a, b) in enumerate(zip(pp, dp), 1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: pp-only {a!r} vs dp x pp {b!r}\n{losses}"


def test_tp_loss_curve_matches_pipeline(losses: dict[str, list[float]]) -> None:
    """`--tp 2`: each stage's blocks split over 2 ranks (parallelize_module, Megatron's layout),
    initialised with the values the unsplit model draws (`materialize` initialises a DTensor
    parameter whole, then keeps its shard): the same losses, to fp32 rounding."""
    pp, tp = losses["pp2"][:3], losses["pp2xtp2"]
    assert len(pp) == len(tp) == 3, losses
    for step, (a, b) in enumerate(zip(pp, tp), 1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: pp-only {a!r} vs pp x tp {b!r}\n{losses}"


def test_a_run_saved_at_dp2xpp2_resumes_on_two_ranks_with_the_same_loss_curve(losses) -> None:
    """`--save DIR` at the end of 3 steps on 4 ranks (dp=2 x pp=2), `--resume` on 2 (pp=2): steps
    4-6 give the uninterrupted 6-step run's losses (to the fp32 rounding by which the dp run's
    first 3 steps already differ)."""
    pp, resumed = losses["pp2"][3:], losses["resumed"]
    assert len(pp) == len(resumed) == 3, losses
    for step, (a, b) in enumerate(zip(pp, resumed), 4):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: uninterrupted {a!r} vs resumed {b!r}\n{losses}"


BAD = {  # options: (WORLD_SIZE, what the refusal must say)
    "--dp 3": ("4", "WORLD_SIZE 4 is not divisible"),
    "--dp 2 --batch 6 --microbatches 2": ("4", "--batch 6 is not divisible by --dp 2 x --microbatches 2"),
    "--tp 3": ("4", "--tp 3: must be at least 1 and divide --heads 4"),
    "--tp 4 --heads 8": ("6", "--tp 4 needs torchrun with WORLD_SIZE = dp x pp x tp processes (got 6)"),
}


@pytest.fixture(scope="module")
def refused() -> dict[str, tuple[int | None, str, str]]:
    """Each BAD case's (exit code, stdout, stderr): the processes run at once (each is mostly
    interpreter start-up and import; one at a time they left a core idle)."""
    procs = {}
    for options, (world, _) in BAD.items():
        env = {**os.environ, "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": world}
        procs[options] = subprocess.Popen(
            [sys.executable, TRAIN_GPT, *options.split()],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    out = {}
    try:
        for options, p in procs.items():
            stdout, stderr = p.communicate(timeout=120)
            out[options] = (p.returncode, stdout, stderr)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    return out


@pytest.mark.parametrize("options", list(BAD))
def test_bad_dp_is_refused_before_any_collective(refused, options: str) -> None:
    """torchrun's variables without a torchrun: the script must exit before it would connect."""
    code, stdout, stderr = refused[options]
    assert code == 2, stdout + stderr
    assert BAD[options][1] in stderr, stderr
