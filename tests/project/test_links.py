"""Every relative link in README.md and docs/**/*.md resolves: to a file of the repository, and,
where it names an anchor (`page.md#a-heading`), to a heading of that page (GitHub's slugs). Links
inside code (fenced blocks, `inline code`) are not links; `http(s):` and `mailto:` ones are not
checked (nothing is fetched). And every test a page names as the guard of a claim
(`test_...`) exists in tests/, wherever it moves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
REFERENCE = re.compile(r"^[ ]{0,3}\[[^\]]+\]:[ \t]+(\S+)", re.M)


def _prose(text: str) -> str:
    """The page less its fenced code blocks and inline code spans."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.M | re.S)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text, flags=re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text, flags=re.U).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, a repeated one numbered as GitHub numbers it."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", page.read_text(), flags=re.M | re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        slug = _slug(heading)
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def broken(page: Path) -> list[str]:
    """Each relative link of `page` that names no file, or no heading of the page it names."""
    prose = _prose(page.read_text())
    bad = []
    for target in LINK.findall(prose) + REFERENCE.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, flags=re.I):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading '#{anchor}' in {dest.name}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken(page) == []


def test_every_test_a_page_names_exists() -> None:
    """A name such as `test_a_limit_is_met_with_exact_gradients` (not a file, `test_x.py`, nor a
    prefix, `test_on_ranks_...`) is a function defined under tests/."""
    defined = set()
    for path in (ROOT / "tests").rglob("*.py"):
        defined |= set(re.findall(r"^\s*def (test_\w+)", path.read_text(), flags=re.M))
    named = {
        (str(page.relative_to(ROOT)), name)
        for page in PAGES
        for name in re.findall(r"\b(test_\w+)\b(?!\.py|\.\.\.)", page.read_text())
        if not name.endswith("_")
    }
    assert sorted(n for n in named if n[1] not in defined) == []


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Planning: `fpipe.plan`\n\n## Once\n\n## Once\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md) [ok](b.md#planning-fpipeplan) [ok](b.md#once-1) [ok](#here) [web](https://x.y/z)\n"
        "# Here\n`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n"
        "[gone](c.md) [no heading](b.md#twice) ![img](d.svg)\n"
    )
    assert [b.split(":")[0] for b in broken(page)] == ["c.md", "b.md#twice", "d.svg"]
