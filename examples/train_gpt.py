"""Train a small character-level GPT with pipeline parallelism, in plain torch plus fpipe.

The corpus is the Python standard library's own source code: the first `--corpus-mib` MiB of the
top-level `*.py` files under `sysconfig.get_paths()["stdlib"]`, concatenated in sorted order and
read as raw bytes (vocabulary 256). Every machine with Python has it, so nothing is downloaded,
and it is the same on every rank and every run of one Python version.

The same script runs in one process (all stages local) and under torchrun (one stage per rank):

    python examples/train_gpt.py                                     # 2 stages in this process
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py   # 4 ranks, 1 stage each
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --dp 2  # 2 replicas x 2 stages
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --tp 2  # 2 stages x 2-way TP

With `--dp N` the ranks form a ("dp", "pp") DeviceMesh of N replicas of a WORLD_SIZE / N-stage
pipeline: every rank draws the same global batch of `--batch` sequences and passes its replica's
slice, and fpipe returns the global loss and its gradients (summed over the replicas), so the loss
curve is the one of the pipeline alone on the same batches. With `--tp N` each stage is split over
N ranks the ecosystem's way: the blocks are `parallelize_module`d on the mesh's "tp" dimension
(attention heads and MLP columns: Megatron's layout), and fpipe traces each stage into a program
over this rank's shards with the collectives in it.

The model knows nothing about pipelines; the training loop is ordinary: fpipe only turns the loss
function into a pipelined one whose `value_and_grad` returns this rank's gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import fpipe


# -- the model: nanoGPT-style, nothing pipeline-specific in it -------------------------------------
class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:  # GPT-2's init; `materialize` calls reset_parameters()
        nn.init.normal_(self.weight, std=0.02)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.attn, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # attn's outputs are laid out head by head (q, k, v of head 0, then head 1, ...), so a
        # column split over tensor-parallel ranks gives each rank whole heads: -1 is its share
        qkv = self.attn(self.ln1(x)).view(b, t, -1, 3, d // self.heads)
        q, k, v = qkv.permute(3, 0, 2, 1, 4)  # each (b, heads, t, d_head)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, -1)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))

    def drop(self, x: torch.Tensor) -> torch.Tensor:  # (fpipe seeds the masks: NOTE [random-number policy])
        return F.dropout(x, self.dropout, self.training) if self.dropout else x


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, layers: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.tok, self.pos = Embedding(vocab, d), Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln(x), self.tok.weight)  # LM head tied to the token embedding


def parallelize(model: GPT, tp_mesh: Any) -> None:
    """Megatron's tensor parallelism in every block: attention heads and the MLP's hidden columns
    split over `tp_mesh` (column-parallel in, row-parallel out); embeddings and norms replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "attn": ColwiseParallel(),
        "proj": RowwiseParallel(),
        "fc": ColwiseParallel(),
        "out": RowwiseParallel(),
    }
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)


# -- data ------------------------------------------------------------------------------------------
def corpus(mib: float) -> torch.Tensor:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text = b"".join(f.read_bytes() for f in files)[: int(mib * 2**20)]
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def get_batch(data: torch.Tensor, args: argparse.Namespace, gen: torch.Generator, device: torch.device):
    starts = torch.randint(len(data) - args.seq - 1, (args.batch, 1), generator=gen)
    chunk = data[starts + torch.arange(args.seq + 1)].to(device)  # (batch, seq + 1)
    return chunk[:, :-1], chunk[:, 1:]  # inputs and next-byte targets


# -- progress --------------------------------------------------------------------------------------
class _Lines:
    """A file for tqdm that gives each refresh a line of its own. tqdm redraws its bar in place with
    carriage returns: right on a terminal, but a log file would get every refresh in one line."""

    def __init__(self, file: TextIO) -> None:
        self.file, self.last = file, ""

    def write(self, text: str) -> None:
        text = text.strip("\r\n").rstrip()  # tqdm's redraw pads with spaces; its close writes "\n"
        done = text.split(" [")[0]  # "100%|##########| 30/30": close repeats the last step's line
        if text and done != self.last:
            self.file.write(text + "\n")
            self.last = done

    def flush(self) -> None:
        self.file.flush()


def progress_bar(steps: int, show: bool) -> tqdm:
    """tqdm on stderr: a bar redrawn in place on a terminal; in a log, a plain line every 10% of the
    steps (and the first and last)."""
    if sys.stderr.isatty():
        return tqdm(total=steps, unit="step", disable=not show, dynamic_ncols=True)
    # maxinterval=inf: after a pause longer than maxinterval (the first step traces), tqdm's monitor
    # thread would set miniters to 1 and print every step from then on.
    every, log = max(1, steps // 10), _Lines(sys.stderr)
    return tqdm(total=steps, unit="step", disable=not show, file=log, ascii=True, mininterval=0,
                miniters=every, maxinterval=float("inf"))  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=32, help="sequences per step (all microbatches)")
    p.add_argument("--seq", type=int, default=64, help="sequence length in bytes")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b", choices=fpipe.schedules.names())
    p.add_argument("--stages", type=int, help="default: 2 in one process, 1 per rank under torchrun")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-mib", type=float, default=2.0)
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas: WORLD_SIZE = dp x pp x tp")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage (they split the heads)")
    p.add_argument("--loss-log", metavar="PATH", help="rank 0 writes the per-step losses here as JSON")
    p.add_argument("--save", metavar="DIR", help="checkpoint directory (fpipe.save), written at the end")
    p.add_argument("--save-every", type=int, default=0, metavar="N", help="also save every N steps")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --save DIR")
    args = p.parse_args()
    # Checked here, before any process group or collective: a bad layout fails alike on every rank.
    if args.dp < 1:
        p.error(f"--dp {args.dp}: needs at least 1 replica")
    if args.dp > 1:
        world = os.environ.get("WORLD_SIZE")
        if "LOCAL_RANK" not in os.environ or world is None:
            p.error(f"--dp {args.dp} needs torchrun with WORLD_SIZE = dp x pp processes")
        if int(world) % args.dp:
            p.error(f"--dp {args.dp}: WORLD_SIZE {world} is not divisible by it (WORLD_SIZE = dp x pp)")
        if args.batch % (args.dp * args.microbatches):
            p.error(
                f"--batch {args.batch} is not divisible by --dp {args.dp} x --microbatches "
                f"{args.microbatches}: each replica takes batch / dp sequences, in microbatches"
            )
    if args.tp < 1 or args.heads % args.tp:
        p.error(
            f"--tp {args.tp}: must be at least 1 and divide --heads {args.heads} (each rank takes whole heads)"
        )
    if args.tp > 1:
        world = os.environ.get("WORLD_SIZE")
        if "LOCAL_RANK" not in os.environ or world is None or int(world) % (args.dp * args.tp):
            p.error(f"--tp {args.tp} needs torchrun with WORLD_SIZE = dp x pp x tp processes (got {world})")
    return args


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    launched = "LOCAL_RANK" in os.environ  # under torchrun: fpipe joins the process group itself
    rank = int(os.environ.get("RANK", 0))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # 1 by default: ranks share the cores, a microbatch's ops are too small to gain from
        torch.set_num_threads(args.threads)  # more, and intra-op threads crawl on busy cores

    mesh, dp_rank = None, 0
    if args.dp > 1 or args.tp > 1:  # replicas x stages x tp; else all ranks form one pipeline
        from torch.distributed.device_mesh import init_device_mesh

        pp = int(os.environ["WORLD_SIZE"]) // (args.dp * args.tp)
        mesh = init_device_mesh(device.type, (args.dp, pp, args.tp), mesh_dim_names=("dp", "pp", "tp"))
        dp_rank = mesh.get_local_rank("dp")

    def local(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return batch[0].chunk(args.dp)[dp_rank], batch[1].chunk(args.dp)[dp_rank]  # this replica's

    data = corpus(args.corpus_mib)
    gen = torch.Generator().manual_seed(args.seed)  # every rank draws the same (global) batches
    x, y = local(get_batch(data, args, gen, device))

    with torch.device("meta"):  # no memory: each rank allocates only its own stage below
        model = GPT(256, args.seq, args.d_model, args.layers, args.heads)
    if args.tp > 1:
        parallelize(model, mesh["tp"])  # type: ignore[index]
    fn, params = fpipe.functionalize(model)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = fn(params, x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    stages = args.stages if args.stages or launched else 2
    cuts = None
    if args.tp > 1:  # tensor-parallel stages begin at blocks: say which (no automatic cut yet)
        n = stages or int(os.environ["WORLD_SIZE"]) // (args.dp * args.tp)
        cuts = [f"blocks.{args.layers * k // n}" for k in range(1, n)]
    piped = fpipe.pipeline(
        loss_fn, stages=stages, microbatches=args.microbatches, schedule=args.schedule, mesh=mesh, cuts=cuts
    )  # with a mesh: the global loss (the mean over replicas) and its gradients, summed over dp
    # Each rank initialises only the modules of its stages (reset_parameters, in module order)
    # from the same seed: deterministic, but not the values a single-process `GPT(...)` would
    # draw from this seed, and different for another number of stages.
    torch.manual_seed(args.seed)
    params = piped.materialize(model, x, y, device=device)
    mine = {k: v for k, v in params.items() if not v.is_meta}
    n_mine = sum(v.to_local().numel() if isinstance(v, DTensor) else v.numel() for v in mine.values())
    n_all = sum(v.numel() for v in params.values())
    print(f"rank {rank}: {n_mine:,} of {n_all:,} parameters live here", file=sys.stderr, flush=True)
    opt = torch.optim.AdamW(mine.values(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    step = fpipe.value_and_grad(piped)
    done = 0
    if args.resume:  # any number of ranks or stages: each reads the parameters its stages use
        extra = fpipe.load(args.save, params, optimizer=opt, pipeline=piped)
        done = extra["step"]
        gen.set_state(extra["batches"])  # the batch stream where the saved run left it
        x, y = local(get_batch(data, args, gen, device))

    losses, tokens_per_step, t0 = [], args.batch * args.seq, time.perf_counter()
    bar = progress_bar(
        args.steps - done, show=rank == 0
    )  # the loss is returned on every rank: rank 0 shows it
    for i in range(done + 1, args.steps + 1):
        loss, grads = step(params, x, y)
        fpipe.clip_grad_norm_(grads, 1.0, pipeline=piped)
        fpipe.set_grads(params, grads)
        opt.step()  # set_grads replaces .grad each step: no zero_grad needed
        batches = gen.get_state()
        x, y = local(get_batch(data, args, gen, device))
        if args.save and ((args.save_every and i % args.save_every == 0) or i == args.steps):
            fpipe.save(
                args.save, params, optimizer=opt, extra={"step": i, "batches": batches}, pipeline=piped
            )
        losses.append(loss.item())
        if i == done + 1:  # the first step traces and splits the program: time the others apart
            first, t0 = time.perf_counter() - t0, time.perf_counter()
        tok_s = (i - done - 1) * tokens_per_step / (time.perf_counter() - t0)
        bar.set_postfix_str(f"loss {losses[-1]:.3f}, {tok_s:,.0f} tok/s", refresh=False)
        bar.update()
    bar.close()

    if rank == 0:
        tok_s = (args.steps - done - 1) * tokens_per_step / (time.perf_counter() - t0)
        print(
            f"done: {args.steps - done} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, {tok_s:,.0f} tok/s, "
            f"first step {first:.1f} s (traces), wall {time.perf_counter() - start:.1f} s",
            flush=True,
        )
    if rank == 0 and args.loss_log:
        with open(args.loss_log, "w") as f:
            json.dump({"losses": losses}, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
