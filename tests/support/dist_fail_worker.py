"""Failure-injection worker for `tests/runtime/test_failures.py`: one pipelined training step in which one
rank raises, SIGKILLs itself or SIGSTOPs itself at a chosen microbatch of its stage.

The fault is an op in the model (`fpipe_test::tripwire`, the identity) that the traced stage
program calls once per forward action; on `--rank` its `--call`-th execution (0-based, the
microbatch number) in the second step (the first compiles on every rank) does `--mode`:

    raise  raise RuntimeError("injected failure ...") inside the step
    kill   os.kill(os.getpid(), SIGKILL)
    stop   os.kill(os.getpid(), SIGSTOP)  (the test kills it afterwards)

Before the fault, the rank writes `fault.json` (pid, wall time) into `--out`; every rank that
leaves the step writes `rank{R}.json` (the exception's type and message, the wall time). The
process group is initialised by fpipe from the environment (torchrun's, or the test's own).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fpipe

_FAULT: dict[str, Any] = {}
_CALLS = [0]


@torch.library.custom_op("fpipe_test::tripwire", mutates_args=())
def _tripwire(x: torch.Tensor) -> torch.Tensor:
    call = _CALLS[0]
    _CALLS[0] += 1
    if _FAULT.get("armed") and int(os.environ["RANK"]) == _FAULT["rank"] and call == _FAULT["call"]:
        _fire()
    return torch.zeros_like(x)


@_tripwire.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _fire() -> None:
    mode, out = _FAULT["mode"], _FAULT["out"]
    with open(os.path.join(out, "fault.json"), "w") as f:
        json.dump({"pid": os.getpid(), "rank": _FAULT["rank"], "mode": mode, "time": time.time()}, f)
    if mode == "raise":
        raise RuntimeError(f"injected failure on rank {_FAULT['rank']} at its forward call {_FAULT['call']}")
    os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)


class Net(nn.Module):
    """`stages` Linear + tanh layers, a boundary after each but the last; the tripwire on stage 1."""

    def __init__(self, stages: int, d: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(stages))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == _FAULT.get("stage", 1):
                x = x + _tripwire(x.detach())  # zeros; on a detached input, so no autograd rule is needed
            if i < len(self.layers) - 1:
                x = fpipe.stage_boundary(x)
        return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=["raise", "kill", "stop"], required=True)
    ap.add_argument("--rank", type=int, required=True, help="the rank that fails (it holds stage --rank)")
    ap.add_argument("--call", type=int, default=3, help="at which forward microbatch of its stage")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--catch", action="store_true", help="catch the failure, note it, exit normally")
    args = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    _FAULT.update(mode=args.mode, rank=args.rank, call=args.call, out=args.out, stage=args.rank)
    torch.manual_seed(0)
    fn, params = fpipe.functionalize(Net(world))
    x, y = torch.randn(4 * args.microbatches, 8), torch.randn(4 * args.microbatches, 8)

    def loss(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(fn(params, x), y)

    piped = fpipe.pipeline(loss, microbatches=args.microbatches, schedule="1f1b", timeout=args.timeout)
    record: dict[str, Any] = {"rank": rank, "pid": os.getpid()}
    try:
        # the first step compiles on every rank, so no wait below is on a slow trace
        fpipe.value_and_grad(piped)(params, x, y)
        _FAULT["armed"], _CALLS[0] = True, 0
        fpipe.value_and_grad(piped)(params, x, y)
        record.update(ok=True)
    except BaseException as err:
        record.update(ok=False, error_type=type(err).__name__, error=str(err))
        if not args.catch:
            raise
        print(f"rank {rank} caught {type(err).__name__} and goes on", flush=True)
        atexit.register(_note_exit, os.path.join(args.out, f"atexit{rank}.json"), rank)
    finally:
        record["time"] = time.time()
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)


def _note_exit(path: str, rank: int) -> None:
    """An atexit handler of the user's: proof that a caught failure lets the process end normally."""
    with open(path, "w") as f:
        json.dump({"rank": rank, "time": time.time()}, f)


if __name__ == "__main__":
    main()
