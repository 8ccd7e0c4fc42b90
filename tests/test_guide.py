"""The guide pages (docs/guide/*.md) run: their `>>>` examples are doctests. (pytest's
`--doctest-glob='*.md'` collects only under testpaths, `tests` and `fpipe`, so docs/ is run here,
as tests/test_schedules.py runs docs/SCHEDULES.md.)"""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guide"


@pytest.mark.parametrize("page", sorted(p.name for p in GUIDE.glob("*.md")))
def test_guide_page_examples_run(page):
    result = doctest.testfile(str(GUIDE / page), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 5, result
