"""Where fpipe's time goes on one GPU: step times and top kernels, fpipe vs torch.func.

python bench/gpu_profile.py
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "bench")
import gpu_check as G  # noqa: E402

import fpipe  # noqa: E402


def main() -> None:
    args = argparse.Namespace(vocab=8192, d=1024, heads=16, layers=8, seq=512, batch=32)
    loss_fn, params, x, y = G.make(args, torch.bfloat16)
    ref = torch.func.grad_and_value(loss_fn)

    def chunked() -> None:  # the same microbatching in eager torch.func
        for xs, ys in zip(x.chunk(4), y.chunk(4)):
            ref(params, xs, ys)

    runs = {"torch.func unsplit": lambda: ref(params, x, y), "torch.func 4 chunks": chunked}
    for mb in (1, 4):
        piped = fpipe.pipeline(loss_fn, stages=1, microbatches=mb)
        vg = fpipe.value_and_grad(piped)
        runs[f"fpipe stages=1 mb={mb}"] = lambda vg=vg: vg(params, x, y)
        if mb == 1:
            vg(params, x, y)
            c = next(iter(piped._cache.values()))
            ops = Counter(
                str(n.target)
                for p in c.staged.programs.values()
                for n in p.gm.graph.nodes
                if n.op == "call_function"
            )
            print(
                "attention/softmax/mm ops in the staged program:",
                {
                    k: v
                    for k, v in ops.items()
                    if any(
                        s in k for s in ("attention", "softmax", "bmm", "mm", "seeded", "_to_copy", "clone")
                    )
                },
            )
    for name, fn in runs.items():
        print(f"{name:28s} median {G.timed(fn, 10) * 1e3:8.2f} ms")
    for name in ("torch.func unsplit", "fpipe stages=1 mb=1"):
        fn = runs[name]
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        print(f"\n== {name} (3 steps)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
