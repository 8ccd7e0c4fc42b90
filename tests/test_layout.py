"""No import cycle between the modules of the fpipe package.

Every `import` and `from ... import` counts, wherever it stands (inside a function, under
`if TYPE_CHECKING:`): a lazy import hides a cycle from Python but not from the reader. Edges into
or out of a package's `__init__.py` are left out, since a package re-exports its modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "fpipe"


def _modules(pkg: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (packages as `a.b`)."""
    out = {}
    for path in pkg.rglob("*.py"):
        parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(mod: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """What an import statement names: modules, or `pkg.name` for `from pkg import name`."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    base = base[: len(base) - node.level + 1] if node.level else []
    target = ".".join(base + ([node.module] if node.module else []))
    return [target] + [f"{target}.{a.name}" for a in node.names]


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """Module -> the package modules it imports, `__init__.py` files left out."""
    mods = _modules(pkg)
    plain = {m for m, p in mods.items() if p.name != "__init__.py"}
    graph: dict[str, set[str]] = {}
    for m in plain:
        path = mods[m]
        nodes = [
            n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))
        ]
        graph[m] = {t for n in nodes for t in _targets(m, path, n) if t in plain and t != m}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state: dict[str, int] = {}  # absent: unseen; 1: on the current path; 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w) :] + [w]
            found = visit(w) if w not in state else None
            if found:
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        found = visit(v) if v not in state else None
        if found:
            return found
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert find_cycle(graph) == ["p.a", "p.b", "p.c", "p.a"]
    assert find_cycle({"p.a": {"p.b"}, "p.b": set()}) is None


def test_the_graph_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\n"
    )
    assert import_graph(pkg) == {"p.a": {"p.sub.b"}, "p.sub.b": {"p.a"}}
    assert find_cycle(import_graph(pkg)) == ["p.a", "p.sub.b", "p.a"]
    assert "fpipe._src.schedules.schedule_data" in import_graph()["fpipe._src.schedules.simulate"]


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle between fpipe modules: " + " -> ".join(cycle or [])
