"""Multi-process worker: transformers GPT-2 and Llama trained by fpipe on 2 and 4 pipeline ranks.

Run by `tests/support/four_ranks_worker.py` (one 4-rank launch for tests/pipeline/test_hf_dist.py and two other
modules: a process group costs seconds to start), or alone as

    torchrun --standalone --nproc-per-node 4 tests/support/hf_dist_worker.py --out DIR

On 4 processes, a case with pp=4 is one pipeline over all ranks; a case with pp=2 runs on a
DeviceMesh (dp=2, pp=2): two 2-rank pipeline replicas, each passed its half of the batch
(NOTE [gradients over replicas]: the loss and gradients are the whole batch's). Every rank builds
the whole tiny model from the same seed, computes the unsplit single-process reference
(`torch.func.grad_and_value`, fp64, whole batch) and writes `DIR/rank{R}.json`: per case the
loss errors, the gradient errors of the keys this rank got, and the errors after two AdamW steps.
A case that raises is recorded (type and message) and the next case runs.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fpipe

DT = torch.float64
BATCH, SEQ, MICROBATCHES, VOCAB = 8, 8, 4, 64
CASES = [("gpt2", 2), ("llama", 2), ("gpt2", 4), ("llama", 4)]


def build(name: str) -> torch.nn.Module:
    import transformers  # here, not at the top: pytest --doctest-modules imports this file

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
            eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(DT).train()


def batch() -> dict[str, torch.Tensor]:
    """Left-padded rows; the loss is the whole batch's token mean via `num_items_in_batch`."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    pad = torch.tensor([0, 3, 1, 0, 5, 2, 0, 4])
    mask = (torch.arange(SEQ)[None, :] >= pad[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return dict(
        input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=(labels[:, 1:] != -100).sum()
    )


def loss_of(fn: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    def loss(params: dict[str, torch.Tensor], **b: torch.Tensor) -> torch.Tensor:
        return fn(params, **b).loss

    return loss


def scaled_errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """|got - ref| per key, relative to the largest entry of the whole reference tree."""
    scale = max(v.abs().max().item() for v in ref.values())
    return {k: (g - ref[k]).abs().max().item() / scale for k, g in got.items()}


def replica_slice(b: dict[str, torch.Tensor], mesh: Any) -> dict[str, torch.Tensor]:
    """This replica's rows of the batch on a (dp, pp) mesh (a 0-dim count stays whole)."""
    if mesh is None:
        return b
    dp_rank = mesh.get_local_rank("dp")
    return {k: v.chunk(2)[dp_rank] if v.dim() else v for k, v in b.items()}


def run_case(name: str, pp: int, mesh: Any) -> dict[str, Any]:
    model = build(name)
    fn, params = fpipe.functionalize(model)
    ref_params = {k: v.clone() for k, v in params.items()}
    b = batch()
    loss = loss_of(fn)
    piped = fpipe.pipeline(loss, microbatches=MICROBATCHES, out_axes="sum", mesh=mesh, timeout=120)
    opt = ref_opt = None
    out: dict[str, Any] = {"all_keys": sorted(params), "pp_rank": piped.pg.rank, "steps": []}
    for _ in range(2):
        rg, rl = torch.func.grad_and_value(loss)(ref_params, **b)
        value, grads = fpipe.value_and_grad(piped)(params, **replica_slice(b, mesh))
        step = {"loss": value.item(), "ref_loss": rl.item(), "loss_dtype": str(value.dtype)}
        step["loss_rel_err"] = abs(value.item() - rl.item()) / abs(rl.item())
        step["grad_keys"] = sorted(grads)
        step["grad_err"] = scaled_errors(grads, rg)
        local = {k: params[k] for k in grads}
        if opt is None:
            opt = torch.optim.AdamW(list(local.values()), lr=1e-2)
            ref_opt = torch.optim.AdamW(list(ref_params.values()), lr=1e-2)
        fpipe.set_grads(local, grads)
        opt.step()
        opt.zero_grad(set_to_none=True)
        fpipe.set_grads(ref_params, rg)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        step["param_err"] = scaled_errors(local, {k: ref_params[k] for k in local})
        out["steps"].append(step)
    c = [c for key, c in piped._cache.items()][0]
    out["n_stages"] = c.staged.n_stages
    return out


def run(out: str) -> None:
    """Every case, in an initialised 4-rank process group; writes `out/rank{R}.json`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "launch with --nproc-per-node 4"
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    results: dict[str, Any] = {}
    failed = None
    for name, pp in CASES:
        key = f"{name}-pp{pp}"
        if failed is not None:  # fpipe stops every rank of a failed pipeline: the group is done
            results[key] = {"error": f"not run: {failed} failed first"}
            continue
        try:
            results[key] = run_case(name, pp, mesh2 if pp == 2 else None)
            dist.barrier()
        except Exception as err:  # recorded; the test reports it
            results[key] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            failed = key
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    run(args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
