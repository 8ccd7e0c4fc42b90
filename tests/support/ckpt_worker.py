"""Checkpoint worker for `tests/training/test_checkpoint_dist.py`, launched twice by torchrun (gloo):

    torchrun --nproc-per-node 2 tests/support/ckpt_worker.py save DIR     # pp=2: 3 AdamW steps, save
    torchrun --nproc-per-node 4 tests/support/ckpt_worker.py resume DIR   # pp=4, dp=2 x pp=2, GPT-2

A tied model (`models.TiedLM`: the embedding is read by the first and the last stage), fp64,
AdamW. "save" trains 3 steps at pp=2 and writes `DIR/ckpt` (`fpipe.save`) and `DIR/ckpt_async`
(`fpipe.async_save`, while a 4th step runs). "resume" loads them into models built on the meta device and
`materialize`d, at pp=4 (from ckpt) and at dp=2 x pp=2 (from ckpt_async, replicas each passing
half the batch; once more with the parameters sharded as DTensors), trains 3 more steps and
compares with an uninterrupted 6-step run in one process (`reference`); the dp=2 x pp=2 runs
save their 6-step state (`DIR/ckpt6`, `DIR/ckpt6_sharded`); then it loads a GPT-2
`save_pretrained` directory into a meta GPT-2 cut in 4 stages. Each rank writes
`DIR/PHASE.rank{R}.json`; a case that raises is recorded, and the next runs. "save" ends with
ConvBN in 4 stages (its BatchNorm buffers on both ranks) `async_save`d to `DIR/bn` with each
rank's own `extra`, and `dist.destroy_process_group()` right after it, not waiting.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
from models import ConvBN, TiedLM, lm_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import fpipe

DT, BATCH, SEQ, VOCAB, M, LR = torch.float64, 8, 5, 12, 2, 1e-2
DEADLINE_S = float(os.environ.get("CKPT_WORKER_DEADLINE_S", "100"))


def build(stages: int | None, meta: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return TiedLM(vocab=VOCAB, d=8, n_layers=3, stages=stages).to(DT)


def batch(step: int, part: int = 0, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch (the same on every rank), or replica `part` of `parts`' rows of it."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=g)
    return x.chunk(parts)[part], y.chunk(parts)[part]


def reference(steps: int = 6) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The uninterrupted run: `steps` AdamW steps in one process with autograd."""
    model = build(None)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for s in range(steps):
        x, y = batch(s)
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def piped_for(model: torch.nn.Module, mesh: Any = None) -> tuple[Any, dict[str, torch.Tensor]]:
    fn, params = fpipe.functionalize(model)
    piped = fpipe.pipeline(lambda p, x, y: lm_loss(fn(p, x), y), microbatches=M, mesh=mesh, timeout=60)
    return piped, params


def train(piped: Any, params: dict, opt: Any, steps: range, part: int = 0, parts: int = 1) -> list[float]:
    losses = []
    for s in steps:
        loss, grads = fpipe.value_and_grad(piped)(params, *batch(s, part, parts))
        fpipe.set_grads(params, grads)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def save_phase(out: str) -> dict[str, Any]:
    model = build(2)
    piped, params = piped_for(model)
    opt = torch.optim.AdamW(params.values(), lr=LR)
    rec: dict[str, Any] = {"no_pipeline": _error(lambda: fpipe.save(f"{out}/x", params, optimizer=opt))}
    rec["losses"] = train(piped, params, opt, range(3))
    fpipe.save(f"{out}/ckpt", params, optimizer=opt, extra={"step": 3}, pipeline=piped)
    handle = fpipe.async_save(f"{out}/ckpt_async", params, optimizer=opt, extra={"step": 3}, pipeline=piped)
    rec["losses"] += train(piped, params, opt, range(3, 4))  # a step while it writes: not in it
    handle.result()
    rec["load_no_pipeline"] = _error(lambda: fpipe.load(f"{out}/ckpt", params))
    bad = {"module": torch.nn.Linear(1, 1)} if dist.get_rank() == 1 else {}  # not weights_only-loadable
    rec["one_rank_refuses"] = _error(lambda: fpipe.save(f"{out}/bad", params, extra=bad, pipeline=piped))
    fpipe.save(f"{out}/per_rank", params, extra={"data_pos": 1000 + dist.get_rank()}, pipeline=piped)
    rec["per_rank_extra"] = fpipe.load(f"{out}/per_rank", params, pipeline=piped)  # this rank's own
    return rec


def bn_state(out: str) -> Any:
    """ConvBN in 4 stages on 2 ranks (bn1 in stage 0, bn2 in stage 1), 2 steps, then `async_save` with this
    rank's own extra, left running: `main` destroys the process group right after."""
    torch.manual_seed(0)
    model = ConvBN(stages=4).to(DT)
    fn, params = fpipe.functionalize(model)
    piped = fpipe.pipeline(
        lambda p, x, y: torch.nn.functional.cross_entropy(fn(p, x), y),
        microbatches=M, schedule="interleaved-1f1b", timeout=60,
    )  # fmt: skip
    opt = torch.optim.SGD(params.values(), lr=LR)
    for s in range(2):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(4, 3, 5, 5, generator=g, dtype=DT), torch.randint(0, 3, (4,), generator=g)
        _, grads = fpipe.value_and_grad(piped)(params, x, y)
        fpipe.set_grads(params, grads)
        opt.step()
    mine = [bn for bn in ("bn1", "bn2") if model.get_buffer(f"{bn}.num_batches_tracked") > 0]
    bufs = {n: b.tolist() for n, b in model.named_buffers() if n.split(".")[0] in mine}  # updated here
    handle = fpipe.async_save(f"{out}/bn", params, extra={"pos": 1000 + dist.get_rank()}, pipeline=piped)
    return handle, {"buffers": bufs}


def resume(
    ckpt: str, stages: int, mesh: Any = None, sharded: bool = False, save_to: str = ""
) -> dict[str, Any]:
    """Resume the tied model from `ckpt` on a meta-built, materialised model; 3 more steps;
    then save the 6-step state to `save_to` (if given) from this layout."""
    part, parts = (mesh.get_local_rank("dp"), 2) if mesh is not None else (0, 1)
    model = build(stages, meta=True)
    piped, params = piped_for(model, mesh)
    params = piped.materialize(model, *batch(3, part, parts), init=lambda m: None)
    local = sorted(piped.local(params))
    if sharded:
        params = {
            k: distribute_tensor(v, mesh["dp"], [Shard(0)]) if not v.is_meta else v for k, v in params.items()
        }
    opt = torch.optim.AdamW(piped.local(params).values(), lr=LR)
    extra = fpipe.load(ckpt, params, optimizer=opt, pipeline=piped)
    losses = train(piped, params, opt, range(3, 6), part, parts)
    if save_to:
        fpipe.save(save_to, params, optimizer=opt, extra={"step": 6}, pipeline=piped)
    ref_losses, ref = reference()
    return {
        "extra": extra, "local": local, "all": sorted(params),
        "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses[3:])),
        "param_err": {k: float((whole(params[k]) - ref[k]).abs().max()) for k in local},
    }  # fmt: skip


def gpt2(out: str) -> dict[str, Any]:
    """A GPT-2 `save_pretrained` directory loaded into a meta GPT-2 cut in 4 stages."""
    import transformers

    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, attn_pdrop=0.0, resid_pdrop=0.0,
        embd_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    if dist.get_rank() == 0:
        transformers.GPT2LMHeadModel(cfg).save_pretrained(f"{out}/hf")
    dist.barrier()
    src = transformers.GPT2LMHeadModel.from_pretrained(f"{out}/hf")
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    fn, params = fpipe.functionalize(model)
    piped = fpipe.pipeline(lambda p, ids: fn(p, input_ids=ids, labels=ids).loss, stages=4, timeout=60)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    params = piped.materialize(model, ids, init=lambda m: None)
    fpipe.load(f"{out}/hf", params, pipeline=piped)
    want = dict(src.named_parameters())
    local = sorted(piped.local(params))
    err = max(float((params[k] - want[k].detach()).abs().max()) for k in local)
    loss = fpipe.value_and_grad(piped)(params, ids)[0].item()
    return {"local": local, "all": sorted(params), "err": err, "loss": loss,
            "ref_loss": src(input_ids=ids, labels=ids).loss.item()}  # fmt: skip


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def _case(rec: dict[str, Any], name: str, fn: Any) -> None:
    t0 = time.perf_counter()
    try:
        rec[name] = fn()
        rec[name]["seconds"] = time.perf_counter() - t0
    except Exception as err:
        rec[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


def main() -> None:
    phase, out = sys.argv[1], sys.argv[2]
    faulthandler.dump_traceback_later(DEADLINE_S, exit=True)  # a hang fails with every stack
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rec: dict[str, Any] = {"rank": dist.get_rank()}
    if phase == "save":
        _case(rec, "save", lambda: save_phase(out))
        _case(rec, "bn", lambda: bn_state(out)[1])  # not waited for: destroy_process_group follows
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        _case(rec, "pp4", lambda: resume(f"{out}/ckpt", 4))
        _case(rec, "dp2pp2", lambda: resume(f"{out}/ckpt_async", 2, mesh, save_to=f"{out}/ckpt6"))
        _case(rec, "dp2pp2_sharded", lambda: resume(f"{out}/ckpt", 2, mesh, True, f"{out}/ckpt6_sharded"))
        _case(rec, "gpt2", lambda: gpt2(out))
    with open(os.path.join(out, f"{phase}.rank{rec['rank']}.json"), "w") as f:
        json.dump(rec, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
