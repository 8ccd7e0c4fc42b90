"""Run across processes: each rank interprets its own action list; values cross by p2p.

Communication is derived, not scheduled: a value produced by an action on rank A and read by a
program on rank B travels in a *bundle* (every value that action sends to B). Each ordered pair
of ranks is one channel, and B receives A's bundles in exactly the order A sends them -- taking
early ones it does not need yet into its store -- so p2p messages always match (torch matches
them by order, not by tag), whatever the schedule. Sends are non-blocking (`batch_isend_irecv`);
receives for the next action are posted before the current one runs, so transfers overlap compute.
Shapes and dtypes come from the traced program, identical on every rank: no per-step handshake.

A full backward B whose outputs go to another rank runs as its two halves (`split.backward_parts`):
the input-gradient part, then the send of its outputs, then the weight-gradient part. The schedule
and the work are the same; the previous stage gets its gradient one weight-gradient pass sooner
(1F1B's critical path runs through those sends).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .dist import PeerFailure, PPGroup, SendReaper, exit_hard_after_failure
from .run import Results, Timeline, action_place, outputs_by_program, release, run_program
from .schedule import Action, Schedule
from .split import Place, Program, Staged, backward_parts

__all__ = ["DistRunner"]


@dataclasses.dataclass
class _Bundle:
    action: Action  # the producing action (on the sending rank)
    peer: int  # pp rank of the other end
    names: list[str]


class DistRunner:
    """Runs this rank's part of a `Schedule` over a `Staged` program."""

    def __init__(self, staged: Staged, schedule: Schedule, pg: PPGroup, timeout: float) -> None:
        self.staged, self.schedule, self.pg, self.timeout = staged, schedule, pg, timeout
        self.rank = pg.rank
        self.actions = schedule.ranks[self.rank]
        self._plan_sends()
        self._plan_recvs()
        self.local_refs = self._local_refcounts()
        self.reaper = SendReaper(pg, timeout)
        self.timeline = Timeline()
        self._out_index = outputs_by_program(staged, lambda place: self.rank_of(place) == self.rank)
        self.b_parts = self._plan_backward_parts()

    def rank_of(self, place: Place) -> int:
        return self.schedule.stage_rank[place[1]]

    # -- planning (once per signature) --------------------------------------------------------
    def _sends_of(self, a: Action, rank: int) -> dict[int, list[str]]:
        prog = self.staged.programs.get(action_place(a))
        out: dict[int, list[str]] = defaultdict(list)
        if prog is None:
            return out
        for name in prog.outputs:
            for c in self.staged.consumers.get(name, []):
                peer = self.rank_of(c)
                if peer != rank and name not in out[peer]:
                    out[peer].append(name)
        return out

    def _plan_sends(self) -> None:
        self.sends: dict[Action, list[_Bundle]] = {
            a: [_Bundle(a, peer, names) for peer, names in self._sends_of(a, self.rank).items()]
            for a in self.actions
        }

    def _plan_recvs(self) -> None:
        """For each channel peer -> me: bundles in the peer's send order; per action, how far to read."""
        self.channels: dict[int, list[_Bundle]] = defaultdict(list)
        for peer in range(self.schedule.pp):
            if peer == self.rank:
                continue
            for a in self.schedule.ranks[peer]:
                names = self._sends_of(a, peer).get(self.rank)
                if names:
                    self.channels[peer].append(_Bundle(a, peer, names))
        where = {(b.peer, b.action): i for peer, bs in self.channels.items() for i, b in enumerate(bs)}
        self.need: dict[Action, dict[int, int]] = {}
        for a in self.actions:
            need: dict[int, int] = {}
            prog = self.staged.programs.get(action_place(a))
            for name in prog.inputs if prog else []:
                src = self.staged.producer.get(name)
                if src is None or self.rank_of(src) == self.rank:
                    continue
                peer = self.rank_of(src)
                idx = where[(peer, Action(src[0], src[1], a.mb))]
                need[peer] = max(need.get(peer, -1), idx)
            self.need[a] = need

    def _plan_backward_parts(self) -> dict[int, tuple[Program, Program]]:
        """Stages whose B actions here send to another rank and have weight-gradient work left
        after the input gradients: run as I, send, W (module docstring)."""
        parts: dict[int, tuple[Program, Program]] = {}
        for a in self.actions:
            place = action_place(a)
            if a.kind != "B" or a.stage in parts or not self.sends.get(a):  # (no program: no sends)
                continue
            pair = backward_parts(self.staged, place)
            if pair is None:
                continue
            for part in pair:  # the step outputs each part computes
                self._out_index[part.place] = [
                    e for e in self._out_index.get(place, []) if e[1] in part.outputs
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
    ) -> Results:
        n_out = len(self.staged.out_names)
        results = Results(len(data), n_out, summed, glob.values())
        self.timeline = Timeline()
        st = _State(self, data)
        try:
            for i, a in enumerate(self.actions):
                st.current = a
                st.post_recvs(a)
                if i + 1 < len(self.actions):
                    st.post_recvs(self.actions[i + 1])
                start = time.perf_counter()
                st.wait_recvs(a)
                if self.need[a]:
                    self.timeline.add(f"wait {a}", self.rank, start, time.perf_counter(), "wait")
                self._step(a, st, glob, results)
            self.reaper.drain()
        except (PeerFailure, TimeoutError):
            raise
        except Exception as err:
            where = (
                f"action {st.current} (stage {st.current.stage}, microbatch {st.current.mb})"
                if st.current
                else "setup"
            )
            msg = f"rank {self.rank} failed at {where}: {type(err).__name__}: {err}"
            self.pg.report_failure(msg)
            exit_hard_after_failure()  # peers' transfers may be in flight
            raise RuntimeError(f"fpipe {msg}") from err
        return results

    def _step(self, a: Action, st: _State, glob: dict[str, torch.Tensor], results: Results) -> None:
        prog = self.staged.programs.get(action_place(a))
        if prog is None:
            return
        env = st.envs[a.mb]
        parts = self.b_parts.get(a.stage) if a.kind == "B" else None
        if parts is None:
            run_program(prog, a, self.rank, env, glob, self.timeline, self._out_index, results)
            st.send(a, env)
        else:
            i_part, w_part = parts
            run_program(i_part, a, self.rank, env, glob, self.timeline, self._out_index, results)
            st.send(a, env)
            run_program(w_part, a, self.rank, env, glob, self.timeline, self._out_index, results)
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
        self.posted = {peer: 0 for peer in runner.channels}  # bundles posted per channel
        self.recv_works: dict[tuple[int, int], tuple[list[Any], list[torch.Tensor]]] = {}
        self.current: Action | None = None

    def post_recvs(self, a: Action) -> None:
        for peer, idx in self.r.need[a].items():
            ops, keys = [], []
            for k in range(self.posted[peer], idx + 1):
                bundle = self.r.channels[peer][k]
                bufs = [self._buffer(n) for n in bundle.names]
                gpeer = self.r.pg.global_rank(peer)
                ops += [dist.P2POp(dist.irecv, b, gpeer, self.r.pg.group) for b in bufs]
                keys.append((k, bufs))
            if ops:
                works = dist.batch_isend_irecv(ops)
                for k, bufs in keys:
                    self.recv_works[(peer, k)] = (works, bufs)
                self.posted[peer] = idx + 1

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
                bundle = self.r.channels[peer][key[1]]
                _, bufs = self.recv_works.pop(key)
                self.envs[bundle.action.mb].update(
                    (n, self._laid_out(n, b)) for n, b in zip(bundle.names, bufs)
                )

    def _laid_out(self, name: str, buf: torch.Tensor) -> torch.Tensor:
        """A received (contiguous) value in the layout it was traced with, if that differs."""
        stride = self.r.staged.strides.get(name)
        if stride is None:
            return buf
        return torch.empty_strided(buf.shape, stride, dtype=buf.dtype, device=buf.device).copy_(buf)

    def _waiting(self, a: Action, peer: int, idx: int) -> str:
        src = self.r.channels[peer][idx].action
        return (
            f"at action {a} (stage {a.stage}, microbatch {a.mb}) waiting for rank {peer}'s "
            f"action {src} (stage {src.stage}, microbatch {src.mb})"
        )

    def send(self, a: Action, env: dict[str, torch.Tensor]) -> None:
        for bundle in self.r.sends.get(a, []):
            gpeer = self.r.pg.global_rank(bundle.peer)
            keep = [env[n].contiguous() for n in bundle.names]
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, gpeer, self.r.pg.group) for t in keep])
            what = f"sending {a}'s outputs (stage {a.stage}, microbatch {a.mb}) to rank {bundle.peer}"
            self.r.reaper.submit(works, keep, what, bundle.peer)
