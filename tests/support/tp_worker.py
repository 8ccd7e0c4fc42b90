"""Tensor x pipeline (x data) parallel worker for `tests/parallel/test_tp.py`: under torchrun, 4 ranks form a
("pp", "tp") mesh of 2 x 2 and 8 ranks a ("dp", "pp", "tp") mesh of 2 x 2 x 2. A small GPT is
parallelized with `parallelize_module` on mesh["tp"] (heads and MLP columns split: Megatron's
layout; "sp" cases add SequenceParallel norms, so the residual stream crosses stages as DTensors
sharded on the sequence). Every case compares the loss and this rank's DTensor gradients (made
whole) with `torch.func.grad_and_value` of the unsplit, unparallelized model over the global batch
(fp64). Writes `rank{R}.json` into `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dp_worker import MatmulFlops
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import pipe_split
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import fpipe

VOCAB, D, HEADS, SEQ, LAYERS, BATCH, M = 16, 8, 4, 4, 2, 8, 2
TWO = ["blocks.1"]  # where stages begin: two stages, or four (zbv: two per rank)
FOUR = ["blocks.0.mlp", "blocks.1", "blocks.1.mlp"]
CASES = {  # name: (plan, schedule, cuts, the loss's reduction)
    "tp-1f1b": ("tp", "1f1b", TWO, "mean"),
    "tp-zbv": ("tp", "zbv", FOUR, "mean"),
    "tp-sum": ("tp", "1f1b", TWO, "sum"),
    "sp-1f1b": ("sp", "1f1b", TWO, "mean"),
    "sp-zb-h1": ("sp", "zb-h1", TWO, "mean"),
}
ON_8_RANKS = ("tp-1f1b",)  # the 8-rank launch runs this one, with AdamW (the suite's time)
ADAMW = ("tp-1f1b", "sp-1f1b")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # the heads are split over tp: -1 is this rank's share of them
        q, k, v = (m(x).view(b, t, -1, D // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(D), Attention(), nn.LayerNorm(D), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def parallelize(model: GPT, tp_mesh: Any, plan: str) -> GPT:
    """Megatron's layout on `tp_mesh`; "sp" also shards the norms and the residual stream on the
    sequence dimension (a DTensor stream: `use_local_output=False`)."""
    sp = plan == "sp"
    seq = Shard(1)
    block_plan: dict[str, Any] = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(output_layouts=seq, use_local_output=False) if sp else RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=seq, use_local_output=False) if sp else RowwiseParallel(),
    }
    if sp:
        gather = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        block_plan.update(
            {"ln1": SequenceParallel(), "ln2": SequenceParallel(), "attn": gather, "mlp": gather}
        )
    for b in model.blocks:
        parallelize_module(b, tp_mesh, block_plan)
    top: dict[str, Any] = {"head": ColwiseParallel(output_layouts=Replicate())}
    if sp:
        top = {
            "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=False),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
        }
    return parallelize_module(model, tp_mesh, top)


def built(plan: str, mesh: Any, device: str = "cpu") -> GPT:
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT().double()
    return parallelize(model, mesh["tp"], plan)


def reference() -> GPT:
    torch.manual_seed(0)
    return GPT().double()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(
        0, VOCAB, (BATCH, SEQ), generator=g
    )


def my_slice(mesh: Any, t: torch.Tensor) -> torch.Tensor:
    names = mesh.mesh_dim_names
    return t.chunk(mesh.size(names.index("dp")))[mesh.get_local_rank("dp")] if "dp" in names else t


def loss_of(fn: Any, reduction: str = "mean") -> Any:
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fn(params, x).flatten(0, 1), y.flatten(), reduction=reduction)

    return loss


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_case(name: str, mesh: Any) -> dict[str, Any]:
    """One case's record; "tp-1f1b" also measures `matmul_share` on its compiled pipeline, and the
    ADAMW cases take their two AdamW steps through it (the same pipeline they would build)."""
    plan, schedule, cuts, reduction = CASES[name]
    model = built(plan, mesh)
    fn, params = fpipe.functionalize(model)
    rfn, rparams = fpipe.functionalize(reference())
    x, y = data()
    ref_g, ref_v = torch.func.grad_and_value(loss_of(rfn, reduction))(rparams, x, y)
    piped = fpipe.pipeline(loss_of(fn, reduction), mesh=mesh, microbatches=M, schedule=schedule, cuts=cuts)
    vg = fpipe.value_and_grad(piped)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        v, g = vg(params, my_slice(mesh, x), my_slice(mesh, y))
    forward = piped(params, my_slice(mesh, x), my_slice(mesh, y))  # a plain call: the loss alone
    rec: dict[str, Any] = {
        "warned_reduction": any("cannot read how output" in str(w.message) for w in caught),
        "forward_err": abs(float(forward) - float(ref_v)),
        "loss_err": abs(float(v) - float(ref_v)),
        "keys": sorted(g),
        "grad_err": {k: float((whole(t) - ref_g[k]).abs().max()) for k, t in g.items()},
        "placements_equal": all(
            isinstance(t, DTensor) == isinstance(params[k], DTensor)
            and (not isinstance(t, DTensor) or t.placements == params[k].placements)
            for k, t in g.items()
        ),
        "dtensor_grads": sum(isinstance(t, DTensor) for t in g.values()),
        "stages": piped.local_stages,
        "crossing": crossing(piped),
        # the global gradient norm over pp and tp (shards summed, replicated ones counted once)
        "norm_err": abs(
            float(fpipe.clip_grad_norm_(g, 1e9, pipeline=piped))
            - float(torch.stack([t.norm() for t in ref_g.values()]).norm())
        ),
    }
    if name == "tp-1f1b":
        rec["matmul_share"] = record("matmul_share", matmul_share, mesh, vg, params)
    if name in ADAMW and (name in ON_8_RANKS or "dp" not in mesh.mesh_dim_names):
        rec["adamw_err"] = adamw_steps(model, params, piped, mesh)
    return rec


def crossing(piped: Any) -> list[list[int]]:
    """The shapes of the values stage 0's forward sends to stage 1's (this rank's shards)."""
    st = piped._last.staged
    return sorted(
        list(st.meta[v][0])
        for v, p in st.producer.items()
        if p == ("F", 0) and ("F", 1) in st.consumers.get(v, [])
    )


def adamw_steps(model: GPT, params: dict[str, torch.Tensor], piped: Any, mesh: Any) -> float:
    """Two AdamW steps through the pipeline (DTensor parameters, DTensor gradients) against two
    of the unsplit model in one process: the largest difference of a parameter this rank holds.
    `piped` is the case's pipeline of `model` (`params` its parameters), the same as
    `pipeline(loss_of(fn), mesh=mesh, microbatches=M, cuts=TWO)` of a fresh one, already compiled."""
    x, y = data()
    ref = reference()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for _ in range(2):
        ref_opt.zero_grad()
        F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
        ref_opt.step()
    opt = None
    grads: dict[str, torch.Tensor] = {}
    held = dict(model.named_parameters())
    for _ in range(2):
        _, grads = fpipe.value_and_grad(piped)(params, my_slice(mesh, x), my_slice(mesh, y))
        mine = {k: held[k] for k in grads}
        if opt is None:
            opt = torch.optim.AdamW(list(mine.values()), lr=1e-2, foreach=False)
        fpipe.set_grads(mine, grads)
        opt.step()
    want = dict(ref.named_parameters())
    return max(float((whole(held[k].detach()) - want[k].detach()).abs().max()) for k in grads)


def matmul_share(mesh: Any, vg: Any, params: dict[str, torch.Tensor]) -> float:
    """This rank's matrix-multiply FLOPs in a step over those of the unsplit step over its dp
    slice (one process, autograd): about 1 / (pp x tp). `vg`: value_and_grad of the "tp-1f1b"
    case's pipeline (`pipeline(loss_of(fn), mesh=mesh, microbatches=M, cuts=TWO)` of the "tp"
    GPT), already compiled and run once; `params` its parameters."""
    x, y = (my_slice(mesh, t) for t in data())
    with MatmulFlops() as mine:
        vg(params, x, y)
    ref = reference()
    with MatmulFlops() as whole_step:
        F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
    return mine.flops / whole_step.flops


def tp_rank_data_mismatch(mesh: Any) -> str:
    """tp ranks passing batches of different shapes: a ValueError on every rank, before any step."""
    fn, params = fpipe.functionalize(built("tp", mesh))
    x, y = (my_slice(mesh, t) for t in data())
    n = x.shape[0] if mesh.get_local_rank("tp") == 0 else x.shape[0] // 2
    piped = fpipe.pipeline(loss_of(fn), mesh=mesh, microbatches=M, cuts=TWO)
    try:
        fpipe.value_and_grad(piped)(params, x[:n], y[:n])
    except ValueError as err:
        return str(err)
    return "no error"


def auto_partition(mesh: Any) -> str:
    """`stages=2` with no boundaries or cuts: refused, asking for cuts (fpipe cannot yet choose
    a tensor-parallel function's cuts)."""
    fn, params = fpipe.functionalize(built("tp", mesh))
    piped = fpipe.pipeline(loss_of(fn), mesh=mesh, microbatches=M, stages=2)
    try:
        fpipe.value_and_grad(piped)(params, *data())
    except ValueError as err:
        return str(err)
    return "no error"


def pipe_split_refused(mesh: Any) -> str:
    """torch.distributed.pipelining's `pipe_split()` in a tensor-parallel function: refused (NOTE
    [pipe_split] in fpipe/_src/tracing/cut_at.py), asking for stage_boundary or cuts."""
    fn, params = fpipe.functionalize(built("tp", mesh))

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = fn(p, x)
        pipe_split()
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    try:
        fpipe.value_and_grad(fpipe.pipeline(loss, mesh=mesh, microbatches=M))(params, *data())
    except ValueError as err:
        return str(err)
    return "no error"


def refused(mesh: Any, params: dict[str, torch.Tensor], x: torch.Tensor) -> str:
    """The error a step of `(x @ w).sum()` on these inputs raises (before any transfer)."""
    piped = fpipe.pipeline(lambda p, x: (x @ p["w"]).sum(), mesh=mesh)
    try:
        fpipe.value_and_grad(piped)(params, x)
    except (TypeError, ValueError) as err:
        return str(err)
    return "no error"


def dtensor_data(mesh: Any) -> str:
    """A DTensor data argument beside tensor-parallel parameters: refused, saying to pass plain."""
    w = distribute_tensor(torch.ones(4, 4), mesh["tp"], [Shard(1)])
    return refused(mesh, {"w": w}, distribute_tensor(torch.ones(2, 4), mesh["tp"], [Replicate()]))


def dp_and_tp_at_once(mesh: Any) -> str:
    """A parameter sharded over dp and tp at once (a 2-D DTensor): refused."""
    w = distribute_tensor(torch.ones(4, 4), mesh["dp", "tp"], [Shard(0), Shard(1)])
    return refused(mesh, {"w": w}, torch.ones(2, 4))


def sharded_tensor(mesh: Any) -> str:
    """A ShardedTensor parameter: a TypeError saying to use DTensor."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    tp = mesh["tp"]
    ranks = [f"rank:{r}/cpu" for r in dist.get_process_group_ranks(tp.get_group())]
    st = sharded_tensor.empty(ChunkShardingSpec(dim=0, placements=ranks), 4, 4, process_group=tp.get_group())
    piped = fpipe.pipeline(lambda p, x: (x @ p["w"]).sum(), mesh=mesh)
    try:
        fpipe.value_and_grad(piped)({"w": st}, torch.ones(2, 4))
    except TypeError as err:
        return str(err)
    return "no error"


def on_meta(mesh: Any) -> dict[str, Any]:
    """The GPT built on the meta device, parallelized, then materialized from the unsplit model's
    state dict: this rank allocates only the shards its stages read; the step equals the
    reference."""
    model = built("tp", mesh, device="meta")
    fn, params = fpipe.functionalize(model)
    x, y = (my_slice(mesh, t) for t in data())
    piped = fpipe.pipeline(loss_of(fn), mesh=mesh, microbatches=M, cuts=TWO)
    ref = reference()
    params = piped.materialize(model, x, y, state_dict=ref.state_dict())
    real = {k: v for k, v in params.items() if not (v.to_local() if isinstance(v, DTensor) else v).is_meta}
    local = sum((v.to_local() if isinstance(v, DTensor) else v).numel() for v in real.values())
    v, g = fpipe.value_and_grad(piped)(params, x, y)
    rfn, rparams = fpipe.functionalize(ref)
    ref_g, ref_v = torch.func.grad_and_value(loss_of(rfn))(rparams, *data())
    return {
        "allocated_fraction": local / sum(p.numel() for p in ref.parameters()),
        "real_keys": sorted(real),
        "grad_keys": sorted(g),
        "loss_err": abs(float(v) - float(ref_v)),
        "grad_err": max(float((whole(t) - ref_g[k]).abs().max()) for k, t in g.items()),
    }


def tp_rank_fails_mid_step(mesh: Any) -> dict[str, Any]:
    """Global rank 1 (pp 0, tp 1) fails inside a stage program, after its 5th tensor-parallel
    collective, while its tp peer waits in the next one: every rank stops with an error naming
    rank 1, within seconds (the pipeline's timeout is 120 s: a rank left waiting would take that)."""
    import time

    from fpipe._src.parallel import tp_collectives

    fn, params = fpipe.functionalize(built("tp", mesh))
    x, y = data()
    piped = fpipe.pipeline(loss_of(fn), mesh=mesh, microbatches=M, cuts=TWO, timeout=120)
    vg = fpipe.value_and_grad(piped)
    vg(params, x, y)  # compiled and run once
    wait, calls = tp_collectives._wait, [0]

    def failing_wait(work: Any, what: str) -> None:
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("injected failure on global rank 1")
        wait(work, what)

    if dist.get_rank() == 1:
        tp_collectives._wait = failing_wait
    start = time.monotonic()
    try:
        vg(params, x, y)
        msg = "no error"
    except Exception as err:
        msg = f"{type(err).__name__}: {err}"
    finally:
        tp_collectives._wait = wait
    return {"error_text": msg, "seconds": time.monotonic() - start}


def tp_of_one(_mesh: Any) -> dict[str, Any]:
    """A ("pp", "tp") mesh of 4 x 1: parallelize_module on a tp dimension of size 1 (generic
    code run without tensor parallelism) gives the unsplit model's loss and gradients."""
    mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("pp", "tp"))
    fn, params = fpipe.functionalize(built("tp", mesh))
    rfn, rparams = fpipe.functionalize(reference())
    ref_g, ref_v = torch.func.grad_and_value(loss_of(rfn))(rparams, *data())
    piped = fpipe.pipeline(loss_of(fn), mesh=mesh, microbatches=M, cuts=FOUR)
    v, g = fpipe.value_and_grad(piped)(params, *data())
    return {
        "loss_err": abs(float(v) - float(ref_v)),
        "grad_err": max(float((whole(t) - ref_g[k]).abs().max()) for k, t in g.items()),
        "dtensor_grads": sum(isinstance(t, DTensor) for t in g.values()),
    }


def best_of_layout(p: Any) -> dict[tuple[int, int], Any]:
    """The plan itself, and the best candidate of each other dp x pp layout."""
    out = {(p.dp, p.pp): p}
    for c in p.candidates:
        out.setdefault((c.dp, c.pp), c)
    return out


def planned(mesh: Any) -> dict[str, Any]:
    """fpipe.plan on the 4 ranks of a model parallelized on mesh["tp"] (tp = 2): the layouts
    dp x pp = 2 around it, cuts between blocks, the 2 best verified as real steps; then
    `pipeline(plan=p)` -- and the best candidate of each layout -- on the replica's rows against the
    unsplit model over the plan's batch. A batch of 2 rows keeps the candidates few (dp = 2:
    one microbatch; pp = 2: two), and no budget times the first of each layout only."""
    fn, params = fpipe.functionalize(built("tp", mesh))
    x, y = (t[:2] for t in data())
    loss = loss_of(fn)
    p = fpipe.plan(loss, params, x, y, world_size=4, optimizer="sgd", budget_s=0.0, verify=2)
    rfn, rparams = fpipe.functionalize(reference())
    ref_g, ref_v = torch.func.grad_and_value(loss_of(rfn))(rparams, x, y)

    def run(c: Any) -> list[float]:
        piped = fpipe.pipeline(loss, plan=c)
        i, n = dist.get_rank() // (c.pp * c.tp), 2 // c.dp
        v, g = fpipe.value_and_grad(piped)(params, x[i * n : (i + 1) * n], y[i * n : (i + 1) * n])
        err = max(float((whole(t) - ref_g[k]).abs().max()) for k, t in g.items())
        return [abs(float(v) - float(ref_v)), err, piped.cfg.mesh.mesh_dim_names, list(piped.cfg.mesh.shape)]

    return {
        "layout": [p.layout, p.tp, list(p.cuts), p.measured_step_s, p.verified],
        "candidates": [[c.layout, c.dp, c.pp, c.tp, list(c.cuts)] for c in p.candidates],
        "dropped": [[c.layout, why] for c, why in p.dropped],
        "layouts": {c.layout: run(c) for c in best_of_layout(p).values()},  # pp x tp, dp x tp
    }


def planned_over_tp(_mesh: Any) -> dict[str, Any]:
    """fpipe.plan given the plain model and `tensor_parallel=` (a function parallelizing a fresh
    model on the tp mesh it is given): tp = 1, 2 and 4 planned together on 4 ranks (no budget:
    the first candidate of each dp x pp layout is timed); the 2 best verified; then each tp > 1's best
    candidate, built with `pipeline(c.function, plan=c)` and called with `c.params`, against the
    unsplit model."""

    def build(tp_mesh: Any) -> tuple[Any, Any]:
        fn, params = fpipe.functionalize(parallelize(reference(), tp_mesh, "tp"))
        return loss_of(fn), params

    rfn, rparams = fpipe.functionalize(reference())
    x, y = (t[:4] for t in data())
    p = fpipe.plan(
        loss_of(rfn),
        rparams,
        x,
        y,
        world_size=4,
        optimizer="sgd",
        budget_s=0.0,
        verify=2,
        tensor_parallel=build,
    )
    ref_g, ref_v = torch.func.grad_and_value(loss_of(rfn))(rparams, x, y)

    def run(c: Any) -> list[float]:
        i, n = dist.get_rank() // (c.pp * c.tp), 4 // c.dp
        v, g = fpipe.value_and_grad(fpipe.pipeline(c.function, plan=c))(
            c.params, x[i * n : (i + 1) * n], y[i * n : (i + 1) * n]
        )
        return [
            abs(float(v) - float(ref_v)),
            max(float((whole(t) - ref_g[k]).abs().max()) for k, t in g.items()),
        ]

    best = {c.tp: c for c in reversed(p.candidates) if c.tp > 1}  # each tp's best predicted
    # (tp = 1 pipelines from a plan: tests/parallel/test_dp.py)
    return {
        "layout": [p.layout, p.tp, p.verified, p.measured_step_s],
        "verified": [c.layout for c in p.candidates[: p.verified]],
        "tps": sorted({c.tp for c in p.candidates}),
        "runs": {c.layout: run(c) for c in best.values()},
        "table": str(p),
    }


def plan_on_scattered_tp_ranks(_mesh: Any) -> str:
    """A tp mesh of ranks {0, 2} / {1, 3}: pipeline(plan=p) could not give it back as its mesh's
    innermost dimension, so fpipe.plan refuses it before measuring."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "rest"))
    fn, params = fpipe.functionalize(built("tp", mesh))
    try:
        fpipe.plan(loss_of(fn), params, *data(), world_size=4, verify=0)
    except ValueError as err:
        return str(err)
    return "no error"


def record(name: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as err:  # recorded; the test names the case
        return {"error": f"{type(err).__name__}: {err}", "case": name}


ON_4_RANKS = {  # the 4-rank launch's further cases (TP_WORKER_CASES selects among these too)
    "on_meta": on_meta,
    "mismatch": tp_rank_data_mismatch,
    "sharded_tensor": sharded_tensor,
    "auto_partition": auto_partition,
    "pipe_split": pipe_split_refused,
    "dtensor_data": dtensor_data,
    "tp_of_one": tp_of_one,
    "plan": planned,
    "plan_scattered": plan_on_scattered_tp_ranks,
    "plan_over_tp": planned_over_tp,
    "failure": tp_rank_fails_mid_step,  # last: it leaves work pending
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    dims = ("dp", "pp", "tp") if world == 8 else ("pp", "tp")
    mesh = init_device_mesh("cpu", (2,) * len(dims), mesh_dim_names=dims)
    rank = dist.get_rank()
    rec: dict[str, Any] = {"rank": rank, **{d: mesh.get_local_rank(d) for d in dims}}
    only = os.environ.get("TP_WORKER_CASES", "").split(",")  # for running a few cases by hand
    for name in CASES if world == 4 else ON_8_RANKS:
        if only == [""] or name in only:
            rec[name] = record(name, run_case, name, mesh)
    rec["matmul_share"] = rec.get("tp-1f1b", {}).pop("matmul_share", "tp-1f1b did not run")
    if world == 8:
        rec["dp_and_tp"] = record("dp_and_tp", dp_and_tp_at_once, mesh)
    if world == 4:
        for name, fn in ON_4_RANKS.items():
            if only == [""] or name in only:
                rec[name] = record(name, fn, mesh)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
