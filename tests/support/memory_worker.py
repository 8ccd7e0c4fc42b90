"""Predicted against measured step memory, in fresh processes.

    python tests/support/memory_worker.py NAME...                              # all stages in one process
    torchrun --standalone --nproc-per-node 2 tests/support/memory_worker.py NAME...   # one rank each
    torchrun --standalone --nproc-per-node 2 tests/support/memory_worker.py plan NAME...   # fpipe.plan first

Prints (rank 0, under torchrun) one line `RESULT {json}`: per case NAME, per rank, `predicted`
(`piped.memory`, before anything ran) and `measured`, the resident-set growth of one
`value_and_grad` step after a warm-up step (peak `VmHWM` minus `VmRSS` before, the peak mark
reset through /proc/self/clear_refs). Run it with `MALLOC_MMAP_THRESHOLD_=131072` so freed
tensors leave the resident set (../shared/DESIGN.md, "Measuring memory on CPU"); the tensors of
these cases are mostly larger than that.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint as checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import GPT, MLP, StepCounter, lm_loss  # noqa: E402

import fpipe  # noqa: E402

Case = tuple[Callable[..., Any], Any, tuple[torch.Tensor, ...]]


def mlp() -> Case:
    fn, params = fpipe.functionalize(MLP(d_in=256, hidden=512, d_out=256, n_layers=8))

    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (fn(p, x) - y).pow(2).mean()

    return loss, params, (torch.randn(2048, 256), torch.randn(2048, 256))


def gpt(batch: int = 64) -> Case:
    fn, params = fpipe.functionalize(GPT(vocab=256, d=128, n_head=4, n_layer=4, seq=64))

    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lm_loss(fn(p, x), y)

    return loss, params, (torch.randint(0, 256, (batch, 64)), torch.randint(0, 256, (batch, 64)))


def gpt128() -> Case:
    """`gpt` at batch 128: a microbatch's activations are 512 KiB, well above the mmap threshold
    (128 KiB), so the resident set follows the live tensors; at batch 64 many of a step's
    tensors are near or under it, and glibc's heap holds more than is live (up to 13 % over the
    prediction, measured, under a limit)."""
    return gpt(128)


class CheckpointedGPT(GPT):
    """`GPT` with `torch.utils.checkpoint` around every block (fpipe recomputes them)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x0 = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        x = fpipe.stage_boundary(x0) if 0 in self.cuts else x0
        for i, block in enumerate(self.blocks):
            x = checkpoint.checkpoint(block, x, use_reentrant=False)
            x = fpipe.stage_boundary(x) if i + 1 in self.cuts else x
        return self.head(self.ln_f(x) + x0)


def gptck() -> Case:
    fn, params = fpipe.functionalize(CheckpointedGPT(vocab=256, d=128, n_head=4, n_layer=4, seq=64))

    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lm_loss(fn(p, x), y)

    return loss, params, (torch.randint(0, 256, (64, 64)), torch.randint(0, 256, (64, 64)))


def stepbuf() -> Case:
    """A module buffer written in place and read by every layer (issue 24 case 1), float64; its
    fourth element resets the buffer, so each step starts from the same state."""
    model = StepCounter(cut=4)  # stage 0 holds more: the limit binds there
    fn, params = fpipe.functionalize(model)
    return fn, params, (torch.randn(16, 8, dtype=torch.float64),), model.step.zero_


class CNN(torch.nn.Module):
    """A small convolutional classifier (five 3x3 convolutions, the last strided, and a linear
    head): the convolutions' kernel workspaces are a share of its step (NOTE [kernel
    workspaces] in fpipe/_src/memory/workspace.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = torch.nn.ModuleList(
            [torch.nn.Conv2d(3, 16, 3, padding=1)]
            + [torch.nn.Conv2d(16, 16, 3, padding=1) for _ in range(3)]
            + [torch.nn.Conv2d(16, 32, 3, stride=2, padding=1)]
        )
        self.head = torch.nn.Linear(32 * 16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = torch.relu(conv(x))
        return self.head(x.flatten(1))


def cnn(dtype: torch.dtype = torch.float32, batch: int = 128) -> Case:
    """`CNN`: in float32 its convolutions run on oneDNN, in float64 on torch's im2col kernels."""
    fn, params = fpipe.functionalize(CNN().to(dtype))

    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(fn(p, x), y)

    return loss, params, (torch.randn(batch, 3, 32, 32, dtype=dtype), torch.randint(0, 10, (batch,)))


def cnn64() -> Case:
    return cnn(torch.float64, 32)


MODELS = {
    "mlp": mlp,
    "gpt": gpt,
    "gpt128": gpt128,
    "gptck": gptck,
    "stepbuf": stepbuf,
    "cnn": cnn,
    "cnn64": cnn64,
}


def _status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def rss_growth(step: Callable[[], Any]) -> int:
    """Peak resident-set growth while `step()` runs."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    out = step()
    peak = _status("VmHWM")
    del out
    return peak - before


def measure(name: str) -> dict[str, Any]:
    """Case `name` is `model-schedule-stages-microbatches`, e.g. `mlp-zb-h1-4-8`, optionally
    `@fraction`: under `memory_limit` = that fraction of the unconstrained prediction (then also
    `limit`, and `grads_equal`: the step's gradients equal the unconstrained pipeline's)."""
    name, _, frac = name.partition("@")
    head, stages, mbs = name.rsplit("-", 2)
    model, schedule = head.split("-", 1)
    torch.manual_seed(0)
    f, params, args, *reset = MODELS[model]()
    again = reset[0] if reset else lambda: None  # buffers written by a step start alike
    kw: dict[str, Any] = dict(stages=int(stages), microbatches=int(mbs), schedule=schedule)
    out: dict[str, Any] = {}
    if frac:  # one limit for every rank: the fraction of the largest rank's peak
        free = fpipe.pipeline(f, **kw)
        out["unconstrained"] = free.memory(params, *args)
        most = torch.tensor(out["unconstrained"])
        if dist.is_initialized():
            dist.all_reduce(most, dist.ReduceOp.MAX)
        out["limit"] = kw["memory_limit"] = int(float(frac) * int(most))
        again()
        ref = fpipe.value_and_grad(free)(params, *args)[1]
        free_ops = _backward_ops(free)
        del free
    piped = fpipe.pipeline(f, **kw)
    out["predicted"] = piped.memory(params, *args)
    step = fpipe.value_and_grad(piped)
    again()
    grads = step(params, *args)[1]
    out["bound_sends"] = getattr(piped._last.runner, "bound_sends", False)  # type: ignore[union-attr]
    if frac:
        out["grads_equal"] = all(torch.equal(grads[k], ref[k]) for k in grads if not grads[k].is_meta)
        out["recomputed_ops"] = _backward_ops(piped) - free_ops
        del ref
    del grads
    out["measured"] = rss_growth(lambda: step(params, *args))
    return out


D = 4096


def elementwise() -> Case:
    """A float64 model of elementwise layers whose values crossing between ranks are a large
    share of a rank's memory; an odd batch (405 rows), so 2 ranks plan pipelines (dp = 2 does
    not divide it)."""
    g = torch.Generator().manual_seed(0)
    params = {f"{k}{i}": torch.randn(D, generator=g, dtype=torch.float64) for i in range(4) for k in "wb"}

    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x
        for i in range(4):
            h = torch.tanh(h * p[f"w{i}"] + p[f"b{i}"])
        return (h - y).pow(2).mean()

    x, y = (torch.randn(405, D, generator=g, dtype=torch.float64) for _ in range(2))
    return loss, params, (x, y)


def planned() -> dict[str, Any]:
    """`fpipe.plan` as docs/guide/planning.md calls it, under torchrun before any process group, and
    `pipeline(f, plan=p)`'s step against `torch.func` of the unsplit function (float64); then
    the plan under the least limit a candidate's predicted peak meets, its chosen layout's step
    measured: resident-set growth plus this rank's parameters and their AdamW state (2x), which
    the step does not allocate."""
    from fpipe._src.memory.remat_choose import least_limit

    loss_fn, params, (tokens, targets) = elementwise()
    plan = fpipe.plan(loss_fn, params, tokens, targets, world_size=2)  # docs/guide/planning.md's call
    out: dict[str, Any] = {"group": dist.is_initialized(), "verified": plan.verified}
    out["layout"] = [plan.layout, plan.stages, list(plan.cuts)]
    loss, grads = _plan_step(loss_fn, plan, params, tokens, targets)
    want_grads, want_loss = torch.func.grad_and_value(loss_fn)(params, tokens, targets)
    out["loss_err"] = float((loss - want_loss).abs())
    out["grad_err"] = max(float((grads[k] - want_grads[k]).abs().max()) for k in grads)
    out["keys"] = sorted(grads)  # this rank's parameters: every one on some rank
    peaks = sorted(c.predicted_peak_bytes for c in plan.candidates)
    out["limit"] = limit = least_limit(peaks[0])
    under = fpipe.plan(loss_fn, params, tokens, targets, world_size=2, memory_limit=limit)
    out["dropped"] = sum(why.startswith("peak") for _, why in under.dropped)
    out["chosen"], out["predicted"] = under.layout, under.predicted_peak_bytes
    step = functools.partial(_plan_step, loss_fn, under, params, tokens, targets)
    grads = step()[1]
    mine = 3 * sum(params[k].nbytes for k, g in grads.items() if not g.is_meta)
    del grads
    out["measured"] = rss_growth(step) + mine
    return out


def _plan_step(f: Any, plan: fpipe.Plan, params: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    """`value_and_grad(pipeline(f, plan=plan))` on this rank's replica's rows."""
    i, n = int(os.environ["RANK"]) // plan.pp, x.shape[0] // plan.dp
    return fpipe.value_and_grad(fpipe.pipeline(f, plan=plan))(
        params, x[i * n : (i + 1) * n], y[i * n : (i + 1) * n]
    )


def _backward_ops(piped: fpipe.Pipelined) -> int:
    """The operations of this rank's backward programs (recomputation adds to them)."""
    st = piped._last.staged  # type: ignore[union-attr]
    mine = set(piped.local_stages)
    return sum(p.n_nodes for (k, s), p in st.programs.items() if k != "F" and s in mine)


def main() -> None:
    group = "RANK" in os.environ  # the process group: started by fpipe (plan, pipeline) or here
    out: dict[str, list[Any]] = {}
    for name in sys.argv[1:]:
        try:
            mine = planned() if name == "plan" else measure(name)
        except Exception as err:  # (plan: recorded, the test names it)
            if name != "plan":
                raise
            traceback.print_exc()  # (in the log the test shows)
            mine = {"error": f"{type(err).__name__}: {err}"}
        if group and not dist.is_initialized():
            dist.init_process_group("gloo")
        out[name] = [None] * (dist.get_world_size() if group else 1)
        if group:
            dist.all_gather_object(out[name], mine)
        else:
            out[name] = [mine]
    if not group or dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    if group:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
