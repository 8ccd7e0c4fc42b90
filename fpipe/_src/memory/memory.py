"""Memory: a step's peak working memory, predicted from the compiled plan before anything runs.

# NOTE [predicting memory]
`predict` replays the runner's actions in order -- every stage's in one process (the runner's
global order), this rank's in a process group -- and keeps an account of the storages the
runner holds, the way run.py and run_dist.py hold them, with sizes from the traced programs'
fake tensors (`memory_graph.profile`):

- the values one program hands a later one (saved activations, boundary values, what an I half
  hands its W half), per microbatch, from the program that makes them until their last reader
  here has run (`run.release`); a view of a value costs nothing more;
- gradient sums, one per differentiated input, from the first program that writes one to the end
  of the step (the runner's own zeros where a program adds into them, `run.accumulating`), and
  the other step outputs (each microbatch's loss), to the end;
- in a process group, receive buffers from the moment their receive is posted (the plan's
  groups; on gloo one group early), and sent values until this rank's next action has ended
  (the send thread keeps them until the peer has them: under a memory limit the runner waits
  for that there, `DistRunner.bound_sends`; without one a slow peer can make it later);
- while a program runs, its own peak (`Profile.peak`: what it allocates that is alive at once,
  with the workspace of the kernel running: NOTE [kernel workspaces] in workspace.py).

The peak is the largest held-plus-running total over the step. The parameters, module buffers
and the call's data are the caller's and are not counted; neither are allocator slack, the
workspaces of kernels workspace.py has no rule for (a matrix product's) and the few bytes of
Python objects. A forward-only call holds less.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any

from ..runtime import EMULATE_NCCL_ORDER, accumulating, action_place
from ..runtime import precision as precision_
from ..schedules import Action
from ..stages import Program, Staged
from .memory_graph import Profile, profile

__all__ = ["MemoryReport", "StageMemory", "predict", "predict_plan"]


Key = tuple[Any, ...]  # one storage the runner holds


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """One stage's share of a `MemoryReport`, in bytes."""

    stage: int
    rank: int
    at_peak: int  # of the peak: this stage's held values, gradient sums and running program
    grads: int  # its gradient sums
    kept: int  # its values held for later programs at the peak
    in_flight: int  # microbatches with values of this stage held at the peak
    transient: int  # the largest peak of one of its programs


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """A predicted step: `peak` bytes, reached while action `at` runs; `stages`, per stage;
    `actions`, per action: (action, bytes while it runs, bytes of values held after it).

    Example:
        >>> import torch, fpipe
        >>> def f(w, x):
        ...     h = fpipe.stage_boundary(torch.tanh(x @ w))
        ...     return (h @ w).pow(2).mean()
        >>> w, x = torch.randn(256, 256), torch.randn(1024, 256)
        >>> report = fpipe.pipeline(f, microbatches=4).memory_report(w, x)
        >>> [s.stage for s in report.stages], sum(s.grads for s in report.stages) == w.nbytes
        ([0, 1], True)
        >>> print(report.table())  # w's gradient sum: from B1.0, its first writer
        stage  rank   at peak  grad sums      kept  in flight   largest program
            0     0  0.50 MiB   0.00 MiB  0.50 MiB          2          0.50 MiB
            1     1  1.25 MiB   0.25 MiB  0.50 MiB          2          0.50 MiB
        total        1.75 MiB                                  peak during B1.3
    """

    peak: int
    at: str
    stages: tuple[StageMemory, ...]
    actions: tuple[tuple[str, int, int], ...]

    def __int__(self) -> int:
        return self.peak

    def table(self) -> str:
        """The per-stage breakdown as a text table, sizes in MiB."""
        head = ("stage", "rank", "at peak", "grad sums", "kept", "in flight", "largest program")
        rows = [head] + [
            (str(s.stage), str(s.rank), *map(_mib, (s.at_peak, s.grads, s.kept)), str(s.in_flight),
             _mib(s.transient))
            for s in self.stages
        ]  # fmt: skip
        rows.append(("total", "", _mib(self.peak), "", "", "", f"peak during {self.at}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)).rstrip() for r in rows)

    def __str__(self) -> str:
        return self.table()


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class _Account:
    """The storages held, each with its size, stage, microbatch, and holders of two kinds: 0, the
    runner's per-microbatch values; 1, anything else (step results, the send thread)."""

    def __init__(self) -> None:
        self.size: dict[Key, int] = {}
        self.stage: dict[Key, int] = {}
        self.mb: dict[Key, int] = {}
        self.holders: dict[Key, list[int]] = {}  # [value holders, result holders]
        self.total = 0

    def hold(self, key: Key | None, kind: int, size: int = 0, stage: int = 0, mb: int = -1) -> None:
        if key is None:
            return
        if key not in self.holders:
            self.size[key], self.stage[key], self.mb[key] = size, stage, mb
            self.holders[key] = [0, 0]
            self.total += size
        self.holders[key][kind] += 1

    def drop(self, key: Key | None, kind: int) -> None:
        if key is None or key not in self.holders:
            return
        self.holders[key][kind] -= 1
        if sum(self.holders[key]) == 0:
            self.total -= self.size.pop(key)
            del self.holders[key], self.stage[key], self.mb[key]

    def values(self) -> int:
        return sum(self.size[k] for k, h in self.holders.items() if h[0] > 0)


class _Replay:
    """One replay of a rank's (or the process's) actions; see NOTE [predicting memory]."""

    def __init__(
        self, staged: Staged, runner: Any, summed: frozenset[int], n_mb: int, precision: Any = None
    ) -> None:
        self.st, self.runner, self.summed, self.n_mb = staged, runner, summed, n_mb
        self.widen = precision_.of(precision).widen  # the runner's sums (NOTE [precision policy])
        self.acc = _Account()
        self.env: dict[tuple[int, str], list[Key | None]] = {}
        local = runner.local_refs if hasattr(runner, "local_refs") else runner.refcount
        self.left = {(m, n): k for m in range(n_mb) for n, k in local.items()}
        self.sums: dict[int, tuple[Key | None, bool]] = {}  # output -> (storage, owned)
        self.peak, self.at, self.running = 0, "", 0
        self.at_peak: dict[int, int] = {}
        self.kept_at_peak: tuple[dict[int, int], dict[int, set[int]]] = ({}, {})
        self.transient: dict[int, int] = {}
        self.log: list[tuple[str, int, int]] = []

    def key_of(self, mb: int, name: str) -> Key | None:
        """The storage of value `name` of microbatch `mb` (None: the caller's, or none)."""
        keys = self.env.get((mb, name), [])
        return keys[0] if len(keys) == 1 else None

    # -- one program ----------------------------------------------------------------------------
    def variant(self, prog: Program) -> tuple[Any, dict[int, Any]]:
        """The graph the runner runs for `prog` and the sums it adds into (`run.run_program`)."""
        outs_of = self.runner.out_index.get(prog.place, ())
        own = {n: i for i, n, only in outs_of if only and i in self.summed}
        if self.n_mb > 1 and own:
            gm, sums_like = accumulating(prog, tuple(own), self.widen)
            if gm is not None:
                return gm, {own[n]: like for n, like in sums_like}
        return prog.gm, {}

    def run(self, a: Action, k: Any, prog: Program) -> None:
        gm, fused = self.variant(prog)
        for i, like in fused.items():  # `Results.running_sum`: zeros at the first writer
            if i not in self.sums:
                self.sums[i] = (("sum", i), True)
                self.acc.hold(("sum", i), 1, like.numel() * self.widen(like.dtype).itemsize, a.stage)
        pr = _profile(gm)
        self.transient[a.stage] = max(self.transient.get(a.stage, 0), pr.peak)
        self.observe(str(a), a.stage, pr.peak)
        names = [*prog.inputs, *(("sum", i) for i in fused)]
        seen: set[str] = set()  # a name listed twice (an I half's output sent and kept for W): one value
        for name, parts in zip(prog.outputs, pr.outputs):
            keys = [self._input_key(a.mb, names[o[1]]) if isinstance(o, tuple) else (a, k, o) for o in parts]
            if not keys or name in seen:
                continue
            seen.add(name)
            self.env[a.mb, name] = keys
            for key, o in zip(keys, parts):
                self.acc.hold(key, 0, pr.sizes.get(o, 0) if isinstance(o, int) else 0, a.stage, a.mb)
        self.results(a, prog, fused, pr)

    def _input_key(self, mb: int, name: Any) -> Key | None:
        if isinstance(name, tuple):  # a running sum
            return name
        keys = self.env.get((mb, name), [])
        return keys[0] if keys else None

    def results(self, a: Action, prog: Program, fused: dict[int, Any], pr: Profile) -> None:
        """What `Results.put` holds of `prog`'s step outputs."""
        for i, name, _ in self.runner.out_index.get(prog.place, ()):
            key = self.key_of(a.mb, name)
            if i in fused:
                continue
            if i not in self.summed:
                self.acc.hold(key, 1)
            elif i not in self.sums:
                fresh = prog.outputs.index(name) in pr.fresh
                self.sums[i] = (key, fresh)
                self.acc.hold(key, 1)
            elif not self.sums[i][1]:  # `sums[i] + value`: a new tensor, the old one let go
                self.acc.hold(("sum", i), 1, _bytes(self.st, name), a.stage)
                self.acc.drop(self.sums[i][0], 1)
                self.sums[i] = (("sum", i), True)

    def release(self, prog: Program, mb: int, extra: Iterable[str] = ()) -> None:
        """`run.release`: drop what no later program here reads."""
        for n in prog.inputs:
            if (mb, n) in self.left:
                self.left[mb, n] -= 1
                if self.left[mb, n] <= 0:
                    self._pop(mb, n)
        for n in [*prog.outputs, *extra]:
            if self.left.get((mb, n), 0) <= 0:
                self._pop(mb, n)

    def _pop(self, mb: int, name: str) -> None:
        for key in self.env.pop((mb, name), []):
            self.acc.drop(key, 0)

    # -- the account ----------------------------------------------------------------------------
    def observe(self, label: str, stage: int, running: int) -> None:
        total = self.running = self.acc.total + running
        if total > self.peak or not self.at:
            self.peak, self.at = total, label
            self.at_peak = {stage: running}
            kept: dict[int, int] = {}
            flight: dict[int, set[int]] = {}
            for key, size in self.acc.size.items():
                s = self.acc.stage[key]
                self.at_peak[s] = self.at_peak.get(s, 0) + size
                if self.acc.holders[key][0] > 0:
                    kept[s] = kept.get(s, 0) + size
                    flight.setdefault(s, set()).add(self.acc.mb[key])
            self.kept_at_peak = (kept, flight)

    def report(self, stages: Iterable[int]) -> MemoryReport:
        kept, flight = self.kept_at_peak
        grads: dict[int, int] = {}
        for key, _ in self.sums.values():
            if key is not None and key in self.acc.size:
                s = self.acc.stage[key]
                grads[s] = grads.get(s, 0) + self.acc.size[key]
        rows = tuple(
            StageMemory(
                s, self.runner.schedule.stage_rank[s], self.at_peak.get(s, 0), grads.get(s, 0),
                kept.get(s, 0), len(flight.get(s, ())), self.transient.get(s, 0),
            )
            for s in stages
        )  # fmt: skip
        return MemoryReport(self.peak, self.at, rows, tuple(self.log))


def _profile(gm: Any) -> Profile:
    """`profile(gm)`, once per graph module (kept on it: remat_choose.py predicts many plans
    that share most programs)."""
    if "_fpipe_profile" not in gm.__dict__:
        gm.__dict__["_fpipe_profile"] = profile(gm)
    return gm.__dict__["_fpipe_profile"]  # type: ignore[no-any-return]


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def predict(
    staged: Staged, runner: Any, summed: frozenset[int], n_mb: int, precision: Any = None
) -> MemoryReport:
    """The predicted memory of one value-and-grad step of `runner` (NOTE [predicting memory]):
    a `LocalRunner` replays every stage, a `DistRunner` its rank's. `summed`: the step outputs
    summed over microbatches (parameter gradients); `precision`: the pipeline's `Precision`
    (the dtype its gradient sums are held in)."""
    rp = _Replay(staged, runner, summed, n_mb, precision)
    if hasattr(runner, "plan"):
        _replay_rank(rp)
    else:
        for k, a in enumerate(runner.order):
            prog = staged.programs.get(action_place(a))
            if prog is not None:
                rp.run(a, k, prog)
                rp.release(prog, a.mb)
            rp.log.append((str(a), rp.running, rp.acc.values()))
    return rp.report(sorted({a.stage for a in runner.local_actions}))


# -- a rank of a process group (run_dist.py) ------------------------------------------------------


def _replay_rank(rp: _Replay) -> None:
    r, sent = rp.runner, list[Key | None]()
    early = os.environ.get(EMULATE_NCCL_ORDER) != "1" and r.pg.device.type != "cuda"
    posted: set[tuple[int, int]] = set()
    _issue(rp, None, posted, early)
    for k, a in enumerate(r.actions):
        prog = rp.st.programs.get(action_place(a))
        parts = r.b_parts.get(a.stage) if a.kind == "B" else None
        now: list[Key | None] = []
        extra: list[str] = []
        if prog is not None and parts is not None:  # I half, its sends, W half
            rp.run(a, (k, 0), parts[0])
            now = _issue(rp, a, posted, early)
            rp.run(a, (k, 1), parts[1])
            extra = [n for n in parts[0].outputs if n not in prog.outputs]
        elif prog is not None:
            rp.run(a, k, prog)
        if parts is None or prog is None:
            now = _issue(rp, a, posted, early)
        if prog is not None:
            rp.release(prog, a.mb, extra)
        for key in sent:  # the previous action's sends: done once this action has run
            rp.acc.drop(key, 1)
        sent = now
        rp.log.append((str(a), rp.running, rp.acc.values()))


def _issue(rp: _Replay, after: Action | None, posted: set[tuple[int, int]], early: bool) -> list[Key | None]:
    """`_State.issue`: hold what the groups after `after` send, allocate what they receive;
    returns the sent storages."""
    groups = rp.runner.groups.get(after, [])
    sent: list[Key | None] = []
    for g in groups:
        for t in g.sends:
            for n in t.names:
                key = rp.key_of(t.action.mb, n)
                if n in rp.st.strides:  # sent `.contiguous()`: a copy
                    key = ("sent", t.key, n)
                    rp.acc.hold(key, 1, _bytes(rp.st, n), t.action.stage)
                else:
                    rp.acc.hold(key, 1)
                sent.append(key)
    for g in [*groups, *(rp.runner.next_groups.get(after, []) if early else [])]:
        for t in g.recvs:
            if (t.src, t.index) not in posted:
                posted.add((t.src, t.index))
                _receive(rp, t)
    return sent


def _receive(rp: _Replay, t: Any) -> None:
    for n in t.names:
        key = ("recv", t.src, t.index, n)
        here = [p[1] for p in rp.st.consumers.get(n, []) if rp.runner.rank_of(p) == rp.runner.rank]
        rp.acc.hold(key, 0, _bytes(rp.st, n), min(here, default=t.action.stage), t.action.mb)
        rp.env[t.action.mb, n] = [key]


def _bytes(st: Staged, name: str) -> int:
    shape, dtype = st.meta[name][:2]
    return dtype.itemsize * _numel(shape)


def predict_plan(c: Any, inp: Any, n_mb: int, precision: Any = None) -> MemoryReport:
    """`predict` for a compiled plan (`compiler.Compiled`) and the call's `inputs.Inputs`: the
    gradients summed over microbatches are those of inputs passed whole (`execute.execute`)."""
    st = c.staged
    summed = frozenset(st.n_outs + j for j, pos in enumerate(c.diff) if inp.axis_of(pos) is None)
    return predict(st, c.runner, summed, n_mb, precision)
