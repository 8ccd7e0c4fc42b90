"""Claims no other test guards: random streams, memory freed, reduced-precision parity.

- **Random numbers** (`NOTE [random-number policy]` in fpipe/_src/tracing/rng.py): every dropout mask
  is drawn from (base seed, step, microbatch, operation), so masks differ across microbatches,
  operations and steps, and are equal across stage counts, schedules and runs with one seed.
  The masks are read back from the aux output; the gradients are checked against the unsplit
  function with those masks applied by hand (the backward must use the forward's masks).
- **Memory**: the runner frees each value after its last reader, so 1F1B holds fewer bytes at
  its peak than GPipe and both hold less than a runtime that frees nothing.
- **bf16 and autocast**: gradients match the unsplit function at the precision the dtype allows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import MLP, assert_trees_close, compiled

import fpipe

# -- random numbers ---------------------------------------------------------------------------------

P = 0.5  # dropout probability
ROWS, COLS = 8, 64  # a microbatch mask of 2 x 64 repeats by chance with probability 2**-128
DT = torch.float64


def dropout_fn(boundaries: int):
    """Two dropouts (operations 0 and 1) and a loss; `boundaries` in 0..2 cut it into 1..3
    stages: after the first dropout, after the second. The aux output is both dropouts' outputs,
    from which their masks are read (every input to a dropout is positive)."""

    def f(params, x):
        d1 = F.dropout(x * params["s"], P, training=True)
        h = fpipe.stage_boundary(d1) if boundaries >= 1 else d1
        d2 = F.dropout(h * params["t"] + 1, P, training=True)
        h = fpipe.stage_boundary(d2) if boundaries >= 2 else d2
        return (torch.tanh(h) * params["w"]).sum(-1).mean(), (d1, d2)

    return f


def masked_reference(params, x, m1, m2):
    """The same loss as `dropout_fn` with the masks `m1`, `m2` applied by hand: no randomness."""
    d1 = x * params["s"] * m1 / (1 - P)
    d2 = (d1 * params["t"] + 1) * m2 / (1 - P)
    return (torch.tanh(d2) * params["w"]).sum(-1).mean()


def dropout_inputs():
    g = torch.Generator().manual_seed(3)
    params = {k: torch.rand(COLS, generator=g, dtype=DT) + 0.5 for k in "stw"}
    return params, torch.rand(ROWS, COLS, generator=g, dtype=DT) + 0.5


def masked_step(vg, params, x):
    """One step; returns the two masks (bool, ROWS x COLS) and the gradients, after checking the
    loss and gradients against the unsplit function with these masks."""
    (loss, (d1, d2)), grads = vg(params, x)
    m1, m2 = d1 != 0, d2 != 0
    ref_grads, ref_loss = torch.func.grad_and_value(masked_reference)(params, x, m1.to(DT), m2.to(DT))
    assert_trees_close((loss, grads), (ref_loss, ref_grads))
    for m in (m1, m2):  # dropout is on: about half of each mask is dropped
        assert 0.3 < m.double().mean().item() < 0.7
    return m1, m2, grads


def run_dropout(
    boundaries: int = 2,
    schedule: str = "1f1b",
    microbatches: int = 4,
    seed: int = 7,
    steps: int = 1,
    advance: int = 0,
):
    """A fresh pipeline seeded with `seed`, the running generator then advanced by `advance`
    draws (which must not matter: only the base seed does): the masks of each of `steps` steps."""
    torch.manual_seed(seed)
    torch.rand(advance)
    piped = fpipe.pipeline(dropout_fn(boundaries), microbatches=microbatches, schedule=schedule)
    vg = fpipe.value_and_grad(piped, has_aux=True)
    return [masked_step(vg, *dropout_inputs()) for _ in range(steps)]


def chunks(mask: torch.Tensor, microbatches: int) -> list[torch.Tensor]:
    return list(mask.chunk(microbatches))


def test_dropout_masks_differ_across_microbatches():
    m1, m2, _ = run_dropout(microbatches=4)[0]
    for m in (m1, m2):
        parts = chunks(m, 4)
        for i in range(4):
            for j in range(i):
                assert not torch.equal(parts[i], parts[j]), f"microbatches {j} and {i} drew one mask"


def test_dropout_masks_differ_across_operations():
    """Two dropouts of the same shape in one microbatch draw different masks, on one stage too."""
    for boundaries in (0, 2):
        m1, m2, _ = run_dropout(boundaries=boundaries)[0]
        for a, b in zip(chunks(m1, 4), chunks(m2, 4)):
            assert not torch.equal(a, b)


def test_dropout_masks_differ_across_steps():
    steps = run_dropout(steps=3)
    for i in range(3):
        for j in range(i):
            assert not torch.equal(steps[i][0], steps[j][0])
            assert not torch.equal(steps[i][1], steps[j][1])


@pytest.mark.parametrize(
    "boundaries,schedule", [(0, "gpipe"), (1, "gpipe"), (1, "1f1b"), (2, "gpipe"), (2, "zb-h1")]
)
def test_dropout_masks_equal_across_stages_and_schedules(boundaries, schedule):
    """Step 1 and step 2 draw the same masks (and so the same gradients) on 1, 2 or 3 stages and
    any schedule as on 3 stages under 1F1B."""
    base = run_dropout(boundaries=2, schedule="1f1b", steps=2)
    other = run_dropout(boundaries=boundaries, schedule=schedule, steps=2)
    for (b1, b2, bg), (o1, o2, og) in zip(base, other):
        assert torch.equal(b1, o1) and torch.equal(b2, o2)
        assert_trees_close(og, bg)


def test_dropout_masks_follow_the_seed():
    """A fresh pipeline with the same seed draws the same masks (run to run), wherever the running
    generator stands; another seed, others."""
    first = run_dropout(seed=7)[0]
    again = run_dropout(seed=7, advance=5)[0]
    other = run_dropout(seed=8)[0]
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0]) and not torch.equal(first[1], other[1])


# -- memory: values freed after their last reader -----------------------------------------------------

STAGES, MICROBATCHES = 4, 8


def mlp_step(schedule: str) -> tuple[list[tuple[str, int]], int]:
    """Two steps of a deep MLP on 4 stages with 8 microbatches, the second recording the bytes
    the runner holds after each action. Returns those and the bytes a runtime that never frees
    would hold at the end: every value one program hands another, for every microbatch,
    computed from the staged program's value sizes."""
    torch.manual_seed(0)
    fn, params = fpipe.functionalize(MLP(d_in=32, hidden=64, d_out=8, n_layers=8, stages=STAGES))

    def loss(p, x, y):
        return (fn(p, x) - y).pow(2).mean()

    x, y = torch.randn(64, 32), torch.randn(64, 8)
    piped = fpipe.pipeline(loss, microbatches=MICROBATCHES, schedule=schedule)
    vg = fpipe.value_and_grad(piped)
    vg(params, x, y)
    runner = compiled(piped).runner
    assert runner.memory == []  # recorded only when asked
    runner.record_memory = True
    vg(params, x, y)
    st = compiled(piped).staged
    crossing = [st.meta[n] for n in st.consumers if n in st.producer]
    per_mb = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype, *_ in crossing)
    return runner.memory, MICROBATCHES * per_mb


def test_values_are_freed_after_their_last_reader():
    gpipe, never_freed = mlp_step("gpipe")
    one_f_one_b, bound = mlp_step("1f1b")
    assert bound == never_freed and bound > 0
    for memory in (gpipe, one_f_one_b):
        assert sorted(a for a, _ in memory) == sorted(
            f"{k}{s}.{m}" for k in "FB" for s in range(4) for m in range(8)
        )
        assert memory[-1][1] == 0  # nothing is held once the step is done
    peak_gpipe = max(b for _, b in gpipe)
    peak_1f1b = max(b for _, b in one_f_one_b)
    assert 0 < peak_gpipe < never_freed
    # 1F1B has at most `STAGES` microbatches in flight, each holding at most its crossing values
    assert 0 < peak_1f1b <= never_freed * STAGES / MICROBATCHES
    assert peak_1f1b < 0.5 * peak_gpipe  # in flight per stage: 4+3+2+1 of GPipe's 4 x 8


# -- bf16 and mixed precision ---------------------------------------------------------------------------

BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2**-7: one bf16 rounding is up to half of it


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error, in fp64."""
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def assert_rel_close(actual: dict, expected: dict, tol: float) -> None:
    assert actual.keys() == expected.keys()
    for k in expected:
        assert actual[k].dtype == expected[k].dtype, k
        assert rel_err(actual[k], expected[k]) < tol, (k, rel_err(actual[k], expected[k]))


def test_fp32_gradients_exact_beside_a_bf16_parameter():
    """A bf16 parameter first in the dict must not make the fp32 gradients bf16-accurate: the
    mean over 3 microbatches (1/3) is not representable in bf16 (0.3340, 2e-3 off)."""
    g = torch.Generator().manual_seed(0)
    params = {
        "a": torch.randn(8, generator=g).bfloat16(),
        "w": torch.randn(6, 8, generator=g),
        "v": torch.randn(8, 8, generator=g),
    }
    x = torch.randn(12, 6, generator=g)

    def f(p, x, boundary=fpipe.stage_boundary):
        h = boundary(torch.tanh(x @ p["w"]) * p["a"].float())
        return torch.tanh(h @ p["v"]).pow(2).mean()

    ref_grads, ref_loss = torch.func.grad_and_value(lambda p, x: f(p, x, lambda h: h))(params, x)
    loss, grads = fpipe.value_and_grad(fpipe.pipeline(f, microbatches=3))(params, x)
    assert loss.dtype == torch.float32
    assert rel_err(loss, ref_loss) < 1e-5
    assert_rel_close({k: grads[k] for k in "wv"}, {k: ref_grads[k] for k in "wv"}, 1e-4)
    assert_rel_close({"a": grads["a"]}, {"a": ref_grads["a"]}, 2 * BF16_EPS)


def mlp_loss_case():
    """A 4-layer MLP cut into 2 stages, its fp32 params and a batch of 16."""
    torch.manual_seed(0)
    fn, params = fpipe.functionalize(MLP(hidden=32, n_layers=4, stages=2))

    def loss(p, x, y):
        return (fn(p, x) - y).pow(2).mean()

    g = torch.Generator().manual_seed(1)
    return loss, params, torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)


@pytest.mark.parametrize("microbatches", [1, 4])
def test_bf16_model_matches_the_unsplit_function_in_bf16(microbatches):
    """All parameters and data bf16. One microbatch runs the unsplit function's operations, so the
    results are bit-identical; with 4, the sums over microbatches round differently: within two
    bf16 epsilons of the unsplit bf16 result, and as close to the fp64 result as it is."""
    loss, params, x, y = mlp_loss_case()
    bf = {k: v.bfloat16() for k, v in params.items()}
    args = (x.bfloat16(), y.bfloat16())
    ref_grads, ref_loss = torch.func.grad_and_value(loss)(bf, *args)
    exact_grads, _ = torch.func.grad_and_value(loss)(
        {k: v.double() for k, v in params.items()}, x.double(), y.double()
    )
    got_loss, got = fpipe.value_and_grad(fpipe.pipeline(loss, microbatches=microbatches))(bf, *args)
    assert got_loss.dtype == torch.bfloat16
    tol = 1e-30 if microbatches == 1 else 2 * BF16_EPS
    assert rel_err(got_loss, ref_loss) < tol
    assert_rel_close(got, ref_grads, tol)
    for k in params:
        assert rel_err(got[k], exact_grads[k]) < rel_err(ref_grads[k], exact_grads[k]) + 2 * BF16_EPS


@pytest.mark.parametrize("microbatches", [1, 4])
def test_autocast_matches_the_unsplit_function_under_autocast(microbatches):
    """fp32 parameters, the pipelined call under `torch.autocast("cpu", bfloat16)` against the
    unsplit function under the same autocast: bit-identical with one microbatch (so autocast is
    in effect: without it the products are fp32 and differ by ~5e-3), within two bf16 epsilons
    with 4."""
    loss, params, x, y = mlp_loss_case()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_grads, ref_loss = torch.func.grad_and_value(loss)(params, x, y)
        got_loss, got = fpipe.value_and_grad(fpipe.pipeline(loss, microbatches=microbatches))(params, x, y)
    fp32_grads, _ = torch.func.grad_and_value(loss)(params, x, y)
    assert got_loss.dtype == ref_loss.dtype == torch.float32
    tol = 1e-30 if microbatches == 1 else 2 * BF16_EPS
    assert rel_err(got_loss, ref_loss) < tol
    assert_rel_close(got, ref_grads, tol)
    assert max(rel_err(ref_grads[k], fp32_grads[k]) for k in params) > 1e-3  # autocast changes them


def test_one_pipeline_called_with_and_without_autocast():
    """The program traced under autocast must not serve a call without it (nor the reverse): each
    call matches the unsplit function under its own autocast state."""
    loss, params, x, y = mlp_loss_case()
    vg = fpipe.value_and_grad(fpipe.pipeline(loss, microbatches=1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_auto, _ = torch.func.grad_and_value(loss)(params, x, y)
        _, got_auto = vg(params, x, y)
    ref_plain, _ = torch.func.grad_and_value(loss)(params, x, y)
    _, got_plain = vg(params, x, y)
    assert_rel_close(got_auto, ref_auto, 1e-6)
    assert_rel_close(got_plain, ref_plain, 1e-6)


def test_dropout_masks_under_compile_equal_eager():
    """`compile=True`: the compiled programs draw the eager programs' masks, step after step (the
    seed is read at run time, not baked into the compiled code)."""
    eager = run_dropout(boundaries=1, microbatches=2, steps=2)
    torch.manual_seed(7)
    piped = fpipe.pipeline(dropout_fn(1), microbatches=2, schedule="1f1b", compile=True)
    vg = fpipe.value_and_grad(piped, has_aux=True)
    for m1, m2, grads in eager:
        c1, c2, c_grads = masked_step(vg, *dropout_inputs())
        assert torch.equal(c1, m1) and torch.equal(c2, m2)
        assert_trees_close(c_grads, grads)
