"""fpipe.plan's predictions against measured steps, and measured cuts against equal layers (issue 15).

    torchrun --standalone --nproc-per-node 2 bench/plan.py
    torchrun --standalone --nproc-per-node 4 bench/plan.py --top 3

Every rank plans (`fpipe.plan(..., world_size=W, verify=TOP)`: the same plan everywhere,
measurements averaged; the TOP best predicted candidates timed as real steps and the fastest
chosen), rank 0 prints the plan's table and each verified candidate's prediction error
((predicted - measured) / measured). Then, independently of plan() and in interleaved rounds
(A B C D A B C D ...; median of 5 steps of value_and_grad + AdamW after 2 warm-up steps, the
slowest rank): the chosen plan; the candidate prediction alone would have chosen; and the best
pipelined layout with its measured cuts against the same layout cut at equal block counts
(stage_boundary markers) -- the model has a heavy head (a large vocabulary), which equal layers
put on one stage with a block's share of the rest.

Results: docs/BENCHMARKS.md, "Planning (issue 15)".
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fpipe

D, L, V, B, T = 128, 8, 16384, 16, 32  # width, blocks, vocabulary, batch, sequence


def make(seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = {"embed": torch.randn(V, D, generator=g) * 0.02, "head": torch.randn(D, V, generator=g) * 0.02}
    for i in range(L):
        p[f"b{i}.up"] = torch.randn(D, 4 * D, generator=g) * 0.05
        p[f"b{i}.down"] = torch.randn(4 * D, D, generator=g) * 0.05
    tokens = torch.randint(0, V, (B, T), generator=g)
    return p, tokens, torch.roll(tokens, -1, 1)


def block(p: dict[str, torch.Tensor], i: int, h: torch.Tensor) -> torch.Tensor:
    return h + torch.tanh(h @ p[f"b{i}.up"]) @ p[f"b{i}.down"]


def loss(p: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    h = F.embedding(tokens, p["embed"])
    for i in range(L):
        h = block(p, i, h)
    return F.cross_entropy((h @ p["head"]).flatten(0, 1), targets.flatten())


def equal_layers(stages: int) -> Any:
    """`loss` cut at equal block counts: a boundary after every L / stages blocks."""

    def loss_equal(p: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = F.embedding(tokens, p["embed"])
        for i in range(L):
            h = block(p, i, h)
            if (i + 1) % (L // stages) == 0 and i + 1 < L:
                h = fpipe.stage_boundary(h)
        return F.cross_entropy((h @ p["head"]).flatten(0, 1), targets.flatten())

    return loss_equal


def timed(piped: Any, params: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """Median seconds of 5 steps (value_and_grad + AdamW over this rank's parameters), the max
    over ranks."""
    mine = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    opt: torch.optim.Optimizer | None = None
    times = []
    for i in range(7):
        dist.barrier()
        start = time.perf_counter()
        _, grads = fpipe.value_and_grad(piped)(mine, tokens, targets)
        fpipe.set_grads(mine, grads)
        if opt is None:
            opt = torch.optim.AdamW([mine[k] for k in grads], lr=1e-4)
        opt.step()
        opt.zero_grad()
        if i >= 2:
            times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def replica(c: fpipe.Plan, x: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0] // c.dp
    i = dist.get_rank() // c.pp  # the ("dp", "pp") mesh: rank = dp index * pp + pp index
    return x[i * rows : (i + 1) * rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=4, help="candidates plan() verifies (verify=)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved cuts / equal-layers timings")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    world, rank = dist.get_world_size(), dist.get_rank()
    params, tokens, targets = make()
    start = time.perf_counter()
    plan = fpipe.plan(loss, params, tokens, targets, world_size=world, verify=args.top)
    if rank == 0:
        print(f"world_size={world}, threads per rank {torch.get_num_threads()}, plan() took "
              f"{time.perf_counter() - start:.1f} s (measuring and verifying {plan.measure_s:.1f} s)"
              f"\n{plan}\n")  # fmt: skip
    top = plan.candidates[: plan.verified]
    by_prediction = min(top, key=lambda c: c.predicted_step_s)  # what prediction alone would pick
    if rank == 0:
        for c in sorted(top, key=lambda c: c.predicted_step_s):
            err = (c.predicted_step_s - c.measured_step_s) / c.measured_step_s
            print(f"{c.layout:34s} stages {c.stages}  predicted {c.predicted_step_s * 1e3:7.1f} ms  "
                  f"verified {c.measured_step_s * 1e3:7.1f} ms  error {err:+.0%}", flush=True)  # fmt: skip
    pick = next(c for c in plan.candidates if c.pp > 1)  # the best pipelined layout, for the cut test
    mesh = pick.settings({}).get("mesh")  # the plan's mesh (None: all ranks one pipeline)
    eq = fpipe.pipeline(
        equal_layers(pick.stages), microbatches=pick.microbatches, schedule=pick.schedule, mesh=mesh
    )
    runs = {  # timed again, independently of plan(), in interleaved rounds: A B C D A B C D ...
        "chosen": (fpipe.pipeline(loss, plan=plan), plan),
        "best predicted": (fpipe.pipeline(loss, plan=by_prediction), by_prediction),
        "pipelined, measured cuts": (fpipe.pipeline(loss, plan=pick), pick),
        "pipelined, equal layers": (eq, pick),
    }
    got: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for k, (piped, c) in runs.items():
            got[k].append(timed(piped, params, replica(c, tokens), replica(c, targets)))
    if rank == 0:
        med = {k: statistics.median(v) for k, v in got.items()}
        print(
            f"\n{args.rounds} interleaved rounds, median ms: "
            + "; ".join(f"{k} {v * 1e3:.1f}" for k, v in med.items())
        )
        print(f"chosen {plan.layout} vs best predicted {by_prediction.layout}: "
              f"{med['best predicted'] / med['chosen']:.2f}x (same layout: {(plan.layout, plan.stages) == (by_prediction.layout, by_prediction.stages)})")  # fmt: skip
        ratios = sorted(
            e / c for c, e in zip(got["pipelined, measured cuts"], got["pipelined, equal layers"])
        )
        print(f"{pick.layout}: measured cuts {pick.cuts} vs equal layers ({L // pick.stages} blocks per "
              f"stage): equal / cuts per round {' '.join(f'{r:.2f}' for r in ratios)} "
              f"(median {statistics.median(ratios):.2f}x)")  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
