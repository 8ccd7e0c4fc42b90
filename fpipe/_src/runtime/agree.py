"""Agree: every pipeline rank must run the same staged program.

Ranks exchange no shapes at run time: each derives its transfers from its own trace. Two ranks
that traced different programs for the same input signature (a branch on `dist.get_rank()`, a
constant read from a per-process environment) would exchange messages of different sizes --
gloo aborts, NCCL hangs or reads garbage. So at the first call of each signature, after compiling
and before any transfer, the ranks compare a fingerprint of what they staged (`fingerprint`: every
program's graph, inputs, outputs, value shapes and dtypes, the cuts and the schedule) by one
all-gather of a hash, and disagree loudly.

The fingerprint is a function of the program alone, equal in every process: no object ids, no
addresses, no `hash()` of a string (PYTHONHASHSEED differs), no device index (rank r may run on
cuda:r), no source locations (installations may differ between nodes); hashlib digests only.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from ..schedules import Schedule
from ..stages import Program, Staged
from ..tracing import tensor_key
from .dist import PPGroup

__all__ = ["fingerprint", "gather_digests", "check_same_program"]

_KIND_NAMES = {"F": "forward", "B": "backward", "I": "input-gradient", "W": "weight-gradient"}
_KIND_ORDER = "FBIW"


def digest(text: str) -> int:
    """A 56-bit digest of `text` (it fits an int64 tensor), equal in every process."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _canon(x: Any, local: dict[fx.Node, int]) -> str:
    """A text form of a node argument with nothing process-specific in it; a node is named by
    its position in its program (global names shift with any node added elsewhere)."""
    if isinstance(x, fx.Node):
        return f"%{local[x]}"
    if isinstance(x, (list, tuple)):
        return "(" + ",".join(_canon(v, local) for v in x) + ")"
    if isinstance(x, dict):
        items = sorted(x.items(), key=lambda kv: str(kv[0]))
        return "{" + ",".join(f"{k}:{_canon(v, local)}" for k, v in items) + "}"
    if isinstance(x, torch.device):
        return f"device({x.type})"  # rank r may run on cuda:r
    if isinstance(x, torch.Tensor):
        return f"tensor{tuple(x.shape)}:{x.dtype}"
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.layout, torch.memory_format)):
        return repr(x)
    if isinstance(x, slice):
        return f"slice({_canon(x.start, local)},{_canon(x.stop, local)},{_canon(x.step, local)})"
    text = repr(x)
    return type(x).__qualname__ if " at 0x" in text else text


def _target(t: Any) -> str:
    if isinstance(t, str):
        return t
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(t)
    return f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', type(t).__qualname__)}"


def _val(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{tuple(v.shape)}:{v.dtype}"
    if isinstance(v, (list, tuple)):
        return "(" + ",".join(_val(e) for e in v) + ")"
    return ""


def _program_text(prog: Program) -> str:
    """The program's operations in order; which values it reads and writes is the cuts' part."""
    return graph_text(prog.gm)


def graph_text(gm: fx.GraphModule) -> str:
    """A graph's operations in order, with their arguments and value shapes: equal on every rank
    for the same program (nodes numbered within the graph)."""
    local = {n: i for i, n in enumerate(gm.graph.nodes)}
    lines = []
    for n in gm.graph.nodes:
        target = _target(n.target) if n.op not in ("placeholder", "output") else ""
        args = _canon(n.args, local) + _canon(n.kwargs, local)
        lines.append(f"{n.op}:{target}{args}->{_val(n.meta.get('val'))}")
    return "\n".join(lines)


def _cuts_text(staged: Staged) -> str:
    place = {name: f"{p[0]}{p[1]}" for name, p in staged.producer.items()}
    meta = {name: f"{tuple(shape)}:{dtype}" for name, (shape, dtype) in staged.meta.items()}
    return "\n".join(
        [
            f"stages {staged.n_stages}; outputs {staged.out_names} ({staged.n_outs} values)",
            f"inputs {staged.param_inputs} {staged.data_inputs} {staged.const_inputs} {staged.ct_input}",
            f"producer {sorted(place.items())}",
            f"consumers {sorted((k, sorted(v)) for k, v in staged.consumers.items())}",
            f"meta {sorted(meta.items())}",
            f"strides {sorted(staged.strides.items())}",
        ]
    )


def part_name(key: str) -> str:
    """'F1' -> "stage 1's forward program"; other keys are their own names."""
    if key[:1] in _KIND_NAMES and key[1:].isdigit():
        return f"stage {key[1:]}'s {_KIND_NAMES[key[0]]} program"
    return key


def fingerprint(staged: Staged, schedule: Schedule) -> dict[str, int]:
    """A digest of each part of what a rank staged, in the order a difference is reported:
    every program by stage, the cuts (which program makes and reads each value, value shapes),
    the schedule. (A changed program usually changes the cuts' value names too: it comes first.)"""
    parts = {}
    for place in sorted(staged.programs, key=lambda p: (p[1], _KIND_ORDER.index(p[0]))):
        parts[f"{place[0]}{place[1]}"] = digest(_program_text(staged.programs[place]))
    parts["the cut into stages"] = digest(_cuts_text(staged))
    parts["the schedule"] = digest(f"{schedule}\nstage_rank {schedule.stage_rank}")
    return parts


def gather_digests(pg: PPGroup, values: list[int], timeout: float, what: str) -> list[list[int]]:
    """Every rank's `values` (equal length on every rank), by one all-gather."""
    mine = torch.tensor(values, dtype=torch.int64, device=pg.device)
    every = [torch.empty_like(mine) for _ in range(pg.size)]
    work = dist.all_gather(every, mine, group=pg.group, async_op=True)
    pg.wait_all([work], timeout, lambda: what, poll=True)  # a rank that failed compiling reports it
    return [t.tolist() for t in every]


def odd_ranks(values: list[Any]) -> tuple[list[int], list[int]] | None:
    """None if every rank's value is equal, else (the ranks of the rarest value, the others)."""
    groups: dict[Any, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    if len(groups) == 1:
        return None
    least = min(groups.values(), key=len)
    return least, [r for r in range(len(values)) if r not in least]


def check_same_program(call: str, pg: PPGroup, parts: dict[str, int], timeout: float) -> None:
    """Raise ValueError on every rank if the ranks' fingerprints differ (one all-gather)."""
    total = digest(repr(sorted(parts.items())))
    every = gather_digests(pg, [total], timeout, "comparing the staged programs before the first step")
    differ = odd_ranks([v[0] for v in every])
    if differ is None:
        return
    raise ValueError(
        f"{call}: ranks {differ[0]} staged a different program from ranks {differ[1]} for the same "
        f"inputs ({first_difference(pg, parts, timeout)}). Every pipeline rank must trace the same function: a branch "
        "on the rank (dist.get_rank()), or a value that differs between processes (an environment "
        "variable, a random number drawn while tracing), changes the program; compute such values "
        "outside the function and pass them as inputs."
    )


def first_difference(pg: PPGroup, parts: dict[str, int], timeout: float) -> str:
    """Which parts differ between the ranks, first one first (an object all-gather: only on
    the error path, where every rank is alive and waiting for it)."""
    every = pg.gather_objects(parts, timeout, "comparing the staged programs part by part")
    keys = list(dict.fromkeys(k for p in every for k in p))
    differ = [part_name(k) for k in keys if odd_ranks([p.get(k) for p in every]) is not None]
    if not differ:
        return "the programs' overall digests differ"
    also = f"; so do {', '.join(differ[1:4])}" + (", ..." if len(differ) > 4 else "") if differ[1:] else ""
    return f"{differ[0]} differs{also}"


def check_same_signature(
    call: str, pg: PPGroup, key: Any, shapes: list[tuple[int, ...]], timeout: float, role: str = "pipeline"
) -> None:
    """Every rank must run the same program: compare the input signatures (one all-gather of
    a hash per call) so different shapes on two ranks fail loudly instead of corrupting."""
    every = gather_digests(pg, [digest(repr(key))], timeout, "comparing input signatures before the step")
    differ = odd_ranks([v[0] for v in every])
    if differ is not None:
        raise ValueError(
            f"{call}: {role} ranks {differ[0]} were called with inputs whose shapes, dtypes "
            f"or structure differ from {role} ranks {differ[1]}; every {role} "
            "rank must pass inputs of the same signature (a rank that does not use an input may "
            f"pass a meta tensor of the same shape). This rank's data shapes: {shapes}."
        )


def check_same_values(call: str, pg: PPGroup, parts: dict[str, Any], timeout: float, fix: str) -> None:
    """Every rank must pass equal values: one all-gather of a digest per named part (a tensor's
    bytes, or a value's repr); a difference names the first part that differs and the ranks."""
    texts = [
        v.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes().hex()
        if isinstance(v, torch.Tensor)
        else repr(v)
        for v in parts.values()
    ]
    every = gather_digests(
        pg, [digest(t) for t in texts], timeout, "comparing the call's arguments across ranks"
    )
    for j, name in enumerate(parts):
        differ = odd_ranks([v[j] for v in every])
        if differ is not None:
            ranks = [[pg.global_rank(r) for r in side] for side in differ]
            raise ValueError(
                f"{call}: the {name} differ between ranks {ranks[0]} and ranks {ranks[1]}; {fix}"
            )


def check_same_slices(
    call: str, dp: PPGroup, key: Any, data: list[torch.Tensor], names: list[str], timeout: float
) -> None:
    """Every replica must pass slices of one signature: compare the trace keys over dp (one
    all-gather of two numbers per call); on a difference, name the ranks and the first argument
    that differs (a second all-gather, on every replica alike)."""
    leaves = [repr(tensor_key(t, t.device.type)) for t in data]
    every = gather_digests(dp, [digest(repr(key)), len(leaves)], timeout, "comparing the replicas' inputs")
    differ = odd_ranks([tuple(v) for v in every])
    if differ is None:
        return
    where = "the arguments' structure or non-tensor values"
    if len({v[1] for v in every}) == 1 and leaves:
        per = gather_digests(dp, [digest(x) for x in leaves], timeout, "naming the differing argument")
        odd = [j for j in range(len(leaves)) if odd_ranks([p[j] for p in per]) is not None]
        if odd:
            j = odd[0]
            where = f"argument {names[j]} (this rank's: shape {tuple(data[j].shape)}, {data[j].dtype})"
    ranks = [[dp.global_rank(r) for r in side] for side in differ]
    raise ValueError(
        f"{call}: data-parallel ranks {ranks[0]} were called with inputs that differ from ranks "
        f"{ranks[1]} in {where}; every replica must pass a slice of the global batch of the same "
        "shape (split the global batch evenly over the 'dp' dimension)."
    )
