"""Serving: `fpipe.Generator`, a request loop (continuous batching) over generate's pipelined step.

Above `generate`, whose traces, trace key, settings allowlist, refusals, sampling and stage
channels it reuses: `generator` (the loop: requests join free cache slots at step boundaries and
leave at EOS), `generator_slots` (slots, prompt-length buckets, slots from a memory limit) and
`generator_run` (one pass through the stages: in this process, or this rank's stage under
torchrun). Nothing imports this package but `fpipe`.
"""

from .generator import Generator, Request

__all__ = ["Generator", "Request"]
