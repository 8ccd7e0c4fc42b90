"""The guide pages (docs/guide/*.md: the feature reference the README links, a page per feature)
and the feature pages beside them (docs/CHECKPOINTS.md, docs/GENERATION.md, docs/RESUMING.md)
run: their `>>>` examples are doctests. (pytest's `--doctest-glob='*.md'` collects only under
testpaths, `tests` and `fpipe`, so docs/ is run here, as tests/schedules/test_schedules.py runs
docs/SCHEDULES.md.) And the README's two commands are the ones CI and the docs run."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
GUIDE = DOCS / "guide"
PAGES = ["CHECKPOINTS.md", "GENERATION.md", "RESUMING.md"]  # feature pages with examples


@pytest.mark.parametrize("page", sorted(p.name for p in GUIDE.glob("*.md")))
def test_guide_page_examples_run(page):
    result = _run_page(GUIDE / page)
    assert result.failed == 0 and result.attempted > 5, result


@pytest.mark.parametrize("page", PAGES)
def test_feature_page_examples_run(page):
    result = _run_page(DOCS / page)
    assert result.failed == 0 and result.attempted >= 5, result


def _run_page(path: Path) -> doctest.TestResults:
    """The page's doctests, in this process: a page that leaves torch's default dtype changed
    fails (the tests after it would run in that dtype: pass `dtype=` in the page instead)."""
    import torch

    before = torch.get_default_dtype()
    try:
        return doctest.testfile(str(path), module_relative=False, optionflags=doctest.ELLIPSIS)
    finally:
        after = torch.get_default_dtype()
        torch.set_default_dtype(before)
        assert after == before, f"{path.name} left torch's default dtype {after} (it was {before})"


def _commands() -> list[str]:
    """The README's fenced bash commands, in order."""
    return re.findall(r"^```bash\n(.+?)\n```", (ROOT / "README.md").read_text(), flags=re.M)


def test_the_readme_gives_two_commands_and_ci_runs_the_test_command_exactly():
    example, tests = _commands()
    assert example.endswith("python examples/train_gpt.py") and (ROOT / "examples/train_gpt.py").exists()
    assert tests.endswith("python -m pytest -q")
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith("#")]
    assert tests in ci, (tests, ci)
