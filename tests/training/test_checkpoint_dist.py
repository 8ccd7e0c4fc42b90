"""Checkpoints move between layouts (NOTE [checkpoints move between layouts] in
fpipe/_src/training/checkpoint.py): two torchrun launches of `tests/support/ckpt_worker.py` for the module (gloo).
The first trains a tied model 3 AdamW steps at pp=2 and saves it (`fpipe.save` and
`fpipe.async_save`); the second resumes it, built on the meta device and materialised, at pp=4
and at dp=2 x pp=2 (replicated, and sharded as DTensors), and loads a GPT-2 `save_pretrained`
directory into a meta GPT-2 in 4 stages; this process resumes it at pp=1. Three more steps give
the losses and parameters of an uninterrupted 6-step run (fp64, 1e-9).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_worker import DT, LR, build, piped_for, reference, train
from dist_launch import read_json, report, run_torchrun, torchrun_cmd
from models import ConvBN

import fpipe

TOL = 1e-9
DEADLINE_S = 240.0
RESUMED = ["pp4", "dp2pp2", "dp2pp2_sharded"]


def _launch(out: Path, phase: str, ranks: int) -> list[dict[str, Any]]:
    procs = run_torchrun([torchrun_cmd("ckpt_worker.py", ranks, phase, str(out))], out / phase, DEADLINE_S)
    recs = [out / f"{phase}.rank{r}.json" for r in range(ranks)]
    assert all(p.exists() for p in recs) and all(p.rc == 0 for p in procs), report(procs)
    return [read_json(p) for p in recs]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("ckpt")
    saved = _launch(out, "save", 2)
    return {"out": out, "save": saved, "resume": _launch(out, "resume", 4)}


def test_the_saved_run_trained_like_the_reference(run):
    """3 steps, the saves, and a 4th step that ran while `async_save` wrote (the dp=2 x pp=2
    resume from that checkpoint below has the 3-step state: the 4th step is not in it)."""
    ref_losses, _ = reference(4)
    for rec in run["save"]:
        assert "error" not in rec["save"], rec["save"]
        assert len(rec["save"]["losses"]) == 4
        assert max(abs(a - b) for a, b in zip(rec["save"]["losses"], ref_losses)) < TOL


def _pieces(path: Path, kind: str = "param") -> dict[str, list[int]]:
    """name -> the ranks that wrote a piece of it (from each rank's index in the checkpoint)."""
    out: dict[str, list[int]] = {}
    for f in sorted(path.glob("rank*.json")):
        for e in json.loads(f.read_text())["entries"]:
            if e["kind"] == kind and not e["state"]:
                out.setdefault(e["name"], []).append(int(f.stem[4:]))
    return out


def test_every_parameter_is_written_once_under_its_name(run):
    """The tied embedding (read by both pipeline ranks) is one entry; each parameter's tensor is
    written by one rank (its owner), so the checkpoint's files hold each key once."""
    names = sorted(dict(build(2).named_parameters()))
    pieces = _pieces(run["out"] / "ckpt")
    assert sorted(pieces) == names and all(len(r) == 1 for r in pieces.values()), pieces
    optim = [n for f in (run["out"] / "ckpt").glob("rank*.json") for n in json.loads(f.read_text())["optim"]]
    assert sorted(optim) == names


@pytest.mark.parametrize("case", RESUMED)
def test_resumed_run_matches_an_uninterrupted_one(run, case):
    for rec in run["resume"]:
        res = rec[case]
        assert "error" not in res, (rec["rank"], res.get("traceback"))
        assert res["extra"] == {"step": 3}
        assert res["loss_err"] < TOL and max(res["param_err"].values()) < TOL, (rec["rank"], res)


@pytest.mark.parametrize("case", RESUMED)
def test_each_rank_loads_only_its_stages_parameters(run, case):
    """Built on the meta device: each rank's real parameters are its stages' (a strict part of
    the model at pp=4; each pipeline of the dp=2 x pp=2 mesh holds all of them)."""
    recs = run["resume"]
    every = set(recs[0][case]["all"])
    assert all(set(r[case]["local"]) < every for r in recs)
    groups = [[0, 1, 2, 3]] if case == "pp4" else [[0, 1], [2, 3]]
    for g in groups:
        assert set().union(*(recs[r][case]["local"] for r in g)) == every


def test_resume_in_one_process(run):
    """The pp=2 checkpoint resumed at pp=1 in this process (no pipeline= needed)."""
    piped, params = piped_for(build(None))
    opt = torch.optim.AdamW(params.values(), lr=LR)
    assert fpipe.load(run["out"] / "ckpt", params, optimizer=opt, pipeline=piped) == {"step": 3}
    losses = train(piped, params, opt, range(3, 6))
    ref_losses, ref = reference()
    assert max(abs(a - b) for a, b in zip(losses, ref_losses[3:])) < TOL
    assert max(float((params[k] - ref[k]).abs().max()) for k in ref) < TOL


def test_save_and_load_under_a_process_group_need_the_pipeline(run):
    rec = run["save"][0]["save"]
    assert rec["no_pipeline"].startswith("ValueError: save(") and "pass pipeline=piped" in rec["no_pipeline"]
    assert (
        rec["load_no_pipeline"].startswith("ValueError: load(")
        and "pass pipeline=piped" in rec["load_no_pipeline"]
    )


def test_gpt2_save_pretrained_loads_into_a_meta_model_each_rank_its_stages(run):
    recs = [r["gpt2"] for r in run["resume"]]
    assert all("error" not in r for r in recs), recs
    every = set(recs[0]["all"])
    assert all(set(r["local"]) < every for r in recs) and set().union(*(r["local"] for r in recs)) == every
    assert all(r["err"] == 0.0 and abs(r["loss"] - r["ref_loss"]) < 1e-6 for r in recs), recs


def test_an_argument_one_rank_alone_gets_wrong_fails_the_save_on_every_rank(run):
    """Rank 1's extra holds a module (not data): it raises the TypeError, rank 0 a CheckpointError
    naming rank 1 (no rank waits for the other's files), and nothing is written."""
    zero, one = (r["save"]["one_rank_refuses"] for r in run["save"])
    assert one.startswith("TypeError: save(") and "which a checkpoint does not hold" in one, one
    assert zero.startswith("CheckpointError: save(") and "rank 1 refused to save, so no rank does" in zero, (
        zero
    )
    assert not (run["out"] / "bad").exists()


@pytest.mark.parametrize("name", ["ckpt6", "ckpt6_sharded"])
def test_a_dp_x_pp_save_writes_replicated_tensors_once_and_dtensors_as_shards(run, name):
    """Saved at dp=2 x pp=2: a replicated tensor comes from one rank (replica 0 of its owner); a
    DTensor as its two Shard(0) halves from both replicas; loaded in one process it is the
    uninterrupted run after 6 steps."""
    names = sorted(dict(build(2).named_parameters()))
    pieces = _pieces(run["out"] / name)
    want = 2 if name.endswith("sharded") else 1
    assert sorted(pieces) == names and all(len(set(r)) == want for r in pieces.values()), pieces
    piped, params = piped_for(build(None))
    assert fpipe.load(run["out"] / name, params, pipeline=piped) == {"step": 6}
    _, ref = reference()
    assert max(float((params[k] - ref[k]).abs().max()) for k in ref) < TOL


def test_buffers_are_written_by_the_rank_that_updates_them_and_load_anywhere(run):
    """ConvBN in 4 stages on 2 ranks: each BatchNorm's running statistics come from the rank
    whose stage updates them (bn1's and bn2's from different ranks); loaded in one process
    they are what that rank held."""
    pieces = _pieces(run["out"] / "bn", "buffer")
    held = {r["rank"]: r["bn"]["buffers"] for r in run["save"]}
    assert pieces == {n: [rank] for rank, bufs in held.items() for n in bufs}
    assert pieces["bn1.running_mean"] != pieces["bn2.running_mean"]
    assert sorted(pieces) == sorted(f"{bn}.{b}" for bn in ("bn1", "bn2")
                                    for b in ("running_mean", "running_var", "num_batches_tracked"))  # fmt: skip
    model = ConvBN(stages=4).to(DT)
    _, params = fpipe.functionalize(model)
    with pytest.warns(
        UserWarning, match="saved by 2 ranks, with an extra of its own on each, and is loaded by 1"
    ):
        assert fpipe.load(run["out"] / "bn", params, buffers=model) == {"pos": 1000}
    assert all(model.get_buffer(k).tolist() == v for bufs in held.values() for k, v in bufs.items())


def test_async_save_then_destroy_process_group_publishes_each_ranks_extra_and_the_step(run):
    """The worker ends with `async_save` and `dist.destroy_process_group()` at once: the save is
    published all the same (the ranks meet through files), with each rank's own extra."""
    manifest = json.loads((run["out"] / "bn" / "fpipe.json").read_text())
    assert manifest["ranks"] == 2 and manifest["rng_step"] == 2
    extras = [json.loads((run["out"] / "bn" / f"rank{r}.json").read_text())["extra"] for r in (0, 1)]
    assert extras == [{"pos": 1000}, {"pos": 1001}]


def test_each_rank_gets_its_own_extra_back(run):
    """Rank 1 saved data_pos=1001: it gets 1001 back, not rank 0's 1000 (issue 25 case 4)."""
    assert [r["save"]["per_rank_extra"] for r in run["save"]] == [{"data_pos": 1000}, {"data_pos": 1001}]
