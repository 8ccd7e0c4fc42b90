"""The pipelined function composes with torch.func, and torch.func composes inside it.

Every check is against the same computation done by torch.func on the unsplit function, in fp64.
"""

from __future__ import annotations

import pytest
import torch
from models import MLP, assert_trees_close, compiled

import fpipe

DT = torch.float64
BATCH = 8


def _mlp(stages: int | None, seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP(stages=stages).to(DT)


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(BATCH, 6, generator=g, dtype=DT), torch.randn(BATCH, 3, generator=g, dtype=DT)


@pytest.fixture(scope="module")
def mlp():
    """(f with 2 boundaries, the same f without, params): a 3-stage MLP regression loss."""
    fn, params = fpipe.functionalize(_mlp(3))
    plain, _ = fpipe.functionalize(_mlp(None))

    def f(params, x, y):
        return (fn(params, x) - y).pow(2).sum(-1).mean()

    def ref(params, x, y):
        return (plain(params, x) - y).pow(2).sum(-1).mean()

    return f, ref, params


@pytest.fixture
def piped(mlp):
    """A fresh pipelined f per test: its compile cache is not shared between tests."""
    f, _, _ = mlp
    return fpipe.pipeline(f, stages=3, microbatches=4, schedule="1f1b")


def test_torch_func_grad_of_pipelined(mlp, piped, data):
    _, ref, params = mlp
    assert_trees_close(torch.func.grad(piped)(params, *data), torch.func.grad(ref)(params, *data))


def test_torch_func_grad_of_pipelined_compiled_outside(mlp, piped, data):
    """The same, with the program compiled by a plain call first (so grad reuses it)."""
    _, ref, params = mlp
    assert_trees_close(piped(params, *data), ref(params, *data))
    assert_trees_close(torch.func.grad(piped)(params, *data), torch.func.grad(ref)(params, *data))


def test_torch_func_grad_of_pipelined_auto_partition(mlp, data):
    _, ref, params = mlp
    auto = fpipe.pipeline(ref, stages=3, microbatches=2, schedule="gpipe")
    assert_trees_close(torch.func.grad(auto)(params, *data), torch.func.grad(ref)(params, *data))


def test_vmap_over_an_ensemble_of_stacked_parameters(mlp, piped, data):
    _, ref, _ = mlp
    ensemble = [fpipe.functionalize(_mlp(3, seed=s))[1] for s in range(3)]
    stacked = {k: torch.stack([p[k] for p in ensemble]) for k in ensemble[0]}
    got = torch.func.vmap(piped, in_dims=(0, None, None))(stacked, *data)
    want = torch.func.vmap(ref, in_dims=(0, None, None))(stacked, *data)
    assert got.shape == (3,)
    assert_trees_close(got, want)
    assert_trees_close(got[1], ref(ensemble[1], *data))


def test_vmap_over_stack_module_state(piped, data, mlp):
    _, ref, _ = mlp
    stacked, _ = torch.func.stack_module_state([_mlp(3, seed=s) for s in range(3)])
    stacked = {k: v.detach() for k, v in stacked.items()}
    got = torch.func.vmap(piped, in_dims=(0, None, None))(stacked, *data)
    assert_trees_close(got, torch.func.vmap(ref, in_dims=(0, None, None))(stacked, *data))


def test_per_model_grads_of_an_ensemble(piped, data, mlp):
    """vmap(grad(piped)): each member's gradient, through the pipeline."""
    _, ref, _ = mlp
    stacked, _ = torch.func.stack_module_state([_mlp(3, seed=s) for s in range(3)])
    stacked = {k: v.detach() for k, v in stacked.items()}
    got = torch.func.vmap(torch.func.grad(piped), in_dims=(0, None, None))(stacked, *data)
    assert_trees_close(got, torch.func.vmap(torch.func.grad(ref), in_dims=(0, None, None))(stacked, *data))


def _per_example(fn):
    def loss(params, x, y):
        return (fn(params, x) - y).pow(2).sum()

    return loss


def test_pipeline_of_vmap(mlp, data):
    """pipeline(vmap(g)): per-example losses, concatenated over microbatches."""
    fn, params = fpipe.functionalize(_mlp(3))
    per_example = torch.func.vmap(_per_example(fn), in_dims=(None, 0, 0))
    piped = fpipe.pipeline(per_example, microbatches=4)
    got = piped(params, *data)
    assert got.shape == (BATCH,)
    assert_trees_close(got, per_example(params, *data))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_value_and_grad_of_pipeline_of_vmap_then_mean(mlp, data, schedule):
    _, ref, _ = mlp
    fn, params = fpipe.functionalize(_mlp(3))
    per_example = torch.func.vmap(_per_example(fn), in_dims=(None, 0, 0))

    def f(params, x, y):
        return per_example(params, x, y).mean()

    loss, grads = fpipe.value_and_grad(fpipe.pipeline(f, microbatches=4, schedule=schedule))(params, *data)
    ref_grads, ref_loss = torch.func.grad_and_value(ref)(params, *data)
    assert_trees_close((loss, grads), (ref_loss, ref_grads))


def _penalised(fn, lam=0.3):
    """loss + lam * mean over examples of |d loss_i / d x_i|^2 (a gradient penalty, microbatch-invariant)."""

    def f(params, x, y):
        def total(x):
            return (fn(params, x) - y).pow(2).sum()

        # One forward (so one set of boundaries), differentiated inside the pipelined function.
        dx, total_loss = torch.func.grad_and_value(total)(x)
        return total_loss / x.shape[0] + lam * dx.pow(2).sum(-1).mean()

    return f


@pytest.mark.parametrize(
    ("stages", "microbatches", "schedule"),
    [
        (1, 2, "1f1b"),
        (3, 4, "1f1b"),
        (3, 8, "gpipe"),
    ],
)
def test_value_and_grad_of_a_gradient_penalty(data, stages, microbatches, schedule):
    fn, params = fpipe.functionalize(_mlp(stages))
    plain, _ = fpipe.functionalize(_mlp(None))
    f, ref = _penalised(fn), _penalised(plain)
    piped = fpipe.pipeline(f, stages=stages, microbatches=microbatches, schedule=schedule)
    loss, grads = fpipe.value_and_grad(piped)(params, *data)
    ref_grads, ref_loss = torch.func.grad_and_value(ref)(params, *data)
    assert_trees_close((loss, grads), (ref_loss, ref_grads))


@pytest.mark.parametrize("stages", [2, 3])
def test_value_and_grad_of_a_gradient_penalty_auto_partition(data, stages):
    plain, params = fpipe.functionalize(_mlp(None))
    f = _penalised(plain)
    piped = fpipe.pipeline(f, stages=stages, microbatches=4)
    loss, grads = fpipe.value_and_grad(piped)(params, *data)
    assert compiled(piped).staged.n_stages == stages
    ref_grads, ref_loss = torch.func.grad_and_value(f)(params, *data)
    assert_trees_close((loss, grads), (ref_loss, ref_grads))


def test_grad_equals_value_and_grad(mlp, piped, data):
    _, ref, params = mlp
    loss, grads = fpipe.value_and_grad(piped)(params, *data)
    assert_trees_close(fpipe.grad(piped)(params, *data), grads)
    assert_trees_close(loss, ref(params, *data))


def test_value_and_grad_records_no_autograd_history(mlp, piped, data):
    """Parameters that require grad (a module's own `named_parameters()`) give the same result,
    and no autograd graph: recording one would hold every program's intermediates all step."""
    _, ref, params = mlp
    live = {k: v.clone().requires_grad_() for k, v in params.items()}
    loss, grads = fpipe.value_and_grad(piped)(live, *data)
    assert loss.grad_fn is None and all(g.grad_fn is None for g in grads.values())
    ref_loss, ref_grads = torch.func.grad_and_value(ref)(params, *data)[::-1]
    assert_trees_close((loss, grads), (ref_loss, ref_grads))


def _with_aux(fn):
    def f(params, x, y):
        pred = fn(params, x)
        return (pred - y).pow(2).sum(-1).mean(), pred

    return f


def test_has_aux_returns_aux_concatenated_over_microbatches(mlp, data):
    _, ref, params = mlp
    fn, _ = fpipe.functionalize(_mlp(3))
    plain, _ = fpipe.functionalize(_mlp(None))
    piped = fpipe.pipeline(_with_aux(fn), microbatches=4)
    (loss, aux), grads = fpipe.value_and_grad(piped, has_aux=True)(params, *data)
    ref_grads, (ref_loss, ref_aux) = torch.func.grad_and_value(_with_aux(plain), has_aux=True)(params, *data)
    assert aux.shape == (BATCH, 3)
    assert_trees_close((loss, aux, grads), (ref_loss, ref_aux, ref_grads))
    g2, aux2 = fpipe.grad(piped, has_aux=True)(params, *data)
    assert_trees_close((g2, aux2), (ref_grads, ref_aux))


@pytest.mark.parametrize("microbatches", [1, 4])
def test_argnums_includes_a_data_argument(mlp, data, microbatches):
    f, ref, params = mlp
    piped = fpipe.pipeline(f, microbatches=microbatches)
    loss, (g_params, g_x) = fpipe.value_and_grad(piped, argnums=(0, 1))(params, *data)
    ref_gp, ref_gx = torch.func.grad(ref, argnums=(0, 1))(params, *data)
    assert g_x.shape == data[0].shape
    assert_trees_close((loss, g_params, g_x), (ref(params, *data), ref_gp, ref_gx))
    assert_trees_close(fpipe.grad(piped, argnums=1)(params, *data), ref_gx)


# -- stage_boundary is an ordinary function under torch.func -------------------------------------


def _marked(w, x):
    h = fpipe.stage_boundary(torch.tanh(x @ w))
    a, b = fpipe.stage_boundary((h.sin(), {"c": h.cos()}))
    return (a @ w + b["c"]).pow(2).sum()


def _unmarked(w, x):
    h = torch.tanh(x @ w)
    return (h.sin() @ w + h.cos()).pow(2).sum()


@pytest.fixture(scope="module")
def wx():
    g = torch.Generator().manual_seed(4)
    return torch.randn(3, 3, generator=g, dtype=DT), torch.randn(5, 3, generator=g, dtype=DT)


def test_stage_boundary_is_the_identity(wx):
    w, x = wx
    tree = {"a": x, "b": [w, x.sum()]}
    out = fpipe.stage_boundary(tree)
    assert_trees_close(out, tree)
    assert_trees_close(_marked(w, x), _unmarked(w, x))


def test_stage_boundary_under_grad_and_grad_of_grad(wx):
    w, x = wx
    assert_trees_close(torch.func.grad(_marked)(w, x), torch.func.grad(_unmarked)(w, x))
    hess = torch.func.jacrev(torch.func.grad(_marked))(w, x)
    assert_trees_close(hess, torch.func.jacrev(torch.func.grad(_unmarked))(w, x))


def test_stage_boundary_under_vjp(wx):
    w, x = wx
    out, vjp = torch.func.vjp(_marked, w, x)
    ref_out, ref_vjp = torch.func.vjp(_unmarked, w, x)
    ct = torch.tensor(0.7, dtype=DT)
    assert_trees_close((out, vjp(ct)), (ref_out, ref_vjp(ct)))


def test_stage_boundary_under_vmap(wx):
    w, x = wx
    ws = torch.stack([w, 2 * w, -w])
    assert_trees_close(
        torch.func.vmap(_marked, in_dims=(0, None))(ws, x),
        torch.func.vmap(_unmarked, in_dims=(0, None))(ws, x),
    )
    per_example = torch.func.vmap(torch.func.grad(_marked), in_dims=(None, 0))(w, x)
    assert_trees_close(per_example, torch.func.vmap(torch.func.grad(_unmarked), in_dims=(None, 0))(w, x))


def test_stage_boundary_under_autograd(wx):
    w, x = wx
    w1 = w.clone().requires_grad_()
    _marked(w1, x).backward()
    assert_trees_close(w1.grad, torch.func.grad(_unmarked)(w, x))
