"""Multi-process parity worker: run every (schedule, model) case in one torchrun launch.

Launched by `tests/runtime/test_dist.py` (once per module, not once per test: a process group costs
seconds to start), e.g.

    torchrun --standalone --nproc-per-node 4 tests/support/dist_worker.py --out DIR

Each rank runs every case on the same inputs, computes the single-process reference
(`torch.func.grad_and_value` of the unsplit function, fp64) and writes what the tests assert on
to `DIR/rank{R}.json`: per case the loss error, the gradient error per returned key, the returned
keys, the keys this rank's stage programs read, the global gradient norm, and the error after a
clipped AdamW step. A case that raises is recorded (type and message) and the next case runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fpipe

# -- models: plain torch, fp64 ----------------------------------------------------------------------


class MLP(nn.Module):
    """`n` Linear + tanh layers; with `stages`, a `stage_boundary` after evenly spaced layers and a
    skip connection (no parameters) from the first layer's output to the output, which crosses
    every boundary."""

    def __init__(self, d: int = 6, hidden: int = 8, d_out: int = 3, n: int = 8, stages: int | None = None):
        super().__init__()
        dims = [d] + [hidden] * (n - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.cut_after = segments_cut(n, stages)
        self.d_out = d_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = None
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
            if i == 0:
                h0 = x
            if i in self.cut_after:
                x = fpipe.stage_boundary(x)
        return x + h0[:, : self.d_out] if self.cut_after else x


def segments_cut(n: int, stages: int | None) -> set[int]:
    """Segments (of n) after which a boundary goes so that stage s holds segments [s*n/S, (s+1)*n/S)."""
    if not stages or stages == 1:
        return set()
    return {i for i in range(n - 1) if i * stages // n != (i + 1) * stages // n}


def marker_stage_of_layer(n: int, stages: int) -> list[int]:
    return [i * stages // n for i in range(n)]


class Block(nn.Module):
    """Pre-LN transformer block with causal self-attention (mask built in forward)."""

    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in self.qkv(x).split(d, -1)
        )
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_head)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embedding, blocks, final LN, LM head tied to the token embedding."""

    def __init__(self, vocab: int = 13, d: int = 8, n_head: int = 2, n_layer: int = 2, seq: int = 6):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: read by the first and the last stage

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


BATCH = 12  # divisible by every microbatch count used


def build_model(kind: str, p: int) -> tuple[nn.Module, tuple[torch.Tensor, ...], Callable[..., torch.Tensor]]:
    """(module, inputs, loss of (fn, params, *inputs)) for a model kind, on P ranks."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind.startswith("gpt"):
        model: nn.Module = GPT()
        x = torch.randint(0, 13, (BATCH, 6), generator=g)
        y = torch.randint(0, 13, (BATCH, 6), generator=g)

        def lm(
            fn: Callable[..., torch.Tensor], params: Any, x: torch.Tensor, y: torch.Tensor
        ) -> torch.Tensor:
            return F.cross_entropy(fn(params, x).flatten(0, 1), y.flatten())

        return model, (x, y), lm
    if kind == "mlp_transposed":
        # p - 1 stages of MLP, then a boundary on a transposed (non-contiguous) value that the
        # last stage views in a way only that layout allows: the receiver must keep the layout.
        model = MLP(stages=p - 1)
        x = torch.randn(BATCH, 6, generator=g)
        y = torch.randn(BATCH, 3, generator=g)

        def mse_t(
            fn: Callable[..., torch.Tensor], params: Any, x: torch.Tensor, y: torch.Tensor
        ) -> torch.Tensor:
            h = fpipe.stage_boundary(fn(params, x).t())
            return (h.t().view(-1) - y.view(-1)).pow(2).mean()

        return model, (x, y), mse_t
    model = MLP(stages=p if kind == "mlp_markers" else None)
    x = torch.randn(BATCH, 6, generator=g)
    y = torch.randn(BATCH, 3, generator=g)

    def mse(fn: Callable[..., torch.Tensor], params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (fn(params, x) - y).pow(2).mean()

    return model, (x, y), mse


# -- one case ---------------------------------------------------------------------------------------


def vg_compiled(piped: fpipe.Pipelined) -> Any:
    """The compiled value_and_grad program (private cache; the forward call compiles another)."""
    found = [c for key, c in piped._cache.items() if key[1] is not None]
    assert len(found) == 1, len(found)
    return found[0]


def keys_read_by_rank(piped: fpipe.Pipelined, rank: int) -> list[str]:
    """Parameter keys that any stage program placed on `rank` takes as an input."""
    c = vg_compiled(piped)
    st = c.staged
    mine = set()
    for place, prog in st.programs.items():
        if c.runner.rank_of(place) == rank:
            mine.update(prog.inputs)
    return sorted(c.param_keys[i] for i, name in enumerate(st.param_inputs) if name in mine)


def run_case(case: dict[str, Any], p: int, rank: int, two_steps: bool) -> dict[str, Any]:
    kind, sched, stages, m = case["model"], case["schedule"], case["stages"], case["microbatches"]
    model, inputs, loss_of = build_model(kind, p)
    ref_model = model
    if kind == "gpt_meta":
        with torch.device("meta"):
            model = GPT()
    fn, params = fpipe.functionalize(model)
    ref_fn, ref_params = fpipe.functionalize(ref_model)

    def loss(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_of(fn, params, x, y)

    def ref_loss(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_of(ref_fn, params, x, y)

    piped = fpipe.pipeline(
        loss,
        stages=stages,
        microbatches=m,
        schedule=sched,
        timeout=60,
        partition=case.get("partition", "estimate"),
    )
    if kind == "gpt_meta":
        params = piped.materialize(model, *inputs, state_dict=ref_model.state_dict())
    out: dict[str, Any] = {"all_keys": sorted(params)}
    out["local_keys"] = sorted(k for k, v in params.items() if not v.is_meta)
    ref_params = {k: v.clone() for k, v in ref_params.items()}
    params = {k: (v.clone() if not v.is_meta else v) for k, v in params.items()}
    steps = []
    for _ in range(2 if two_steps else 1):
        steps.append(one_step(piped, ref_loss, params, ref_params, inputs))
    out.update(steps[0])
    if two_steps:
        out["step2"] = steps[1]
    out["keys_read"] = keys_read_by_rank(piped, rank)
    out["n_stages"] = vg_compiled(piped).staged.n_stages
    staged = vg_compiled(piped).staged  # where the cuts went: the same on every rank
    out["cut"] = sorted((f"{k}{s}", sorted(prog.inputs)) for (k, s), prog in staged.programs.items())
    runner = vg_compiled(piped).runner
    out["schedule_stage_rank"] = list(runner.schedule.stage_rank)
    out["b_stages"] = sorted({a.stage for a in runner.actions if a.kind == "B"})
    out["b_split"] = sorted(runner.b_parts)  # B run as I, send, W
    if case["forward"]:  # forward only, at the parameters after the optimizer step(s)
        fwd = piped(params, *inputs)
        out["fwd_loss_err"] = abs(fwd.item() - ref_loss(ref_params, *inputs).item())
    return out


def marker_keys(p: int, rank: int) -> list[str]:
    """The keys rank `rank` reads in the markers model, from its construction (not from fpipe)."""
    n = len(MLP().layers)
    owner = marker_stage_of_layer(n, p)
    return sorted(f"layers.{i}.{w}" for i in range(n) if owner[i] == rank for w in ("weight", "bias"))


def one_step(
    piped: fpipe.Pipelined,
    ref_loss: Callable[..., torch.Tensor],
    params: dict[str, torch.Tensor],
    ref_params: dict[str, torch.Tensor],
    inputs: tuple[torch.Tensor, ...],
) -> dict[str, Any]:
    """One pipelined value_and_grad + clip + AdamW step against the same step done unsplit."""
    rg, rl = torch.func.grad_and_value(ref_loss)(ref_params, *inputs)
    t0 = time.perf_counter()
    lval, grads = fpipe.value_and_grad(piped)(params, *inputs)
    out: dict[str, Any] = {"seconds": time.perf_counter() - t0}
    out["loss"], out["ref_loss"] = lval.item(), rl.item()
    out["loss_err"] = abs(lval.item() - rl.item())
    out["loss_dtype"] = str(lval.dtype)
    out["grad_keys"] = sorted(grads)
    out["grad_err"] = {k: (g - rg[k]).abs().max().item() for k, g in grads.items()}
    out["grad_shape_ok"] = all(g.shape == rg[k].shape and g.dtype == rg[k].dtype for k, g in grads.items())
    ref_norm = torch.sqrt(sum((g**2).sum() for g in rg.values())).item()
    max_norm = 0.5 * ref_norm  # so that clipping happens and scales every gradient
    norm = fpipe.clip_grad_norm_(grads, max_norm, pipeline=piped)
    out["norm"], out["ref_norm"], out["norm_dtype"] = norm.item(), ref_norm, str(norm.dtype)
    coef = max_norm / (norm.item() + 1e-6)  # what clipping by the returned norm must have applied
    out["clip_err"] = max(((g - rg[k] * coef).abs().max().item() for k, g in grads.items()), default=0.0)
    # AdamW on this rank's parameters (through .grad) against AdamW on the reference's, both
    # with the reference gradients clipped by the same coefficient.
    local = {k: v for k, v in params.items() if not v.is_meta}
    before = {k: v.clone() for k, v in local.items()}
    opt = torch.optim.AdamW(list(local.values()), lr=1e-2)
    fpipe.set_grads(local, grads)
    opt.step()
    ref_opt = torch.optim.AdamW(list(ref_params.values()), lr=1e-2)
    for k, v in ref_params.items():
        v.grad = rg[k] * coef
    ref_opt.step()
    # (a rank whose stages hold no parameters has no gradients: nothing to compare)
    out["adamw_err"] = max(((local[k] - ref_params[k]).abs().max().item() for k in grads), default=0.0)
    out["adamw_moved"] = min(((local[k] - before[k]).abs().max().item() for k in grads), default=None)
    for v in ref_params.values():
        v.grad = None
    for v in local.values():
        v.grad = None
    return out


# -- the case list --------------------------------------------------------------------------------

# Tracing dominates a case's time (the GPT's most: ~3x the MLP's), so not every model runs on every
# schedule: every model on 1F1B (the default), the MLP on every schedule, the tied GPT also on ZB-H1
# (split backward) and ZBV (V placement: the tied embedding's two readers on one rank).
ALL_MODELS = ["mlp_auto", "mlp_markers", "gpt", "gpt_meta"]
GPT_TOO = {"zb-h1", "zbv"}


def builds(name: str, p: int, m: int, stages: int | None = None) -> int | None:
    """The number of stages of schedule `name` on p ranks (with `stages`, if given); None if it
    cannot be built so."""
    try:
        return fpipe.schedules.build(name, pp=p, microbatches=m, stages=stages).n_stages
    except ValueError:
        return None


def cases(p: int, m: int) -> list[dict[str, Any]]:
    """Kinds: "one" -- one stage per rank, every schedule that builds so (stages=None where that
    is the schedule's own count, else stages=P); "multi" -- several stages per rank, every
    schedule whose own count is not P (stages=None: fpipe picks it); "refused" -- a schedule that
    cannot place one stage per rank, asked to (stages=P), whose error is asserted."""
    out = []

    def add(kind: str, name: str, models: list[str], stages: int | None, forward: bool = False) -> None:
        for model in models:
            out.append(
                dict(id=f"{kind}-{name}-{model}", kind=kind, schedule=name, model=model, stages=stages)
            )
            out[-1].update(microbatches=m, forward=forward)

    for name in fpipe.schedules.names():
        own = builds(name, p, m)
        if builds(name, p, m, stages=p):
            models = (
                ALL_MODELS if name == "1f1b" else ["mlp_auto", "gpt"] if name in GPT_TOO else ["mlp_auto"]
            )
            add("one", name, models, None if own == p else p, forward=name == "1f1b")
        if own is not None and own != p:
            add("multi", name, ["mlp_auto", "gpt"] if name in GPT_TOO else ["mlp_auto"], None)
    add("layout", "1f1b", ["mlp_transposed"], None)
    add("measured", "1f1b", ["gpt"], p)
    out[-1].update(partition="measure", id=f"{out[-1]['id']}-measure")
    for name in fpipe.schedules.names():  # last: a refused call reports its error to the c10d store
        if not builds(name, p, m, stages=p):
            add("refused", name, ["mlp_auto"], p)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--only", nargs="*", default=None, help="run only these case ids")
    args = ap.parse_args()
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    results: dict[str, Any] = {"rank": rank, "world": p, "pid": os.getpid(), "cases": {}}
    todo = [c for c in cases(p, args.microbatches) if not args.only or c["id"] in args.only]
    for i, case in enumerate(todo):
        t0 = time.perf_counter()
        try:
            rec = run_case(case, p, rank, two_steps=(i == 0))
            rec["ok"] = True
        except Exception as err:  # recorded for the test to assert on; the next case still runs
            rec = {
                "ok": False,
                "error_type": type(err).__name__,
                "error": str(err),
                "traceback": traceback.format_exc(),
            }
        rec.update(case=case, case_seconds=time.perf_counter() - t0)
        results["cases"][case["id"]] = rec
        dist.barrier()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
