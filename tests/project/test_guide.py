"""The guide pages (docs/guide/*.md) and the feature pages beside them (docs/CHECKPOINTS.md,
docs/GENERATION.md, docs/RESUMING.md) run: their `>>>` examples are doctests. (pytest's
`--doctest-glob='*.md'` collects only under testpaths, `tests` and `fpipe`, so docs/ is run here,
as tests/schedules/test_schedules.py runs docs/SCHEDULES.md.)"""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
GUIDE = DOCS / "guide"
PAGES = ["CHECKPOINTS.md", "GENERATION.md", "RESUMING.md"]  # feature pages with examples


@pytest.mark.parametrize("page", sorted(p.name for p in GUIDE.glob("*.md")))
def test_guide_page_examples_run(page):
    result = doctest.testfile(str(GUIDE / page), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 5, result


@pytest.mark.parametrize("page", PAGES)
def test_feature_page_examples_run(page):
    result = doctest.testfile(str(DOCS / page), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted >= 5, result
