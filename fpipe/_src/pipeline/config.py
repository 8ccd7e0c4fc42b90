"""What the user asked for: `pipeline(...)`'s arguments, checked once, and how calls name them.

`Config` is the one object every step of the data path reads its settings from (inputs,
compile, outputs); `Pipelined` holds it. Errors quote `Config.call`, the user's own call:
"pipeline(loss, stages=4, microbatches=8): ...".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..runtime import DEFAULT_TIMEOUT, check_precision
from ..schedules import Schedule, names
from ..tracing import check_cuts

REDUCTIONS = ("mean", "sum")
PARTITIONS = ("estimate", "measure")


def fn_name(f: Callable[..., Any]) -> str:
    return getattr(f, "__name__", None) or repr(f)


@dataclasses.dataclass(frozen=True)
class Config:
    """`pipeline`'s arguments (see its docstring for each)."""

    f: Callable[..., Any]
    stages: int | None = None
    microbatches: int = 1
    schedule: str | Schedule | Callable[..., Schedule] = "1f1b"
    in_axes: Any = 0
    out_axes: Any = None
    mesh: Any = None
    timeout: float = DEFAULT_TIMEOUT
    compile: bool | dict[str, Any] = False
    partition: str = "estimate"
    cuts: Any = None  # module paths where stages begin (NOTE [cuts by module path] in cuts.py)
    memory_limit: int | None = None  # bytes per rank (NOTE [meeting a memory limit] in remat_choose.py)
    precision: Any = None  # a Precision (NOTE [precision policy] in precision.py)
    costs: Any = None  # measured per-operation costs to cut by, shared (fpipe.plan's; compiler.py)

    @property
    def call(self) -> str:
        """The call as the user wrote it, for error messages."""
        parts = [fn_name(self.f)]
        if self.stages is not None:
            parts.append(f"stages={self.stages}")
        parts.append(f"microbatches={self.microbatches}")
        return f"pipeline({', '.join(parts)})"

    def check(self) -> None:
        """Refuse bad arguments at `pipeline(...)`, before any call."""
        call = f"pipeline({fn_name(self.f)}, microbatches={self.microbatches})"
        if isinstance(self.schedule, str) and self.schedule not in names():
            raise ValueError(
                f"{call.rstrip(')')}, schedule={self.schedule!r}): unknown schedule; known schedules "
                f"are {names()}."
            )
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"{call}: microbatches must be a positive int, got {self.microbatches!r}.")
        if self.partition not in PARTITIONS:
            raise ValueError(
                f"{call.rstrip(')')}, partition={self.partition!r}): partition must be 'estimate' (a "
                "static cost model) or 'measure' (time each operation on the device)."
            )
        check_cuts(call, self.cuts)
        check_precision(call, self.precision)
        lim = self.memory_limit
        if lim is not None and (isinstance(lim, bool) or not isinstance(lim, int) or lim <= 0):
            raise ValueError(
                f"{call.rstrip(')')}, memory_limit={lim!r}): memory_limit must be a positive int "
                "(bytes per rank) or None."
            )
        if self.stages is not None and (not isinstance(self.stages, int) or self.stages < 1):
            raise ValueError(
                f"pipeline({fn_name(self.f)}, stages={self.stages!r}): stages must be a positive int or None."
            )
