"""User mistakes raise ValueError/TypeError with a message that names the call, the numbers and the fix.

Messages are matched exactly (`re.escape` of the whole message), so a change to one is a visible,
reviewed change to this file.
"""

from __future__ import annotations

import re

import pytest
import torch
from models import MLP

import fpipe

DT = torch.float64


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    fn, params = fpipe.functionalize(MLP(stages=3).to(DT))

    def loss(params, x, y):
        return (fn(params, x) - y).pow(2).sum(-1).mean()

    return fn, params, loss


def _xy(batch: int):
    g = torch.Generator().manual_seed(5)
    return torch.randn(batch, 6, generator=g, dtype=DT), torch.randn(batch, 3, generator=g, dtype=DT)


def _raises(exc, message: str):
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


@pytest.mark.parametrize(("batch", "microbatches", "suggested"), [(10, 4, 2), (9, 8, 3), (7, 2, 1)])
def test_batch_not_divisible_by_microbatches(model, batch, microbatches, suggested):
    _, params, loss = model
    piped = fpipe.pipeline(loss, microbatches=microbatches)
    msg = (
        f"pipeline(loss, microbatches={microbatches}): batch size {batch} of argument 'x' (dim 0) is not "
        f"divisible by microbatches={microbatches}; use a batch that is a multiple of {microbatches} or "
        f"microbatches={suggested}."
    )
    with _raises(ValueError, msg):
        fpipe.value_and_grad(piped)(params, *_xy(batch))
    with _raises(ValueError, msg):
        piped(params, *_xy(batch))


def test_batch_not_divisible_names_a_keyword_argument():
    def f(w, x, *, mask):
        return (x @ w * mask).sum()

    piped = fpipe.pipeline(f, microbatches=4)
    w, x = torch.ones(2, 2, dtype=DT), torch.ones(8, 2, dtype=DT)
    msg = (
        "pipeline(f, microbatches=4): batch size 6 of argument 'mask' (dim 0) is not divisible by "
        "microbatches=4; use a batch that is a multiple of 4 or microbatches=3."
    )
    with _raises(ValueError, msg):
        piped(w, x, mask=torch.ones(6, 2, dtype=DT))


def test_a_failed_call_does_not_poison_the_next(model):
    _, params, loss = model
    piped = fpipe.pipeline(loss, microbatches=4)
    with pytest.raises(ValueError, match="batch size 10"):
        fpipe.value_and_grad(piped)(params, *_xy(10))
    loss_value, _ = fpipe.value_and_grad(piped)(params, *_xy(8))
    torch.testing.assert_close(loss_value, loss(params, *_xy(8)), rtol=1e-10, atol=0)


@pytest.mark.parametrize("stages", [2, 4])
def test_stages_disagree_with_boundaries(model, stages):
    _, params, loss = model
    piped = fpipe.pipeline(loss, stages=stages, microbatches=2)
    msg = (
        f"pipeline(loss, stages={stages}, microbatches=2): stages={stages} but the function's "
        "stage_boundary (or pipe_split()) calls make 3 stages (the most boundaries on one path from "
        "the inputs); pass stages=3 (or stages=None to follow the boundaries), or remove the calls to "
        "let fpipe choose the cuts."
    )
    with _raises(ValueError, msg):
        fpipe.value_and_grad(piped)(params, *_xy(8))


def _non_tensor_message(leaf: int, type_name: str) -> str:
    return (
        f"stage_boundary(x): leaf {leaf} of x is {'an' if type_name[0] in 'aeiou' else 'a'} {type_name}, not a tensor; only tensors can cross a stage "
        "boundary. Pass the non-tensor values around the boundary (they are constants of the traced "
        "program) or convert them with torch.as_tensor."
    )


def test_non_tensor_crossing_a_boundary_inside_a_pipeline():
    def f(w, x):
        h, n = fpipe.stage_boundary((torch.tanh(x @ w), 3))
        return (h * n).sum()

    piped = fpipe.pipeline(f, microbatches=2)
    with _raises(ValueError, _non_tensor_message(1, "int")):
        fpipe.value_and_grad(piped)(torch.eye(2, dtype=DT), torch.ones(4, 2, dtype=DT))


def test_non_tensor_crossing_a_boundary_eagerly():
    with _raises(ValueError, _non_tensor_message(1, "str")):
        fpipe.stage_boundary({"a": torch.ones(2), "b": "hidden"})


_KEYS_FIX = (
    "it must hold exactly the 8 parameters of the module. Pass the dict returned by functionalize (or by "
    "materialize), updated by your optimizer but with the same keys."
)


@pytest.mark.parametrize(
    ("drop", "add", "what"),
    [
        (["layers.1.bias"], [], "is missing 1 key(s) ['layers.1.bias']"),
        ([], ["bogus"], "has 1 unexpected key(s) ['bogus']"),
        (
            ["layers.0.weight", "layers.3.bias"],
            ["w"],
            "is missing 2 key(s) ['layers.0.weight', 'layers.3.bias'] and has 1 unexpected key(s) ['w']",
        ),
    ],
)
def test_params_keys_differ_from_the_module(model, drop, add, what):
    fn, params, loss = model
    bad = {k: v for k, v in params.items() if k not in drop}
    bad.update({k: torch.zeros(3, dtype=DT) for k in add})
    msg = f"functionalize(MLP)(params, ...): params {what}; {_KEYS_FIX}"
    with _raises(ValueError, msg):
        fpipe.value_and_grad(fpipe.pipeline(loss, microbatches=2))(bad, *_xy(4))
    with _raises(ValueError, msg):
        fn(bad, _xy(4)[0])


def test_params_that_is_not_a_dict(model):
    fn, _, _ = model
    msg = (
        "functionalize(MLP)(params, ...): params must be a dict of tensors keyed by parameter name, got list; "
        "pass the dict that functionalize returned."
    )
    with _raises(TypeError, msg):
        fn([torch.ones(1)], _xy(4)[0])


@pytest.mark.parametrize("name", ["zb", "1F1B", "GPipe"])
def test_unknown_schedule(model, name):
    _, _, loss = model
    msg = (
        f"pipeline(loss, microbatches=4, schedule={name!r}): unknown schedule; known schedules are "
        f"{fpipe.schedules.names()}."
    )
    with _raises(ValueError, msg):
        fpipe.pipeline(loss, microbatches=4, schedule=name)


def _branchy(fn):
    def loss(params, x, y):
        out = fn(params, x)
        if out.sum() > 0:  # a branch on a tensor's value
            out = out * 2
        return (out - y).pow(2).sum(-1).mean()

    return loss


def _line_of(text: str) -> int:
    with open(__file__) as src:
        return next(i for i, line in enumerate(src, 1) if text in line)


@pytest.mark.parametrize("grad", [True, False])
def test_branch_on_a_tensor_value_names_the_user_line(model, grad):
    fn, params, _ = model
    loss = _branchy(fn)
    piped = fpipe.pipeline(loss, microbatches=2)
    where = (
        f"{__file__}:{_line_of('if out.sum() > 0:')} (`if out.sum() > 0:  # a branch on a tensor's value`)"
    )
    msg = (
        f"pipeline(loss, microbatches=2): the function depends on the value of a tensor at {where}. fpipe "
        "traces the function once per input signature (shapes, dtypes, structure), like jax.jit, so Python "
        "control flow and shapes must not depend on tensor values. Use torch.where or masking instead of the "
        "branch, or pass the deciding value as a Python number (it then becomes part of the signature)."
    )
    with _raises(ValueError, msg):
        if grad:
            fpipe.value_and_grad(piped)(params, *_xy(4))
        else:
            piped(params, *_xy(4))


def test_item_on_a_tensor_names_the_user_line(model):
    fn, params, _ = model

    def loss(params, x, y):
        scale = float(x.abs().max().item())  # .item() on a traced tensor
        return (fn(params, x) - y).pow(2).mean() * scale

    with pytest.raises(
        ValueError, match=re.escape(f"{__file__}:{_line_of('scale = float(x.abs')} (`scale = float(")
    ):
        fpipe.value_and_grad(fpipe.pipeline(loss, microbatches=2))(params, *_xy(4))


# -- more argument checks -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        ({"microbatches": 0}, "pipeline(loss, microbatches=0): microbatches must be a positive int, got 0."),
        (
            {"microbatches": 2.0},
            "pipeline(loss, microbatches=2.0): microbatches must be a positive int, got 2.0.",
        ),
        ({"stages": 0}, "pipeline(loss, stages=0): stages must be a positive int or None."),
        (
            {"stages": 2, "partition": "profile"},
            "pipeline(loss, microbatches=1, partition='profile'): partition must be 'estimate' (a "
            "static cost model) or 'measure' (time each operation on the device).",
        ),
    ],
)
def test_bad_pipeline_arguments(model, kwargs, msg):
    _, _, loss = model
    with _raises(ValueError, msg):
        fpipe.pipeline(loss, **kwargs)


def test_loss_must_be_a_scalar(model):
    fn, params, _ = model

    def per_example(params, x, y):
        return (fn(params, x) - y).pow(2).sum(-1)

    msg = (
        "value_and_grad(pipeline(per_example, microbatches=2)): the function must return a scalar loss, but "
        "returns a tensor of shape (2,); reduce it to a scalar, or pass has_aux=True and return (loss, aux)."
    )
    with _raises(ValueError, msg):
        fpipe.value_and_grad(fpipe.pipeline(per_example, microbatches=2))(params, *_xy(4))


def test_argnums_out_of_range(model):
    _, params, loss = model
    msg = "value_and_grad(pipeline(loss, microbatches=2)): argnums=3 is out of range for a call with 3 positional arguments."
    with _raises(ValueError, msg):
        fpipe.value_and_grad(fpipe.pipeline(loss, microbatches=2), argnums=3)(params, *_xy(4))


def test_value_and_grad_needs_a_pipelined_function(model):
    _, _, loss = model
    with _raises(TypeError, "value_and_grad(piped): expected the result of fpipe.pipeline, got function."):
        fpipe.value_and_grad(loss)


def test_too_many_automatic_stages():
    def f(w, x):
        return (x * w).sum()

    msg = (
        "pipeline(f, stages=4, microbatches=2): stages=4 but the function has only 2 operations on its data "
        "to split; use stages<=2."
    )
    with _raises(ValueError, msg):
        fpipe.pipeline(f, stages=4, microbatches=2)(torch.ones(3, dtype=DT), torch.ones(4, 3, dtype=DT))


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.round()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 3


def test_custom_autograd_function_is_refused_not_silently_differentiated():
    def f(w, x):
        h = fpipe.stage_boundary(torch.tanh(x @ w))
        return _StraightThrough.apply(h @ w).pow(2).sum()

    piped = fpipe.pipeline(f, microbatches=2, out_axes="sum")
    msg = (
        "pipeline(f, microbatches=2): the function calls the custom autograd.Function _StraightThrough "
        f"(from {__name__}); fpipe traces its forward into plain operations and would differentiate those "
        "instead of calling its backward, giving wrong gradients. Move it out of the pipelined function, or "
        "express it with differentiable operations (a straight-through estimator is "
        "`x + (f(x) - x).detach()`)."
    )
    with _raises(ValueError, msg):
        fpipe.value_and_grad(piped)(torch.eye(4, dtype=DT), torch.ones(8, 4, dtype=DT))
