"""Cuts by module path (NOTE [cuts by module path] in fpipe/_src/tracing/cuts.py): `pipeline(f, cuts=...)`
gives the stages, programs and gradients of the equivalent `stage_boundary` calls; the rule
forms name the same modules as the list they stand for; bad paths and rules are refused with
the closest real paths."""

from __future__ import annotations

import re

import pytest
import torch
from models import GPT, compiled, lm_loss

import fpipe
from fpipe._src.runtime.agree import fingerprint

N_LAYER = 4


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = GPT(n_layer=N_LAYER).double()
    fn, params = fpipe.functionalize(model)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 11, (8, 5), generator=g) for _ in range(2))

    def loss(p, x, y):
        return lm_loss(fn(p, x), y)

    ref_grads, ref_loss = torch.func.grad_and_value(loss)(params, x, y)
    return model, loss, params, (x, y), (ref_loss, ref_grads)


def _run(gpt, marks: set[int], **options):
    """value_and_grad with the model's own boundaries at `marks` (models.GPT: boundary k is after
    segment k -- 0 the embedding, i + 1 block i -- so before blocks.k, or ln_f for k = N_LAYER)."""
    model, loss, params, args, _ = gpt
    model.cuts = marks
    try:
        piped = fpipe.pipeline(loss, microbatches=4, **options)
        value, grads = fpipe.value_and_grad(piped)(params, *args)
    finally:
        model.cuts = set()
    c = compiled(piped)
    return value, grads, fingerprint(c.staged, c.runner.schedule)


@pytest.fixture(scope="module")
def listed(gpt):
    """`listed(paths)`: `_run` with `cuts=paths` (a list), once per list for the module (each run
    traces the GPT; the list forms are what both tests below compare with)."""
    done = {}

    def get(paths: list[str]):
        if tuple(paths) not in done:
            done[tuple(paths)] = _run(gpt, set(), cuts=list(paths))
        return done[tuple(paths)]

    return get


def _close(a, b, tol=1e-12):
    assert abs(float(a[0]) - float(b[0])) < tol
    assert max(float((a[1][k] - b[1][k]).abs().max()) for k in b[1]) < tol


@pytest.mark.parametrize(
    ("marks", "paths"),
    [
        ({2}, ["blocks.2"]),
        ({1, 3}, ["blocks.1", "blocks.3"]),
        ({0, 2, N_LAYER}, ["blocks.0", "blocks.2", "ln_f"]),
    ],
)
def test_cuts_equal_the_equivalent_markers(gpt, listed, marks, paths):
    """The same programs (the fingerprint the ranks compare: every program's operations, the
    cut, the schedule), the same loss and gradients, equal to the unsplit function's."""
    loss_m, grads_m, fp_m = _run(gpt, marks)
    loss_c, grads_c, fp_c = listed(paths)
    assert fp_c == fp_m
    assert torch.equal(loss_c, loss_m) and all(torch.equal(grads_c[k], grads_m[k]) for k in grads_m)
    _close((loss_c, grads_c), gpt[4])


@pytest.mark.parametrize(
    ("rule", "paths"),
    [
        (re.compile(r"blocks\.(1|3)"), ["blocks.1", "blocks.3"]),
        ({"blocks": 2}, ["blocks.2"]),
        ({"blocks": 1}, ["blocks.1", "blocks.2", "blocks.3"]),
    ],
)
def test_rule_forms_name_the_same_modules_as_their_list(gpt, listed, rule, paths):
    assert _run(gpt, set(), cuts=rule)[2] == listed(paths)[2]


def test_stages_none_follows_the_cuts_and_a_wrong_count_is_refused(gpt):
    _, loss, params, args, _ = gpt
    piped = fpipe.pipeline(loss, microbatches=2, cuts=["blocks.1", "blocks.3"])
    fpipe.value_and_grad(piped)(params, *args)
    assert compiled(piped).staged.n_stages == 3
    wrong = fpipe.pipeline(loss, stages=4, microbatches=2, cuts=["blocks.1", "blocks.3"])
    with pytest.raises(
        ValueError, match=r"stages=4 but cuts=\['blocks.1', 'blocks.3'\] make 3 stages; pass stages=3"
    ):
        fpipe.value_and_grad(wrong)(params, *args)


@pytest.mark.parametrize(
    ("cuts", "message"),
    [
        (["blocks.7"], "does not have: 'blocks.7' (closest: ['blocks.3', 'blocks.2', 'blocks.1'])"),
        (["block.1"], "does not have: 'block.1' (closest: ['blocks.1', "),
        (re.compile("head2"), "cuts='head2' matches none of GPT's module paths (tok, pos, blocks,"),
        ({"ln_f": 2}, "needs 'ln_f' to be a ModuleList or Sequential of GPT; its lists are blocks,"),
        ({"blocks": 9}, "'blocks' has 4 entries, so no entry is the k-th; use k < 4"),
    ],
)
def test_bad_paths_and_rules_are_refused_with_the_real_paths(gpt, cuts, message):
    _, loss, params, args, _ = gpt
    with pytest.raises(ValueError) as err:
        fpipe.value_and_grad(fpipe.pipeline(loss, microbatches=2, cuts=cuts))(params, *args)
    assert message in str(err.value)


def test_markers_and_cuts_together_are_refused(gpt):
    model, loss, params, args, _ = gpt
    model.cuts = {2}
    try:
        with pytest.raises(
            ValueError, match="calls fpipe.stage_boundary and passes cuts=; mark stages one way"
        ):
            fpipe.value_and_grad(fpipe.pipeline(loss, microbatches=2, cuts=["blocks.3"]))(params, *args)
    finally:
        model.cuts = set()


@pytest.mark.parametrize("cuts", ["blocks.1", [], [3], {"blocks": 0}])
def test_a_cuts_argument_of_the_wrong_form_is_refused_at_pipeline(gpt, cuts):
    with pytest.raises(TypeError, match=r"must be a non-empty list of module paths"):
        fpipe.pipeline(gpt[1], cuts=cuts)


def test_cuts_need_a_functionalized_module():
    def f(w, x):
        return (x @ w).sum()

    piped = fpipe.pipeline(f, cuts=["blocks.1"])
    with pytest.raises(ValueError, match="called no module wrapped by fpipe.functionalize"):
        fpipe.value_and_grad(piped)(torch.ones(2, 2), torch.ones(3, 2))


def test_cuts_on_a_hugging_face_model_with_keyword_inputs():
    """GPT-2's blocks take keyword arguments (masks, flags, None): only the tensors cross."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    model = transformers.GPT2LMHeadModel(cfg).double().eval()
    fn, params = fpipe.functionalize(model)
    ids = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(2))

    def loss(p, ids):
        return fn(p, input_ids=ids, labels=ids, use_cache=False).loss

    piped = fpipe.pipeline(loss, microbatches=2, cuts={"transformer.h": 1})
    value, grads = fpipe.value_and_grad(piped)(params, ids)
    ref_grads, ref = torch.func.grad_and_value(loss)(params, ids)
    assert compiled(piped).staged.n_stages == 3
    assert abs(float(value - ref)) < 1e-6 * abs(float(ref))  # transformers' loss is float32 (test_hf_models)
    assert max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads) < 1e-10


def _seq(n: int = 4) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(3, 3) for _ in range(n))).double()


def test_paths_resolve_in_whichever_functionalized_module_has_them_and_the_root_list():
    """An encoder and a head functionalized apart: "2" is the encoder's; `{"": 2}` is every 2nd
    entry of the model itself (a Sequential)."""
    enc, head = _seq(), torch.nn.Linear(3, 1).double()
    f_enc, p_enc = fpipe.functionalize(enc)
    f_head, p_head = fpipe.functionalize(head)

    def loss(p, x):
        return f_head(p["head"], f_enc(p["enc"], x)).pow(2).mean()

    params, x = {"enc": p_enc, "head": p_head}, torch.ones(4, 3, dtype=torch.float64)
    ref_grads, ref = torch.func.grad_and_value(loss)(params, x)
    for cuts in (["2"], {"": 2}):
        piped = fpipe.pipeline(loss, microbatches=2, cuts=cuts)
        value, grads = fpipe.value_and_grad(piped)(params, x)
        assert compiled(piped).staged.n_stages == 2
        assert abs(float(value - ref)) < 1e-12
        assert max(float((grads["enc"][k] - ref_grads["enc"][k]).abs().max()) for k in p_enc) < 1e-12


class _Odd(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = torch.nn.Embedding(3, 3)
        self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

    def forward(self, x):
        table = self.pos.weight  # read directly: `pos` is never called with a tensor
        return self.b(torch.func.vmap(self.a)(x) + table.sum())


def test_a_cut_that_makes_no_stage_is_refused():
    """A cut inside torch.func.vmap (the boundary is dropped there) used to leave one stage and
    no error."""
    model = _Odd().double()
    fn, params = fpipe.functionalize(model)
    x = torch.ones(4, 3, dtype=torch.float64)
    piped = fpipe.pipeline(lambda p, x: fn(p, x).sum(), microbatches=2, cuts=["a"])
    with pytest.raises(
        ValueError, match=r"1 of the cuts at \['a'\] made no stage: a boundary inside torch.func.vmap"
    ):
        fpipe.value_and_grad(piped)(params, x)


def test_a_named_module_that_receives_no_tensor_is_refused():
    class NoInput(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = torch.nn.Module()
            self.bias.register_parameter("v", torch.nn.Parameter(torch.zeros(3)))
            self.bias.forward = lambda: self.bias.v  # called with no arguments
            self.a = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.a(x) + self.bias()

    fn, params = fpipe.functionalize(NoInput().double())
    piped = fpipe.pipeline(lambda p, x: fn(p, x).sum(), microbatches=2, cuts=["bias", "a"])
    with pytest.raises(ValueError, match=r"cuts name module\(s\) \['bias'\] that receive no tensor"):
        fpipe.value_and_grad(piped)(params, torch.ones(4, 3, dtype=torch.float64))
