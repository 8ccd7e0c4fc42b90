"""Random numbers in staged programs.

# NOTE [random-number policy]
Every random operation in a traced program (dropout's mask, `torch.rand`, ...) draws from a
generator seeded by (base seed, step, microbatch, index of the operation in the traced
program), not from the process's running generator. So a pipelined step gives the same numbers
whatever the number of stages, the placement or the schedule, on every run with the same base
seed, and ranks need no shared generator state. The base seed is `torch.initial_seed()` at each
call (seed every rank alike with `torch.manual_seed`); the step counts the pipeline's calls.
Changing the number of microbatches changes the shapes each operation draws, so those numbers
differ (as they would in any framework). The unsplit function under torch.func draws from the
running generator, so its dropout masks differ from fpipe's: compare with dropout off.

The (base seed, step, microbatch) the runner sets lives in a `contextvars.ContextVar`, not in
module state: a thread (or an asyncio task) that runs another pipeline's step at the same time
sets its own, and a thread that never set one draws from seed (0, 0, 0) rather than from
another step's. tests/pipeline/test_trust_claims.py checks the claims about masks across microbatches,
operations, steps, stage counts, schedules and seeds.
"""

from __future__ import annotations

import contextvars
import hashlib
from typing import Any

import torch

__all__ = ["is_random", "seeded", "set_step", "set_microbatch"]

# (base seed, step, microbatch) of the step this context runs
_state: contextvars.ContextVar[tuple[int, int, int]] = contextvars.ContextVar("fpipe_rng", default=(0, 0, 0))


def is_random(target: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> bool:
    """Does this call draw random numbers? Attention with `dropout_p=0` does not."""
    if not (isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags):
        return False
    for i, arg in enumerate(target._schema.arguments):
        if arg.name == "dropout_p":
            value = (kwargs or {}).get("dropout_p", args[i] if i < len(args) else arg.default_value)
            return not (isinstance(value, (int, float)) and value == 0)
    return True


def set_step(base: int, step: int) -> None:
    _state.set((base, step, _state.get()[2]))


def set_microbatch(mb: int) -> None:
    base, step, _ = _state.get()
    _state.set((base, step, mb))


def _seed(index: int) -> int:
    base, step, mb = _state.get()
    key = f"{base}:{step}:{mb}:{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def seeded(index: int, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Run the random `op` with a generator seeded for (step, microbatch, `index`)."""
    devices = (
        [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    )
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(_seed(index))
        return op(*args, **kwargs)
