"""A value replicated over tp crossing a stage boundary: sent by every tp rank, or sent once and
broadcast on the next stage (issue 12). 4 ranks, gloo: a ("pp", "tp") mesh of 2 x 2.

    torchrun --standalone --nproc-per-node 4 bench/tp_replicated_send.py

"every": each tp rank of stage 0 sends its copy to the same tp rank of stage 1 (what fpipe does:
the tp ranks' transfers run side by side). "once": tp rank 0 of stage 0 sends, and tp rank 0 of
stage 1 broadcasts it to its tp peers. For each size, `--rounds` rounds time one transfer of each
way (order alternating), between `dist.barrier()`s, max over ranks; medians are printed.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def every(x: torch.Tensor, mesh: object, pp: int) -> None:
    peer = dist.get_global_rank(mesh.get_group("pp"), 1 - pp)  # type: ignore[attr-defined]
    op = dist.P2POp(dist.isend if pp == 0 else dist.irecv, x, peer, group=mesh.get_group("pp"))  # type: ignore[attr-defined]
    for w in dist.batch_isend_irecv([op]):
        w.wait()


def once(x: torch.Tensor, mesh: object, pp: int, tp: int) -> None:
    if tp == 0:
        every(x, mesh, pp)
    if pp == 1:
        src = dist.get_global_rank(mesh.get_group("tp"), 0)  # type: ignore[attr-defined]
        dist.broadcast(x, src, group=mesh.get_group("tp"))  # type: ignore[attr-defined]


def timed(fn: object) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--kib", default="256,4096,16384")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, tp = mesh.get_local_rank("pp"), mesh.get_local_rank("tp")
    rows = []
    for kib in map(int, a.kib.split(",")):
        x = torch.zeros(kib * 256)  # fp32
        ways = {
            "every": functools.partial(every, x, mesh, pp),
            "once": functools.partial(once, x, mesh, pp, tp),
        }
        times: dict[str, list[float]] = {k: [] for k in ways}
        for r in range(a.rounds + 2):
            for k in sorted(ways, reverse=bool(r % 2)):
                t = timed(ways[k])
                if r >= 2:  # two warm-up rounds
                    times[k].append(t)
        rows.append((kib, statistics.median(times["every"]), statistics.median(times["once"])))
    if dist.get_rank() == 0:
        print(f"{'size':>10} {'every tp rank (ms)':>20} {'once + broadcast (ms)':>22} {'once / every':>13}")
        for kib, e, o in rows:
            print(f"{kib:>7} KiB {e * 1e3:>20.2f} {o * 1e3:>22.2f} {o / e:>13.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
