"""The order in which every rank walks a generation's (step, microbatch, stage) operations.

# NOTE [several stages per rank]
Under torchrun `generate(stages=k * ranks)` puts stage s on rank s mod ranks (looped, as
interleaved pipeline schedules place virtual stages): each rank holds k runs of decoder blocks,
and a microbatch's step crosses every rank k times. Every rank walks its operations in one
global order, the slot each would start at if every stage took one unit of time and started as
soon as its inputs exist (`walk_order`): stage s of (step t, microbatch i) starts s units after
stage 0 of it, and stage 0 starts (t, i) one unit after (t, i - 1) and once the token of
(t - 1, i) is back from the last stage. Every input of an operation comes from an operation of
an earlier slot, so a rank that blocks on its receives in this order never waits on a peer that
waits on it. With microbatches >= stages stage 0 never waits for a token, so no rank idles in the
steady state; each rank works on k microbatches at once. Two stages on one rank hand their
values over in the process; between ranks each (source stage, destination stage) pair is a
channel of its own (a gloo tag), so the values of one pair never meet another pair's in a
receive, whatever the order their slots interleave in.
"""

from __future__ import annotations

__all__ = ["walk_order"]


def walk_order(steps: int, microbatches: int, stages: int, mine: list[int]) -> list[tuple[int, int, int]]:
    """(step, microbatch, stage) of `mine`'s operations in the global order (NOTE [several
    stages per rank]); stage 0's list ends with (steps, i, 0) for each microbatch: the receive of
    its last tokens."""
    start: dict[tuple[int, int], int] = {}
    ops: list[tuple[int, int, int, int]] = []
    prev = -1
    for t in range(steps + 1):
        for i in range(microbatches):
            slot = prev + 1 if t == 0 else max(prev + 1, start[t - 1, i] + stages)
            start[t, i] = prev = slot
            ops += [(slot + s, t, i, s) for s in mine if t < steps or s == 0]
    return [op[1:] for op in sorted(ops)]
