"""Runtime: run staged programs by a schedule, in one process or one rank of a process group.

Above `stages` and `schedules`. `run` (`LocalRunner`: every stage here; `Results`, `Timeline`,
the gradient sums), `run_dist` (`DistRunner`: this rank's actions, values by p2p bundles in the
communication plan's order), `dist` (`PPGroup`, failure reports that end every rank, deadlines),
`group_start` (the default group from torchrun's environment), `exiting` (how a process ends
after a failure), `agree` (ranks compare signatures and staged programs before any transfer)
and `precision` (the dtypes a step computes, accumulates and reduces in).
"""

from . import precision
from .agree import (
    check_same_program,
    check_same_signature,
    check_same_slices,
    check_same_values,
    digest,
    fingerprint,
    graph_text,
)
from .dist import DEFAULT_TIMEOUT, PeerFailure, PPGroup, exit_hard_after_failure, group_of, pp_group
from .group_start import start_group
from .precision import Precision, cast_inputs, check_precision, for_reduce, hand_back
from .run import LocalRunner, Results, Timeline, accumulating, action_place
from .run_dist import EMULATE_NCCL_ORDER, DistRunner, send_reaper

__all__ = [
    "DEFAULT_TIMEOUT", "EMULATE_NCCL_ORDER", "DistRunner", "LocalRunner", "PPGroup", "PeerFailure",
    "Precision", "Results", "Timeline", "accumulating", "action_place", "cast_inputs", "check_precision",
    "check_same_program", "check_same_signature", "check_same_slices", "check_same_values", "digest",
    "exit_hard_after_failure", "fingerprint", "for_reduce", "graph_text", "group_of", "hand_back",
    "pp_group", "precision", "send_reaper", "start_group",
]  # fmt: skip
