"""Outputs keep their dtype and say what they cannot honour, in one process (NOTE [outputs keep
their dtype] in fpipe/_src/pipeline/out_reduce.py, NOTE [interacting examples] in fpipe/_src/pipeline/reduction.py).
The same cases across ranks: tests/pipeline/test_outputs_dist.py. References: the unsplit function under
`torch.func` in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import assert_trees_close

import fpipe


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w0": torch.randn(4, 6, generator=g, dtype=torch.float64),
        "w1": torch.randn(6, 3, generator=g, dtype=torch.float64),
    }


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)


def _logits(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return fpipe.stage_boundary(torch.tanh(x @ p["w0"])) @ p["w1"]


def accuracy(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
    """A loss and an accuracy count returned as aux (case 14 of issue 24)."""
    logits = _logits(p, x)
    return F.cross_entropy(logits, y), (logits.argmax(-1) == y).sum()


@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_an_integer_count_is_summed_and_keeps_its_dtype(microbatches):
    """The count over microbatches is the whole batch's count, an int64, in a plain call and in
    value_and_grad (it was averaged into a float: 0.5 for 1 at 2 microbatches)."""
    p, (x, y) = _params(), _data()
    piped = fpipe.pipeline(accuracy, microbatches=microbatches)
    (loss, count), grads = fpipe.value_and_grad(piped, has_aux=True)(p, x, y)
    (ref_grads, (ref_loss, ref_count)) = torch.func.grad_and_value(accuracy, has_aux=True)(p, x, y)
    assert count.dtype == torch.int64 and count.item() == ref_count.item()
    torch.testing.assert_close(loss, ref_loss)
    assert_trees_close(grads, ref_grads)
    plain = piped(p, x, y)[1]
    assert plain.dtype == torch.int64 and plain.item() == ref_count.item()


def test_an_integer_averaged_is_refused_naming_the_output_and_the_fix():
    """out_axes='mean' for an integer count: refused, as torch.mean refuses integers."""
    p, (x, y) = _params(), _data()
    piped = fpipe.pipeline(accuracy, microbatches=2, out_axes=("mean", "mean"))
    with pytest.raises(
        ValueError,
        match=r"microbatches=2\): output 1 is a torch.int64 scalar that fpipe would average over the 2 microbatch values.*out_axes=\('mean', 'sum'\)",
    ):
        piped(p, x, y)


def test_an_integer_fpipe_cannot_read_is_refused():
    """The largest label of the batch: neither a sum nor a mean, and no integer average."""

    def f(p, x, y):
        return F.cross_entropy(_logits(p, x), y), y.max()

    p, (x, y) = _params(), _data()
    with pytest.raises(ValueError, match=r"output 1 is a torch.int64 scalar that fpipe would average"):
        fpipe.pipeline(f, microbatches=2)(p, x, y)
    loss, top = fpipe.pipeline(f, microbatches=1)(p, x, y)  # one value: nothing combined
    assert top.dtype == torch.int64 and top.item() == y.max().item()


def test_an_integer_that_does_not_depend_on_the_batch_is_returned_as_is():
    def f(p, x, y, n):
        return F.cross_entropy(_logits(p, x), y), n * 2

    p, (x, y) = _params(), _data()
    n = torch.tensor(7)
    loss, twice = fpipe.pipeline(f, microbatches=4, in_axes=(0, 0, None))(p, x, y, n)
    assert twice.dtype == torch.int64 and twice.item() == 14


def test_a_max_of_the_batch_warns_that_it_is_averaged():
    """A scalar that is neither a sum nor a mean (case 17): averaged over microbatches, with a
    warning naming the operation, in one process too (it warned only under tensor parallelism)."""

    def f(p, x, y):
        logits = _logits(p, x)
        return F.cross_entropy(logits, y), logits.max()

    p, (x, y) = _params(), _data()
    piped = fpipe.pipeline(f, microbatches=2)
    with pytest.warns(
        UserWarning,
        match=r"cannot read how output 1 reduces the batch \(it reduces the batch with aten.max.default.*averages the 2 microbatch values",
    ):
        _, top = piped(p, x, y)
    halves = [f(p, xm, ym)[1] for xm, ym in zip(x.split(4), y.split(4))]
    torch.testing.assert_close(top, sum(halves) / 2)  # what the warning says it does


def test_the_sum_plus_decay_warning_gives_advice_that_reproduces_the_function():
    """Case 17: the advice divides the decay by the values combined and passes out_axes='sum';
    following it gives the unsplit function's loss and gradients."""

    def f(p, x, y):
        return F.cross_entropy(_logits(p, x), y, reduction="sum") + p["w1"].pow(2).sum()

    def fixed(p, x, y):
        return F.cross_entropy(_logits(p, x), y, reduction="sum") + p["w1"].pow(2).sum() / 4

    p, (x, y) = _params(), _data()
    with pytest.warns(
        UserWarning,
        match=r"divide that term by 4 \(the number of values combined\) in the function and pass out_axes='sum'",
    ):
        fpipe.pipeline(f, microbatches=4)(p, x, y)
    loss, grads = fpipe.value_and_grad(fpipe.pipeline(fixed, microbatches=4, out_axes="sum"))(p, x, y)
    ref_grads, ref_loss = torch.func.grad_and_value(f)(p, x, y)
    torch.testing.assert_close(loss, ref_loss)
    assert_trees_close(grads, ref_grads)


def maml(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One inner gradient step over the whole batch, then the loss with the adapted weights."""
    inner = torch.func.grad(lambda w: F.cross_entropy(x @ p["w0"] @ w, y))(p["w1"])
    return F.cross_entropy(_logits({"w0": p["w0"], "w1": p["w1"] - 0.5 * inner}, x), y)


def centred(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A batch statistic feeding back into every example."""
    return F.cross_entropy(_logits(p, x - x.mean(0)), y)


@pytest.mark.parametrize("f, op", [(maml, "aten.nll_loss_forward"), (centred, "aten.mean.dim")])
def test_examples_that_interact_warn_naming_the_op_and_the_fix(f, op):
    """Case 18: the pipeline gives the per-microbatch function (it differs from the unsplit
    one); fpipe says so, naming where the batch is reduced, and microbatches=1 as the fix."""
    p, (x, y) = _params(), _data()
    with pytest.warns(
        UserWarning, match=rf"examples interact: {op}.* reduces over the batch.*microbatches=1"
    ):
        loss = fpipe.pipeline(f, microbatches=2)(p, x, y)
    assert not torch.allclose(loss, f(p, x, y))
    torch.testing.assert_close(fpipe.pipeline(f, microbatches=1)(p, x, y), f(p, x, y))  # no warning


def test_ordinary_losses_and_the_gpt_example_do_not_warn():
    """A loss reduced at the end is not an interaction (pytest turns any warning into an error);
    nor is the GPT of tests/support/models.py with its mean cross-entropy."""
    from models import GPT

    p, (x, y) = _params(), _data()
    fpipe.pipeline(accuracy, microbatches=4)(p, x, y)
    fpipe.pipeline(
        lambda p, x, y: F.cross_entropy(_logits(p, x), y) + 1e-2 * p["w0"].pow(2).sum(), microbatches=4
    )(p, x, y)
    model = GPT().to(torch.float64)
    fn, params = fpipe.functionalize(model)
    idx = torch.randint(0, 11, (4, 5))
    fpipe.value_and_grad(
        fpipe.pipeline(lambda q, i, t: F.cross_entropy(fn(q, i).flatten(0, 1), t.flatten()), microbatches=2)
    )(params, idx, idx)


def test_a_sum_divided_by_a_count_of_tokens_warns_that_it_is_averaged():
    """A loss normalised by the batch's count of labelled tokens: each microbatch divides by its
    own count, so no combination reproduces it; fpipe averages the values and says so."""

    def f(p, x, y):
        keep = (y > 0).to(x.dtype)
        per = F.cross_entropy(_logits(p, x), y, reduction="none")
        return (per * keep).sum() / keep.sum()

    p, (x, y) = _params(), _data()
    with pytest.warns(
        UserWarning,
        match=r"cannot read how output 0 reduces the batch, so it averages the 2 microbatch values",
    ):
        fpipe.pipeline(f, microbatches=2)(p, x, y)


def test_a_gradient_penalty_summed_over_the_batch_is_summed():
    """A loss that is a sum over the batch of an inner `torch.func.grad` with respect to the data
    (a gradient penalty) was averaged over microbatches on b6b0e74 (half the loss, wrong
    gradients, no warning): the reduction analysis now reads it as a sum (float64, exact)."""
    g = torch.Generator().manual_seed(0)
    p = {"a": torch.randn(4, 3, generator=g, dtype=torch.float64)}
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)

    def f(p, x):
        return torch.func.grad(lambda x: (x @ p["a"]).sin().sum())(x).pow(2).sum()

    got = fpipe.value_and_grad(fpipe.pipeline(f, microbatches=2))(p, x)
    assert_trees_close(got, torch.func.grad_and_value(f)(p, x)[::-1])


def test_a_sum_loss_after_an_eval_mode_batchnorm_is_summed():
    """Found by the fuzzer on b6b0e74 (docs/FUZZING.md): a sum over the batch after a BatchNorm in
    eval mode (running statistics read, not written) was averaged over microbatches: 9.26 where
    the unsplit function gives 37.04, no warning."""
    bn = torch.nn.BatchNorm1d(4).double().eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    fn, params = fpipe.functionalize(bn)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def f(p, x):
        return fn(p, x).pow(2).sum()

    got = fpipe.value_and_grad(fpipe.pipeline(f, microbatches=4))(params, x)
    assert_trees_close(got, torch.func.grad_and_value(f)(params, x)[::-1])


def test_an_unbind_beside_the_batch_keeps_it_readable():
    """`q, k, v = qkv.unbind(2)` (as attention in bf16 traces on CPU) keeps the batch in each
    piece: a sum loss after it is read as a sum, without a warning (it was unreadable: averaged,
    with the warning, once the warning held in every mode)."""
    g = torch.Generator().manual_seed(0)
    p = {"w": torch.randn(4, 12, generator=g, dtype=torch.float64)}
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)

    def g_(p, x):
        a, b, c = (x @ p["w"]).view(x.shape[0], 3, 4).unbind(1)
        return (a * b + c).sum()

    got = fpipe.value_and_grad(fpipe.pipeline(g_, microbatches=2))(p, x)
    assert_trees_close(got, torch.func.grad_and_value(g_)(p, x)[::-1])
