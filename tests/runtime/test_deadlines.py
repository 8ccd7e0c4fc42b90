"""Every collective fpipe issues has a deadline (NOTE [failures never hang] in fpipe/_src/runtime/dist.py):
each torch.distributed collective in fpipe/_src is issued with `async_op=True` and its work
waited by `PPGroup.wait_all` under the pipeline's timeout (or, for p2p, `batch_isend_irecv`'s
works, waited the same way). The few that are not are listed here by name with the deadline
they do have; a new blocking collective fails this test. (The clip's all-reduces were blocking:
issue 24, case 15.)"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "fpipe" / "_src"
COLLECTIVES = {
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
    "all_to_all_single", "barrier", "gather", "scatter", "reduce", "all_gather_object",
    "broadcast_object_list", "gather_object", "scatter_object_list", "send", "recv",
}  # fmt: skip
ELSEWHERE = {  # (module, function, collective): the deadline it has instead
    # checkpoints: a gloo group of their own (`checkpoint.checkpoint_group`), created with a
    # 30-minute timeout (writing a large checkpoint may take minutes; the group's timeout ends a
    # wait for a rank that stopped)
    ("checkpoint", "_start", "broadcast_object_list"),
    ("checkpoint", "_agree", "all_gather_object"),
    ("checkpoint_manager", "_agreed", "broadcast_object_list"),
}


def _scan() -> tuple[set[tuple[str, str, str]], set[tuple[str, str, str]]]:
    """(every collective call, the blocking ones) as (module, function, collective)."""
    found, every = set(), set()
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for call in ast.walk(fn):
                f = call.func if isinstance(call, ast.Call) else None
                if not (
                    isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "dist"
                ):
                    continue
                asynchronous = any(
                    k.arg == "async_op" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in call.keywords  # type: ignore[union-attr]
                )
                if f.attr in COLLECTIVES:
                    every.add((path.stem, fn.name, f.attr))
                    if not asynchronous:
                        found.add((path.stem, fn.name, f.attr))
    return every, found


def test_every_collective_is_waited_under_a_deadline():
    assert _scan()[1] == ELSEWHERE


def test_the_scan_sees_the_collectives_it_checks():
    """The scan is not vacuous: it finds the asynchronous collectives too."""
    every, blocking = _scan()
    waited = {
        ("dist", "broadcast", "broadcast"),
        ("dist", "all_reduce", "all_reduce"),
        ("dist", "_gather", "all_gather"),
    }
    assert waited <= every - blocking, every
