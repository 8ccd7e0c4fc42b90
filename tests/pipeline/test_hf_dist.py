"""transformers GPT-2 and Llama train on 2 and 4 pipeline ranks (gloo) with exact gradients.

One torchrun launch of 4 processes (`tests/support/hf_dist_worker.py` runs every case: pp=4 over all
ranks, pp=2 on a (dp=2, pp=2) DeviceMesh; the launch, the `four_ranks` fixture of
tests/conftest.py, is shared with tests/runtime/test_trust_dist.py and tests/generate/test_generate_cache.py);
the tests assert on its per-rank JSON.
Per case and rank, over two AdamW steps: the loss equals the unsplit whole-batch reference (the
model computes it in float32), every gradient this rank returns equals the reference's within
1e-10 of the largest gradient entry, the parameters after each step equal the reference's, and
each rank of a pipeline holds only part of the parameters while together they hold all of them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

CASES = [("gpt2", 2), ("llama", 2), ("gpt2", 4), ("llama", 4)]
WORLD = 4
TOL = 1e-10


@pytest.fixture(scope="module")
def results(four_ranks) -> list[dict]:
    return four_ranks("hf")


def pipeline_groups(pp: int) -> list[list[int]]:
    """The global ranks of each pipeline: all four, or the rows of the (dp=2, pp=2) mesh."""
    return [list(range(WORLD))] if pp == WORLD else [[0, 1], [2, 3]]


@pytest.mark.parametrize(("name", "pp"), CASES)
def test_trains_with_exact_gradients(results, name, pp):
    key = f"{name}-pp{pp}"
    for rank, res in enumerate(results):
        case = res[key]
        assert "error" not in case, f"rank {rank}: {case.get('error')}\n{case.get('traceback')}"
        assert case["n_stages"] == pp
        for i, step in enumerate(case["steps"]):
            where = f"rank {rank}, step {i + 1}"
            assert step["loss_dtype"] == "torch.float32"  # transformers' ForCausalLMLoss upcasts
            assert step["loss_rel_err"] <= 1e-6, where
            assert step["grad_keys"], f"{where}: no gradients"
            assert max(step["grad_err"].values()) <= TOL, (where, step["grad_err"])
            assert max(step["param_err"].values()) <= TOL, (where, step["param_err"])
        # the second step's loss reflects the first update, so the step trained
        assert case["steps"][1]["ref_loss"] != case["steps"][0]["ref_loss"]


@pytest.mark.parametrize(("name", "pp"), CASES)
def test_each_rank_holds_its_stage(results, name, pp):
    key = f"{name}-pp{pp}"
    for rank, res in enumerate(results):
        assert "error" not in res[key], f"rank {rank}: {res[key]['error']}"
    for group in pipeline_groups(pp):
        per_rank = [set(results[r][key]["steps"][0]["grad_keys"]) for r in group]
        all_keys = set(results[group[0]][key]["all_keys"])
        assert set().union(*per_rank) == all_keys
        assert all(keys < all_keys for keys in per_rank)
        assert sorted(results[r][key]["pp_rank"] for r in group) == list(range(pp))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_replicas_agree(results, name):
    """The two 2-rank replicas of the mesh, each passed its half of the batch, return the same
    (global) loss."""
    for rank, res in enumerate(results):
        assert "error" not in res[f"{name}-pp2"], f"rank {rank}: {res[f'{name}-pp2']['error']}"
    a, b = (results[r][f"{name}-pp2"]["steps"] for r in (0, 2))
    assert [s["loss"] for s in a] == [s["loss"] for s in b]
