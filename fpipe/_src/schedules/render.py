"""Render: pictures of a schedule's simulated timeline, as text or SVG.

Both pictures place each action where `simulate` says it runs, one row per rank, so the idle
gaps (the bubble) show where they fall. Costs are passed through to `simulate`.

Importing this module installs `render` as what `Schedule.render(**costs)` calls
(`schedule_data.set_renderer`): schedule_data.py cannot import this module, which builds on
`simulate` and so on schedule_data (NOTE [schedule layering] in schedule_data.py).
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from typing import Any

from .schedule_data import Action, Schedule, set_renderer
from .simulate import Simulation, simulate

__all__ = ["render", "to_svg"]

IDLE = "."


def render(sched: Schedule, **costs: Any) -> str:
    """An ASCII timeline of `sched`: a header, then one row per rank of `|LABEL` boxes over time.

    Each action's box is as wide as its simulated duration; `.` marks idle time. The scale puts
    the shortest action in a box just wide enough for the longest label.

    Args:
        sched: the schedule; it is validated first.
        **costs: `forward`, `backward`, `weight`, `comm`, as for `simulate`.

    Example:
        >>> from fpipe.schedules import build
        >>> print(render(build("1f1b", pp=2, microbatches=2)))
        1f1b: 2 ranks, 2 stages, 2 microbatches; makespan 9, bubble 33.3% per rank (mean)
        rank 0 |F0.0|F0.1|.........|B0.0     |....|B0.1     |
        rank 1 .....|F1.0|B1.0     |F1.1|B1.1     |
    """
    sim = simulate(sched, **costs)
    scale = _scale(sim)
    rows = [_row(acts, sim, scale) for acts in sched.ranks]
    label = max(len(f"rank {r}") for r in range(sched.pp))
    body = [f"rank {r}".ljust(label) + " " + row for r, row in enumerate(rows)]
    return "\n".join([_header(sim), *body])


def _header(sim: Simulation) -> str:
    s = sim.schedule
    mean = sum(sim.bubble) / len(sim.bubble) if sim.bubble else 0.0
    return (
        f"{s.name}: {s.pp} ranks, {s.n_stages} stages, {s.n_microbatches} microbatches; "
        f"makespan {sim.makespan:g}, bubble {mean:.1%} per rank (mean)"
    )


def _scale(sim: Simulation) -> float:
    """Columns per time unit: the shortest action gets room for the longest label and a bar."""
    widths = [len(str(a)) + 1 for a in sim.start]
    durations = [sim.end[a] - sim.start[a] for a in sim.start if sim.end[a] > sim.start[a]]
    return max(widths, default=1) / min(durations, default=1.0)


def _row(acts: Sequence[Action], sim: Simulation, scale: float) -> str:
    width = round(sim.makespan * scale) + 1
    cells = [IDLE] * width
    starts = {round(sim.start[a] * scale) for a in acts}
    for a in acts:
        c0, c1 = round(sim.start[a] * scale), round(sim.end[a] * scale)
        cells[c0:c1] = ("|" + str(a)).ljust(c1 - c0)[: c1 - c0]
        if c1 not in starts:
            cells[c1] = "|"
    return "".join(cells).rstrip(IDLE) if acts else ""


# -- SVG ---------------------------------------------------------------------------------------

COLORS = {"F": "#9ecae1", "B": "#a1d99b", "I": "#fdae6b", "W": "#bcbddc"}
_PX, _ROW, _LEFT, _TITLE = 28.0, 22, 64, 26


def to_svg(
    scheds: Schedule | Sequence[Schedule], path: str | os.PathLike[str] | None = None, **costs: Any
) -> str:
    """An SVG picture of the simulated timeline of one schedule or several, stacked on one time scale.

    Args:
        scheds: a `Schedule`, or a sequence of them to compare (same costs, same scale).
        path: if given, the SVG is also written there.
        **costs: `forward`, `backward`, `weight`, `comm`, as for `simulate`.

    Returns:
        The SVG document as a string (no dependency beyond the standard library).

    Example:
        >>> from fpipe.schedules import build
        >>> svg = to_svg([build("1f1b", pp=2, microbatches=2), build("zb-h1", pp=2, microbatches=2)])
        >>> svg.startswith("<svg") and svg.count("<rect") > 16
        True
    """
    sims = [simulate(s, **costs) for s in ([scheds] if isinstance(scheds, Schedule) else scheds)]
    px = _PX / min((_unit(sim) for sim in sims), default=1.0)
    width = _LEFT + max((sim.makespan for sim in sims), default=0.0) * px + 16
    parts, y = [], 8.0
    for sim in sims:
        parts += _block(sim, y, px)
        y += _TITLE + sim.schedule.pp * _ROW + 14
    parts += _legend(y)
    svg = _document(width, y + _ROW + 8, parts)
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(svg)
    return svg


def _unit(sim: Simulation) -> float:
    durations = [sim.end[a] - sim.start[a] for a in sim.start if sim.end[a] > sim.start[a]]
    return min(durations, default=1.0)


def _block(sim: Simulation, y: float, px: float) -> list[str]:
    s = sim.schedule
    mean = sum(sim.bubble) / len(sim.bubble) if sim.bubble else 0.0
    title = f"{s.name}: pp={s.pp}, {s.n_stages} stages, {s.n_microbatches} microbatches; makespan {sim.makespan:g}, bubble {mean:.1%}"
    out = [_text(_LEFT, y + 16, title, weight="bold")]
    for r, acts in enumerate(s.ranks):
        top = y + _TITLE + r * _ROW
        out.append(_text(4, top + 15, f"rank {r}"))
        out += [_box(a, _LEFT + sim.start[a] * px, top, (sim.end[a] - sim.start[a]) * px) for a in acts]
    return out


def _box(a: Action, x: float, y: float, w: float) -> str:
    rect = f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{_ROW - 2}" fill="{COLORS[a.kind]}" stroke="#555" stroke-width="0.5"/>'
    return rect + _text(x + w / 2, y + 14, str(a), anchor="middle", size=9)


def _legend(y: float) -> list[str]:
    names = {
        "F": "forward",
        "B": "full backward",
        "I": "input-gradient backward",
        "W": "weight-gradient backward",
    }
    out, x = [], float(_LEFT)
    for kind, label in names.items():
        out.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="14" height="14" fill="{COLORS[kind]}" stroke="#555" stroke-width="0.5"/>'
        )
        out.append(_text(x + 18, y + 11, f"{kind}: {label}"))
        x += 40 + 7 * len(label)
    return out


def _text(
    x: float, y: float, s: str, *, anchor: str = "start", size: int = 11, weight: str = "normal"
) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-family="monospace" font-size="{size}" '
        f'text-anchor="{anchor}" font-weight="{weight}">{html.escape(s)}</text>'
    )


def _document(width: float, height: float, parts: list[str]) -> str:
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}">'
    )
    return (
        "\n".join([head, f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>', *parts, "</svg>"])
        + "\n"
    )


set_renderer(render)  # `Schedule.render` calls it: NOTE [schedule layering] in schedule_data.py
