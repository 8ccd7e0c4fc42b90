"""The generated table in docs/MODELS.md is the output of the current sources, and says what its prose says.

`python scripts/models_table.py --write` writes the table between `<!-- models_table:begin ... -->`
and `<!-- models_table:end -->` and stamps the begin marker with a hash of what the table depends
on (fpipe/**/*.py and the script). A run costs about a minute of CPU, so this module does not
re-run it: it fails when the stamped hash differs from the current files (the message gives the
command that regenerates the table), checks the table holds no machine-specific text, and checks
that the doc's reading of the table ("every model splits and trains with parity ...") matches the
table as committed. The hashing and the rewriting of the doc are tested on a scratch tree.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
WRITE = "python scripts/models_table.py --write"


@pytest.fixture(scope="module")
def mt() -> ModuleType:
    """scripts/models_table.py as a module (importing it runs no model)."""
    spec = importlib.util.spec_from_file_location("models_table", ROOT / "scripts" / "models_table.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _rows(body: str) -> list[list[str]]:
    """The table's data rows, as lists of cells."""
    lines = [ln for ln in body.splitlines() if ln.startswith("| ")][1:]  # less the header
    return [[c.strip() for c in ln.strip().strip("|").split(" | ")] for ln in lines]


# -- the committed table ------------------------------------------------------------------------
def test_models_table_is_current(mt: ModuleType) -> None:
    why = mt.stale()
    assert why is None, why


def test_models_table_has_no_machine_specific_text(mt: ModuleType) -> None:
    body = mt.section(mt.DOC.read_text())["body"]
    assert str(ROOT) not in body
    assert "site-packages" not in body
    path = re.search(r"(?:^|[\s(`'\"])(?:/|[A-Za-z]:\\)[\w.-]+[/\\]", body, re.M)
    assert path is None, f"an absolute path in the generated table: {path and path.group()!r}"


def test_models_table_says_what_the_doc_says(mt: ModuleType) -> None:
    """docs/MODELS.md, 'Reading it': every model but the last row splits and trains with parity in
    both libraries; the last (a data-dependent branch) fails in both, fpipe naming its file and line."""
    rows = _rows(mt.section(mt.DOC.read_text())["body"])
    assert [r[0] for r in rows] == [row.label for row in mt.ROWS]
    hint = "the table no longer says what docs/MODELS.md's 'Reading it' says: update that prose"
    for label, f_split, f_parity, t_split, t_parity in rows[:-1]:
        assert f_split.startswith(f"yes: {mt.STAGES} stages") and t_split.startswith("yes: 2 stages"), (
            hint,
            label,
        )
        assert f_parity.startswith("yes (grad err") and t_parity.startswith("yes (grad err"), (hint, label)
    label, f_split, f_parity, t_split, t_parity = rows[-1]
    assert "if h.sum() > 0:" in label
    assert f_split.startswith("ValueError:") and "scripts/models_table.py:" in f_split, (hint, f_split)
    assert t_split.startswith("RuntimeError:") and f_parity == t_parity == "—", (hint, t_split)


# -- the machinery, on a scratch tree -------------------------------------------------------------
SOURCES = {
    "fpipe/__init__.py": "from fpipe._src.a import y\n",
    "fpipe/_src/a.py": "y = 2\n",
    "scripts/models_table.py": "print('table')\n",
    "README.md": "readme\n",
    "tests/test_a.py": "def test_a(): pass\n",
}


def _tree(root: Path, files: dict[str, str | bytes]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(text.encode() if isinstance(text, str) else text)
    return root


@pytest.mark.parametrize(
    "change, counts",
    [
        ({"fpipe/_src/a.py": "y = 3\n"}, True),
        ({"fpipe/_src/b.py": ""}, True),  # a new source file, even empty
        ({"scripts/models_table.py": "print('other table')\n"}, True),
        ({"README.md": "other\n", "tests/test_a.py": "", "docs/MODELS.md": "doc\n"}, False),
        ({"fpipe/_src/__pycache__/a.cpython-311.pyc": b"\x00\x01"}, False),
        ({"fpipe/_src/a.py": b"y = 2\r\n"}, False),  # a Windows checkout of the same source
    ],
)
def test_inputs_hash_covers_the_sources_and_the_script(
    mt: ModuleType, tmp_path: Path, change: dict[str, str | bytes], counts: bool
) -> None:
    before = mt.inputs_hash(_tree(tmp_path, SOURCES))
    assert re.fullmatch(r"[0-9a-f]{16}", before)
    after = mt.inputs_hash(_tree(tmp_path, change))
    assert (after != before) == counts, change


def test_write_replaces_only_the_section_and_check_follows_the_sources(
    mt: ModuleType, tmp_path: Path
) -> None:
    root = _tree(tmp_path, SOURCES)
    doc = root / "docs" / "MODELS.md"
    doc.parent.mkdir()
    doc.write_text("intro\n\n<!-- models_table:begin inputs= -->\nold\n<!-- models_table:end -->\nend\n")
    why = mt.stale(doc, root)
    assert why and "docs/MODELS.md" in why and f"`{WRITE}`" in why

    digest = mt.inputs_hash(root)
    written = mt.with_table(doc.read_text(), "| new |\n", digest)
    assert written.startswith(f"intro\n\n<!-- models_table:begin inputs={digest} (generated by `{WRITE}`")
    assert written.endswith(" -->\n| new |\n<!-- models_table:end -->\nend\n")
    assert mt.with_table(written, "| new |", digest) == written  # a rewrite changes nothing
    doc.write_text(written)
    assert mt.stale(doc, root) is None

    _tree(root, {"fpipe/_src/a.py": "y = 3\n"})
    assert mt.stale(doc, root) and digest in mt.stale(doc, root)


@pytest.mark.parametrize("n", [0, 2])
def test_the_doc_needs_exactly_one_section(mt: ModuleType, n: int) -> None:
    doc = "text\n" + "<!-- models_table:begin inputs=0 -->\n| t |\n<!-- models_table:end -->\n" * n
    with pytest.raises(ValueError, match=f"found {n}"):
        mt.section(doc)
