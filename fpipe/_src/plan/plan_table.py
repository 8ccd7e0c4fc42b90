"""The text table `fpipe.Plan` prints: ranked candidates, dropped ones, and why the winner won."""

from __future__ import annotations

from typing import Any

__all__ = ["table"]

_HEAD = (
    "#",
    "layout",
    "stages",
    "step (pred)",
    "step (measured)",
    "bubble",
    "makespan",
    "dp all-reduce",
    "peak",
    "note",
)


def _ms(x: float) -> str:
    return "-" if x != x else f"{x * 1e3:.1f} ms"


def _row(i: str, p: Any, note: str) -> tuple[str, ...]:
    peak = f"{p.predicted_peak_bytes / 2**20:.1f} MiB" if p.predicted_peak_bytes else "-"
    bubble = "-" if p.bubble != p.bubble else f"{p.bubble:.0%}"
    return (
        i, p.layout, str(p.stages), _ms(p.predicted_step_s), _ms(p.measured_step_s), bubble, _ms(p.parts.get("makespan", float("nan"))),
        _ms(p.parts.get("dp all-reduce", float("nan"))), peak, note,
    )  # fmt: skip


def why(p: Any) -> str:
    """One line: the winner, and what it saves against the runner-up."""
    head = f"chosen: {p.layout} ({p.stages} stages), predicted {_ms(p.predicted_step_s)} per step"
    if len(p.candidates) < 2:
        return head + ", the only layout that fits."
    q = p.candidates[1]
    if p.verified > 1:
        return (
            f"{head}, measured {_ms(p.measured_step_s)}: the fastest of the {p.verified} best "
            f"predicted, timed as real steps on this job ({q.layout}: {_ms(q.measured_step_s)})."
        )
    diffs = [
        f"{k} {_ms(p.parts[k])} vs {_ms(q.parts[k])}"
        for k in ("makespan", "dp all-reduce", "optimizer", "outside actions")
        if abs(p.parts[k] - q.parts[k]) > 0.02 * max(q.predicted_step_s, 1e-12)
    ]
    gain = q.predicted_step_s / p.predicted_step_s - 1
    return (
        f"{head}, {gain:.0%} faster than the next, {q.layout} (bubble {p.bubble:.0%} vs {q.bubble:.0%}"
        + ("; " + "; ".join(diffs) if diffs else "")
        + ")."
    )


def table(p: Any) -> str:
    rows: list[tuple[str, ...]] = [_HEAD]
    rows += [_row(str(i + 1), c, "<- chosen" if i == 0 else "") for i, c in enumerate(p.candidates)]
    rows += [_row("-", c, "dropped: " + reason) for c, reason in p.dropped]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEAD))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append(why(p))
    if p.links is not None:
        lk = p.links
        lines.append(
            f"measured in {p.measure_s:.1f} s (0.0: cached); links: {lk.how}: p2p "
            f"{lk.p2p_latency * 1e6:.0f} us + {lk.p2p_bandwidth / 1e9:.2f} GB/s, all-reduce "
            f"{lk.allreduce_latency * 1e6:.0f} us + {lk.allreduce_bandwidth / 1e9:.2f} GB/s."
        )
    return "\n".join(lines)
