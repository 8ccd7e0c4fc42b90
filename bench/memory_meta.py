"""Stage-sharded parameters: peak memory per rank of a ~1 GB model built on the meta device.

    torchrun --standalone --nproc-per-node 4 bench/memory_meta.py [--microbatches 4] [--json OUT]

The model (16 x Linear(4096, 4096) + bias, tanh between: 268M fp32 parameters, 1.07 GB) is built
under `torch.device("meta")`, traced on fake tensors, and each rank materialises only the layers
of its stage (`Pipelined.materialize`), then runs one `value_and_grad` step on a tiny batch.
Peak RSS (`ru_maxrss`) is read after importing torch (the baseline), after materialising, and
after the step; rank 0 prints one row per rank. A rank holding the whole model would grow by
1.07 GB for the parameters alone, and as much again for their gradients.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fpipe

MB = 2**20
LAYERS, WIDTH = 16, 4096


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--json", default=None, help="write rank 0's table as JSON here")
    args = ap.parse_args()
    m = args.microbatches
    base = peak_mb()
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = Deep()
    fn, params = fpipe.functionalize(model)
    model_mb = sum(p.numel() * p.element_size() for p in params.values()) / MB
    x, y = torch.randn(m, WIDTH), torch.randn(m, WIDTH)  # one row per microbatch

    def loss(params, x, y):
        return F.mse_loss(fn(params, x), y)

    piped = fpipe.pipeline(loss, microbatches=m)
    params = piped.materialize(model, x, y)
    local = {k: v for k, v in params.items() if not v.is_meta}
    after_materialize = peak_mb()
    _, grads = fpipe.value_and_grad(piped)(params, x, y)
    after_step = peak_mb()
    row = {
        "rank": dist.get_rank(),
        "local_layers": sorted({int(k.split(".")[1]) for k in local}),
        "local_params_mb": sum(v.numel() * v.element_size() for v in local.values()) / MB,
        "grads_mb": sum(g.numel() * g.element_size() for g in grads.values()) / MB,
        "baseline_mb": base,
        "materialize_growth_mb": after_materialize - base,
        "step_growth_mb": after_step - base,
        "seconds": time.perf_counter() - t0,
    }
    rows: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        print(f"model: {LAYERS} x Linear({WIDTH}, {WIDTH}) fp32 = {model_mb:.0f} MiB; microbatches={m}")
        print(
            "| rank | layers | local params MiB | grads MiB | peak RSS growth after materialize | after one step | baseline RSS |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            layers = f"{r['local_layers'][0]}-{r['local_layers'][-1]}"
            print(
                f"| {r['rank']} | {layers} | {r['local_params_mb']:.0f} | {r['grads_mb']:.0f} | "
                f"{r['materialize_growth_mb']:.0f} MiB | {r['step_growth_mb']:.0f} MiB | {r['baseline_mb']:.0f} MiB |"
            )
        share = model_mb / len(rows)
        worst = max(r["materialize_growth_mb"] for r in rows), max(r["step_growth_mb"] for r in rows)
        print(
            f"a quarter of the model: {share:.0f} MiB. Worst growth: materialize {worst[0]:.0f} MiB "
            f"({worst[0] / share:.2f} x the share), after the step {worst[1]:.0f} MiB ({worst[1] / share:.2f} x: "
            f"parameters + gradients of the stage would be 2.00 x + overhead)"
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model_mb": model_mb, "microbatches": m, "rows": rows}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
