"""Shared pytest configuration for the test suite (fixtures live next to the tests that use them,
here only those that more than one module uses)."""

from __future__ import annotations

import ast
import inspect
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

# The launch workers, shared test models and the launcher (tests/support/) import one another as
# top-level modules, as they do when torchrun runs a worker from there.
SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

from dist_launch import ROOT, read_json, report, run_torchrun, torchrun_cmd  # noqa: E402

# Every process the tests start (torchrun workers, examples, bare ranks) imports fpipe from this
# checkout, not from wherever `pip install -e` pointed: a second worktree tests its own code.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)

TRUST_RANKS = 2


@pytest.fixture(scope="session")
def trust_launch(tmp_path_factory):
    """One torchrun launch of `tests/support/trust_dist_worker.py` on 2 ranks for tests/runtime/test_trust_dist.py,
    tests/runtime/test_timeline.py, tests/tracing/test_from_tdp.py and tests/pipeline/test_transforms_dist.py (a process group costs seconds to start):
    its output folder and processes (ended: a hard deadline, then SIGKILL)."""
    out = tmp_path_factory.mktemp("trust")
    cmd = torchrun_cmd("trust_dist_worker.py", TRUST_RANKS, "--out", str(out))
    return out, run_torchrun([cmd], out, deadline_s=300.0)


# -- the `multirank` marker ---------------------------------------------------------------------------
# Every test that starts rank processes -- a torchrun launch or bare ranks (tests/support/dist_launch.py) --
# is marked `multirank` here, at collection, so `pytest -m "not multirank"` is the single-process
# inner loop. Found from the code, not from a list: a test launches if its function, a fixture it
# uses, or a function or class of the tests those reach (transitively, by name) calls one of
# dist_launch's launchers or names torchrun's module (`python -m torch.distributed.run`).

TESTS = Path(__file__).resolve().parent
_LAUNCHERS = frozenset({"run_torchrun", "start_ranks", "torchrun_cmd"})
_TORCHRUN = "torch.distributed.run"
_launches_memo: dict[int, bool] = {}


def _from_tests(obj: Any) -> bool:
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        return False
    try:
        return TESTS in Path(inspect.getsourcefile(obj) or "").resolve().parents
    except TypeError:
        return False


def _launches(obj: Any) -> bool:
    """Whether calling `obj` (a function or class of the tests) may start rank processes."""
    key = id(obj)
    if key not in _launches_memo:
        _launches_memo[key] = False  # a cycle of calls adds nothing
        _launches_memo[key] = _reaches_a_launcher(obj)
    return _launches_memo[key]


def _reaches_a_launcher(obj: Any) -> bool:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, SyntaxError):  # no source, or a lambda's line that does not parse alone
        return False
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    if names & _LAUNCHERS or any(_TORCHRUN in s for s in strings):
        return True
    scope = getattr(obj, "__globals__", None) or vars(sys.modules[obj.__module__])
    for name in names & scope.keys():
        value = scope[name]
        if isinstance(value, (str, list, tuple, dict)) and _TORCHRUN in repr(value):
            return True  # a module-level command line
        if _from_tests(value) and _launches(value):
            return True
    return False


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        function = getattr(item, "function", None)
        if function is None:  # doctests
            continue
        defs = item._fixtureinfo.name2fixturedefs.values()
        used = [function, *(d.func for ds in defs for d in ds if _from_tests(d.func))]
        if any(_launches(f) for f in used):
            item.add_marker(pytest.mark.multirank)
            # NOTE [two workers]: under `-n 2 --dist loadgroup` (pyproject's addopts) every
            # multi-rank test runs in one worker, one after another, so each shared launch
            # (`four_ranks`, `trust_launch`, ...) starts once; the single-process tests run in
            # the other worker meanwhile, on the core the launches leave idle.
            item.add_marker(pytest.mark.xdist_group("multirank"))


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
    tests/generate/test_generate_cache.py and tests/generate/test_generator.py share."""
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


TRAIN_GPT = str(ROOT / "examples" / "train_gpt.py")  # absolute: torchrun_cmd joins it to tests/
TRAIN_GPT_TINY = "--layers 2 --d-model 32 --heads 2 --seq 16 --batch 8 --microbatches 2 --corpus-mib 0.05"
# name -> (processes, extra options). pp2 runs 6 steps uninterrupted; dp2xpp2 runs 3 and saves a
# checkpoint, which "resumed" (2 ranks, another layout) continues for steps 4-6.
# pp2xtp2 (4 ranks, --tp 2) runs 3 steps: tensor parallelism must not change the curve either.
TRAIN_GPT_LAUNCHES = {
    "pp2": (2, ("--steps", "6")),
    "dp2xpp2": (4, ("--dp", "2", "--steps", "3", "--save")),
    "pp2xtp2": (4, ("--tp", "2", "--steps", "3")),
}


@pytest.fixture(scope="session")
def train_gpt_launches(tmp_path_factory):
    """The torchrun launches of `examples/train_gpt.py` (`TRAIN_GPT_LAUNCHES`, started at once on
    the same global batches, then "resumed": 2 ranks, `--resume`, steps 4-6) that
    tests/project/test_example_dp.py compares; tests/project/test_examples.py reads pp2's log as its torchrun run
    of the example (4 interpreters importing torch cost more than the run). Returns the output
    folder (each launch's `NAME.json` loss log) and each launch's torchrun, ended."""
    out = tmp_path_factory.mktemp("train_gpt")
    ckpt = str(out / "ckpt")

    def cmd(name: str, n: int, extra: tuple[str, ...]) -> list[str]:
        given = [a for e in extra for a in ((e, ckpt) if e == "--save" else (e,))]  # --save DIR
        log = ("--loss-log", str(out / f"{name}.json"))
        return torchrun_cmd(TRAIN_GPT, n, *TRAIN_GPT_TINY.split(), *given, *log)

    procs = run_torchrun([cmd(k, *v) for k, v in TRAIN_GPT_LAUNCHES.items()], out, deadline_s=240)
    for name, p in zip(TRAIN_GPT_LAUNCHES, procs):
        p.name = name
    launched = dict(zip(TRAIN_GPT_LAUNCHES, procs))
    if all(p.rc == 0 for p in procs):  # (a failed launch: test_example_dp reports it)
        again = [cmd("resumed", 2, ("--steps", "6", "--save", "--resume"))]
        resumed = run_torchrun(again, out / "resumed", 240)  # its own log: node0.log is pp2's
        launched["resumed"] = resumed[0]
    return out, launched


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny programs (a second thread buys nothing there, and
    spins while the cores are shared); modules ask for it with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
