"""An honest reduction: `value_and_grad(piped)` equals `torch.func.grad_and_value(f)` for the
ways a loss reduces its batch (NOTE [an honest reduction] in fpipe/_src/pipeline/reduction.py), and the
1/M factor is applied in the loss's precision."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import assert_trees_close

import fpipe

M = 4


def _params(dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "emb": torch.randn(11, 6, generator=g, dtype=dtype),
        "w": torch.randn(6, 6, generator=g, dtype=dtype) / 3,
        "v": torch.randn(6, 5, generator=g, dtype=dtype) / 3,
    }


def _hidden(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = fpipe.stage_boundary(torch.tanh(x @ p["w"]))
    return h @ p["v"]  # (..., 5)


LOSSES = {
    "sum": lambda p, x, t: _hidden(p, x).pow(2).sum(),
    "mean": lambda p, x, t: _hidden(p, x).pow(2).mean(),
    "sum / batch rows": lambda p, x, t: _hidden(p, x).pow(2).sum() / x.shape[0],
    "sum / numel": lambda p, x, t: (lambda y: y.sum() / y.numel())(_hidden(p, x)),
    "sum / a constant": lambda p, x, t: _hidden(p, x).sum() / 1000.0,
    "sum / a constant equal to the microbatch size": lambda p, x, t: _hidden(p, x).sum() / 2,
    "mean over batch, then sum": lambda p, x, t: _hidden(p, x).mean(0).sum(),
    "sum over batch, then mean": lambda p, x, t: _hidden(p, x).sum(0).mean(),
    "cross_entropy sum": lambda p, x, t: F.cross_entropy(_hidden(p, x), t, reduction="sum"),
    "cross_entropy mean": lambda p, x, t: F.cross_entropy(_hidden(p, x), t),
    "mse sum * 0.5": lambda p, x, t: 0.5 * F.mse_loss(_hidden(p, x), torch.ones(x.shape[0], 5, dtype=x.dtype), reduction="sum"),
    "mean + weight decay": lambda p, x, t: _hidden(p, x).pow(2).mean() + 1e-2 * p["w"].pow(2).sum(),
    "sum of two sums": lambda p, x, t: _hidden(p, x).sum() - 2 * _hidden(p, x).pow(2).sum(),
    # followed through attention, split + cat and masked writes (what tensor-parallel and
    # sequence-parallel programs are made of): a sum stays a sum
    "sum through attention": lambda p, x, t: (lambda q: F.scaled_dot_product_attention(q, q, q).sum())(_hidden(p, x).view(-1, 1, 1, 5)),
    "sum through split and cat": lambda p, x, t: torch.cat(_hidden(p, x).split([2, 3], dim=1)[::-1], 1).pow(2).sum(),
    "sum through a masked write": lambda p, x, t: _masked(_hidden(p, x)).sum(),
}  # fmt: skip


def _masked(h: torch.Tensor) -> torch.Tensor:
    out = h.clone()
    out[h < 0] = 0.0
    return out


@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_and_grads_equal_the_unsplit_function(name: str) -> None:
    f = LOSSES[name]
    p, x = _params(), torch.randn(8, 6, dtype=torch.float64)
    t = torch.randint(0, 5, (8,))
    piped = fpipe.pipeline(f, microbatches=M)
    loss, grads = fpipe.value_and_grad(piped)(p, x, t)
    ref_grads, ref_loss = torch.func.grad_and_value(f)(p, x, t)
    torch.testing.assert_close(loss, ref_loss)
    assert_trees_close(grads, ref_grads)
    torch.testing.assert_close(piped(p, x, t), f(p, x, t))  # the plain call reduces alike


def test_a_language_model_loss_through_an_embedding_and_flattened_tokens_is_a_mean() -> None:
    def lm(p: dict[str, torch.Tensor], idx: torch.Tensor, targets: torch.Tensor, how: str) -> torch.Tensor:
        logits = _hidden(p, p["emb"][idx])  # (B, T, 5)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=how)

    p, idx, tg = _params(), torch.randint(0, 11, (8, 3)), torch.randint(0, 5, (8, 3))
    for how in ("mean", "sum"):
        piped = fpipe.pipeline(lm, microbatches=M)
        loss, grads = fpipe.value_and_grad(piped)(p, idx, tg, how)
        ref_grads, ref_loss = torch.func.grad_and_value(lm)(p, idx, tg, how)
        torch.testing.assert_close(loss, ref_loss)
        assert_trees_close(grads, ref_grads)


def test_a_sum_plus_a_term_that_is_not_summed_over_the_batch_warns_naming_out_axes() -> None:
    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return _hidden(p, x).sum() + p["w"].pow(2).sum()

    p, x = _params(), torch.randn(8, 6, dtype=torch.float64)
    piped = fpipe.pipeline(f, microbatches=M)
    with pytest.warns(
        UserWarning, match=r"microbatches=4\): output 0 adds a sum over the batch .*out_axes='sum'"
    ):
        fpipe.value_and_grad(piped)(p, x)


def test_out_axes_given_by_the_user_wins() -> None:
    f = LOSSES["mean"]
    p, x, t = _params(), torch.randn(8, 6, dtype=torch.float64), torch.zeros(8, dtype=torch.long)
    loss = fpipe.value_and_grad(fpipe.pipeline(f, microbatches=M, out_axes="sum"))(p, x, t)[0]
    ref = sum(f(p, xm, t) for xm in x.split(2))
    torch.testing.assert_close(loss, ref)


def test_a_bf16_parameter_first_does_not_round_the_microbatch_scaling() -> None:
    """A bf16 parameter first in the params dict, an fp32 loss, 3 microbatches: 1/3 used to be
    taken in bf16 (0.33398), biasing every fp32 gradient by 0.2 %."""

    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        h = fpipe.stage_boundary(torch.tanh(x @ p["a"].float() @ p["w"]))
        return (h @ p["v"]).pow(2).mean()

    g = torch.Generator().manual_seed(1)
    p = {
        "a": torch.eye(4, dtype=torch.bfloat16),
        "w": torch.randn(4, 4, generator=g),
        "v": torch.randn(4, generator=g),
    }
    x = torch.randn(6, 4, generator=g)
    _, grads = fpipe.value_and_grad(fpipe.pipeline(f, microbatches=3))(p, x)
    ref = torch.func.grad(f)(p, x)
    for k in ("w", "v"):
        rel = ((grads[k] - ref[k]).norm() / ref[k].norm()).item()
        assert rel < 1e-5, (k, rel)
