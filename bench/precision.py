"""Mixed precision (issue 29): step time of bf16 under `fpipe.Precision` against fp32, and against
bf16 with the gradient sums accumulated in bf16; and the loss curve of bf16 against fp32.

    python bench/precision.py
    python bench/precision.py --layers 4 --d-model 256 --seq 64 --batch 16 --microbatches 8 --steps 6

Model: bench/models.py's GPT, cut into 2 stages, 1f1b, in one process (every stage local), one
torch thread. Modes, each with fpipe.value_and_grad over the same batch:
  fp32        fp32 parameters, no policy.
  bf16        fp32 master weights, Precision(param_dtype=bf16): cast once per step, sums in fp32,
              fp32 gradients.
  bf16-params bf16 parameters, no policy: no cast, sums in fp32, bf16 gradients (the default).
  bf16-acc16  bf16 parameters, Precision(accum_dtype=bf16): sums in bf16 (fpipe before issue 29).
Printed: the median step time of each mode (rounds alternate the order, after one warm-up
step each), and their ratios to fp32. With --curve N: N AdamW steps of fp32 and of bf16 from the
same initial weights and batches, and the largest relative difference between their losses.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import models  # noqa: E402

import fpipe  # noqa: E402

BF16 = torch.bfloat16
MODES: dict[str, tuple[torch.dtype, fpipe.Precision | None]] = {
    "fp32": (torch.float32, None),
    "bf16": (torch.float32, fpipe.Precision(param_dtype=BF16)),
    "bf16-params": (BF16, None),
    "bf16-acc16": (BF16, fpipe.Precision(accum_dtype=BF16)),
}


def build(args: argparse.Namespace, seed: int = 1) -> tuple[Any, dict[str, torch.Tensor], Any]:
    cfg = models.GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, heads=4, layers=args.layers)
    torch.manual_seed(0)
    fn, params = fpipe.functionalize(models.GPT(cfg, models.cuts_for(cfg, 2)))

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return models.lm_loss(fn(p, x).float(), y)

    return loss_fn, {k: v.detach() for k, v in params.items()}, models.make_batch(cfg, args.batch, seed)


def step_times(args: argparse.Namespace) -> dict[str, float]:
    loss_fn, params, (x, y) = build(args)
    steps, per = {}, {}
    for name, (dtype, policy) in MODES.items():
        piped = fpipe.pipeline(loss_fn, microbatches=args.microbatches, precision=policy)
        p = {k: v.to(dtype) for k, v in params.items()}
        steps[name] = (fpipe.value_and_grad(piped), p)
        steps[name][0](p, x, y)  # warm-up: trace and compile
        per[name] = []
    for r in range(args.steps):
        for name in MODES if r % 2 == 0 else reversed(MODES):
            step, p = steps[name]
            t0 = time.perf_counter()
            step(p, x, y)
            per[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in per.items()}


def curve(args: argparse.Namespace, policy: fpipe.Precision | None) -> list[float]:
    loss_fn, init, _ = build(args)
    params = {k: v.clone() for k, v in init.items()}
    opt = torch.optim.AdamW(params.values(), lr=3e-3)
    step = fpipe.value_and_grad(fpipe.pipeline(loss_fn, microbatches=args.microbatches, precision=policy))
    losses = []
    for i in range(args.curve):  # a fresh batch each step (random tokens: the loss falls to ~ln(vocab))
        x, y = build(args, seed=100 + i)[2]
        loss, grads = step(params, x, y)
        fpipe.set_grads(params, grads)
        opt.step()
        losses.append(float(loss))
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--curve", type=int, default=0, metavar="N")
    args = ap.parse_args()
    torch.set_num_threads(1)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# {when}, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"fpipe {models.fpipe_revision()}: {' '.join(sys.argv)}")  # fmt: skip
    med = step_times(args)
    for name, t in med.items():
        print(f"{name:11s} {t * 1e3:8.1f} ms/step  {t / med['fp32']:.2f}x fp32")
    if args.curve:
        a, b = curve(args, None), curve(args, fpipe.Precision(param_dtype=BF16))
        worst = max(abs(p - q) / p for p, q in zip(a, b))
        print(f"loss fp32 {a[0]:.3f} -> {a[-1]:.3f}, bf16 {b[0]:.3f} -> {b[-1]:.3f}; "
              f"largest relative difference over {args.curve} steps {worst:.2%}")  # fmt: skip


if __name__ == "__main__":
    main()
