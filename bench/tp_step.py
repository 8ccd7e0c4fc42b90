"""Tensor parallelism inside stages (issue 12): per-shard traced programs against eager DTensor,
and tp=2 against tp=1. 2 ranks, gloo, one torch thread each.

    torchrun --standalone --nproc-per-node 2 bench/tp_step.py
    torchrun --standalone --nproc-per-node 2 bench/tp_step.py --d-model 512 --layers 4 --steps 12

Model: the GPT of `examples/train_gpt.py` (byte vocabulary, tied head, `--layers` blocks of
`--d-model` with `--heads` heads, sequence `--seq`), fp32, on random tokens; `--batch` sequences
per step in `--microbatches` microbatches. The tensor-parallel modes parallelize its blocks with
the example's `parallelize` (Megatron's layout: attention heads and MLP columns split over the
"tp" ranks, embeddings and norms replicated).

Modes (each times one forward + backward over the whole batch, no optimizer):
1. `fpipe tp=2`: `fpipe.pipeline` on a ("pp", "tp") = (1, 2) mesh: one stage, its programs traced
   over this rank's shards with the collectives in them (no DTensor dispatch while they run).
2. `eager DTensor tp=2`: the same parallelized model run eagerly, microbatch by microbatch, with
   `loss.backward()`: DTensor dispatch on every op (what a user runs without fpipe).
3. `fpipe pp=2`: the unparallelized model as a 2-stage pipeline (1F1B) over the same two ranks.
4. `eager 1 process`: the unparallelized model in rank 0 alone, one thread, microbatch by
   microbatch (rank 1 waits): the tp=1 x pp=1 baseline.

Also printed: the number of tp collectives in one fpipe tp=2 step and the time rank 0 spends
waiting in them.

Timing: every mode is built and warmed up (`--warmup` steps); then `--steps` rounds each run one
step of every mode, the order rotating by round. A step's time is the max over ranks, between
`dist.barrier()` and `time.perf_counter()`. Reported: medians, and medians of per-round ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from train_gpt import GPT, parallelize  # noqa: E402

import fpipe  # noqa: E402


def args_() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    return p.parse_args()


def model(a: argparse.Namespace, tp_mesh: object | None) -> GPT:
    torch.manual_seed(0)
    m = GPT(256, a.seq, a.d_model, a.layers, a.heads)
    if tp_mesh is not None:
        parallelize(m, tp_mesh)
    return m


def loss_of(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fn(params, x).flatten(0, 1), y.flatten())

    return loss


def eager_step(m: GPT, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    m.zero_grad(set_to_none=True)
    for xs, ys in zip(x.chunk(k), y.chunk(k)):
        (F.cross_entropy(m(xs).flatten(0, 1), ys.flatten()) / k).backward()


def timed(fn: Callable[[], object], alone: bool = False) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    if not alone or dist.get_rank() == 0:
        fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.barrier()
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def collectives_of(step: Callable[[], object]) -> tuple[int, float]:
    """One step with fpipe's tp collectives counted and their waits timed (this rank)."""
    from fpipe._src.parallel import tp_collectives

    wait, spent = tp_collectives._wait, [0, 0.0]

    def timed_wait(work: object, what: str) -> None:
        t0 = time.perf_counter()
        wait(work, what)
        spent[0] += 1
        spent[1] += time.perf_counter() - t0

    tp_collectives._wait = timed_wait
    try:
        timed(step)
    finally:
        tp_collectives._wait = wait
    return int(spent[0]), float(spent[1])


def main() -> None:
    a = args_()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    assert dist.get_world_size() == 2, "run with torchrun --nproc-per-node 2"
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (a.batch, a.seq), generator=g) for _ in range(2))
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "tp"))
    m_tp, m_plain = model(a, mesh["tp"]), model(a, None)
    fn_tp, p_tp = fpipe.functionalize(m_tp)
    fn_pp, p_pp = fpipe.functionalize(m_plain)
    vg_tp = fpipe.value_and_grad(fpipe.pipeline(loss_of(fn_tp), mesh=mesh, microbatches=a.microbatches))
    vg_pp = fpipe.value_and_grad(fpipe.pipeline(loss_of(fn_pp), stages=2, microbatches=a.microbatches))
    modes: dict[str, tuple[Callable[[], object], bool]] = {
        "fpipe tp=2": (lambda: vg_tp(p_tp, x, y), False),
        "eager DTensor tp=2": (lambda: eager_step(m_tp, x, y, a.microbatches), False),
        "fpipe pp=2": (lambda: vg_pp(p_pp, x, y), False),
        "eager 1 process": (lambda: eager_step(m_plain, x, y, a.microbatches), True),
    }
    for fn, alone in modes.values():
        for _ in range(a.warmup):
            timed(fn, alone)
    times: dict[str, list[float]] = {k: [] for k in modes}
    names = list(modes)
    for r in range(a.steps):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            times[k].append(timed(*modes[k]))
    n_coll, coll_s = collectives_of(lambda: vg_tp(p_tp, x, y))
    if dist.get_rank() != 0:
        dist.destroy_process_group()
        return
    print(
        f"GPT d_model {a.d_model}, {a.layers} layers, {a.heads} heads, seq {a.seq}, batch {a.batch}, "
        f"{a.microbatches} microbatches, fp32, 2 gloo ranks x 1 thread; {a.steps} rounds"
    )
    print(f"{'mode':<22}{'median step (s)':>16}")
    for k, ts in times.items():
        print(f"{k:<22}{statistics.median(ts):>16.4f}")

    def ratio(num: str, den: str) -> float:
        return statistics.median(n / d for n, d in zip(times[num], times[den]))

    print(f"fpipe tp=2: {n_coll} tp collectives per step, {coll_s:.4f} s waiting in them (rank 0)")
    print(f"eager DTensor / fpipe, tp=2 (per-round ratio): {ratio('eager DTensor tp=2', 'fpipe tp=2'):.2f}x")
    print(f"fpipe tp=2 / eager 1 process: {ratio('fpipe tp=2', 'eager 1 process'):.2f}")
    print(f"fpipe tp=2 / fpipe pp=2: {ratio('fpipe tp=2', 'fpipe pp=2'):.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
