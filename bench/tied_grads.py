"""Tied parameters (issue 11): each stage's gradient contribution summed on its stage and once per
step over ranks (NOTE [tied gradients] in fpipe/_src/stages/split_tied.py), against the joint graph's own
addition on the lowest stage, which needs the head's contribution sent once per microbatch.

    torchrun --standalone --nproc-per-node 2 bench/tied_grads.py
    torchrun --standalone --nproc-per-node 2 bench/tied_grads.py --vocab 8192 --dim 256 \
        --layers 4 --batch 8 --seq 64 --microbatches 8 --steps 12

Model: a language model whose head is its embedding matrix transposed (vocab x dim, fp32): the
lookup on stage 0, `--layers` residual tanh layers split between the 2 stages, the head on
stage 1; cross-entropy loss; 1f1b over 2 ranks (gloo, one torch thread each). Modes:
"untied" (fpipe's default) and "joint" (`fpipe._src.stages.split.UNTIE = False` while the pipeline is
compiled). Printed: the bytes each step sends between the pipeline ranks (from the runner's
communication plan: every value of every transfer, per step; then the tied gradient is
all-reduced (untied) or broadcast from stage 0's rank (joint) once), the median step time of each mode
(rounds alternate the order), their ratio, and the largest difference between the two modes'
gradients (the sum is reassociated, so not bitwise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fpipe  # noqa: E402
from fpipe._src.stages import split  # noqa: E402

MiB = 2**20


def make_loss(layers: int) -> Any:
    def loss_fn(params: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = params["wte"][tokens]
        for i in range(layers):
            h = h + torch.tanh(h @ params[f"w{i}"])
            if i + 1 == layers // 2:
                h = fpipe.stage_boundary(h)
        logits = h @ params["wte"].t()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return loss_fn


def make_params(vocab: int, d: int, layers: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {"wte": torch.randn(vocab, d, generator=g) * 0.02}
    for i in range(layers):
        out[f"w{i}"] = torch.randn(d, d, generator=g) / d**0.5
    return out


def sent_bytes(piped: Any) -> int:
    """Bytes this rank sends to the other pipeline rank in one step (the runner's plan)."""
    runner, meta = piped._last.runner, piped._last.staged.meta
    total = 0
    for groups in runner.groups.values():
        for g in groups:
            for t in g.sends:
                for name in t.names:
                    shape, dtype = meta[name]
                    total += shape.numel() * dtype.itemsize
    return total


def step_time(vg: Any, args: tuple[Any, ...]) -> tuple[float, dict[str, torch.Tensor]]:
    dist.barrier()
    t0 = time.perf_counter()
    _, grads = vg(*args)
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt), grads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    params = make_params(args.vocab, args.dim, args.layers)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    modes: dict[str, Any] = {}
    for name, untie in (("untied", True), ("joint", False)):
        split.UNTIE = untie
        piped = fpipe.pipeline(make_loss(args.layers), microbatches=args.microbatches, schedule="1f1b")
        vg = fpipe.value_and_grad(piped)
        grads = {}
        for _ in range(args.warmup):
            _, grads = step_time(vg, (params, tokens, targets))
        modes[name] = {"piped": piped, "vg": vg, "grads": grads, "times": []}
    split.UNTIE = True
    for r in range(args.steps):
        for name in list(modes) if r % 2 == 0 else list(reversed(modes)):
            modes[name]["times"].append(step_time(modes[name]["vg"], (params, tokens, targets))[0])
    sent = {n: torch.tensor([sent_bytes(m["piped"])], dtype=torch.float64) for n, m in modes.items()}
    for t in sent.values():
        dist.all_reduce(t)  # both directions
    diff = max(
        float((modes["untied"]["grads"][k] - modes["joint"]["grads"][k]).abs().max())
        for k in modes["untied"]["grads"]
    )
    diff_t = torch.tensor([diff], dtype=torch.float64)
    dist.all_reduce(diff_t, op=dist.ReduceOp.MAX)
    if rank == 0:
        wte = params["wte"].numel() * 4 / MiB
        print(
            f"fpipe tied_grads: vocab {args.vocab} x dim {args.dim} tied (wte {wte:.1f} MiB), {args.layers} "
            f"layers, batch {args.batch} x {args.seq}, {args.microbatches} microbatches, 1f1b, 2 ranks "
            f"(gloo), torch {torch.__version__}"
        )
        print("| mode | p2p sent between ranks per step | then, once per step | s/step (median) |")
        print("|---|---|---|---|")
        once = {
            "untied": f"all-reduce of the tied gradient ({wte:.1f} MiB)",
            "joint": f"broadcast of it ({wte:.1f} MiB)",
        }
        for n, m in modes.items():
            print(
                f"| {n} | {float(sent[n]) / MiB:.1f} MiB | {once[n]} | {statistics.median(m['times']):.4f} |"
            )
        ratios = [a / b for a, b in zip(modes["untied"]["times"], modes["joint"]["times"])]
        print(
            f"untied/joint: {statistics.median(modes['untied']['times']) / statistics.median(modes['joint']['times']):.3f}"
            f" (medians), {statistics.median(ratios):.3f} (median of per-round ratios); largest gradient "
            f"difference {float(diff_t):.2e}"
        )
        for n, m in modes.items():
            print(f"  {n}: " + " ".join(f"{t:.4f}" for t in m["times"]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
