"""torch.func transforms around a pipelined call in a process group (NOTE [transforms in a
group]), run inside existing launches: `trust_dist_worker` (2 ranks: pp=2 with 1F1B, ZB-H1 and
interleaved-1F1B over 4 stages) and its --mesh cases in the 4-rank launch (dp=2 x pp=2, and
pp=4). Each case's result on this rank against the unsplit function under torch.func (fp64):
the max abs error over every leaf, and the stages this rank ran. tests/pipeline/test_transforms_dist.py
asserts on the records.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import fpipe

D = 3


def chain(stages: int, out: str = "mean") -> Callable[..., Any]:
    """An MLP of `stages` layers with a boundary after each but the last; a mean-squared error
    (`out` "rows": each example's; "pair": each example's and the last activations)."""

    def f(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        h = x
        for i in range(stages):
            h = torch.tanh(h @ p[f"w{i}"] + p[f"b{i}"])
            h = fpipe.stage_boundary(h) if i < stages - 1 else h
        if out == "rows":
            return ((h - y) ** 2).mean(1)
        if out == "pair":
            return ((h - y) ** 2).mean(1), h
        return ((h - y) ** 2).mean()  # (F.mse_loss's double derivative fails under jvp of grad on torch 2.13)

    f.__name__ = f"chain{stages}"
    return f


def inner(stages: int) -> Callable[..., Any]:
    """`chain(stages)`'s MLP written with torch.func inside the function: the first layer per
    example under `vmap`, and a penalty on the gradient of tanh(h)^2 with respect to the last
    activations (`grad` inside the last stage)."""

    def g(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.func.vmap(lambda r: torch.tanh(r @ p["w0"] + p["b0"]))(x)
        for i in range(1, stages):
            h = torch.tanh(fpipe.stage_boundary(h) @ p[f"w{i}"] + p[f"b{i}"])
        pen = torch.func.grad(lambda t: (torch.tanh(t) ** 2).sum())(h)
        return ((h - y) ** 2).mean() + 0.1 * (pen**2).mean()

    g.__name__ = f"inner{stages}"
    return g


def data(stages: int, batch: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = {}
    for i in range(stages):
        p[f"w{i}"] = torch.randn(D, D, generator=g, dtype=torch.float64)
        p[f"b{i}"] = torch.randn(D, generator=g, dtype=torch.float64)
    x = torch.randn(batch, D, generator=g, dtype=torch.float64)
    return p, x, torch.randn(batch, D, generator=g, dtype=torch.float64)


def _err(got: Any, want: Any) -> float:
    a, _ = torch.utils._pytree.tree_flatten(got)
    b, _ = torch.utils._pytree.tree_flatten(want)
    assert len(a) == len(b), (len(a), len(b))
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def cases(
    piped: fpipe.Pipelined, stages: int, dp: int | None = None, n: int = 2, batch: int = 8
) -> dict[str, Any]:
    """Every supported transform of `piped` (of `chain(stages)`) against the unsplit function.
    On a dp mesh (`dp`: this replica of `n`), the rank passes its slice of the batch: `grad` is the whole
    batch's (as fpipe.value_and_grad), batched results are the replica's examples."""
    f = chain(stages)
    p, x, y = data(stages, batch, 7)
    mx, my = (x, y) if dp is None else (x.chunk(n)[dp], y.chunk(n)[dp])
    grad, vmap = torch.func.grad, torch.func.vmap
    ens = {k: torch.stack([v, 2 * v]) for k, v in p.items()}
    ct = torch.tensor(0.7, dtype=torch.float64)
    v = {k: torch.sin(t) for k, t in p.items()}  # tangents
    zs = torch.arange(3.0, dtype=torch.float64)
    vx = torch.cos(mx)  # on a dp mesh: this replica's slice of cos(x), the whole batch's tangent
    runs: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "grad": (lambda: grad(piped)(p, mx, my), lambda: grad(f)(p, x, y)),
        "grad_and_value": (
            lambda: torch.func.grad_and_value(piped, argnums=(0, 1))(p, mx, my),
            lambda: _gv_ref(f, p, x, y, dp, n),
        ),
        "vjp": (
            lambda: torch.func.vjp(piped, p, mx, my)[1](ct)[0],
            lambda: torch.func.vjp(f, p, x, y)[1](ct)[0],
        ),
        "vmap": (
            lambda: vmap(piped, in_dims=(None, 0, 0))(p, mx, my),
            lambda: vmap(f, in_dims=(None, 0, 0))(p, mx, my),
        ),
        "per_sample": (
            lambda: vmap(torch.func.grad_and_value(piped), in_dims=(None, 0, 0))(p, mx, my),
            lambda: vmap(torch.func.grad_and_value(f), in_dims=(None, 0, 0))(p, mx, my),
        ),
        "ensemble": (
            lambda: vmap(piped, in_dims=(0, None, None))(ens, mx, my),
            lambda: vmap(f, in_dims=(0, None, None))(ens, mx, my),
        ),
        "ensemble_fpipe_grad": (
            lambda: vmap(fpipe.grad(piped), in_dims=(0, None, None))(ens, mx, my),
            lambda: vmap(grad(f), in_dims=(0, None, None))(ens, mx, my),
        ),
        "jvp": (
            lambda: torch.func.jvp(piped, (p, mx, my), (v, vx, 0 * my)),
            lambda: torch.func.jvp(f, (p, x, y), (v, torch.cos(x), 0 * y)),
        ),
        "hvp": (
            lambda: torch.func.jvp(lambda q: grad(piped)(q, mx, my), (p,), (v,)),
            lambda: torch.func.jvp(lambda q: grad(f)(q, x, y), (p,), (v,)),
        ),
        **_vjp_runs(piped, stages, (p, x, y), dp, n),
        **_inner_runs(piped, stages, (p, mx, my), (x, y)),
        "vmap_of_something_else": (  # the call's inputs are not batched at the vmap's level
            lambda: vmap(lambda z: grad(piped)(p, mx, my)["w0"] * z)(zs),
            lambda: vmap(lambda z: grad(f)(p, x, y)["w0"] * z)(zs),
        ),
    }
    out: dict[str, Any] = {}
    for name, (got, want) in runs.items():
        try:
            out[name] = {"err": _err(got(), want()), "stages": piped.local_stages}
        except Exception as err:  # recorded: the test names it
            out[name] = {"error": f"{type(err).__name__}: {err}"}
    out["refused"] = _refusals(piped, p, mx, my)
    return out


def _inner_runs(piped: fpipe.Pipelined, stages: int, pxy: Any, whole: Any) -> dict[str, Any]:
    """`fpipe.value_and_grad` of a function that itself calls vmap and grad (`inner`): the loss
    and this rank's gradients (the ones it returns, at least one) against the unsplit function."""
    got: dict[str, Any] = {}

    def run() -> Any:
        got["v"] = fpipe.value_and_grad(_like(piped, inner(stages)))(*pxy)
        return got["v"]

    def ref() -> Any:
        grads, loss = torch.func.grad_and_value(inner(stages))(pxy[0], *whole)
        assert got["v"][1], "no gradient on this rank"
        return loss, {k: grads[k] for k in got["v"][1]}

    return {"inner_vmap_grad": (run, ref)}


def _like(piped: fpipe.Pipelined, f: Callable[..., Any], **over: Any) -> fpipe.Pipelined:
    """A pipeline of `f` with `piped`'s settings (and `over`)."""
    keys = ("stages", "microbatches", "schedule", "mesh", "timeout")
    return fpipe.pipeline(f, **{**{k: getattr(piped.cfg, k) for k in keys}, **over})


def _vjp_runs(piped: fpipe.Pipelined, stages: int, pxy: Any, dp: int | None, n: int) -> dict[str, Any]:
    """torch.func.vjp of batched outputs (each example's loss; and a pair with the activations),
    pulled back at a cotangent known only at vjp_fn's call: the value, and every argument's part
    (on a dp mesh: the replica's examples, and the whole batch's parameter gradient)."""
    p, x, y = pxy
    mine = (lambda t: t) if dp is None else (lambda t: t.chunk(n)[dp])
    ct = torch.linspace(-1.0, 1.0, x.shape[0], dtype=torch.float64)
    ch = torch.cos(torch.arange(x.numel(), dtype=torch.float64)).reshape(x.shape)
    out = {}
    todo: list[tuple[str, str, Any]] = [("vjp_batched", "rows", ct), ("vjp_tuple", "pair", (ct, ch))]
    for name, kind, cts in todo:
        f, piped_f = chain(stages, kind), _like(piped, chain(stages, kind))
        out[name] = (
            lambda f=piped_f, c=cts: _vjp_at(f, (p, mine(x), mine(y)), torch.utils._pytree.tree_map(mine, c)),
            lambda f=f, c=cts: _vjp_ref(f, (p, x, y), c, mine),
        )
    return out


def _vjp_at(f: Callable[..., Any], primals: tuple[Any, ...], ct: Any) -> Any:
    value, vjp_fn = torch.func.vjp(f, *primals)[:2]  # (torch.func.vjp's has_aux=True returns 3)
    return value, vjp_fn(ct)


def _vjp_ref(f: Callable[..., Any], primals: tuple[Any, ...], ct: Any, mine: Callable[..., Any]) -> Any:
    value, (gp, gx, gy) = _vjp_at(f, primals, ct)
    return torch.utils._pytree.tree_map(mine, value), (gp, mine(gx), mine(gy))


def _gv_ref(f: Callable[..., Any], p: Any, x: torch.Tensor, y: torch.Tensor, dp: int | None, n: int) -> Any:
    (gp, gx), v = torch.func.grad_and_value(f, argnums=(0, 1))(p, x, y)
    return (gp, gx if dp is None else gx.chunk(n)[dp]), v


def _refusals(piped: fpipe.Pipelined, p: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, str]:
    """Transforms fpipe does not distribute: the error each raises (before any transfer)."""
    rows = fpipe.pipeline(_per_row, microbatches=2, mesh=piped.cfg.mesh, timeout=piped.cfg.timeout)
    summed = _like(rows, _per_row, out_axes="sum")
    mixed = _like(rows, _rows_and_mean)
    wrong = torch.ones(x.shape[0] + 1, dtype=torch.float64)
    calls = {
        "jacrev": lambda: torch.func.jacrev(lambda q: torch.func.vmap(piped, in_dims=(None, 0, 0))(q, x, y))(
            p
        ),
        "vmap_jvp": lambda: torch.func.vmap(lambda xb: torch.func.jvp(lambda q: piped(q, xb, y), (p,), (p,)))(
            x[None]
        ),
        "grad_of_grad": lambda: torch.func.grad(lambda q: _sq(torch.func.grad(piped)(q, x, y)))(p),
        "vjp_summed": lambda: torch.func.vjp(lambda q: summed(q, x, y), p),
        "vjp_mixed": lambda: torch.func.vjp(lambda q: mixed(q, x, y), p),
        "jacrev_batched": lambda: torch.func.jacrev(lambda q: rows(q, x, y))(p),
        "vjp_ct_shape": lambda: torch.func.vjp(lambda q: rows(q, x, y), p)[1](wrong),
        "vmap_randomness": lambda: torch.func.vmap(piped, in_dims=(None, 0, 0), randomness="different")(
            p, x, y
        ),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "not refused"
        except Exception as err:  # (the test requires a ValueError's message)
            out[name] = f"{type(err).__name__}: {err}"
    return out


def _per_row(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each row's squared error: an output that is not a scalar."""
    h = fpipe.stage_boundary(torch.tanh(x @ p["w0"]))
    return ((torch.tanh(h @ p["w1"]) - y) ** 2).mean(1)


def _rows_and_mean(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
    """Each row's squared error, then their mean: a scalar after a batched first output."""
    rows = _per_row(p, x, y)
    return rows, rows.mean()


def _sq(g: dict[str, torch.Tensor]) -> torch.Tensor:
    return sum((v**2).sum() for v in g.values())  # type: ignore[return-value]


def with_meta(piped: fpipe.Pipelined, rank: int) -> dict[str, Any]:
    """2 stages, 2 ranks, each passing the other's parameters on the meta device (as
    `materialize` leaves them): its own parameters' results match; the others' are meta;
    per-sample gradients are refused."""
    f = chain(2)
    p, x, y = data(2, 8, 7)
    mine = {k: (v if k.endswith(str(rank)) else v.to("meta")) for k, v in p.items()}
    v = {k: torch.sin(t) for k, t in mine.items()}
    grad = torch.func.grad
    runs = {
        "grad": (lambda: grad(piped)(mine, x, y), lambda: grad(f)(p, x, y)),
        "hvp": (
            lambda: torch.func.jvp(lambda q: grad(piped)(q, x, y), (mine,), (v,))[1],
            lambda: torch.func.jvp(
                lambda q: grad(f)(q, x, y), (p,), ({k: torch.sin(t) for k, t in p.items()},)
            )[1],
        ),
    }
    out: dict[str, Any] = {}
    for name, (got, want) in runs.items():
        try:
            g, w = got(), want()
            meta = sorted(k for k, t in g.items() if t.is_meta)
            err = max((g[k] - w[k]).abs().max().item() for k in g if not g[k].is_meta)
            out[name] = {"err": err, "meta": meta, "stages": piped.local_stages}
        except Exception as err:  # recorded: the test names it
            out[name] = {"error": f"{type(err).__name__}: {err}"}
    try:  # refused on both ranks (each passes a meta parameter)
        torch.func.vmap(grad(piped), in_dims=(None, 0, 0))(mine, x, y)
        out["per_sample_refused"] = "not refused"
    except ValueError as err:
        out["per_sample_refused"] = str(err)
    return out


def run_pp(timeout: float = 60.0) -> dict[str, Any]:
    """On the whole group as one pipeline: 2 stages with 1F1B and ZB-H1, 4 stages interleaved
    (on 2 ranks), or 4 stages 1F1B (on 4 ranks)."""
    world = torch.distributed.get_world_size()
    rec: dict[str, Any] = {}
    if world == 2:
        for sched in ("1f1b", "zb-h1"):
            rec[sched] = cases(fpipe.pipeline(chain(2), microbatches=2, schedule=sched, timeout=timeout), 2)
        interleaved = fpipe.pipeline(chain(4), microbatches=2, schedule="interleaved-1f1b", timeout=timeout)
        rec["interleaved-1f1b"] = cases(interleaved, 4)
        rank = torch.distributed.get_rank()
        rec["meta"] = with_meta(fpipe.pipeline(chain(2), microbatches=2, timeout=timeout), rank)
    else:
        rec["1f1b"] = cases(fpipe.pipeline(chain(4), microbatches=2, timeout=timeout), 4)
    return rec
