"""No import cycle between the modules of the fpipe package; imports between the subpackages of
fpipe/_src only run down their layers, through each package's face (docs/ARCHITECTURE.md).

Every `import` and `from ... import` counts, wherever it stands (inside a function, under
`if TYPE_CHECKING:`): a lazy import hides a cycle from Python but not from the reader. Edges into
or out of a package's `__init__.py` are left out of the module graph, since a package re-exports
its modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "fpipe"


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


# -- subpackages ------------------------------------------------------------------------------------
SRC = PKG / "_src"
# The subpackages of fpipe/_src by layer, bottom first: a package imports only packages of lower
# layers; packages of one layer do not import each other.
LAYERS = [
    ("schedules", "tracing"),
    ("stages",),
    ("runtime",),
    ("memory", "parallel"),
    ("pipeline",),
    ("training",),
    ("plan", "generate"),
    ("serve",),
]
MAX_MODULES = 12


def _face(init: Path) -> tuple[set[str], set[str]]:
    """(the names in a package's `__all__`, the names its `__init__.py` binds with `from .mod
    import`), read without importing it."""
    names: set[str] = set()
    bound: set[str] = set()
    for node in ast.parse(init.read_text()).body:
        target = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if (
            any(getattr(t, "id", "") == "__all__" for t in target)
            and getattr(node, "value", None) is not None
        ):
            names = set(ast.literal_eval(node.value))  # type: ignore[arg-type]
        if isinstance(node, ast.ImportFrom) and node.module:
            bound |= {a.asname or a.name for a in node.names}
    return names, bound


def package_findings(src: Path = SRC, layers: list[tuple[str, ...]] = LAYERS) -> list[str]:
    """What breaks the package rules, one line each: an import that runs up or sideways between
    the subpackages of `src`, one that reaches past a package's face (`from ..pkg.mod import`) or
    for a name not in its `__all__` or private, a face binding a module's name to something else,
    a module outside every package, a package in no layer or over MAX_MODULES modules."""
    layer = {p: i for i, tier in enumerate(layers) for p in tier}
    root = ".".join(src.relative_to(src.parents[1]).parts)  # fpipe._src
    mods = _modules(src.parent)
    out = [
        f"{m}: not in a subpackage" for m, f in mods.items() if f.parent == src and f.name != "__init__.py"
    ]
    pkgs = sorted({f.parent.name for f in src.glob("*/__init__.py")})
    faces = {p: _face(src / p / "__init__.py") for p in pkgs}
    for p in pkgs:
        own = {f.stem for f in (src / p).glob("*.py")} - {"__init__"}
        out += [f"package {p}: in no layer" for _ in [0] if p not in layer]
        out += [f"package {p}: {len(own)} modules (> {MAX_MODULES})" for _ in [0] if len(own) > MAX_MODULES]
        out += [f"package {p}: its __init__ binds {n!r}, the name of its module" for n in faces[p][1] & own]
    for m, path in sorted(mods.items()):
        parts = m.split(".")
        if len(parts) < 3 or parts[:2] != root.split(".") or parts[2] not in faces:
            continue
        p = parts[2]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            target = _targets(m, path, node)[0] if isinstance(node, ast.ImportFrom) else None
            for t in [target] if target else [a.name for a in node.names]:  # type: ignore[union-attr]
                tp = t.split(".")
                if tp[:2] != parts[:2] or len(tp) < 3 or tp[2] == p or tp[2] not in faces:
                    continue
                q = tp[2]
                if layer.get(q, -1) >= layer.get(p, -1):
                    out.append(f"{m} imports {t}: {q} is not below {p}")
                if len(tp) > 3 or isinstance(node, ast.Import):
                    out.append(f"{m} imports {t}: past the face of {q} (import from {root}.{q})")
                    continue
                for a in node.names:
                    if a.name.startswith("_") or a.name not in faces[q][0]:
                        out.append(f"{m} imports {a.name} from {q}: not in its __all__")
    return out


def test_the_package_check_finds_what_it_checks(tmp_path: Path) -> None:
    src = tmp_path / "p" / "_src"
    for pkg, init in {"low": "from .a import f\n\n__all__ = ['f']\n", "high": "__all__ = []\n"}.items():
        (src / pkg).mkdir(parents=True)
        (src / pkg / "__init__.py").write_text(init)
    (tmp_path / "p" / "__init__.py").write_text("")
    (src / "__init__.py").write_text("")
    (src / "flat.py").write_text("")
    (src / "low" / "a.py").write_text("def f():\n    from ..high import b\n\ndef _g(): pass\n")
    (src / "high" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nfrom ..low import f\nif TYPE_CHECKING:\n"
        "    from ..low import _g\n    from ..low.a import f\n"
    )
    assert package_findings(src, [("low",), ("high",)]) == [
        "p._src.flat: not in a subpackage",
        "p._src.high.b imports _g from low: not in its __all__",
        "p._src.high.b imports p._src.low.a: past the face of low (import from p._src.low)",
        "p._src.low.a imports p._src.high: high is not below low",  # lazy, inside a function
        "p._src.low.a imports b from high: not in its __all__",
    ]
    (src / "low" / "__init__.py").write_text("from .a import a\n\n__all__ = ['a']\n")
    assert package_findings(src, [("low", "high")])[1:3] == [
        "package low: its __init__ binds 'a', the name of its module",
        "p._src.high.b imports p._src.low: low is not below high",  # one layer: not below
    ]


def test_imports_between_subpackages_run_down_through_their_faces() -> None:
    found = package_findings()
    assert found == [], "package layout:\n" + "\n".join(found)
    assert sorted(p for tier in LAYERS for p in tier) == sorted(
        f.parent.name for f in SRC.glob("*/__init__.py")
    )
