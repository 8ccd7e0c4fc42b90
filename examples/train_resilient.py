"""Train train_gpt.py's GPT (dropout on) so that a killed rank costs only the steps since the last
checkpoint: torchrun restarts the job, and it resumes from `fpipe.CheckpointManager`'s latest step.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/train_resilient.py --root runs/a

Every `--every` steps each rank saves (in the background: `async_save`) its stage's parameters, its
optimizer state, and its own data position into `ROOT/step_SSSSSSSS`; the last `--keep` steps are
kept and nothing else in ROOT is touched. At start, every attempt (the first, or one torchrun
restarted after a rank died) restores the latest complete step, if there is one, and goes on from
it. fpipe seeds dropout by the step (NOTE [random-number policy]), and the checkpoint holds the
pipeline's step count, so the resumed run draws the masks the uninterrupted one drew: its losses
and final parameters are bit-identical (tests/training/test_resilient.py kills a rank at a random step).

`--kill-at STEP --kill-rank R` is for trying it: on the first attempt, rank R SIGKILLs itself in
the middle of step STEP (after its part of the step, before the optimizer step).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import fpipe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpt import GPT, corpus, get_batch  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, help="the run's checkpoint folder (fpipe.CheckpointManager)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=10, help="save every N steps")
    p.add_argument("--keep", type=int, default=3, help="keep the last K saved steps")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-mib", type=float, default=0.5)
    p.add_argument("--loss-log", metavar="PATH", help="rank 0 appends each step's loss here (JSON lines)")
    p.add_argument("--params-out", metavar="PATH", help="each rank writes its final parameters to PATH.rankR")
    p.add_argument("--kill-at", type=int, metavar="STEP", help="first attempt only: SIGKILL a rank at STEP")
    p.add_argument("--kill-rank", type=int, default=1)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    data = corpus(args.corpus_mib)
    gen = torch.Generator().manual_seed(args.seed)  # the batch stream: saved per rank
    x, y = get_batch(data, args, gen, torch.device("cpu"))

    with torch.device("meta"):
        model = GPT(256, args.seq, args.d_model, args.layers, args.heads, dropout=args.dropout)
    fn, params = fpipe.functionalize(model)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fn(params, x).flatten(0, 1), y.flatten())

    stages = None if "LOCAL_RANK" in os.environ else 2  # one stage per rank; 2 in one process
    piped = fpipe.pipeline(loss_fn, stages=stages, microbatches=args.microbatches)
    torch.manual_seed(args.seed)  # also the base seed of fpipe's dropout masks
    params = piped.materialize(model, x, y)
    opt = torch.optim.AdamW([v for v in params.values() if not v.is_meta], lr=args.lr)
    step = fpipe.value_and_grad(piped)

    mgr = fpipe.CheckpointManager(args.root, keep=args.keep, every=args.every, pipeline=piped)
    done = 0
    if mgr.latest() is not None:  # a restarted attempt (or a rerun): go on from the latest step
        done, extra = mgr.restore(params, optimizer=opt)
        gen.set_state(extra["batches"])
        x, y = get_batch(data, args, gen, torch.device("cpu"))
    print(f"rank {rank}, attempt {attempt}: starting after step {done}", file=sys.stderr, flush=True)

    for i in range(done + 1, args.steps + 1):
        loss, grads = step(params, x, y)
        if i == args.kill_at and rank == args.kill_rank and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the optimizer has not stepped
        fpipe.set_grads(params, grads)
        opt.step()
        batches = gen.get_state()  # where the batch of step i + 1 is drawn from
        x, y = get_batch(data, args, gen, torch.device("cpu"))
        mgr.save(i, params, optimizer=opt, extra={"batches": batches}, force=i == args.steps)
        if rank == 0 and args.loss_log:
            with open(args.loss_log, "a") as f:
                f.write(json.dumps({"step": i, "loss": loss.item(), "attempt": attempt}) + "\n")
    mgr.wait()  # the last save published (and old steps deleted) before the process group ends
    if args.params_out:
        torch.save({k: v for k, v in params.items() if not v.is_meta}, f"{args.params_out}.rank{rank}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
