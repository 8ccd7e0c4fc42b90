"""Mixed precision (NOTE [precision policy] in fpipe/_src/runtime/precision.py): bf16 compute with fp32
gradient accumulation, the parameter cast once per step, the dtypes handed back, autocast inside.
The reference is the unsplit function under torch.func in float64 at the same (bf16) point."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import fpipe
from fpipe._src.runtime import precision as precision_

ROOT = Path(__file__).resolve().parents[2]
D, BATCH = 64, 256
BF16 = torch.bfloat16


def mlp(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A 3-layer MLP in two stages."""
    h = torch.tanh(x @ p["w0"] + p["b0"])
    h = fpipe.stage_boundary(torch.tanh(h @ p["w1"] + p["b1"]))
    return ((h @ p["w2"] + p["b2"] - y) ** 2).mean()


def setup() -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """bf16 parameters and data, and the float64 gradient at exactly that point."""
    g = torch.Generator().manual_seed(0)
    p = {f"w{i}": (torch.randn(D, D, generator=g) / D**0.5).to(BF16) for i in range(3)}
    p.update({f"b{i}": (torch.randn(D, generator=g) * 0.1).to(BF16) for i in range(3)})
    x, y = torch.randn(BATCH, D, generator=g).to(BF16), torch.randn(BATCH, D, generator=g).to(BF16)
    ref = torch.func.grad(mlp)({k: v.double() for k, v in p.items()}, x.double(), y.double())
    return p, x, y, ref


def rel_err(g: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    num = sum(((g[k].double() - ref[k]) ** 2).sum() for k in ref)
    return float((num / sum((ref[k] ** 2).sum() for k in ref)) ** 0.5)


def test_fp32_master_weights_cast_to_bf16_match_one_unsplit_bf16_step_at_64_microbatches():
    """fp32 parameters cast to bf16 for compute, 64 microbatches: fp32 gradients whose error is no
    worse than the unsplit bf16 step's (accumulating in bf16 was 2.7x worse here)."""
    p, x, y, ref = setup()
    unsplit = rel_err(torch.func.grad(mlp)(p, x, y), ref)
    piped = fpipe.pipeline(mlp, microbatches=64, precision=fpipe.Precision(param_dtype=BF16))
    g = fpipe.grad(piped)({k: v.float() for k, v in p.items()}, x, y)
    assert {v.dtype for v in g.values()} == {torch.float32}
    assert rel_err(g, ref) <= unsplit, (rel_err(g, ref), unsplit)


def test_bf16_parameters_accumulate_in_fp32_by_default():
    """bf16 parameters, no policy given: summed in fp32, handed back in bf16 (one rounding more
    than the fp32 sum: within 10% of the unsplit step's error); fp32 on request (no worse)."""
    p, x, y, ref = setup()
    unsplit = rel_err(torch.func.grad(mlp)(p, x, y), ref)
    g = fpipe.grad(fpipe.pipeline(mlp, microbatches=64))(p, x, y)
    assert {v.dtype for v in g.values()} == {BF16}
    assert rel_err(g, ref) <= 1.1 * unsplit, (rel_err(g, ref), unsplit)
    piped = fpipe.pipeline(mlp, microbatches=64, precision=fpipe.Precision(grad_dtype=torch.float32))
    g32 = fpipe.grad(piped)(p, x, y)
    assert {v.dtype for v in g32.values()} == {torch.float32}
    assert rel_err(g32, ref) <= unsplit, (rel_err(g32, ref), unsplit)


def test_accumulating_in_bf16_is_what_loses_accuracy():
    """`accum_dtype=torch.bfloat16` keeps the old behaviour: the error grows past 2x the unsplit's."""
    p, x, y, ref = setup()
    unsplit = rel_err(torch.func.grad(mlp)(p, x, y), ref)
    piped = fpipe.pipeline(mlp, microbatches=64, precision=fpipe.Precision(accum_dtype=BF16))
    assert rel_err(fpipe.grad(piped)(p, x, y), ref) > 2 * unsplit


def test_the_parameter_cast_happens_once_per_step_per_stage(monkeypatch):
    """Six parameters, two steps of 16 microbatches: twelve casts, and no program casts a
    parameter (the programs read bf16 parameters)."""
    p, x, y, _ = setup()
    calls = []
    real = precision_.cast_leaf
    monkeypatch.setattr(precision_, "cast_leaf", lambda t, d: calls.append(d) or real(t, d))
    piped = fpipe.pipeline(mlp, microbatches=16, precision=fpipe.Precision(param_dtype=BF16))
    masters = {k: v.float() for k, v in p.items()}
    for _ in range(2):
        fpipe.grad(piped)(masters, x, y)
    assert calls == [BF16] * 12
    (c,) = piped._cache.values()
    params = set(c.staged.param_inputs)
    for prog in c.staged.programs.values():
        for n in prog.gm.graph.nodes:
            if n.op == "call_function" and ("to_copy" in str(n.target) or "convert" in str(n.target)):
                assert not {str(a) for a in n.args} & params, (prog, n)


def test_autocast_regions_inside_the_function_under_a_policy():
    """fp32 parameters and an autocast(bf16) region in the function: the policy accumulates the
    (fp32) gradients as they come; the result matches the unsplit autocast step closely."""
    p, x, y, _ = setup()

    def f(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            h = torch.tanh(x @ p["w0"] + p["b0"])
        return mlp({**p, "w0": torch.eye(D), "b0": torch.zeros(D)}, h.float(), y)

    masters = {k: v.float() for k, v in p.items()}
    want = torch.func.grad(f)(masters, x.float(), y.float())
    g = fpipe.grad(fpipe.pipeline(f, microbatches=8, precision=fpipe.Precision()))(
        masters, x.float(), y.float()
    )
    assert {v.dtype for v in g.values()} == {torch.float32}
    for k in g:
        torch.testing.assert_close(g[k], want[k], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        ({"param_dtype": torch.int8}, "Precision(param_dtype=torch.int8): expected one of"),
        ({"accum_dtype": None}, "Precision(accum_dtype=None): expected one of"),
    ],
)
def test_bad_precision_is_refused_at_pipeline(kwargs, msg):
    with pytest.raises(TypeError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        fpipe.pipeline(mlp, microbatches=2, precision=fpipe.Precision(**kwargs))


def test_precision_must_be_a_policy():
    with pytest.raises(TypeError, match="precision must be an fpipe.Precision"):
        fpipe.pipeline(mlp, microbatches=2, precision=torch.bfloat16)  # type: ignore[arg-type]


# -- 4 ranks, dp=2 x pp=2 (tests/support/precision_worker.py, in the shared 4-rank launch) ---------------


@pytest.fixture(scope="module")
def ranks(four_ranks):
    return [rec["precision"] for rec in four_ranks("dp")]


def test_gradients_are_reduced_over_dp_in_fp32_under_a_bf16_policy(ranks):
    """fp32 masters computed in bf16: the dp all-reduce runs in fp32 (the accumulated sums'
    dtype), the gradients come back fp32, within 10% of one unsplit bf16 step's error."""
    for rec in ranks:
        r = rec["reduce"]
        assert "error" not in r, r
        assert r["reduce_dtypes"] == ["torch.float32"] and r["grad_dtypes"] == ["torch.float32"], r
        assert r["err"] <= 1.1 * r["unsplit_err"], r


def test_each_rank_casts_only_its_own_stages_parameters_once_per_step(ranks):
    """Other ranks' parameters on the meta device: a step casts exactly this rank's real ones
    (stage 0: w0, b0, w1, b1; stage 1: w2, b2), once each."""
    assert sorted(rec["reduce"]["real_casts"] for rec in ranks) == [[2, 2], [2, 2], [4, 4], [4, 4]]


def test_fp32_master_weights_sharded_over_dp_get_fp32_gradient_shards(ranks):
    """Master weights as DTensors sharded over dp (each rank holds its shard's master copy only),
    computed in bf16: the gradients are fp32 DTensor shards, as accurate as unsharded."""
    for rec in ranks:
        r = rec["sharded"]
        assert "error" not in r, r
        assert r["types"] == ["DTensor torch.float32"], r
        assert r["err"] <= 1.1 * rec["reduce"]["unsplit_err"], (r, rec["reduce"])


def test_an_inf_on_one_rank_makes_every_rank_skip_the_step_and_halve_the_scale(ranks):
    """fp16 compute, `fpipe.LossScaler`: rank 3 alone finds an inf; all four ranks skip (unscale_
    returns False, gradients left as they are) and halve 1024 to 512; the next, finite step is
    unscaled on every rank, keeps the scale, and `clip_grad_norm_` agrees on the norm."""
    for rec in ranks:
        s = rec["scaler"]
        assert "error" not in s, s
        assert s["inf"] == {"ok": False, "scale": 512.0, "unscaled": False, "norm": None}, s
        assert s["finite"]["ok"] and s["finite"]["scale"] == 512.0 and s["finite"]["unscaled"], s
    assert len({rec["scaler"]["finite"]["norm"] for rec in ranks}) == 1


def test_the_loss_scaler_grows_after_finite_steps_and_round_trips_its_state():
    s = fpipe.LossScaler(init_scale=8.0, growth_interval=2)
    for _ in range(2):
        assert s.unscale_({"w": torch.full((2,), 8.0)})
        s.update()
    assert float(s.scale) == 16.0
    t = fpipe.LossScaler()
    t.load_state_dict(s.state_dict())
    assert (float(t.scale), t.good_steps) == (16.0, 0)
    with pytest.raises(RuntimeError, match="call unscale_"):
        t.update()


def test_the_example_gpt_trains_in_bf16_under_the_policy_like_fp32():
    """examples/train_gpt.py's GPT (tiny), 10 AdamW steps, 2 stages x 4 microbatches: fp32 master
    weights computed in bf16 follow the fp32 run's loss curve within 2% at every step."""
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    train_gpt = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(train_gpt)  # type: ignore[union-attr]
    torch.manual_seed(0)
    fn, init = fpipe.functionalize(train_gpt.GPT(64, 16, 32, 2, 2))
    tokens = torch.randint(0, 64, (16, 17), generator=torch.Generator().manual_seed(1))

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(fn(p, x).flatten(0, 1).float(), y.flatten())

    def curve(precision: fpipe.Precision | None) -> list[float]:
        params = {k: v.detach().clone() for k, v in init.items()}
        opt = torch.optim.AdamW(params.values(), lr=1e-2)
        step = fpipe.value_and_grad(fpipe.pipeline(loss_fn, stages=2, microbatches=4, precision=precision))
        losses = []
        for _ in range(10):
            loss, grads = step(params, tokens[:, :-1], tokens[:, 1:])
            fpipe.set_grads(params, grads)
            opt.step()
            losses.append(float(loss))
        return losses

    fp32, bf16 = curve(None), curve(fpipe.Precision(param_dtype=BF16))
    assert fp32[-1] < fp32[0] - 0.3, fp32  # it trains
    assert all(abs(a - b) <= 0.02 * a for a, b in zip(fp32, bf16)), (fp32, bf16)


def test_the_memory_prediction_counts_bf16_gradient_sums_in_fp32():
    """`memory_report` replays the runner: bf16 parameters' gradient sums are held in fp32."""
    p, x, y, _ = setup()
    report = fpipe.pipeline(mlp, microbatches=4).memory_report(p, x, y)
    assert sum(s.grads for s in report.stages) == sum(v.numel() * 4 for v in p.values())


def test_the_memory_prediction_counts_sums_in_the_policys_accum_dtype():
    """With `Precision(accum_dtype=torch.float64)` the runner holds the sums in float64, and the
    prediction (what `memory_limit` and the recomputation choice rest on) counts them so."""
    p, x, y, _ = setup()
    prec = fpipe.Precision(accum_dtype=torch.float64)
    report = fpipe.pipeline(mlp, microbatches=4, precision=prec).memory_report(p, x, y)
    assert sum(s.grads for s in report.stages) == sum(v.numel() * 8 for v in p.values())
