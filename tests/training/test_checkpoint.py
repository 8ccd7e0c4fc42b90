"""fpipe.save / fpipe.load / fpipe.async_save in one process (fpipe/_src/training/checkpoint*.py).

Round trips of parameters, optimizer state and `extra`; a tied model; resuming after 3 AdamW
steps equals an uninterrupted 6-step run; names and shapes that differ, missing and truncated
files; a safetensors directory. Crashes are in tests/training/test_checkpoint_crash.py, the layouts of
several processes in tests/training/test_checkpoint_dist.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from ckpt_worker import LR, build, piped_for, reference, train
from torch import nn

import fpipe
from fpipe._src.training import checkpoint_files

DT = torch.float64


def saved_keys(path: Path) -> set[tuple[str, str, str]]:
    """(kind, name, state) of every tensor the checkpoint's ranks wrote."""
    return {
        (e["kind"], e["name"], e["state"])
        for f in path.glob("rank*.json")
        for e in json.loads(f.read_text())["entries"]
    }


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(4, 3, generator=g, dtype=DT),
        "a.bias": torch.randn(4, generator=g, dtype=DT),
    }


def _stepped(
    params: dict[str, torch.Tensor],
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(params.values(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        for p in params.values():
            p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
    return opt, sched


def test_round_trip_of_parameters_optimizer_state_and_extra(tmp_path):
    params = _params()
    opt, sched = _stepped(params)
    extra = {"step": 2, "rng": torch.get_rng_state(), "sched": sched.state_dict(), "data": [1, (2, "x")]}
    fpipe.save(tmp_path / "c", params, optimizer=opt, extra=extra)
    mine = _params(seed=1)
    opt2 = torch.optim.AdamW(mine.values(), lr=1.0)
    got = fpipe.load(tmp_path / "c", mine, optimizer=opt2)
    assert all(torch.equal(mine[k], params[k]) for k in params)
    assert (
        torch.equal(got["rng"], extra["rng"])
        and got["sched"] == extra["sched"]
        and got["data"] == [1, (2, "x")]
    )
    want, have = opt.state_dict(), opt2.state_dict()
    assert want["param_groups"] == have["param_groups"]  # lr halved twice by the scheduler
    for i, st in want["state"].items():
        assert st.keys() == have["state"][i].keys() and all(
            torch.equal(v, have["state"][i][k]) for k, v in st.items()
        )


def test_keys_are_the_parameters_names_and_state_is_under_them(tmp_path):
    params = _params()
    opt, _ = _stepped(params)
    fpipe.save(tmp_path / "c", params, optimizer=opt)
    state = {("optim", n, k) for n in params for k in ("step", "exp_avg", "exp_avg_sq")}
    assert saved_keys(tmp_path / "c") == {*(("param", n, "") for n in params), *state}
    assert set(json.loads((tmp_path / "c" / "rank0.json").read_text())["optim"]) == set(params)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight


def test_a_tied_parameter_is_written_once_and_loads_into_both_uses(tmp_path):
    torch.manual_seed(0)
    src, dst = Tied(), Tied()
    _, params = fpipe.functionalize(src)
    fpipe.save(tmp_path / "c", params)
    assert saved_keys(tmp_path / "c") == {("param", "emb.weight", "")}
    _, mine = fpipe.functionalize(dst)
    fpipe.load(tmp_path / "c", mine)
    assert torch.equal(dst.head.weight, src.emb.weight) and dst.head.weight is dst.emb.weight


def test_resume_after_three_adamw_steps_equals_six_uninterrupted(tmp_path):
    """The tied model cut in 2 stages, in one process, fp64: save after 3 steps, load into a model
    initialised otherwise, 3 more steps: the losses and parameters of 6 steps within 1e-9."""
    piped, params = piped_for(build(2))
    opt = torch.optim.AdamW(params.values(), lr=LR)
    first = train(piped, params, opt, range(3))
    fpipe.save(tmp_path / "c", params, optimizer=opt, extra={"step": 3}, pipeline=piped)
    torch.manual_seed(1)
    model = build(2)
    for p in model.parameters():
        nn.init.normal_(p)
    piped, params = piped_for(model)
    opt = torch.optim.AdamW(params.values(), lr=LR)
    assert fpipe.load(tmp_path / "c", params, optimizer=opt, pipeline=piped) == {"step": 3}
    losses = first + train(piped, params, opt, range(3, 6))
    ref_losses, ref = reference()
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-9
    assert max(float((params[k] - ref[k]).abs().max()) for k in ref) < 1e-9


def test_names_and_shapes_that_differ_are_named(tmp_path):
    fpipe.save(tmp_path / "c", {"a": torch.zeros(2, 3), "b": torch.zeros(3)})
    with pytest.raises(ValueError) as err:
        fpipe.load(tmp_path / "c", {"a": torch.zeros(2, 4), "c": torch.zeros(3)})
    msg = str(err.value)
    assert msg.startswith(
        f"load({str(tmp_path / 'c')!r}, params): the parameters differ from those of the checkpoint"
    )
    assert "not in the checkpoint: ['c']" in msg and "in the checkpoint but not in params: ['b']" in msg
    assert "'a' is float32 (2, 4) here, float32 (2, 3) in the checkpoint" in msg


def test_optimizer_state_missing_from_the_checkpoint_is_named(tmp_path):
    params = _params()
    fpipe.save(tmp_path / "c", params)
    opt = torch.optim.AdamW(params.values())
    with pytest.raises(ValueError, match=r"holds no optimizer state for \['a.weight', 'a.bias'\]"):
        fpipe.load(tmp_path / "c", params, optimizer=opt)


def test_an_optimizer_over_other_tensors_is_refused(tmp_path):
    opt = torch.optim.SGD([torch.zeros(7)], lr=0.1)
    with pytest.raises(
        ValueError, match=r"optimizer.param_groups\[0\]\['params'\]\[0\] \(shape \(7,\)\) is not a tensor"
    ):
        fpipe.save(tmp_path / "c", _params(), optimizer=opt)
    assert not (tmp_path / "c").exists()


def test_extra_that_is_not_data_is_refused_before_writing(tmp_path):
    with pytest.raises(
        TypeError, match=r"extra\['obj'\] is a tests?.*Tied, which a checkpoint does not hold"
    ):
        fpipe.save(tmp_path / "c", _params(), extra={"obj": Tied()})
    assert not (tmp_path / "c").exists()


def _saved(tmp_path: Path) -> Path:
    fpipe.save(tmp_path / "c", _params(), extra={"step": 1})
    return tmp_path / "c"


@pytest.mark.parametrize("which", ["rank0.safetensors", "rank0.json"])
def test_a_missing_file_is_named(tmp_path, which):
    path = _saved(tmp_path)
    victim = path / which
    victim.unlink()
    with pytest.raises(ValueError, match=f"{victim} is missing .* the checkpoint is incomplete"):
        fpipe.load(path, _params())


def test_a_truncated_file_is_named(tmp_path):
    path = _saved(tmp_path)
    victim = path / "rank0.safetensors"
    size = victim.stat().st_size
    os.truncate(victim, size - 10)
    with pytest.raises(ValueError, match=f"{victim} has {size - 10} bytes, the manifest says {size}"):
        fpipe.load(path, _params())


def test_no_manifest_means_no_complete_checkpoint(tmp_path):
    path = _saved(tmp_path)
    (path / "fpipe.json").unlink()
    with pytest.raises(ValueError, match="fpipe.json is missing, so .* is not a complete fpipe checkpoint"):
        fpipe.load(path, _params())
    with pytest.raises(FileNotFoundError, match="no checkpoint directory at"):
        fpipe.load(tmp_path / "absent", _params())


@pytest.mark.parametrize("exchange", [True, False])
def test_a_new_save_replaces_the_previous_and_leaves_nothing_beside_it(tmp_path, monkeypatch, exchange):
    if not exchange:  # where renameat2 is missing: two renames through .c.previous
        monkeypatch.setattr(checkpoint_files, "_exchange", lambda a, b: False)
    path = _saved(tmp_path)
    fpipe.save(path, {k: v + 1 for k, v in _params().items()}, extra={"step": 2})
    mine = _params()
    assert fpipe.load(path, mine) == {"step": 2} and torch.equal(mine["a.bias"], _params()["a.bias"] + 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".c.lock", "c"]  # (the lock file stays)


def test_async_save_writes_the_values_of_the_call_and_publishes_on_completion(tmp_path):
    params = {"w": torch.randn(64, 64, dtype=DT)}
    before = params["w"].clone()
    handle = fpipe.async_save(tmp_path / "c", params, extra={"step": 7})
    params["w"].add_(1.0)  # training goes on
    handle.result()
    assert handle.done()
    mine = {"w": torch.zeros(64, 64, dtype=DT)}
    assert fpipe.load(tmp_path / "c", mine) == {"step": 7} and torch.equal(mine["w"], before)


def test_a_safetensors_directory_loads_the_weights_and_names_what_differs(tmp_path):
    from safetensors.torch import save_file

    params = _params()
    (tmp_path / "hf").mkdir()
    save_file({k: v.clone() for k, v in params.items()}, str(tmp_path / "hf" / "model.safetensors"))
    mine = _params(seed=1)
    assert fpipe.load(tmp_path / "hf", mine) == {} and all(torch.equal(mine[k], params[k]) for k in params)
    with pytest.raises(ValueError, match=r"not in the checkpoint: \['extra.weight'\]"):
        fpipe.load(tmp_path / "hf", {**mine, "extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"'a.bias' is \(5,\) here, \(4,\) in the files"):
        fpipe.load(tmp_path / "hf", {**mine, "a.bias": torch.zeros(5, dtype=DT)})
    with pytest.raises(ValueError, match="holds weights only; pass optimizer=None"):
        fpipe.load(tmp_path / "hf", mine, optimizer=torch.optim.SGD(mine.values(), lr=0.1))


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),  # state {"momentum_buffer": None}: a non-tensor
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.1),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.1, momentum=0.5),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_any_optimizer_with_tensor_and_scalar_state_round_trips(tmp_path, name):
    params = _params()
    opt = OPTIMIZERS[name](params.values())
    for _ in range(2):
        for p in params.values():
            p.grad = torch.ones_like(p)
        opt.step()
    fpipe.save(tmp_path / "c", params, optimizer=opt)
    mine = _params(seed=1)
    opt2 = OPTIMIZERS[name](mine.values())
    fpipe.load(tmp_path / "c", mine, optimizer=opt2)
    want, have = opt.state_dict(), opt2.state_dict()
    assert want["param_groups"] == have["param_groups"] and want["state"].keys() == have["state"].keys()
    for i, st in want["state"].items():
        assert st.keys() == have["state"][i].keys(), (st, have["state"][i])
        for k, v in st.items():
            assert (
                torch.equal(v, have["state"][i][k])
                if isinstance(v, torch.Tensor)
                else v == have["state"][i][k]
            )


def test_param_groups_hyperparameters_follow_the_parameters(tmp_path):
    params = _params()
    opt = torch.optim.AdamW(
        [{"params": [params["a.weight"]], "lr": 0.1}, {"params": [params["a.bias"]], "lr": 0.2}]
    )
    fpipe.save(tmp_path / "c", params, optimizer=opt)
    mine = _params()
    swapped = torch.optim.AdamW([{"params": [mine["a.bias"]], "lr": 9.0}, {"params": [mine["a.weight"]]}])
    fpipe.load(tmp_path / "c", mine, optimizer=swapped)
    assert [g["lr"] for g in swapped.param_groups] == [0.2, 0.1]
    merged = torch.optim.AdamW(mine.values())
    with pytest.raises(
        ValueError, match=r"optimizer.param_groups\[0\] holds parameters saved in groups with other"
    ):
        fpipe.load(tmp_path / "c", mine, optimizer=merged)


def test_pipeline_must_be_a_pipelined(tmp_path):
    with pytest.raises(TypeError, match=r"pipeline= must be the result of fpipe.pipeline, got dict"):
        fpipe.save(tmp_path / "c", _params(), pipeline={})


def test_a_sharded_safetensors_save_reads_through_its_index_and_names_a_broken_file(tmp_path):
    import json

    from safetensors.torch import save_file

    params, hf = _params(), tmp_path / "hf"
    hf.mkdir()
    save_file({"a.weight": params["a.weight"]}, str(hf / "model-00001-of-00002.safetensors"))
    save_file({"a.bias": params["a.bias"]}, str(hf / "model-00002-of-00002.safetensors"))
    weight_map = {
        "a.weight": "model-00001-of-00002.safetensors",
        "a.bias": "model-00002-of-00002.safetensors",
    }
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    mine = _params(seed=1)
    fpipe.load(hf, mine)
    assert all(torch.equal(mine[k], params[k]) for k in params)
    broken = hf / "model-00002-of-00002.safetensors"
    os.truncate(broken, broken.stat().st_size - 4)
    with pytest.raises(ValueError, match=f"{broken} cannot be read"):
        fpipe.load(hf, mine)
    broken.unlink()
    with pytest.raises(ValueError, match=f"{broken} is missing"):
        fpipe.load(hf, mine)
