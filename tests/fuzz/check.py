"""Run one example and compare it with its reference: the unsplit function under `torch.func`
in float64, microbatch by microbatch as the contract defines it (docs/guide/contract.md, "The contract": the
mean of per-microbatch means, buffers updated once per microbatch in order), or, for programs
with dropout, fpipe itself on one stage with no limit (fpipe's masks are its own: NOTE
[random-number policy] in fpipe/_src/tracing/rng.py).

Each example runs two steps; between them both sides take the same SGD-with-momentum step, and
with `save_load` fpipe's parameters and optimizer go through `fpipe.save` / `fpipe.load` first.
Compared after each step: the loss, every aux output (dtype and value), the gradients, every
module buffer; after the last, the parameters after one more optimizer step (the reloaded
momentum).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

import fpipe

from .grammar import Built, Example, build, loss_function

RTOL, ATOL = 1e-9, 1e-12  # float64: reorderings of the same sums stay near 1e-15 relative
LR, MOMENTUM = 0.1, 0.9
STATEFUL = {"buf_rw", "bn_train"}  # layers that write a buffer or mix the batch: per microbatch
DIST_TIMEOUT_S = 60.0  # fpipe's peer timeout on ranks (its default is 300 s)


@dataclasses.dataclass
class Outcome:
    """ "ok", "refused" (a refusal fpipe documents: a memory limit it cannot meet) or "fail"."""

    status: str
    signature: str = ""  # what failed, without numbers or layer indices (groups failures)
    detail: str = ""  # the first mismatches or the error, with numbers
    warnings: tuple[str, ...] = ()
    held: str = ""  # on a rank of a pipeline: JSON {buffer: equal to the reference here} (dist.py)


# -- the reference --------------------------------------------------------------------------------
class Reference:
    """The unsplit function under torch.func on a copy of the module, one microbatch at a time;
    `replicas` copies of the buffers (data-parallel replicas each update their own)."""

    def __init__(self, ex: Example, b: Built, replicas: int = 1) -> None:
        self.ex, self.module = ex, copy.deepcopy(b.module)
        for kind, block in zip(ex.layers, self.module.blocks):
            if kind == "ckpt":
                block.plain = True
        self.params = {k: v.clone() for k, v in b.params.items()}
        bufs = dict(self.module.named_buffers())
        self.buffers = [{k: v.clone() for k, v in bufs.items()} for _ in range(replicas)]
        self.opt = torch.optim.SGD(list(self.params.values()), lr=LR, momentum=MOMENTUM)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
        ex, n_rep, m = self.ex, len(self.buffers), self.ex.microbatches
        argnums = (0, 2) if ex.grad_x else 0  # f(params, buffers, x, y)
        vg = torch.func.grad_and_value(self._f, argnums=argnums, has_aux=bool(ex.aux))
        if not STATEFUL & set(ex.layers):  # no example meets another, no buffer changes: whole batch
            return _combine(ex, [vg(self.params, self.buffers[0], x, y)], 1)
        outs = []
        for i, (xc, yc) in enumerate(zip(x.chunk(n_rep * m), y.chunk(n_rep * m))):
            outs.append(vg(self.params, self.buffers[i // m], xc, yc))  # updates the buffers in place
        return _combine(ex, outs, n_rep * m)

    def _f(self, params: Any, buffers: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        """The example's loss function with the buffers an input (torch.func refuses a write to a
        captured tensor)."""

        def call(p: Any, xx: torch.Tensor) -> Any:
            return torch.func.functional_call(self.module, (p, buffers), (xx,), tie_weights=True)

        return loss_function(self.ex, call)(params, x, y)

    def update(self, grads: dict[str, torch.Tensor]) -> None:
        for k, p in self.params.items():
            p.grad = grads[k]
        self.opt.step()


def _combine(ex: Example, outs: list[Any], n: int) -> tuple[Any, Any]:
    """(value, grads) of the whole step from the per-microbatch `grad_and_value` results."""
    mean = ex.loss == "mean"
    gs = [o[0] for o in outs]
    vals = [o[1] for o in outs]
    losses = [v[0] if ex.aux else v for v in vals]
    loss = sum(losses) / n if mean else sum(losses)
    pg = [g[0] if ex.grad_x else g for g in gs]
    grads: Any = {k: sum(g[k] for g in pg) / n if mean else sum(g[k] for g in pg) for k in pg[0]}
    if ex.grad_x:
        gx = torch.cat([g[1] for g in gs])
        grads = (grads, gx / n if mean else gx)
    if not ex.aux:
        return loss, grads
    aux = {}
    for a in ex.aux:
        parts = [v[1][a] for v in vals]
        if a == "float_mean":
            aux[a] = sum(parts) / n
        elif a == "float_rows":
            aux[a] = torch.cat(parts)
        else:
            aux[a] = torch.stack(parts).sum()
    return (loss, aux), grads


class Baseline:
    """fpipe on one stage (no boundaries), GPipe, no limit: the reference of a program with
    dropout (fpipe draws a mask per (step, microbatch, operation), on any stages and schedule)."""

    def __init__(self, ex: Example) -> None:
        self.ex = dataclasses.replace(ex, cuts=(), stages=None, limit=None, schedule="gpipe")
        self.b = build(self.ex, boundaries=False)
        self.module, self.params = self.b.module, self.b.params
        kw = {"out_axes": out_axes(ex)} if "bn_train" in ex.layers else {}
        self.piped = fpipe.pipeline(self.b.loss_fn, microbatches=ex.microbatches, schedule="gpipe", **kw)
        self.opt = torch.optim.SGD(list(self.params.values()), lr=LR, momentum=MOMENTUM)

    @property
    def buffers(self) -> list[dict[str, torch.Tensor]]:
        return [dict(self.module.named_buffers())]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
        return fpipe.value_and_grad(self.piped, self.b.argnums, self.b.has_aux)(self.params, x, y)

    def update(self, grads: dict[str, torch.Tensor]) -> None:
        fpipe.set_grads(self.params, grads)
        self.opt.step()


# -- comparing ------------------------------------------------------------------------------------
def compare(where: str, got: Any, want: Any, out: list[tuple[str, str]]) -> None:
    """Append (signature part, detail) for each leaf of `got` that differs from `want`."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            out.append((f"{where}:structure", f"{where}: keys {_keys(got)} != {sorted(want)}"))
            return
        for k in want:
            compare(f"{where}.{k}", got[k], want[k], out)
        return
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            out.append((f"{where}:structure", f"{where}: {type(got).__name__} != {type(want).__name__}"))
            return
        for i, (g, w) in enumerate(zip(got, want)):
            compare(f"{where}[{i}]", g, w, out)
        return
    _compare_tensor(where, got, want, out)


def _keys(got: Any) -> Any:
    return sorted(got) if isinstance(got, dict) else type(got).__name__


def _compare_tensor(where: str, got: Any, want: torch.Tensor, out: list[tuple[str, str]]) -> None:
    if not isinstance(got, torch.Tensor):
        out.append((f"{where}:missing", f"{where}: got {type(got).__name__}, want a tensor"))
    elif got.dtype != want.dtype:
        out.append(
            (
                f"{where}:dtype",
                f"{where}: dtype {got.dtype} (value {_short(got)}), want {want.dtype} ({_short(want)})",
            )
        )
    elif got.shape != want.shape:
        out.append((f"{where}:shape", f"{where}: shape {tuple(got.shape)}, want {tuple(want.shape)}"))
    elif not want.is_floating_point():
        if not torch.equal(got, want):
            out.append((f"{where}:value", f"{where}: {_short(got)}, want {_short(want)}"))
    elif not torch.allclose(got.detach(), want.detach(), rtol=RTOL, atol=ATOL, equal_nan=True):
        err = (got.detach() - want.detach()).abs().max().item()
        scale = want.detach().abs().max().item()
        out.append((f"{where}:value", f"{where}: max abs error {err:.3g} (max |want| {scale:.3g})"))


def _short(t: torch.Tensor) -> str:
    return str(t.detach().flatten()[:4].tolist())


# -- one example ----------------------------------------------------------------------------------
def make_pipeline(ex: Example, b: Built, mesh: Any = None, limit: int | None = None) -> Any:
    """The example's pipeline; a limit is `limit` or `ex.limit` x the peak predicted without one."""
    kw: dict[str, Any] = dict(stages=ex.stages, microbatches=ex.microbatches, schedule=ex.schedule)
    if "bn_train" in ex.layers:  # batch statistics: fpipe cannot read a reduction, so say it
        kw["out_axes"] = out_axes(ex)
    if mesh is not None or ex.pp * ex.dp > 1:  # on ranks: a failing example ends within a minute
        kw.update(mesh=mesh, timeout=DIST_TIMEOUT_S)
    if limit is not None:
        kw["memory_limit"] = limit
    elif ex.limit is not None:
        f = b.loss_fn if not b.has_aux else _loss_only(b.loss_fn)
        probe = {**kw, "out_axes": ex.loss} if "out_axes" in kw else kw
        peak = fpipe.pipeline(f, **probe).memory(b.params, b.x, b.y)
        kw["memory_limit"] = max(1, int(ex.limit * peak))
    return fpipe.pipeline(b.loss_fn, **kw)


def out_axes(ex: Example) -> Any:
    """How each output combines over microbatches, as the reference combines it. Passed only
    where the batch interacts (BatchNorm in training mode): there fpipe documents that it cannot
    read a scalar's reduction and averages it (docs/guide/contract.md, "The contract"); elsewhere it must read
    each one itself."""
    loss = ex.loss
    if not ex.aux:
        return loss
    return (loss, {a: {"float_mean": "mean", "float_rows": 0, "int_count": "sum"}[a] for a in ex.aux})


def _loss_only(f: Any) -> Any:
    def loss_only(params: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        return f(params, x, y)[0]

    return loss_only


def run_example(ex: Example) -> Outcome:
    """Run `ex` in this process (every stage here) and compare it with its reference."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with tempfile.TemporaryDirectory(prefix="fpipe-fuzz-") as tmp:
                problems = steps(ex, Path(tmp))
        except Exception as err:  # noqa: BLE001 -- every error is an outcome to report
            outcome = error_outcome(err)
        else:
            outcome = problems_outcome(problems)
    return with_warnings(outcome, [w.message for w in caught])


def with_warnings(outcome: Outcome, messages: list[Any]) -> Outcome:
    """The outcome with the warnings seen; a failure that fpipe warned about is marked
    "[warned]" in its signature (a wrong result with a warning is not a silent one)."""
    keys = tuple(sorted({warning_key(m) for m in messages}))
    sig = outcome.signature + (" [warned]" if keys and outcome.status == "fail" else "")
    return dataclasses.replace(outcome, signature=sig, warnings=keys)


def steps(
    ex: Example, tmp: Path, mesh: Any = None, rank: tuple[int, int] = (0, 0), replicas: int = 1
) -> list:
    """Two steps of `ex` against its reference; the mismatches (signature part, detail).
    `rank` = (dp rank, pp rank) and `replicas` (dp) for a multi-rank example."""
    b = build(ex)
    ref: Any = Baseline(ex) if "dropout" in ex.layers else Reference(ex, b, replicas)
    piped = make_pipeline(ex, b, mesh)
    xs, ys = (b.x.chunk(replicas)[rank[0]], b.y.chunk(replicas)[rank[0]]) if replicas > 1 else (b.x, b.y)
    params, opt, problems = b.params, None, []
    initial = {k: v.clone() for k, v in b.module.named_buffers()}
    held = set(initial)  # buffers equal to the reference after every step so far
    for step in (1, 2):
        try:
            value, grads = fpipe.value_and_grad(piped, b.argnums, b.has_aux)(params, xs, ys)
        except ValueError as err:  # a limit under the least fpipe can meet: run at that least one
            least = re.search(r"least limit fpipe can meet is memory_limit=(\d+)", str(err))
            if step == 2 or least is None:
                raise
            piped = make_pipeline(ex, b, mesh, int(least.group(1)))
            value, grads = fpipe.value_and_grad(piped, b.argnums, b.has_aux)(params, xs, ys)
        want_value, want_grads = ref.step(b.x, b.y)
        if ex.aux:
            compare(
                f"step{step}:loss", value[0] if isinstance(value, tuple) else value, want_value[0], problems
            )
            want_aux = {k: _replica(v, rank[0], replicas) if v.dim() else v for k, v in want_value[1].items()}
            compare(f"step{step}:aux", value[1] if isinstance(value, tuple) else None, want_aux, problems)
        else:
            compare(f"step{step}:loss", value, want_value, problems)
        got_g, want_g = _local(grads), _mine(want_grads, grads, rank[0], replicas)
        if ex.grad_x:
            compare(f"step{step}:grads", got_g[0], want_g[0], problems)
            compare(f"step{step}:grad_x", got_g[1], want_g[1], problems)
        else:
            compare(f"step{step}:grads", got_g, want_g, problems)
        _compare_buffers(
            f"step{step}:buffers", b.module, initial, ref.buffers[rank[0]], ex.pp > 1, held, problems
        )
        pgrads = grads[0] if ex.grad_x else grads
        if _have(pgrads):  # (a rank whose stages read no parameter has nothing to step)
            opt = opt or torch.optim.SGD([params[k] for k in _have(pgrads)], lr=LR, momentum=MOMENTUM)
            fpipe.set_grads(params, {k: pgrads[k] for k in _have(pgrads)})
            opt.step()
        ref.update(want_grads[0] if ex.grad_x else want_grads)
        if step == 1 and ex.save_load:
            params, opt = _round_trip(tmp, params, opt, piped, b.module)
            initial = {k: v.clone() for k, v in b.module.named_buffers()}  # as loaded, on every rank
    compare(
        "after:params",
        {k: params[k] for k in _have(pgrads)},
        {k: ref.params[k] for k in _have(pgrads)},
        problems,
    )
    if ex.pp > 1:  # a buffer no rank updated is a failure too (dist.py checks over the ranks)
        problems.append(("held:" + json.dumps({n: n in held for n in initial}), ""))
    return problems


def _compare_buffers(
    where: str, module: Any, initial: Any, want: Any, staged_elsewhere: bool, held: set[str], out: list
) -> None:
    """Each buffer against the reference; on ranks of a pipeline a buffer another rank's stage
    updates stays as it was here (`held` keeps those equal to the reference)."""
    for name, got in module.named_buffers():
        mine: list[tuple[str, str]] = []
        compare(f"{where}.{name}", got, want[name], mine)
        if mine:
            held.discard(name)
            if not (staged_elsewhere and torch.equal(got, initial[name])):
                out += mine


def _replica(t: torch.Tensor, dp_rank: int, replicas: int) -> torch.Tensor:
    """This replica's rows of a per-row output (each replica gets its own, as its data gradient)."""
    return t.chunk(replicas)[dp_rank] if replicas > 1 else t


def _have(grads: dict[str, Any]) -> list[str]:
    """The parameters this rank got gradients for (every one in one process)."""
    return [k for k, g in grads.items() if g is not None]


def _local(grads: Any) -> Any:
    """fpipe's gradients as compared: under a process group a parameter this rank does not use
    is None (and is left out); the data gradient is this replica's slice."""
    return _drop_none(grads)


def _mine(want: Any, got: Any, dp_rank: int, replicas: int) -> Any:
    """The reference's gradients restricted to what this rank holds (see `_local`)."""
    if isinstance(want, tuple):
        gx = want[1].chunk(replicas)[dp_rank] if replicas > 1 else want[1]
        return (_mine(want[0], got[0], dp_rank, replicas), gx)
    return {k: v for k, v in want.items() if got.get(k) is not None}


def _drop_none(grads: Any) -> Any:
    if isinstance(grads, tuple):
        return (_drop_none(grads[0]), grads[1])
    return {k: v for k, v in grads.items() if v is not None}


def _round_trip(
    tmp: Path, params: dict[str, torch.Tensor], opt: Any, piped: Any, module: torch.nn.Module
) -> tuple[Any, Any]:
    """fpipe.save of the parameters, optimizer and buffers; then the buffers are overwritten and
    all of it is loaded into fresh tensors, a fresh optimizer and the module (on every rank, one
    with no optimizer too: both are collective)."""
    fpipe.save(tmp / "ckpt", params, optimizer=opt, buffers=module, pipeline=piped)
    with torch.no_grad():
        for b in module.buffers():
            b.fill_(3)  # what the load must overwrite
    fresh = {k: torch.zeros_like(v) for k, v in params.items()}
    opt2 = None
    if opt is not None:
        mine = {id(p) for group in opt.param_groups for p in group["params"]}
        opt2 = torch.optim.SGD(
            [fresh[k] for k, v in params.items() if id(v) in mine], lr=LR, momentum=MOMENTUM
        )
    fpipe.load(tmp / "ckpt", fresh, optimizer=opt2, buffers=module, pipeline=piped)
    return fresh, opt2


# -- outcomes -------------------------------------------------------------------------------------
REFUSALS = {"least limit fpipe can meet": "memory_limit below the least limit fpipe can meet"}


def error_outcome(err: BaseException) -> Outcome:
    text = f"{type(err).__name__}: {err}"
    for needle, what in REFUSALS.items():
        if needle in text:
            return Outcome("refused", what, text[:300])
    return Outcome("fail", "error " + normalize(text)[:100], text[:2000])


def problems_outcome(problems: list[tuple[str, str]]) -> Outcome:
    held = [p for p, _ in problems if p.startswith("held:")]
    problems = [(p, d) for p, d in problems if not p.startswith("held:")]
    if not problems:
        return Outcome("ok", held=held[0][5:] if held else "")
    return Outcome("fail", signature(problems), "\n".join(d for _, d in problems[:12]))


def signature(problems: list[tuple[str, str]]) -> str:
    """What a failure is: the mismatches of its first step that has any (later ones follow
    from it), coarsened (`coarse`); a wrong gradient stands for the wrong aux values and data
    gradient that come with it."""
    parts = {coarse(p) for p, _ in problems}
    first = min(parts, key=lambda p: _ORDER.index(p.split(":", 1)[0]))
    parts = {p for p in parts if p.split(":", 1)[0] == first.split(":", 1)[0]}
    if any(p.endswith(":grads:value") for p in parts):
        parts = {p for p in parts if not (p.endswith(":value") and (":aux." in p or ":grad_x:" in p))}
    return " ".join(sorted(parts))


_ORDER = ["step1", "step2", "after", "buffers"]


def coarse(part: str) -> str:
    """A mismatch's signature part: which quantity of which step, not which parameter
    ("step1:grads:value", "step2:aux.int_count:dtype", "step1:buffers.running_mean:value")."""
    where, _, kind = part.rpartition(":")
    step, _, what = where.partition(":")
    head, _, rest = what.partition(".")
    if head in ("grads", "params"):
        return f"{step}:{head}:{kind}"
    if head == "buffers":
        return f"{step}:buffers.{rest.rsplit('.', 1)[-1]}:{kind}"
    return f"{step}:{what}:{kind}"


def normalize(text: str) -> str:
    """A message without what varies between examples: numbers, layer indices, names."""
    text = re.sub(r"fuzz_\d+_\d+", "f", text)
    text = re.sub(r"blocks\.\d+", "blocks.*", text)
    text = re.sub(r"\[\d+\]", "", text)
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", text)


def warning_key(message: Any) -> str:
    return normalize(str(message))[:90]
