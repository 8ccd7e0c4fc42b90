"""fpipe.plan over dp x pp x tp: predictions against real steps, tensor-parallel layouts included (issue 15).

    torchrun --standalone --nproc-per-node 4 bench/plan_tp.py --top 6

Every rank plans `fpipe.plan(loss, params, x, y, world_size=W, tensor_parallel=build,
verify=TOP)`: `build(tp_mesh)` parallelizes a fresh GPT on the tp mesh it is given (Megatron's
layout: q/k/v and the MLP's first layer column-parallel, the attention output and the MLP's
second layer row-parallel, the head column-parallel), so tp = 1, 2, 4 (every tp dividing W) are
planned together (optimizer="none": every step timed is value-and-grad only). The TOP best
predicted are timed as real steps by plan() itself (its NOTE [plan verification]) and the
fastest chosen. Rank 0 prints the table and, per verified candidate, its predicted and measured
step and the error (predicted - measured) / measured; then the pick against the best predicted;
then each tp's best predicted candidate timed here (median of 3 steps after 1, slowest rank).

Results: docs/BENCHMARKS.md, "Planning (issue 15)", "with tensor parallelism".
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fpipe

D, HEADS, L, V, B, T = 128, 8, 4, 4096, 16, 32  # width, heads, blocks, vocabulary, batch, sequence


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.fc, self.proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # -1: this rank's share of the heads under tp
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, -1, D // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        x = x + self.o(
            F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        )
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def fresh() -> GPT:
    torch.manual_seed(0)
    return GPT()


def loss_of(fn: Any) -> Any:
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fn(params, x).flatten(0, 1), y.flatten())

    return loss


def build(tp_mesh: Any) -> tuple[Any, Any]:
    model = fresh()
    col, row = ColwiseParallel(), RowwiseParallel()
    for b in model.blocks:
        parallelize_module(b, tp_mesh, {"q": col, "k": col, "v": col, "o": row, "fc": col, "proj": row})
    parallelize_module(
        model, tp_mesh, {"head": ColwiseParallel(output_layouts=torch.distributed.tensor.Replicate())}
    )
    fn, params = fpipe.functionalize(model)
    return loss_of(fn), params


def timed(c: fpipe.Plan, x: torch.Tensor, y: torch.Tensor) -> float:
    """Median seconds of 3 value-and-grad steps of candidate `c` (after one), the slowest rank's."""
    i, n = dist.get_rank() // (c.pp * c.tp), x.shape[0] // c.dp
    vg = fpipe.value_and_grad(fpipe.pipeline(c.function, plan=c))
    times = []
    for k in range(4):
        dist.barrier()
        start = time.perf_counter()
        vg(c.params, x[i * n : (i + 1) * n], y[i * n : (i + 1) * n])
        if k:
            times.append(time.perf_counter() - start)
    t = torch.tensor([sorted(times)[1]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=6, help="candidates plan() verifies (verify=)")
    ap.add_argument("--budget", type=float, default=60.0, help="plan()'s budget_s")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    fn, params = fpipe.functionalize(fresh())
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.roll(x, -1, 1)
    start = time.perf_counter()
    p = fpipe.plan(
        loss_of(fn), params, x, y, world_size=world, optimizer="none", budget_s=args.budget, verify=args.top,
        tensor_parallel=build,
    )  # fmt: skip
    took = time.perf_counter() - start
    if rank == 0:
        print(p)
        print(f"\nplan() took {took:.1f} s (measuring {p.measure_s:.1f} s, the rest verifying)")
        print("\n| # | layout | stages | cuts | predicted (ms) | measured (ms) | error |")
        print("|---|---|---:|---|---:|---:|---:|")
        for i, c in enumerate(p.candidates[: p.verified]):
            err = (c.predicted_step_s - c.measured_step_s) / c.measured_step_s
            cuts = ", ".join(c.cuts) or "-"
            print(
                f"| {i + 1} | {c.layout} | {c.stages} | {cuts} | {c.predicted_step_s * 1e3:.1f} | "
                f"{c.measured_step_s * 1e3:.1f} | {err:+.0%} |"
            )
        verified = p.candidates[: p.verified]
        first = min(verified, key=lambda c: c.predicted_step_s)
        print(
            f"\npick {p.layout}: {p.measured_step_s * 1e3:.1f} ms; best predicted {first.layout}: "
            f"{first.measured_step_s * 1e3:.1f} ms ({first.measured_step_s / p.measured_step_s:.2f}x)"
        )
    # each tp's best predicted candidate, timed here (value-and-grad only: no optimizer step)
    best = [next(c for c in p.candidates if c.tp == tp) for tp in sorted({c.tp for c in p.candidates})]
    measured = [timed(c, x, y) for c in best]
    if rank == 0:
        print("\n| tp | best predicted layout | predicted (ms) | measured here (ms) | error |")
        print("|---:|---|---:|---:|---:|")
        for c, m in zip(best, measured):
            print(
                f"| {c.tp} | {c.layout} | {c.predicted_step_s * 1e3:.1f} | {m * 1e3:.1f} | "
                f"{(c.predicted_step_s - m) / m:+.0%} |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
