"""Tracing: a user function -> functional aten graphs on fake tensors, and what each operation does.

The bottom layer with `schedules`. `trace` makes the two traces of a signature (the forward of
one microbatch; the joint value-and-grad graph), with `marker` (the `stage_boundary` op), `cuts`
and `cut_at` (boundaries by module path, or at a position), `captured` (refusing captured values;
checkpointed regions), `frames` (the user's line in errors). What every later pass asks of an
operation is answered here once: `effects` (what it writes), `rng` (seeded random operations).
`trace_key` keys a trace; `functionalize` makes a module a function; `tree` (pytrees, one key
order on every rank) and `dtensors` are the shared helpers.
"""

from . import functionalize, trace_key, tree
from .captured import following_checkpoints, warn_lost_regions
from .cut_at import activations, insert_marker, refuse_pipe_splits
from .cuts import Cutter, check_cuts
from .dtensors import like, local
from .effects import is_mutating, output_alias, replay, writes, written, written_inputs
from .functionalize import Functionalized
from .marker import BOUNDARY, BOUNDARY_BWD, stage_boundary
from .rng import is_random, seeded, set_microbatch, set_step
from .trace import (
    Forward,
    Joint,
    fake_like,
    flat_function,
    forward_as_joint,
    functional,
    lift_constants,
    make_fakes,
    run_trace,
    trace_forward,
    trace_joint,
)
from .trace_key import tensor_key

__all__ = [
    "BOUNDARY", "BOUNDARY_BWD", "Cutter", "Forward", "Functionalized", "Joint", "activations", "check_cuts",
    "fake_like", "flat_function", "following_checkpoints", "forward_as_joint", "functional",
    "functionalize", "insert_marker", "is_mutating", "is_random", "lift_constants", "like", "local",
    "make_fakes", "output_alias", "refuse_pipe_splits", "replay", "run_trace", "seeded", "set_microbatch",
    "set_step", "stage_boundary", "tensor_key", "trace_forward", "trace_joint", "trace_key", "tree",
    "warn_lost_regions", "writes", "written", "written_inputs",
]  # fmt: skip
