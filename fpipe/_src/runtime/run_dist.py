"""Run across processes: each rank interprets its own action list; values cross by p2p.

Communication is derived, not scheduled: a value produced by an action on rank A and read by a
program on rank B travels in a *bundle* (every value that action sends to B). Each ordered pair
of ranks is one channel, and B receives A's bundles in exactly the order A sends them -- taking
early ones it does not need yet into its store -- so p2p messages always match (torch matches
them by order, not by tag), whatever the schedule. Shapes and dtypes come from the traced
program, identical on every rank: no per-step handshake.

Every rank builds every rank's communication plan (`comm.comm_plan`, plain data, once per
signature) and checks that it cannot deadlock on in-order streams (`simulate.validate_comm`)
before any transfer. Each rank issues its groups of sends and receives in the plan's order, one
`batch_isend_irecv` per group: NCCL runs them in that order, and the plan's order keeps it free
of deadlock. On gloo, whose operations complete independently, the receives of the next group
are posted one group early too, so transfers overlap compute; `FPIPE_EMULATE_NCCL_ORDER=1`
instead issues each group only once the previous one completed (NCCL's order, for the tests).

A full backward B whose outputs go to another rank runs as its two halves (`split_iw.backward_parts`):
the input-gradient part, then the send of its outputs, then the weight-gradient part. The schedule
and the work are the same; the previous stage gets its gradient one weight-gradient pass sooner
(1F1B's critical path runs through those sends). The timeline names the halves `B1.0` and
`B1.0/w`, and each group that sends `send B1.0` (kind "send").
"""

from __future__ import annotations

import functools
import os
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..schedules import Action, CommGroup, CommPlan, Schedule, Transfer, comm_plan, validate_comm
from ..stages import Place, Program, Staged, backward_parts
from .dist import PeerFailure, PPGroup, SendReaper, exit_hard_after_failure
from .precision import Precision
from .run import Results, Timeline, action_place, outputs_by_program, release, run_program

__all__ = ["DistRunner", "EMULATE_NCCL_ORDER"]

EMULATE_NCCL_ORDER = "FPIPE_EMULATE_NCCL_ORDER"  # env var: "1" issues each group after the last completed


def send_reaper(pg: PPGroup, timeout: float) -> SendReaper:
    """The process group's one send reaper (a thread), shared by its runners (one per signature)."""
    reaper = getattr(pg, "_fpipe_send_reaper", None)
    if reaper is None:
        reaper = SendReaper(pg, timeout)
        pg._fpipe_send_reaper = reaper  # type: ignore[attr-defined]
    return reaper


class DistRunner:
    """Runs this rank's part of a `Schedule` over a `Staged` program."""

    def __init__(
        self, staged: Staged, schedule: Schedule, pg: PPGroup, timeout: float, bound_sends: bool = False
    ) -> None:
        self.staged, self.schedule, self.pg, self.timeout = staged, schedule, pg, timeout
        # each action's sent values let go once the next action has ended, as memory.py
        # predicts (NOTE [predicting memory]); else they live until the peer has them
        self.bound_sends = bound_sends
        self.rank = pg.rank
        self.actions = schedule.ranks[self.rank]
        self.plan: CommPlan = comm_plan(schedule, self._sends_of, self._reads_of)
        validate_comm(schedule, self.plan)  # every rank checks every rank's plan: all raise alike
        groups: dict[Action | None, list[CommGroup]] = defaultdict(list)
        for g in self.plan.groups[self.rank]:  # in the plan's order
            groups[g.after].append(g)
        self.groups = dict(groups)
        self.next_groups = self._next_groups()
        self.need = self.plan.need
        self.incoming = {(t.src, t.index): t for g in self.plan.groups[self.rank] for t in g.recvs}
        self.local_refs = self._local_refcounts()
        self.timeline = Timeline()
        self.out_index = outputs_by_program(staged, lambda place: self.rank_of(place) == self.rank)
        self.b_parts = self._plan_backward_parts()

    @functools.cached_property
    def reaper(self) -> SendReaper:
        """The group's send thread, at the first step (a runner built to predict a rank's memory,
        `plan_cost.rank_memory`, starts none)."""
        return send_reaper(self.pg, self.timeout)

    @property
    def local_actions(self) -> list[Action]:
        """The actions this process runs, in order."""
        return list(self.actions)

    def rank_of(self, place: Place) -> int:
        return self.schedule.stage_rank[place[1]]

    # -- planning (once per signature) --------------------------------------------------------
    def _sends_of(self, a: Action, rank: int) -> list[tuple[int, list[str]]]:
        """(peer, names) per bundle action `a`, run on `rank`, sends."""
        prog = self.staged.programs.get(action_place(a))
        out: dict[int, list[str]] = defaultdict(list)
        for name in prog.outputs if prog else []:
            for c in self.staged.consumers.get(name, []):
                peer = self.rank_of(c)
                if peer != rank and name not in out[peer]:
                    out[peer].append(name)
        return list(out.items())

    def _reads_of(self, a: Action, rank: int) -> list[tuple[int, Action]]:
        """(peer, producing action) per value action `a`, run on `rank`, receives."""
        prog = self.staged.programs.get(action_place(a))
        out = []
        for name in prog.inputs if prog else []:
            src = self.staged.producer.get(name)
            if src is not None and self.rank_of(src) != rank:
                out.append((self.rank_of(src), Action(src[0], src[1], a.mb)))
        return out

    def _next_groups(self) -> dict[Action | None, list[CommGroup]]:
        """After each action (None: before the first), the groups planned after the next action
        that has any: whose receives gloo posts a group early."""
        out: dict[Action | None, list[CommGroup]] = {}
        upcoming: list[CommGroup] = []
        for prev, a in reversed(list(zip([None, *self.actions], self.actions))):
            upcoming = self.groups.get(a, upcoming)
            out[prev] = upcoming
        return out

    def _plan_backward_parts(self) -> dict[int, tuple[Program, Program]]:
        """Stages whose B actions here send to another rank and have weight-gradient work left
        after the input gradients: run as I, send, W (module docstring)."""
        parts: dict[int, tuple[Program, Program]] = {}
        for a in self.actions:
            place = action_place(a)
            if a.kind != "B" or a.stage in parts or not any(g.sends for g in self.groups.get(a, [])):
                continue
            if self.staged.programs[place].gm.meta.get("fpipe_recomputes"):  # NOTE in remat.py
                continue
            pair = backward_parts(self.staged, place)
            if pair is None:
                continue
            for part in pair:  # the step outputs each part computes
                self.out_index[part.place] = [
                    e for e in self.out_index.get(place, []) if e[1] in part.outputs
                ]
            parts[a.stage] = pair
        return parts

    def _local_refcounts(self) -> dict[str, int]:
        refs: dict[str, int] = {}
        for name, places in self.staged.consumers.items():
            refs[name] = sum(1 for p in places if self.rank_of(p) == self.rank)
        return refs

    # -- running ------------------------------------------------------------------------------
    def run(
        self,
        glob: dict[str, torch.Tensor],
        data: Sequence[dict[str, torch.Tensor]],
        summed: frozenset[int] = frozenset(),
        after: Callable[[Action, Results], None] | None = None,
        before: Callable[[Action], None] | None = None,
        precision: Precision | None = None,
    ) -> Results:
        n_out = len(self.staged.out_names)
        results = Results(len(data), n_out, summed, glob.values(), precision)
        self.timeline = Timeline()
        self.reaper.timeout = self.timeout  # the reaper is shared; the timeout is this pipeline's
        st = _State(self, data)
        try:
            st.issue(None)
            for a in self.actions:
                st.current = a
                sent_before = self.reaper.submitted
                if before is not None:  # e.g. gather sharded parameters while receives travel
                    before(a)
                start = time.perf_counter()
                st.wait_recvs(a)
                if self.need[a]:
                    self.timeline.add(f"wait {a}", self.rank, start, time.perf_counter(), "wait")
                self._step(a, st, glob, results)
                if self.bound_sends:  # the sends of the actions before this one have completed
                    self.reaper.settled(sent_before)
                if after is not None:
                    after(a, results)
            self.reaper.drain()
        except (PeerFailure, TimeoutError):
            raise
        except Exception as err:
            where = (
                f"action {st.current} (stage {st.current.stage}, microbatch {st.current.mb})"
                if st.current
                else "setup"
            )
            msg = f"{self.pg.me} failed at {where}: {type(err).__name__}: {err}"
            self.pg.report_failure(msg)
            exit_hard_after_failure()  # peers' transfers may be in flight
            raise RuntimeError(f"fpipe {msg}") from err
        return results

    def _step(self, a: Action, st: _State, glob: dict[str, torch.Tensor], results: Results) -> None:
        prog = self.staged.programs.get(action_place(a))
        if prog is None:
            st.issue(a)  # (no program, nothing to send; the group may hold receives)
            return
        env = st.envs[a.mb]
        parts = self.b_parts.get(a.stage) if a.kind == "B" else None
        run = functools.partial(
            run_program, a=a, rank=self.rank, env=env, glob=glob, timeline=self.timeline,
            out_index=self.out_index, results=results,
        )  # fmt: skip
        if parts is None:
            run(prog)
            st.issue(a)
        else:
            i_part, w_part = parts
            run(i_part)
            st.issue(a)
            run(w_part, label=f"{a}/w")
            for name in i_part.outputs:  # what I handed to W
                if name not in prog.outputs:
                    env.pop(name, None)
        release(prog, env, st.left[a.mb])


class _State:
    """One step's mutable state: per-microbatch values, posted receives, pending sends."""

    def __init__(self, runner: DistRunner, data: Sequence[dict[str, torch.Tensor]]) -> None:
        self.r = runner
        self.envs = [dict(d) for d in data]
        self.left = [dict(runner.local_refs) for _ in data]
        self.recv_works: dict[tuple[int, int], tuple[list[Any], list[torch.Tensor]]] = {}
        self.current: Action | None = None
        self.emulate = os.environ.get(EMULATE_NCCL_ORDER) == "1"
        # gloo (not emulated): operations complete independently, so the next group's receives
        # are posted a group early and transfers overlap compute; NCCL: exactly the plan's order
        self.early = not self.emulate and runner.pg.device.type != "cuda"
        self._per_op = True

    def issue(self, after: Action | None) -> None:
        """Issue the groups planned after action `after` (None: before the first action), each as
        one batch; on gloo also post the next action's groups' receives."""
        groups = self.r.groups.get(after, [])
        start = time.perf_counter()
        for group in groups:
            self._issue(group, after)
        if self.early:
            self._post_next(after)
        if any(g.sends for g in groups):
            self.r.timeline.add(f"send {after}", self.r.rank, start, time.perf_counter(), "send")

    def _post_next(self, after: Action | None) -> None:
        """Post the receives of the groups planned after the next action (later than `after`)
        that has any."""
        for g in self.r.next_groups.get(after, []):
            recvs = [t for t in g.recvs if (t.src, t.index) not in self.recv_works]
            if recvs:
                self._batch([], recvs)

    def _issue(self, group: CommGroup, after: Action | None) -> None:
        recvs = [t for t in group.recvs if (t.src, t.index) not in self.recv_works]
        keep = [self.envs[t.action.mb][n].contiguous() for t in group.sends for n in t.names]
        works = self._batch(group.sends, recvs, keep)
        if self.emulate:  # NCCL's order: the next group starts once this one completed
            self.r.pg.wait_all(works, self.r.timeout, functools.partial(self._describe, group), None)
            for t in recvs:
                self.recv_works[t.src, t.index] = ([], self.recv_works[t.src, t.index][1])
        elif group.sends:
            peers = sorted({t.dst for t in group.sends})
            to = f"rank {peers[0]}" if len(peers) == 1 else "ranks " + ", ".join(map(str, peers))
            where = f" (stage {after.stage}, microbatch {after.mb})" if after is not None else ""
            what = f"sending {after}'s outputs{where} to {to}"
            self.r.reaper.submit(works[: len(keep)] if self._per_op else works, keep, what, peers[0])

    def _batch(
        self,
        sends: Sequence[Transfer],
        recvs: Sequence[Transfer],
        keep: Sequence[torch.Tensor] = (),
    ) -> list[Any]:
        """One batch_isend_irecv of `sends` (their tensors `keep`, in order) and `recvs`."""
        group = self.r.pg.group
        ops, k = [], 0
        for t in sends:
            gpeer = self.r.pg.global_rank(t.dst)
            ops += [dist.P2POp(dist.isend, keep[k + j], gpeer, group) for j in range(len(t.names))]
            k += len(t.names)
        bufs_of = []
        for t in recvs:
            bufs = [self._buffer(n) for n in t.names]
            bufs_of.append(bufs)
            ops += [dist.P2POp(dist.irecv, b, self.r.pg.global_rank(t.src), group) for b in bufs]
        works = dist.batch_isend_irecv(ops) if ops else []
        self._per_op = len(works) == len(ops)  # gloo: one work per operation; NCCL: coalesced
        k = len(keep)
        for t, bufs in zip(recvs, bufs_of):
            mine = works[k : k + len(bufs)] if self._per_op else works
            self.recv_works[t.src, t.index] = (mine, bufs)
            k += len(bufs)
        return works

    def _buffer(self, name: str) -> torch.Tensor:
        shape, dtype = self.r.staged.meta[name]
        return torch.empty(shape, dtype=dtype, device=self.r.pg.device)

    def wait_recvs(self, a: Action) -> None:
        for peer, idx in self.r.need[a].items():
            keys = [(peer, k) for k in range(idx + 1) if (peer, k) in self.recv_works]
            works = {id(w): w for key in keys for w in self.recv_works[key][0]}
            self.r.pg.wait_all(
                list(works.values()),
                self.r.timeout,
                functools.partial(self._waiting, a, peer, idx),
                peer,
            )
            for key in keys:
                t = self.r.incoming[key]
                _, bufs = self.recv_works.pop(key)
                self.envs[t.action.mb].update((n, self._laid_out(n, b)) for n, b in zip(t.names, bufs))

    def _laid_out(self, name: str, buf: torch.Tensor) -> torch.Tensor:
        """A received (contiguous) value in the layout it was traced with, if that differs."""
        stride = self.r.staged.strides.get(name)
        if stride is None:
            return buf
        return torch.empty_strided(buf.shape, stride, dtype=buf.dtype, device=buf.device).copy_(buf)

    def _waiting(self, a: Action, peer: int, idx: int) -> str:
        src = self.r.incoming[peer, idx].action
        return (
            f"at action {a} (stage {a.stage}, microbatch {a.mb}) waiting for rank {peer}'s "
            f"action {src} (stage {src.stage}, microbatch {src.mb})"
        )

    def _describe(self, group: CommGroup) -> str:
        return f"on rank {self.r.rank}'s communication {group} (emulated NCCL order)"
