"""Pipeline a Hugging Face `GPT2LMHeadModel` as it is: no edit to the model, fpipe picks the cuts.

    python examples/hf_gpt2.py                                     # 2 stages in this process
    torchrun --standalone --nproc-per-node 2 examples/hf_gpt2.py   # 1 stage per rank

The model is a small random-init GPT-2 (no download) trained on bytes of Python's own standard
library. The loss is the one transformers computes from `labels=`; the training loop is plain torch.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
from pathlib import Path

import torch
import transformers

import fpipe


def batches(batch: int, seq: int, seed: int):
    text = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_bytes()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(seed)  # every rank draws the same batches
    while True:
        starts = torch.randint(len(data) - seq, (batch,), generator=gen).tolist()
        yield torch.stack([data[i : i + seq] for i in starts])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=4)
    args = p.parse_args()
    launched = "LOCAL_RANK" in os.environ  # under torchrun fpipe joins the process group itself
    if launched:
        torch.set_num_threads(1)

    torch.manual_seed(0)  # the same weights on every rank
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=args.seq, n_embd=64, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    fn, params = fpipe.functionalize(model)

    def loss_fn(params, input_ids):
        return fn(params, input_ids=input_ids, labels=input_ids, use_cache=False).loss

    # stages=None under torchrun: one stage per rank; in one process: 2 stages, run here
    piped = fpipe.pipeline(loss_fn, stages=None if launched else 2, microbatches=args.microbatches)
    step = fpipe.value_and_grad(piped)
    opt = torch.optim.AdamW(params.values(), lr=3e-3)  # steps only the tensors that get a .grad

    for i, input_ids in zip(range(1, args.steps + 1), batches(args.batch, args.seq, seed=0)):
        loss, grads = step(params, input_ids)  # grads: this rank's parameters; the loss: on every rank
        fpipe.clip_grad_norm_(grads, 1.0, pipeline=piped)
        fpipe.set_grads(params, grads)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if int(os.environ.get("RANK", 0)) == 0 and (i == 1 or i % 10 == 0):
            print(
                f"step {i:3d}  loss {loss.item():.3f}  ({len(grads)} of {len(params)} parameter tensors here)"
            )
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
