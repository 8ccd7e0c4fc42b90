"""Smoke tests: the examples run end to end, in one process and under torchrun (tiny settings);
examples/dp_sgd.py's step matches the one computed one example at a time.

The one-process run (3 steps) is started here; the torchrun run is the 2-rank, 6-step launch of
tests/project/test_example_dp.py (the `train_gpt_launches` fixture of tests/conftest.py: a launch is
mostly interpreter start-up and import, so it is not started twice). Both are checked for exit
code 0 and the final summary line. Their output goes to a pipe or a file, not a terminal, as in
a log: the progress bar must then be plain lines (examples/README.md), from rank 0 only.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN_GPT = str(ROOT / "examples" / "train_gpt.py")
TINY = "--steps 3 --layers 2 --d-model 32 --heads 2 --seq 16 --batch 8 --microbatches 2 --corpus-mib 0.1"
ONE_PROCESS = [sys.executable, TRAIN_GPT, *TINY.split()]
LAUNCHES = {"one process": 3, "torchrun 2 ranks": 6}  # name -> steps
SUMMARY = r"^done: {steps} steps, loss \d+\.\d+ -> \d+\.\d+, [\d,]+ tok/s, .*wall \d+\.\d s$"
# tqdm's line in a log: "100%|##########| 3/3 [00:01<00:00,  2.51step/s, loss 5.103, 1,234 tok/s]"
PROGRESS = r"^ *(\d+)%\|[^|\n]*\| (\d+)/{steps} \[.*\]$"
DP_SGD = [  # examples/dp_sgd.py: started with the launches above
    *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
    str(ROOT / "examples" / "dp_sgd.py"),
]
DP_SGD_LINE = re.compile(
    r"^DP-SGD step on 8 examples: max \|difference\| from one example at a time (\S+)$", re.M
)


def _start(cmd: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out, err = subprocess.PIPE, subprocess.STDOUT
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True, start_new_session=True)


@pytest.fixture(scope="module")
def finished(train_gpt_launches) -> dict[str, tuple[int, str]]:
    procs = {"one process": _start(ONE_PROCESS), "dp_sgd": _start(DP_SGD)}
    _, launched = train_gpt_launches  # (ended, or ended by their deadline)
    results = {"torchrun 2 ranks": (launched["pp2"].rc, launched["pp2"].text())}
    for name, proc in procs.items():
        try:
            text, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: torchrun and its workers
            text, _ = proc.communicate()
        results[name] = (proc.returncode, text)
    return results


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_train_gpt_runs(finished: dict[str, tuple[int, str]], launch: str) -> None:
    code, text = finished[launch]
    assert code == 0, f"{launch}: exit code {code}\n{text[-3000:]}"
    summary = re.compile(SUMMARY.format(steps=LAUNCHES[launch]), re.M)
    assert summary.search(text), f"{launch}: no summary line\n{text[-3000:]}"


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_train_gpt_progress_in_a_log(finished: dict[str, tuple[int, str]], launch: str) -> None:
    """Not a terminal: no carriage returns, one plain line per 10% of the steps (here every one of
    the 3 or 6 steps, after the line of step 0), from rank 0 only, without repeating the last."""
    code, text = finished[launch]
    assert code == 0, f"{launch}: exit code {code}\n{text[-3000:]}"
    assert "\r" not in text, f"{launch}: carriage returns in a log\n{text[-3000:]}"
    n = LAUNCHES[launch]
    steps = [int(m.group(2)) for m in re.finditer(PROGRESS.format(steps=n), text, re.M)]
    assert steps == list(range(n + 1)), f"{launch}: progress lines for steps {steps}\n{text[-3000:]}"


def test_dp_sgd_per_sample_gradients_through_the_pipeline_match_one_example_at_a_time(finished):
    """examples/dp_sgd.py under torchrun (2 stages, one per rank): per-sample gradients by
    vmap(grad(piped)), clipped, noised, one step -- against the same step computed one example at
    a time with the unsplit model in one process (float64)."""
    code, text = finished["dp_sgd"]
    assert code == 0, f"exit code {code}\n{text[-3000:]}"
    assert "rank 0: stages [0]" in text and "rank 1: stages [1]" in text, text[-3000:]
    m = DP_SGD_LINE.search(text)
    assert m, text[-3000:]
    assert float(m.group(1)) < 1e-10, m.group(0)
