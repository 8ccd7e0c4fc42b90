"""Shared pytest configuration for the test suite (fixtures live next to the tests that use them,
here only those that more than one module uses)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# The launch workers, shared test models and the launcher (tests/support/) import one another as
# top-level modules, as they do when torchrun runs a worker from there.
SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

from dist_launch import read_json, report, run_torchrun, torchrun_cmd  # noqa: E402

TRUST_RANKS = 2


@pytest.fixture(scope="session")
def trust_launch(tmp_path_factory):
    """One torchrun launch of `tests/support/trust_dist_worker.py` on 2 ranks for tests/runtime/test_trust_dist.py,
    tests/runtime/test_timeline.py and tests/tracing/test_from_tdp.py (a process group costs seconds to start):
    its output folder and processes (ended: a hard deadline, then SIGKILL)."""
    out = tmp_path_factory.mktemp("trust")
    cmd = torchrun_cmd("trust_dist_worker.py", TRUST_RANKS, "--out", str(out))
    return out, run_torchrun([cmd], out, deadline_s=300.0)


def pytest_configure(config):
    # Hypothesis, when it reports a failing example, imports a module that touches the deprecated
    # `mypy_extensions.TypedDict`; with filterwarnings=error that warning would hide the real
    # failure behind an INTERNALERROR. Narrowly allowed here (not a torch or fpipe warning).
    config.addinivalue_line(
        "filterwarnings", "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning"
    )


@pytest.fixture(scope="session")
def four_ranks(tmp_path_factory):
    """`four_ranks(part)`: each rank's record of one part ("trust", "hf", "dp" or "generate") of
    the one torchrun launch of `tests/support/four_ranks_worker.py` (4 ranks, started on first use) that
    tests/runtime/test_trust_dist.py, tests/pipeline/test_hf_dist.py, tests/parallel/test_dp.py and
    tests/generate/test_generate_cache.py share."""
    out = tmp_path_factory.mktemp("four_ranks")
    parts = {part: out / part for part in ("trust", "hf", "dp", "generate")}
    launched: list = []

    def get(part: str) -> list[dict]:
        if not launched:
            for folder in parts.values():
                folder.mkdir()
            args = [a for part, folder in parts.items() for a in (f"--{part}-out", str(folder))]
            launched.append(run_torchrun([torchrun_cmd("four_ranks_worker.py", 4, *args)], out, 900.0))
        (procs,) = launched
        assert all(p.rc == 0 for p in procs), "the 4-rank launch failed or hung\n" + report(procs)
        records = [parts[part] / f"rank{r}.json" for r in range(4)]
        assert all(rec.exists() for rec in records), f"{part}: a rank wrote no record\n" + report(procs)
        return [read_json(rec) for rec in records]

    get.folder = parts  # type: ignore[attr-defined]
    return get


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny programs (a second thread buys nothing there, and
    spins while the cores are shared); modules ask for it with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
