"""The fuzzer's grammar: an `Example` is a tiny program (a list of layers over a batch of row
vectors, a loss, optional aux outputs) and the settings to pipeline it with.

Everything is drawn from `random.Random((seed, index))`, so an example is a pure function of
(seed, index, enabled features); `Example.describe()` prints it and `Example.build()` makes its
module, loss function and data. Features (`FEATURES`) switch grammar productions and settings on
and off; a switched-off feature is never drawn.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint

import fpipe

DT = torch.float64
D = 4  # features per row
C = 3  # classes
BATCH = 8

# layer kinds of the grammar -> the feature that enables them (None: always on)
LAYERS: dict[str, str | None] = {
    "lin": None,  # h = tanh(h @ W + b)
    "res": None,  # h = h + sin(h @ W)
    "buf_rw": "buffer_rw",  # buffer.add_(1); h = tanh(h @ W + buffer * 0.25) + h   (case 1)
    "buf_read": "buffer_read",  # h = h * buffer (read only)
    "bn_train": "bn_train",  # BatchNorm1d in training mode (running statistics written; case 2)
    "bn_eval": "bn_eval",  # BatchNorm1d in eval mode (running statistics read)
    "dropout": "dropout",  # F.dropout(h, 0.3, training=True)
    "inplace": "inplace",  # h = h @ W; h += x; h.mul_(0.5)
    "ckpt": "checkpoint",  # torch.utils.checkpoint(tanh(h @ W) + h, use_reentrant=False)
    "tied": "tied",  # h = tanh(tied_linear(h)), every tied layer's weight the same Parameter
}
PROGRAM_FEATURES = (
    "buffer_rw", "buffer_read", "bn_train", "bn_eval", "dropout", "inplace", "checkpoint", "tied",
    "boundaries", "sum_loss", "float_aux", "int_aux", "argnums_data",
)  # fmt: skip
SETTING_FEATURES = ("memory_limit", "save_load", "auto_stages", "dist")
FEATURES = PROGRAM_FEATURES + SETTING_FEATURES
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "looped-bfs", "zbv", "dualpipev")
LIMIT_FRACTIONS = (0.5, 0.7, 0.8, 0.9)


@dataclasses.dataclass(frozen=True)
class Example:
    """One fuzz case. `layers` is the program; `cuts` the layer indices a stage_boundary follows."""

    seed: int
    index: int
    layers: tuple[str, ...]
    cuts: tuple[int, ...]
    loss: str  # "mean" | "sum"
    aux: tuple[str, ...]  # of "float_mean", "float_rows", "int_count"
    grad_x: bool  # argnums=(0, 1): gradients with respect to the data too
    microbatches: int
    schedule: str
    stages: int | None  # stages=N for a function without boundaries (fpipe cuts it)
    limit: float | None  # memory_limit as a fraction of the unconstrained predicted peak
    save_load: bool  # fpipe.save / fpipe.load between the two steps
    dp: int = 1  # replicas (multi-rank examples only)
    pp: int = 1  # pipeline ranks (1: every stage in this process)

    @property
    def features(self) -> set[str]:
        """The features this example exercises (what the campaign summary counts)."""
        out = {LAYERS[k] for k in self.layers if LAYERS[k] is not None}
        out |= {"boundaries"} if self.cuts else set()
        out |= {"sum_loss"} if self.loss == "sum" else set()
        out |= {"int_aux" if a == "int_count" else "float_aux" for a in self.aux}
        out |= {"argnums_data"} if self.grad_x else set()
        out |= {"memory_limit"} if self.limit is not None else set()
        out |= {"save_load"} if self.save_load else set()
        out |= {"auto_stages"} if self.stages is not None else set()
        out |= {"dist"} if self.pp * self.dp > 1 else set()
        out |= {"dp"} if self.dp > 1 else set()
        return {f for f in out if f is not None}

    @property
    def n_stages(self) -> int:
        return self.stages if self.stages is not None else len(self.cuts) + 1

    def describe(self) -> str:
        """`Example(...)` as Python source (double quotes only: it goes inside shell quotes)."""
        fields = dataclasses.asdict(self)
        return "Example(" + ", ".join(f"{k}={_src(v)}" for k, v in fields.items()) + ")"

    def build(self) -> Built:
        return build(self)


def _src(v: Any) -> str:
    if isinstance(v, str):
        return '"' + v + '"'
    if isinstance(v, tuple):
        return "(" + ", ".join(_src(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    return repr(v)


def parse(text: str) -> Example:
    """An `Example.describe()` string back into the example."""
    ex = eval(text, {"__builtins__": {}}, {"Example": Example})  # noqa: S307 -- our own format
    if not isinstance(ex, Example):
        raise ValueError(f"not an Example(...): {text!r}")
    return ex


def draw(seed: int, index: int, features: set[str], world: int = 1) -> Example:
    """The example at (seed, index) with only `features` enabled. `world` > 1: a multi-rank
    example for the shared torchrun launch (dp x pp = world; no dropout there, see check.py)."""
    rng = random.Random(f"{seed}:{index}:{world}")
    dp = rng.choice([d for d in (1, 2, 4) if world % d == 0]) if world > 1 else 1
    pp = world // dp
    kinds = [
        k for k, f in LAYERS.items() if (f is None or f in features) and not (world > 1 and k == "dropout")
    ]
    n_stages = rng.choice((pp, 2 * pp)) if world > 1 else None
    n_layers = (
        rng.randint(1, 3) if n_stages is None else rng.randint(max(1, n_stages - 1), max(4, n_stages - 1))
    )
    layers = tuple(rng.choice(kinds) for _ in range(n_layers))
    if n_stages is None:
        n_cuts = rng.randint(0, min(3, len(layers))) if "boundaries" in features else 0
    else:
        n_cuts = n_stages - 1 if "boundaries" in features else 0
    cuts = tuple(sorted(rng.sample(range(len(layers)), n_cuts)))
    aux = tuple(
        a
        for a, f in (("float_mean", "float_aux"), ("float_rows", "float_aux"), ("int_count", "int_aux"))
        if f in features and rng.random() < 0.4
    )
    per_replica = BATCH // dp
    ms = [
        m for m in (1, 2, 4) if per_replica % m == 0 and (per_replica // m >= 2 or "bn_train" not in layers)
    ]
    ex = Example(
        seed=seed, index=index, layers=layers, cuts=cuts,
        loss="sum" if "sum_loss" in features and rng.random() < 0.4 else "mean",
        aux=aux, grad_x="argnums_data" in features and rng.random() < 0.3,
        microbatches=rng.choice(ms), schedule="1f1b", stages=None,
        limit=rng.choice(LIMIT_FRACTIONS) if "memory_limit" in features and rng.random() < 0.3 else None,
        save_load="save_load" in features and rng.random() < 0.25, dp=dp, pp=pp,
    )  # fmt: skip
    if n_stages is not None and not cuts and n_stages > 1:
        ex = dataclasses.replace(ex, stages=n_stages)
    elif not cuts and "auto_stages" in features and world == 1 and rng.random() < 0.5:
        ex = dataclasses.replace(ex, stages=rng.randint(1, 3))
    return dataclasses.replace(ex, schedule=rng.choice(schedules_for(ex) or ("1f1b",)))


def schedules_for(ex: Example) -> tuple[str, ...]:
    """The schedules that build for the example's stages and microbatches (and its pp ranks)."""
    out = []
    for name in SCHEDULES:
        try:
            if ex.pp * ex.dp > 1:
                s = fpipe.schedules.build(name, pp=ex.pp, microbatches=ex.microbatches)
                if s.n_stages != ex.n_stages:
                    continue
            else:
                fpipe.schedules.build(name, microbatches=ex.microbatches, stages=ex.n_stages)
        except (ValueError, TypeError):
            continue
        out.append(name)
    return tuple(out)


# -- the program ----------------------------------------------------------------------------------
class Net(torch.nn.Module):
    """The example's layers as a module; `boundaries=False` leaves the stage boundaries out (the
    dropout baseline: fpipe's masks do not depend on the stages)."""

    def __init__(self, ex: Example, boundaries: bool = True) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(ex.seed * 1_000_003 + ex.index)
        self.ex, self.boundaries = ex, boundaries
        self.blocks = torch.nn.ModuleList(_layer(kind, g) for kind in ex.layers)
        if "tied" in ex.layers:  # the tied layers' one weight, read on each of their stages
            self.shared = torch.nn.Parameter(_rand(g, D, D) * 0.6)
            for kind, block in zip(ex.layers, self.blocks):
                if kind == "tied":
                    block.weight = self.shared
        self.head = torch.nn.Linear(D, C).to(DT)
        with torch.no_grad():  # from the example's generator, not the process's
            self.head.weight.copy_(_rand(g, C, D) * 0.5)
            self.head.bias.copy_(_rand(g, C) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i, (kind, block) in enumerate(zip(self.ex.layers, self.blocks)):
            h = _apply(kind, block, h, x)
            if self.boundaries and i in self.ex.cuts:
                h = fpipe.stage_boundary(h)
        return self.head(h)


def _rand(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=DT)


def _layer(kind: str, g: torch.Generator) -> torch.nn.Module:
    m = torch.nn.Module()
    if kind in ("bn_train", "bn_eval"):
        bn = torch.nn.BatchNorm1d(D).to(DT)
        bn.running_mean.copy_(_rand(g, D) * 0.3)
        bn.running_var.copy_(_rand(g, D).abs() + 0.5)
        return bn.train(kind == "bn_train")
    if kind != "tied":
        m.weight = torch.nn.Parameter(_rand(g, D, D) * 0.6)
    if kind == "ckpt":
        m.plain = False  # True in the reference's copy (check.py)
    if kind == "lin":
        m.bias = torch.nn.Parameter(_rand(g, D) * 0.1)
    if kind == "buf_rw":
        m.register_buffer("step", torch.zeros((), dtype=DT))
    if kind == "buf_read":
        m.register_buffer("scale", _rand(g, D).abs() + 0.5)
        del m.weight
    if kind == "dropout":
        del m.weight
    return m


def _apply(kind: str, m: Any, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if kind == "lin":
        return torch.tanh(h @ m.weight + m.bias)
    if kind == "res":
        return h + torch.sin(h @ m.weight)
    if kind == "buf_rw":
        m.step.add_(1)
        return torch.tanh(h @ m.weight + m.step * 0.25) + h
    if kind == "buf_read":
        return h * m.scale
    if kind in ("bn_train", "bn_eval"):
        return m(h)
    if kind == "dropout":
        return F.dropout(h, 0.3, training=True)
    if kind == "inplace":
        h = h @ m.weight
        h += x
        return h.mul_(0.5)
    if kind == "ckpt":  # the reference runs the region plainly: torch.func refuses checkpoint's hooks
        if not m.plain:
            return checkpoint.checkpoint(_region, h, m.weight, use_reentrant=False)
        return _region(h, m.weight)
    if kind == "tied":
        return torch.tanh(h @ m.weight)
    raise AssertionError(kind)


def _region(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ w) + h


# -- the loss function ----------------------------------------------------------------------------
@dataclasses.dataclass
class Built:
    """The example made concrete: its module, the function to pipeline, and its data."""

    module: Net
    params: dict[str, torch.Tensor]  # functionalize's, cloned: what the steps update
    loss_fn: Any
    x: torch.Tensor
    y: torch.Tensor
    argnums: int | tuple[int, ...]
    has_aux: bool


def loss_function(ex: Example, call: Any) -> Any:
    """`f(params, x, y)`: the loss (and aux dict) of the example over `call(params, x)`'s logits."""

    def f(params: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out = call(params, x)
        loss = F.cross_entropy(out, y, reduction="sum" if ex.loss == "sum" else "mean")
        if not ex.aux:
            return loss
        aux: dict[str, torch.Tensor] = {}
        for a in ex.aux:
            if a == "float_mean":
                aux[a] = out.pow(2).mean()
            elif a == "float_rows":
                aux[a] = out[:, 0] * 2.0
            else:
                aux[a] = (out.argmax(-1) == y).sum()
        return loss, aux

    f.__name__ = f"fuzz_{ex.seed}_{ex.index}"
    return f


def build(ex: Example, boundaries: bool = True) -> Built:
    module = Net(ex, boundaries)
    fn, params = fpipe.functionalize(module)
    g = torch.Generator().manual_seed(ex.seed * 7919 + ex.index + 1)
    x = _rand(g, BATCH, D)
    y = torch.randint(0, C, (BATCH,), generator=g)
    argnums = (0, 1) if ex.grad_x else 0
    params = {k: v.detach().clone() for k, v in params.items()}
    return Built(module, params, loss_function(ex, fn), x, y, argnums, bool(ex.aux))
