"""`examples/train_gpt.py --dp 2` / `--tp 2`: data or tensor x pipeline parallel gives the
pipeline's loss curve.

Three torchrun launches of the example, started at once on the same global batches (`--batch` is
the global batch): 2 ranks forming one 2-stage pipeline (6 steps), 4 ranks as a 2 x 2
("dp", "pp") mesh (3 steps, then `--save`), and 4 ranks as 2 stages x 2 tensor-parallel ranks
(3 steps); a fourth launch resumes the checkpoint on 2 ranks for steps 4-6. Rank 0 of each writes its per-step losses (`--loss-log`); they must agree to fp32 rounding
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
from dist_launch import ROOT, read_json, report, run_torchrun, torchrun_cmd

TRAIN_GPT = str(ROOT / "examples" / "train_gpt.py")  # absolute: torchrun_cmd joins it to tests/
TINY = "--layers 2 --d-model 32 --heads 2 --seq 16 --batch 8 --microbatches 2 --corpus-mib 0.05"
# name -> (processes, extra options). pp2 runs 6 steps uninterrupted; dp2xpp2 runs 3 and saves a
# checkpoint, which "resumed" (2 ranks, another layout) continues for steps 4-6.
# pp2xtp2 (4 ranks, --tp 2) runs 3 steps: tensor parallelism must not change the curve either.
LAUNCHES = {
    "pp2": (2, ("--steps", "6")),
    "dp2xpp2": (4, ("--dp", "2", "--steps", "3", "--save")),
    "pp2xtp2": (4, ("--tp", "2", "--steps", "3")),
}


@pytest.fixture(scope="module")
def losses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    out = tmp_path_factory.mktemp("example_dp")
    ckpt = str(out / "ckpt")

    def cmd(name: str, n: int, extra: tuple[str, ...]) -> list[str]:
        given = [a for e in extra for a in ((e, ckpt) if e == "--save" else (e,))]  # --save DIR
        return torchrun_cmd(TRAIN_GPT, n, *TINY.split(), *given, "--loss-log", str(out / f"{name}.json"))

    procs = run_torchrun([cmd(k, *v) for k, v in LAUNCHES.items()], out, deadline_s=240)  # side by side
    for name, p in zip(LAUNCHES, procs):
        p.name = name
    assert all(p.rc == 0 for p in procs), report(procs)
    resumed = run_torchrun([cmd("resumed", 2, ("--steps", "6", "--save", "--resume"))], out, deadline_s=240)
    assert all(p.rc == 0 for p in resumed), report(resumed)
    return {name: read_json(out / f"{name}.json")["losses"] for name in [*LAUNCHES, "resumed"]}


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


@pytest.mark.parametrize(
    ("world", "options", "message"),
    [
        ("4", "--dp 3", "WORLD_SIZE 4 is not divisible"),
        ("4", "--dp 2 --batch 6 --microbatches 2", "--batch 6 is not divisible by --dp 2 x --microbatches 2"),
        ("4", "--tp 3", "--tp 3: must be at least 1 and divide --heads 4"),
        ("6", "--tp 4 --heads 8", "--tp 4 needs torchrun with WORLD_SIZE = dp x pp x tp processes (got 6)"),
    ],
)
def test_bad_dp_is_refused_before_any_collective(world: str, options: str, message: str) -> None:
    """torchrun's variables without a torchrun: the script must exit before it would connect."""
    env = {**os.environ, "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": world}
    p = subprocess.run(
        [sys.executable, TRAIN_GPT, *options.split()],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 2, p.stdout + p.stderr
    assert message in p.stderr, p.stderr
