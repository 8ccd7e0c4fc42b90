"""A run that survives a killed rank (examples/train_resilient.py, fpipe.CheckpointManager).

Two torchrun launches of the example side by side, 2 ranks (a 2-stage pipeline), dropout on, each
under `--max-restarts 1`: one uninterrupted, one whose rank R SIGKILLs itself in the middle of
step K on the first attempt (R and K drawn by a seeded generator here). torchrun ends the other
rank and starts the job again; the new attempt joins a fresh process group (NOTE [restarted
attempts] in fpipe/_src/runtime/dist.py) and resumes from the manager's latest complete step. Every loss
either attempt logged, and every rank's final parameters, must equal the uninterrupted run's bit
for bit (dropout's masks, the batch stream and AdamW's state all resumed).
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from dist_launch import ROOT, report, run_torchrun, torchrun_cmd

import fpipe

EXAMPLE = str(ROOT / "examples" / "train_resilient.py")  # absolute: torchrun_cmd joins it to tests/
STEPS, EVERY, KEEP = 6, 2, 2
_draw = random.Random(20)
KILL_AT, KILL_RANK = _draw.randint(3, STEPS), _draw.randint(0, 1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("resilient")

    def cmd(name: str, *extra: str) -> list[str]:
        args = ["--root", str(out / name), "--steps", str(STEPS), "--every", str(EVERY), "--keep", str(KEEP)]
        args += [
            "--dropout",
            "0.1",
            "--loss-log",
            str(out / f"{name}.jsonl"),
            "--params-out",
            str(out / name),
        ]
        return torchrun_cmd(EXAMPLE, 2, *args, *extra, max_restarts=1)

    kill = ("--kill-at", str(KILL_AT), "--kill-rank", str(KILL_RANK))
    procs = run_torchrun([cmd("whole"), cmd("killed", *kill)], out, deadline_s=300)
    assert all(p.rc == 0 for p in procs), report(procs)
    return out, procs


def _losses(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_killed_rank_is_restarted_and_resumes_from_the_latest_checkpoint(runs):
    out, procs = runs
    text = procs[1].text()
    starts = {int(a): int(s) for a, s in re.findall(r"rank 0, attempt (\d): starting after step (\d+)", text)}
    assert starts.keys() == {0, 1} and starts[0] == 0, text[-4000:]
    assert starts[1] % EVERY == 0 and starts[1] < KILL_AT, (starts, KILL_AT)  # a step saved before the kill
    assert fpipe.CheckpointManager(out / "killed", every=EVERY).all_steps() == [STEPS - EVERY, STEPS]
    kept = [f"{dot}step_0000000{s}{lock}" for s in (4, 6) for dot, lock in (("", ""), (".", ".lock"))]
    assert sorted(p.name for p in (out / "killed").iterdir()) == sorted(kept)  # fpipe's files alone


def test_every_logged_loss_and_the_final_parameters_equal_the_uninterrupted_run(runs):
    out, _ = runs
    whole = {e["step"]: e["loss"] for e in _losses(out / "whole.jsonl")}
    assert sorted(whole) == list(range(1, STEPS + 1))
    killed = _losses(out / "killed.jsonl")
    assert {e["step"] for e in killed if e["attempt"] == 1} >= set(range(KILL_AT, STEPS + 1)), killed
    for e in killed:  # both attempts: the steps before the kill, and those run again after it
        assert e["loss"] == whole[e["step"]], (
            f"step {e['step']} (attempt {e['attempt']}): {e['loss']!r} vs {whole[e['step']]!r}"
        )
    for rank in (0, 1):
        a = torch.load(out / f"whole.rank{rank}", weights_only=True)
        b = torch.load(out / f"killed.rank{rank}", weights_only=True)
        assert a.keys() == b.keys() and a
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
