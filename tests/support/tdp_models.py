"""Models in the style of torch.distributed.pipelining's test model zoo (its
test/distributed/pipelining/model_registry.py), written here, tiny and in float64: cut points
written as `pipe_split()` calls or as a `split_spec` dict. `tests/tracing/test_from_tdp.py` runs them in one
process and `tests/support/trust_dist_worker.py` on 2 gloo ranks; both compare with
`torch.func.grad_and_value` of the unsplit function.

Each entry of `ZOO`: (model class, the `pipeline` keyword arguments that cut it, and per stage the
parameters its forward program reads).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipe_split

import fpipe

D, BATCH = 4, 8


class BufferAcross(nn.Module):
    """ExampleCode's shape: a keyword input `y`, and a copy of a buffer made before the cut and
    read after it."""

    def __init__(self) -> None:
        super().__init__()
        self.mm_param0 = nn.Parameter(torch.randn(D, D))
        self.mm_param1 = nn.Parameter(torch.randn(D, D))
        self.register_buffer("cval", torch.randn(D))
        self.lin0, self.lin1 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        x = torch.relu(torch.mm(x, self.mm_param0) + (0 if y is None else y))
        a_constant = self.cval.clone()  # made on stage 0's side, read on stage 1's
        x = self.lin0(x)
        pipe_split()
        x = torch.relu(x) + a_constant
        return torch.relu(self.lin1(torch.mm(x, self.mm_param1)))


class ParamAlias(nn.Module):
    """ModelWithParamAlias's shape: one parameter and one Linear under two names each, used on
    both sides of the cut."""

    def __init__(self) -> None:
        super().__init__()
        self.mm_param1 = self.mm_param0 = nn.Parameter(torch.randn(D, D))
        self.lin1 = self.lin0 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.lin0(torch.mm(x, self.mm_param0) + y)
        pipe_split()  # before the relu: not where fpipe's automatic 2-stage cut would go
        return torch.relu(self.lin1(torch.mm(torch.relu(x), self.mm_param1)))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1, self.net2 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(torch.relu(self.net1(x)))


class ThreeSplits(nn.Module):
    """MultiMLP's shape, four MLPs and three `pipe_split()` calls, with a skip from the input."""

    def __init__(self) -> None:
        super().__init__()
        self.mlps = nn.ModuleList(Mlp() for _ in range(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.mlps[0](x)
        for mlp in self.mlps[1:]:
            pipe_split()
            h = mlp(h) + x  # the input read on every stage
        return h + y


class Layers(nn.Module):
    """No markers in the code: a `split_spec` says where stages begin."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Mlp() for _ in range(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x + y


def _mlp_keys(prefix: str) -> list[str]:
    return [f"{prefix}.{n}.{w}" for n in ("net1", "net2") for w in ("bias", "weight")]


SPEC = {"layers.1": SplitPoint.BEGINNING, "layers.2": SplitPoint.END}
ZOO: dict[str, tuple[type[nn.Module], dict[str, Any], list[list[str]]]] = {
    "buffer_across": (
        BufferAcross,
        {},
        [["lin0.bias", "lin0.weight", "mm_param0"], ["lin1.bias", "lin1.weight", "mm_param1"]],
    ),
    # each alias pair is one parameter under its first registered name (`a = b = ...` assigns
    # `a` first): read on both stages
    "param_alias": (ParamAlias, {}, [["lin1.bias", "lin1.weight", "mm_param1"]] * 2),
    "three_splits": (ThreeSplits, {}, [_mlp_keys(f"mlps.{i}") for i in range(4)]),
    "split_spec": (
        Layers,
        {"cuts": SPEC},
        [_mlp_keys("layers.0"), _mlp_keys("layers.1") + _mlp_keys("layers.2"), _mlp_keys("layers.3")],
    ),
}


# on 2 ranks (tests/support/trust_dist_worker.py): the pipeline options, and per stage the parameters
TWO_RANKS: dict[str, tuple[dict[str, Any], list[list[str]]]] = {
    name: (options, per_stage) for name, (_, options, per_stage) in ZOO.items() if len(per_stage) == 2
}
TWO_RANKS["split_spec"] = (
    {"cuts": {"layers.1": SplitPoint.END}},
    [_mlp_keys("layers.0") + _mlp_keys("layers.1"), _mlp_keys("layers.2") + _mlp_keys("layers.3")],
)
TWO_RANKS["three_splits"] = ({"schedule": "interleaved-1f1b"}, ZOO["three_splits"][2])  # 2 per rank


def build(name: str, seed: int = 0) -> tuple[Any, dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """`(loss, params, (x, y, target))` for zoo model `name` in float64; the model's second input
    is passed by keyword, as TDP's `kwargs` are."""
    torch.manual_seed(seed)
    fn, params = fpipe.functionalize(ZOO[name][0]().double())

    def loss(
        p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        return F.mse_loss(fn(p, x, y=y), target)

    g = torch.Generator().manual_seed(seed + 1)
    data = tuple(torch.randn(BATCH, D, generator=g, dtype=torch.float64) for _ in range(3))
    return loss, params, data


def forward_ops(c: Any) -> dict[int, int]:
    """Per stage, the operations of its forward program (`c`: a compiled entry): where the cut is."""
    return {s: prog.n_nodes for (kind, s), prog in c.staged.programs.items() if kind == "F"}


def stage_params(c: Any) -> list[list[str]]:
    """Per stage, the parameter keys its forward program reads (`c`: a compiled entry)."""
    st = c.staged
    reads = {s: set(prog.inputs) for (kind, s), prog in st.programs.items() if kind == "F"}
    return [
        sorted(c.param_keys[i] for i, n in enumerate(st.param_inputs) if n in reads[s]) for s in sorted(reads)
    ]
