"""GPU check: parity and speed of fpipe's staged programs on one CUDA device.

One process (all stages on the one GPU): gradient parity against `torch.func.grad_and_value` of
the unsplit function for several schedules, then step times for (a) the unsplit function under
torch.func, (b) fpipe with one stage (overhead), (c) fpipe with 4 stages, eager and with
`compile=True` (compile time and step time). Prints one table.

    python bench/gpu_check.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import fpipe


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.ln(x) @ self.tok.weight.t()


def make(args: argparse.Namespace, dtype: torch.dtype) -> tuple:
    torch.manual_seed(0)
    model = GPT(args.vocab, args.d, args.heads, args.layers, args.seq).to("cuda", dtype)
    fn, params = fpipe.functionalize(model)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
    y = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")

    def loss_fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = fn(p, x).flatten(0, 1)
        return F.cross_entropy(logits.float() if logits.dtype == torch.bfloat16 else logits, y.flatten())

    return loss_fn, params, x, y


def timed(step, n: int) -> float:
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def parity(args: argparse.Namespace) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    small = argparse.Namespace(**{**vars(args), "d": 128, "layers": 4, "seq": 64, "batch": 8})
    loss_fn, params, x, y = make(small, torch.float64)
    ref_g, ref_l = torch.func.grad_and_value(loss_fn)(params, x, y)
    for sched, stages in [("gpipe", 4), ("1f1b", 4), ("zb-h1", 4), ("interleaved-1f1b", 4), ("zbv", 4)]:
        piped = fpipe.pipeline(loss_fn, stages=stages, microbatches=4, schedule=sched)
        loss, g = fpipe.value_and_grad(piped)(params, x, y)
        err = max(((g[k] - ref_g[k]).abs().max() / ref_g[k].abs().max().clamp_min(1e-30)).item() for k in g)
        print(
            f"parity fp64 cuda {sched:18s} stages={stages}: loss err {abs(loss - ref_l).item():.2e}, max rel grad err {err:.2e}"
        )
        assert err < 1e-9 and abs(loss - ref_l).item() < 1e-9


def speed(args: argparse.Namespace) -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    loss_fn, params, x, y = make(args, torch.bfloat16)
    rows = []
    ref = torch.func.grad_and_value(loss_fn)
    rows.append(("torch.func.grad_and_value (unsplit)", timed(lambda: ref(params, x, y), args.steps), 0.0))
    for stages, compile_ in [(1, False), (4, False), (4, True)]:
        piped = fpipe.pipeline(loss_fn, stages=stages, microbatches=args.microbatches, compile=compile_)
        vg = fpipe.value_and_grad(piped)
        t = time.perf_counter()
        vg(params, x, y)
        torch.cuda.synchronize()
        first = time.perf_counter() - t
        rows.append(
            (
                f"fpipe stages={stages} mb={args.microbatches} compile={compile_}",
                timed(lambda vg=vg: vg(params, x, y), args.steps),
                first,
            )
        )
    base = rows[0][1]
    tokens = args.batch * args.seq
    print(
        f"\nGPT d={args.d} layers={args.layers} seq={args.seq} batch={args.batch} bf16, one H200, {torch.__version__}"
    )
    print(
        f"{'configuration':48s} {'median step':>12s} {'vs unsplit':>10s} {'tokens/s':>10s} {'first call':>10s}"
    )
    for name, t, first in rows:
        print(f"{name:48s} {t * 1e3:10.2f}ms {t / base:10.3f} {tokens / t:10.0f} {first:9.1f}s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    parity(args)
    speed(args)
    assert math.isfinite(0.0)


if __name__ == "__main__":
    main()
