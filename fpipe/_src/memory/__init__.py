"""Memory: a step's peak predicted before it runs, and recomputation to meet `memory_limit`.

Above `runtime` (it replays the runners' own tables). `memory` predicts a step's peak per rank
(`predict`, `MemoryReport`), `memory_graph` profiles one program's storages (with `workspace`:
kernels' own allocations). `remat` rewrites a backward to recompute dropped values (the walk:
`remat_walk`), `remat_segments` finds the anchors a recomputation stops at, and `remat_choose`
chooses the least recomputation that fits a limit (`choose`, `target_of`).
"""

from .memory import MemoryReport, predict, predict_plan
from .remat import tagged
from .remat_choose import HEADROOM_PERCENT, choose, least_limit, target_of

__all__ = [
    "HEADROOM_PERCENT",
    "MemoryReport",
    "choose",
    "least_limit",
    "predict",
    "predict_plan",
    "tagged",
    "target_of",
]
