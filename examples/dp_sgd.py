"""DP-SGD on the example GPT with pipeline parallelism: per-sample gradients through the pipeline.

    torchrun --standalone --nproc-per-node 2 examples/dp_sgd.py    # 2 stages, one per rank
    python examples/dp_sgd.py                                      # the same, in one process

Differentially private SGD (Abadi et al., 2016) clips each example's gradient to norm C, sums
them, adds Gaussian noise of standard deviation sigma * C and takes a step with the noisy mean.
Each example's gradient is `torch.func.vmap(torch.func.grad(piped), in_dims=(None, 0, 0))`, as
research code writes it: under torchrun fpipe runs it as ONE pipelined call (the vmapped
dimension cut into microbatches; docs/guide/transforms.md), and returns every example's
gradient on every rank that holds the parameter. The noise comes from a seeded generator, the
same on every rank, so every rank takes the same step.

For a check, rank 0 then takes the same step in one process, one example at a time with the
unsplit model (`torch.func.grad` per example, float64), and prints the largest difference
between the two updated parameter sets (tests/project/test_examples.py asserts it is below 1e-10).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import fpipe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpt import GPT  # noqa: E402  (the example GPT: nothing pipeline-specific in it)


def dp_sgd_step(
    per_sample: dict[str, torch.Tensor], params: dict[str, torch.Tensor], args: argparse.Namespace
) -> dict[str, torch.Tensor]:
    """One DP-SGD step from every example's gradient (a leading batch dimension per parameter)."""
    batch = next(iter(per_sample.values())).shape[0]
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values()))  # type: ignore[arg-type]
    scale = (args.clip / (norms + 1e-12)).clamp(max=1.0)  # each example's clipping factor
    noise = torch.Generator().manual_seed(args.seed + 1)  # the same draws on every rank
    new = {}
    for k in sorted(params):
        clipped = (per_sample[k] * scale.view(-1, *[1] * (per_sample[k].dim() - 1))).sum(0)
        z = torch.randn(params[k].shape, generator=noise, dtype=params[k].dtype)
        new[k] = params[k] - args.lr * (clipped + args.sigma * args.clip * z) / batch
    return new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--clip", type=float, default=0.5, help="per-example gradient norm bound C")
    ap.add_argument("--sigma", type=float, default=1.0, help="noise multiplier")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # the same model on every rank (each holds all of it: small)
    model = GPT(256, args.seq, args.d_model, args.layers, args.heads).double()
    fn, params = fpipe.functionalize(model)
    params = {k: v.detach() for k, v in params.items()}
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def loss_one(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One example's loss (x, y: one sequence)."""
        return F.cross_entropy(fn(params, x[None])[0], y)

    stages = 2 if "LOCAL_RANK" not in os.environ else None  # under torchrun: a stage per rank
    piped = fpipe.pipeline(loss_one, stages=stages, microbatches=args.microbatches)
    per_sample = torch.func.vmap(torch.func.grad(piped), in_dims=(None, 0, 0))(params, x, y)
    new = dp_sgd_step(per_sample, params, args)
    rank = int(os.environ.get("RANK", 0))
    print(f"rank {rank}: stages {piped.local_stages}, per-sample gradients of {len(per_sample)} tensors")
    if rank == 0:  # the reference: one example at a time, the unsplit model, one process
        one_by_one = [torch.func.grad(loss_one)(params, x[i], y[i]) for i in range(args.batch)]
        stacked = {k: torch.stack([o[k] for o in one_by_one]) for k in params}
        want = dp_sgd_step(stacked, params, args)
        diff = max((new[k] - want[k]).abs().max().item() for k in params)
        print(f"DP-SGD step on {args.batch} examples: max |difference| from one example at a time {diff:.3g}")


if __name__ == "__main__":
    main()
