"""Multi-rank examples: one torchrun launch runs a whole batch of them (`launch`), each rank
running `steps` of every example on a fresh pipeline over a gloo mesh ("dp", "pp"), or over the
whole world without a mesh when dp = 1 (the plain-torchrun path). `tests/support/fuzz_worker.py` is the
script torchrun starts; it calls `worker_main`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from .check import Outcome, error_outcome, problems_outcome, steps, with_warnings
from .grammar import Example, parse

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # dist_launch, fuzz_worker
if str(SUPPORT) not in sys.path:  # `python -m tests.fuzz` from the repository root
    sys.path.insert(0, str(SUPPORT))


def launch(examples: list[Example], out: Path, world: int, deadline_s: float = 600.0) -> list[Outcome]:
    """Run `examples` (each with dp x pp = world) in one torchrun launch of `world` ranks; an
    example fails if it fails on any rank (its signature and detail name the ranks)."""
    from dist_launch import report, run_torchrun, torchrun_cmd

    out.mkdir(parents=True, exist_ok=True)
    listing = out / "examples.txt"
    listing.write_text("".join(ex.describe() + "\n" for ex in examples))
    cmd = torchrun_cmd("fuzz_worker.py", world, "--examples", str(listing), "--out", str(out))
    procs = run_torchrun([cmd], out, deadline_s)
    per_rank = [_read(out / f"rank{r}.json") for r in range(world)]
    outcomes = []
    for i, _ in enumerate(examples):
        got = [recs[i] if i < len(recs) else None for recs in per_rank]
        if any(g is None for g in got):
            missing = [r for r, g in enumerate(got) if g is None]
            outcomes.append(
                Outcome("fail", "launch: a rank recorded no outcome", f"ranks {missing}\n{report(procs)}")
            )
        else:
            outcomes.append(_merge(got))
    return outcomes


def _read(path: Path) -> list[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


def _merge(per_rank: list[dict[str, Any]]) -> Outcome:
    failed = [(r, o) for r, o in enumerate(per_rank) if o["status"] == "fail"]
    if not failed and all(o["held"] for o in per_rank):  # each buffer updated right on some rank
        held = [json.loads(o["held"]) for o in per_rank]
        lost = sorted(n for n in held[0] if not any(h[n] for h in held))
        if lost:
            detail = f"buffers equal to the reference on no rank (each rank left them as they were): {lost}"
            return Outcome("fail", "buffers:updated on no rank", detail)
    warned = tuple(sorted({w for o in per_rank for w in o["warnings"]}))
    if not failed:
        status = "refused" if any(o["status"] == "refused" for o in per_rank) else "ok"
        sig = next((o["signature"] for o in per_rank if o["signature"]), "")
        return Outcome(status, sig, warnings=warned)
    sig = " ".join(sorted({f"rank{r}:{part}" for r, o in failed for part in o["signature"].split(" ", 1)[:1]}
                          | {part for _, o in failed for part in o["signature"].split()}))  # fmt: skip
    detail = "\n".join(f"rank {r}: {o['detail']}" for r, o in failed)
    return Outcome("fail", sig, detail, warned)


# -- on each rank ---------------------------------------------------------------------------------
def worker_main(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    p = argparse.ArgumentParser()
    p.add_argument("--examples", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=150))
    rank = dist.get_rank()
    out = Path(args.out)
    examples = [parse(line) for line in Path(args.examples).read_text().splitlines() if line.strip()]
    records: list[dict[str, Any]] = []
    for i, ex in enumerate(examples):
        records.append(dataclasses.asdict(_run_on_rank(ex, out / "ckpt" / str(i))))
        (out / f"rank{rank}.json").write_text(json.dumps(records))
        dist.barrier()  # every rank done with this example before the next starts
    dist.destroy_process_group()


def _run_on_rank(ex: Example, ckpt: Path) -> Outcome:
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            mesh = None
            where = (0, dist.get_rank())
            if ex.dp > 1:
                mesh = init_device_mesh("cpu", (ex.dp, ex.pp), mesh_dim_names=("dp", "pp"))
                where = (mesh.get_local_rank("dp"), mesh.get_local_rank("pp"))
            outcome = problems_outcome(steps(ex, ckpt, mesh, where, ex.dp))
        except Exception as err:  # noqa: BLE001 -- every error is an outcome to report
            outcome = error_outcome(err)
            outcome = dataclasses.replace(
                outcome, detail=outcome.detail + "\n" + traceback.format_exc()[-1500:]
            )
    return with_warnings(outcome, [w.message for w in caught])
