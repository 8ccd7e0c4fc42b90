"""All of the training state goes through a checkpoint (issue 25, cases 2-4), in one process.

fpipe's step, which seeds dropout (NOTE [random-number policy]), so a resume is bit-identical;
persistent module buffers (BatchNorm's running statistics and `num_batches_tracked`) from an
fpipe checkpoint and from a `save_pretrained` directory; dtypes checked before anything is
copied. Per-rank `extra` and buffers written by their owning rank: tests/training/test_checkpoint_dist.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import ConvBN
from torch import nn

import fpipe

DT = torch.float64


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(self.a(x)), p=0.5, training=True)
        return self.b(fpipe.stage_boundary(h))


def _run(model: nn.Module, steps: range, ckpt: str = "", load: str = "") -> list[float]:
    """SGD steps of `model` in 2 stages; load `load` first, save to `ckpt` at the end."""
    fn, params = fpipe.functionalize(model)
    piped = fpipe.pipeline(lambda p, x: fn(p, x).square().mean(), microbatches=2)
    opt = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9)
    if load:
        fpipe.load(load, params, optimizer=opt, pipeline=piped)
    losses = []
    for s in steps:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(s), dtype=DT)
        loss, grads = fpipe.value_and_grad(piped)(params, x)
        fpipe.set_grads(params, grads)
        opt.step()
        losses.append(loss.item())
    if ckpt:
        fpipe.save(ckpt, params, optimizer=opt, pipeline=piped)
    return losses


def _dropped(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Dropped().to(DT)


def test_a_resume_with_dropout_is_bit_identical(tmp_path):
    """Issue 25 case 2: the step that seeds dropout's masks is saved and restored, so steps 4-6
    after a resume in a new pipeline draw the masks of the uninterrupted run's steps 4-6."""
    torch.manual_seed(0)
    whole = _run(_dropped(0), range(6))
    torch.manual_seed(0)
    first = _run(_dropped(0), range(3), ckpt=str(tmp_path / "c"))
    other = _dropped(1)
    torch.manual_seed(0)  # the base seed, as the run that saved had it
    again = _run(other, range(3, 6), load=str(tmp_path / "c"))
    assert first + again == whole


def _bn_trained(steps: int = 2) -> tuple[nn.Module, dict[str, torch.Tensor], object]:
    torch.manual_seed(0)
    model = ConvBN(stages=2).to(DT)
    fn, params = fpipe.functionalize(model)
    piped = fpipe.pipeline(lambda p, x, y: F.cross_entropy(fn(p, x), y), microbatches=2)
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(4, 3, 5, 5, generator=g, dtype=DT), torch.randint(0, 3, (4,), generator=g)
        fpipe.value_and_grad(piped)(params, x, y)
    return model, params, piped


def _eval_out(model: nn.Module) -> torch.Tensor:
    x = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(9), dtype=DT)
    return model.eval()(x)


def test_batchnorm_running_statistics_round_trip(tmp_path):
    """Issue 25 case 3: the pipeline's module's persistent buffers are saved (taken from what it
    traced) and `load(buffers=model)` restores them: eval outputs are equal."""
    model, params, piped = _bn_trained()
    assert model.bn1.num_batches_tracked.item() == 4 and model.bn1.running_mean.abs().sum() > 0  # 2 x 2 mbs
    fpipe.save(tmp_path / "c", params, pipeline=piped)
    fresh = ConvBN(stages=2).to(DT)
    _, mine = fpipe.functionalize(fresh)
    fpipe.load(tmp_path / "c", mine, buffers=fresh)
    assert all(torch.equal(fresh.get_buffer(n), b) for n, b in model.named_buffers())
    assert torch.equal(_eval_out(fresh), _eval_out(model))


def test_buffers_the_checkpoint_holds_need_somewhere_to_go(tmp_path):
    """A load that cannot know the module (no pipeline that traced it, no buffers=) is refused
    rather than leaving the running statistics at their initial values; buffers={} skips them."""
    model, params, piped = _bn_trained(1)
    fpipe.save(tmp_path / "c", params, pipeline=piped)
    fresh = ConvBN(stages=2).to(DT)
    _, mine = fpipe.functionalize(fresh)
    with pytest.raises(ValueError, match=r"holds buffers \(\['bn1.num_batches_tracked'.* pass buffers=model"):
        fpipe.load(tmp_path / "c", mine)
    fpipe.load(tmp_path / "c", mine, buffers={})
    assert torch.equal(mine["conv1.weight"], params["conv1.weight"]) and fresh.bn1.num_batches_tracked == 0


def test_a_model_with_buffers_and_a_checkpoint_without_them_is_refused(tmp_path):
    model, params, _ = _bn_trained(1)
    fpipe.save(tmp_path / "c", params)  # no pipeline, no buffers=: parameters alone
    with pytest.raises(ValueError, match=r"has persistent buffers .* holds none \(saved without them\)"):
        fpipe.load(tmp_path / "c", dict(params), buffers=model)


def test_a_save_pretrained_directory_loads_the_buffers_too(tmp_path):
    """Issue 25 case 3: safetensors files hold the module's state_dict, buffers included."""
    from safetensors.torch import save_file

    model, _, _ = _bn_trained()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    fresh = ConvBN(stages=2).to(DT)
    _, mine = fpipe.functionalize(fresh)
    assert fpipe.load(tmp_path, mine, buffers=fresh) == {}
    assert torch.equal(_eval_out(fresh), _eval_out(model))


def test_a_dtype_that_differs_is_refused_before_anything_is_copied(tmp_path):
    """fp64 into bf16 was cast silently; now refused, naming both, and the tensor is untouched."""
    fpipe.save(tmp_path / "c", {"w": torch.randn(3, dtype=torch.float64), "b": torch.ones(2)})
    mine = {"w": torch.zeros(3, dtype=torch.bfloat16), "b": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"'w' is bfloat16 \(3,\) here, float64 \(3,\) in the checkpoint"):
        fpipe.load(tmp_path / "c", mine)
    assert not mine["w"].any() and not mine["b"].any()


def test_extra_keeps_tuples_non_string_keys_tensors_and_bytes(tmp_path):
    extra = {
        "t": (1, 2.5, None),
        "k": {3: "x", (4, 5): [True]},
        "rng": torch.get_rng_state(),
        "b": b"\x00\x01",
    }
    fpipe.save(tmp_path / "c", {"w": torch.ones(1)}, extra=extra)
    got = fpipe.load(tmp_path / "c", {"w": torch.zeros(1)})
    assert got.keys() == extra.keys() and got["t"] == extra["t"] and got["k"] == extra["k"]
    assert torch.equal(got["rng"], extra["rng"]) and got["b"] == extra["b"]


def test_loading_a_checkpoint_with_dropout_without_its_pipeline_warns(tmp_path):
    _run(_dropped(0), range(1), ckpt=str(tmp_path / "c"))
    _, params = fpipe.functionalize(_dropped(1))
    with pytest.warns(UserWarning, match=r"holds its pipeline's step \(1\), .* pass pipeline=piped"):
        fpipe.load(tmp_path / "c", params)
