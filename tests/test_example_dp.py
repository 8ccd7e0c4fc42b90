"""`examples/train_gpt.py --dp 2`: data x pipeline parallel gives the pipeline's loss curve.

Two torchrun launches of the example, started at once on the same global batches (`--batch` is
the global batch): 2 ranks forming one 2-stage pipeline, and 4 ranks as a 2 x 2 ("dp", "pp")
mesh. Rank 0 of each writes its per-step losses (`--loss-log`); they must agree to fp32 rounding
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
TINY = "--steps 3 --layers 2 --d-model 32 --heads 2 --seq 16 --batch 8 --microbatches 2 --corpus-mib 0.05"
LAUNCHES = {"pp2": (2, ()), "dp2xpp2": (4, ("--dp", "2"))}  # name -> (processes, extra options)


@pytest.fixture(scope="module")
def losses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    out = tmp_path_factory.mktemp("example_dp")
    cmds = [
        torchrun_cmd(TRAIN_GPT, n, *TINY.split(), *extra, "--loss-log", str(out / f"{name}.json"))
        for name, (n, extra) in LAUNCHES.items()
    ]
    procs = run_torchrun(cmds, out, deadline_s=240)  # standalone launches, side by side
    for name, p in zip(LAUNCHES, procs):
        p.name = name
    assert all(p.rc == 0 for p in procs), report(procs)
    return {name: read_json(out / f"{name}.json")["losses"] for name in LAUNCHES}


def test_dp_loss_curve_matches_pipeline(losses: dict[str, list[float]]) -> None:
    pp, dp = losses["pp2"], losses["dp2xpp2"]
    assert len(pp) == len(dp) == 3, losses
    assert all(math.isfinite(v) for v in pp + dp), losses
    for step, (a, b) in enumerate(zip(pp, dp), 1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: pp-only {a!r} vs dp x pp {b!r}\n{losses}"


@pytest.mark.parametrize(
    ("world", "options", "message"),
    [
        ("4", "--dp 3", "WORLD_SIZE 4 is not divisible"),
        ("4", "--dp 2 --batch 6 --microbatches 2", "--batch 6 is not divisible by --dp 2 x --microbatches 2"),
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
