"""Stages: a traced joint graph cut into per-stage programs (plain data the runtime runs).

Above `tracing`. `partition` chooses cuts for `stages=N` (a static cost estimate, or the times
`measure` takes on the device); `split` places every joint-graph node into a program
(kind, stage) by dataflow, `split_tied` gives a tied parameter's contributions their own
outputs, `split_iw` splits a backward into input- and weight-gradient halves; `staged` holds
the result (`Place`, `Program`, `Staged`), which the runtime imports without the placer.
"""

from . import split
from .measure import measure_costs
from .partition import auto_partition, node_cost
from .split import count_stages, split_backward
from .split_iw import backward_parts
from .staged import Place, Program, Staged

__all__ = [
    "Place", "Program", "Staged", "auto_partition", "backward_parts", "count_stages", "measure_costs",
    "node_cost", "split", "split_backward",
]  # fmt: skip
