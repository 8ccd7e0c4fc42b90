"""`import fpipe` needs only its declared dependencies (pyproject: torch, optree, numpy):
transformers, a test extra, is imported only when `fpipe.generate` traces a step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BLOCKED = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "transformers":
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import fpipe
assert "transformers" not in sys.modules, sorted(m for m in sys.modules if m.startswith("transformers"))
print("ok", fpipe.generate.__name__)
"""


def test_fpipe_imports_without_transformers() -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED], capture_output=True, text=True, cwd=root, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok generate", done.stderr[-2000:]
