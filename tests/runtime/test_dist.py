"""Multi-process parity on gloo (CPU): every rank's loss and gradients equal the single-process
reference, for every schedule, on 2 ranks (one standalone torchrun) and on 4 ranks formed by two
torchrun "nodes" on loopback (`--nnodes 2 --nproc-per-node 2`, c10d rendezvous), started together.

Starting a process group costs seconds (most of this module's time), so each launch runs every
case of `tests/support/dist_worker.py` at once (on first use, with a hard deadline) and the tests below
assert on what each rank wrote: one test per (launch, case, property), so a failure names its
case. The reference is `torch.func.grad_and_value` of the unsplit function on the same fp64
inputs. The 4-rank launch is the two-node one: one launch covers both, and a single-node torchrun
differs from it only in where the rendezvous store lives.
"""

from __future__ import annotations

from typing import Any

import dist_worker
import pytest
from dist_launch import free_port, read_json, report, run_torchrun, torchrun_cmd

TOL = 1e-10
DEADLINE_S = 300.0
MICROBATCHES = {2: 3, 4: 6}  # more microbatches than ranks, not a multiple of them for P=4
LAUNCHES = {  # name: (ranks, nodes)
    "2ranks": (2, 1),
    "4ranks_2nodes": (4, 2),
}


def _cases(launch: str) -> list[dict[str, Any]]:
    p = LAUNCHES[launch][0]
    return dist_worker.cases(p, MICROBATCHES[p])


def _params(kinds: tuple[str, ...], where: Any = None) -> list[Any]:
    out = []
    for launch in LAUNCHES:
        for c in _cases(launch):
            if c["kind"] in kinds and (where is None or where(c)):
                out.append(pytest.param(launch, c["id"], id=f"{launch}-{c['id']}"))
    return out


def _launch(launch: str, out: Any) -> list[dict[str, Any]]:
    p, n_nodes = LAUNCHES[launch]
    args = ["--out", str(out), "--microbatches", str(MICROBATCHES[p])]
    if n_nodes > 1:  # one torchrun per node, started together, meeting at a c10d store on loopback
        port, per_node = free_port(), p // n_nodes
        nodes = [
            torchrun_cmd("dist_worker.py", per_node, *args, nnodes=n_nodes, node_rank=i, port=port)
            for i in range(n_nodes)
        ]
    else:
        nodes = [torchrun_cmd("dist_worker.py", p, *args)]
    procs = run_torchrun(nodes, out, DEADLINE_S)
    assert all(proc.rc == 0 for proc in procs), f"{launch}: a launch failed or hung\n" + report(procs)
    return [read_json(out / f"rank{r}.json") for r in range(p)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """`results(launch)`: each rank's record, launching on first use (once per module)."""
    done: dict[str, Any] = {}

    def get(launch: str) -> list[dict[str, Any]]:
        if launch not in done:  # a failed launch is remembered too: one launch per module, always
            try:
                done[launch] = _launch(launch, tmp_path_factory.mktemp(launch))
            except Exception as err:
                done[launch] = err
        if isinstance(done[launch], Exception):
            raise done[launch]
        return done[launch]

    return get


def _records(results: Any, launch: str, case_id: str) -> list[dict[str, Any]]:
    ranks = results(launch)
    recs = [r["cases"][case_id] for r in ranks]
    for rank, rec in enumerate(recs):
        assert rec["ok"], f"rank {rank}: {rec['error_type']}: {rec['error']}\n{rec['traceback']}"
    return recs


# -- loss and gradients ----------------------------------------------------------------------------


def _assert_step_parity(recs: list[dict[str, Any]]) -> None:
    for rank, rec in enumerate(recs):
        assert rec["loss_dtype"] == "torch.float64"
        assert rec["loss_err"] <= TOL, (rank, rec["loss"], rec["ref_loss"])
        assert rec["grad_shape_ok"], rank
        bad = {k: e for k, e in rec["grad_err"].items() if not e <= TOL}
        assert not bad, f"rank {rank}: gradients differ from the reference: {bad}"


@pytest.mark.parametrize(("launch", "case_id"), _params(("one", "multi", "layout", "measured")))
def test_loss_and_grads_equal_the_reference(results, launch, case_id):
    recs = _records(results, launch, case_id)
    _assert_step_parity(recs)
    if "step2" in recs[0]:  # the cached program, after an optimizer step
        _assert_step_parity([rec["step2"] for rec in recs])


@pytest.mark.parametrize(("launch", "case_id"), _params(("one", "multi")))
def test_full_backwards_send_input_gradients_before_weight_gradients(results, launch, case_id):
    """A full backward B whose input gradients go to another rank runs as its input-gradient
    part, the send, then its weight-gradient part (the loss and gradients test above covers the
    values). Schedules with B actions all place stage s - 1 on another rank, so that is every
    stage but the first that has weight-gradient work: with one stage per rank, every stage but
    the first holds parameters; with several, an automatic cut may leave a stage without any."""
    recs = _records(results, launch, case_id)
    for rank, rec in enumerate(recs):
        on = rec["schedule_stage_rank"]
        expected = [s for s in rec["b_stages"] if s > 0 and on[s - 1] != rank]
        if rec["case"]["kind"] == "one":
            assert rec["b_split"] == expected, f"rank {rank}"
        else:
            assert set(rec["b_split"]) <= set(expected), f"rank {rank}"
    if recs[0]["case"]["schedule"] in ("gpipe", "1f1b"):
        assert any(rec["b_split"] for rec in recs)


@pytest.mark.parametrize(("launch", "case_id"), _params(("measured",)))
def test_measured_partition_cuts_alike_on_every_rank(results, launch, case_id):
    """Each rank times the operations itself; the times are averaged over the ranks first, so
    every rank cuts at the same places (else the ranks would run different programs)."""
    recs = _records(results, launch, case_id)
    assert all(rec["cut"] == recs[0]["cut"] for rec in recs)
    assert recs[0]["n_stages"] == len(recs)


@pytest.mark.parametrize(("launch", "case_id"), _params(("one", "multi")))
def test_each_rank_gets_the_grads_of_the_params_its_stages_use(results, launch, case_id):
    recs = _records(results, launch, case_id)
    p = len(recs)
    for rank, rec in enumerate(recs):
        assert rec["grad_keys"] == rec["keys_read"], rank
        assert rec["grad_keys"], f"rank {rank} holds no parameters"
    union = set().union(*(rec["grad_keys"] for rec in recs))
    assert union == set(recs[0]["all_keys"])
    case = recs[0]["case"]
    owners: dict[str, set[int]] = {}
    for rank, rec in enumerate(recs):
        for k in rec["grad_keys"]:
            owners.setdefault(k, set()).add(rank)
    shared = {k: r for k, r in owners.items() if len(r) > 1}
    if case["model"].startswith("gpt"):
        # the tied embedding / LM head: read by the first stage and the last one
        last = recs[0]["schedule_stage_rank"][-1]
        assert shared == ({"tok.weight": {0, last}} if last != 0 else {})  # V placement: both on rank 0
    else:
        assert not shared
    if case["model"] == "mlp_markers":
        for rank, rec in enumerate(recs):
            assert rec["grad_keys"] == dist_worker.marker_keys(p, rank), rank
    if case["model"] == "gpt_meta":  # materialize allocated exactly this rank's parameters
        for rank, rec in enumerate(recs):
            assert rec["local_keys"] == rec["grad_keys"], rank
    if case["kind"] == "one":
        assert recs[0]["n_stages"] == p and recs[0]["schedule_stage_rank"] == list(range(p))
    else:  # stages=None: fpipe picks the schedule's own number of stages
        import fpipe

        own = fpipe.schedules.build(case["schedule"], pp=p, microbatches=case["microbatches"])
        assert (recs[0]["n_stages"], recs[0]["schedule_stage_rank"]) == (own.n_stages, list(own.stage_rank))


# -- clip_grad_norm_, AdamW, forward only -----------------------------------------------------------


@pytest.mark.parametrize(("launch", "case_id"), _params(("one", "multi", "layout")))
def test_clip_grad_norm_is_the_global_norm_and_clips_by_it(results, launch, case_id):
    """The norm over all ranks' parameters (a shared one counted once), in fp64 like the grads,
    also on a rank whose stage holds no parameters (layout: the last stage only takes the loss)."""
    recs = _records(results, launch, case_id)
    assert len({rec["norm"] for rec in recs}) == 1, [rec["norm"] for rec in recs]
    for rank, rec in enumerate(recs):
        assert rec["norm_dtype"] == "torch.float64", rank
        assert abs(rec["norm"] - rec["ref_norm"]) <= TOL * rec["ref_norm"], (
            rank,
            rec["norm"],
            rec["ref_norm"],
        )
        assert rec["clip_err"] <= TOL, rank


@pytest.mark.parametrize(("launch", "case_id"), _params(("one", "multi")))
def test_adamw_step_through_set_grads(results, launch, case_id):
    for rank, rec in enumerate(_records(results, launch, case_id)):
        assert rec["adamw_moved"] > 1e-4, rank  # every local parameter was updated
        assert rec["adamw_err"] <= TOL, rank


@pytest.mark.parametrize(("launch", "case_id"), _params(("one",), lambda c: c["forward"]))
def test_forward_only_returns_the_loss_on_every_rank(results, launch, case_id):
    for rank, rec in enumerate(_records(results, launch, case_id)):
        assert rec["fwd_loss_err"] <= TOL, rank


# -- schedules that cannot place one stage per rank -------------------------------------------------


@pytest.mark.parametrize(("launch", "case_id"), _params(("refused",)))
def test_v_schedules_refuse_one_stage_per_rank_with_a_clear_error(results, launch, case_id):
    p = LAUNCHES[launch][0]
    ranks = results(launch)
    name = ranks[0]["cases"][case_id]["case"]["schedule"]
    expected = (
        f"schedules.build({name!r}, pp={p}, stages={p}): the V placement puts stages r and {2 * p - 1}-r "
        f"on rank r, so stages must be 2 * pp = {2 * p}; use stages={2 * p} or pp={p // 2}."
    )
    for rank, r in enumerate(ranks):
        rec = r["cases"][case_id]
        assert not rec["ok"], rank
        assert (rec["error_type"], rec["error"]) == ("ValueError", expected), rank


def test_every_registered_schedule_is_covered():
    import fpipe

    for launch in LAUNCHES:
        covered = {c["schedule"] for c in _cases(launch)}
        assert covered == set(fpipe.schedules.names())
