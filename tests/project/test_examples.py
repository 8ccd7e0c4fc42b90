"""Smoke tests: the examples run end to end, in one process and under torchrun (tiny settings).

Both launches start at once (they are mostly interpreter start-up and import) and are checked
for exit code 0 and the final summary line. Their output goes to a pipe, not a terminal, as in a
log: the progress bar must then be plain lines (examples/README.md), from rank 0 only.
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
SUMMARY = re.compile(r"^done: 3 steps, loss \d+\.\d+ -> \d+\.\d+, [\d,]+ tok/s, .*wall \d+\.\d s$", re.M)
# tqdm's line in a log: "100%|##########| 3/3 [00:01<00:00,  2.51step/s, loss 5.103, 1,234 tok/s]"
PROGRESS = re.compile(r"^ *(\d+)%\|[^|\n]*\| (\d+)/3 \[.*\]$", re.M)
LAUNCHES = {
    "one process": [sys.executable, TRAIN_GPT, *TINY.split()],
    "torchrun 2 ranks": [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *(TRAIN_GPT, *TINY.split()),
    ],
}


def _start(cmd: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out, err = subprocess.PIPE, subprocess.STDOUT
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True, start_new_session=True)


@pytest.fixture(scope="module")
def finished() -> dict[str, tuple[int, str]]:
    procs = {name: _start(cmd) for name, cmd in LAUNCHES.items()}
    results = {}
    for name, p in procs.items():
        try:
            text, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the launch's own session: torchrun and its workers
            text, _ = p.communicate()
        results[name] = (p.returncode, text)
    return results


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_train_gpt_runs(finished: dict[str, tuple[int, str]], launch: str) -> None:
    code, text = finished[launch]
    assert code == 0, f"{launch}: exit code {code}\n{text[-3000:]}"
    assert SUMMARY.search(text), f"{launch}: no summary line\n{text[-3000:]}"


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_train_gpt_progress_in_a_log(finished: dict[str, tuple[int, str]], launch: str) -> None:
    """Not a terminal: no carriage returns, one plain line per 10% of the steps (here every one of
    the 3 steps, after the line of step 0), from rank 0 only, without repeating the last."""
    code, text = finished[launch]
    assert code == 0, f"{launch}: exit code {code}\n{text[-3000:]}"
    assert "\r" not in text, f"{launch}: carriage returns in a log\n{text[-3000:]}"
    steps = [int(m.group(2)) for m in PROGRESS.finditer(text)]
    assert steps == [0, 1, 2, 3], f"{launch}: progress lines for steps {steps}\n{text[-3000:]}"
