"""Run the stage programs of a generation: prefill, then one token per step, microbatches in flight.

# NOTE [the decode schedule]
Step 0 is the prefill of each microbatch's prompt; step t >= 1 feeds microbatch i's token t-1.
Every rank walks the same order, (step, microbatch) = (0, 0), (0, 1), ..., (0, m-1), (1, 0), ...,
and at each one runs its stage: it takes the values its program reads from the stages that
computed them, runs the program (which writes that microbatch's K/V in place), and sends on
what later stages read. The last stage turns the logits into the token and sends it back to
stage 0, which feeds it at the next step of the same microbatch. So with m microbatches in
flight, stage s works on microbatch i while stage s+1 works on i-1, and stage 0 can start
microbatch i's next token as soon as it comes back: with m >= stages no stage waits in the
steady state (vLLM's rule: pp batches in flight fill the pipeline). In one process the stages
run in order at each (step, microbatch). Under torchrun a rank may hold several stages, and
every rank walks its operations in one global order (NOTE [several stages per rank] in
decode_walk.py). Every wait is failure-aware (`PPGroup.wait_all`): a rank that fails reports
where, and every other rank stops naming it.

# NOTE [ranks stop together]
transformers stops when every sequence has ended; a finished sequence gets the pad token until
then. Under torchrun stage 0 has each microbatch's tokens as they come back, so it knows when
every sequence of microbatch i has ended (an EOS in each row). It then does not feed (t, i):
its operation sends a stop flag on in place of the values (the flag is one more tensor in every
message between stages, 0 while running), every later stage passes the flag on instead of
running, the last stage sends no token, and each stage skips microbatch i from then on. The
pad tokens those steps would have given are filled in on stage 0; when every microbatch has
stopped no stage runs again. No collective is added per step: the flag rides on the messages
each operation sends anyway.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..runtime import PeerFailure, PPGroup, exit_hard_after_failure, send_reaper
from .decode import Programs
from .decode_walk import walk_order

__all__ = ["Feed", "StageCaches", "run_local", "run_rank"]

Select = Callable[[torch.Tensor, int, int], torch.Tensor]  # (logits, step, microbatch) -> tokens
OnStep = Callable[[int, list[torch.Tensor]], bool]  # (step, its tokens per microbatch) -> stop?
Ends = tuple[list[int], "int | None"]  # (EOS ids, the pad id a finished sequence gets)


@dataclasses.dataclass
class Feed:
    """What every rank knows of each (step, microbatch): the data inputs but the tokens."""

    prompt: torch.Tensor  # [batch, P]
    mask: torch.Tensor  # [batch, max_len]: the prompt's mask, then ones
    positions: torch.Tensor  # [batch, P]
    microbatches: int
    steps: int
    refill: int | None = None  # the step that feeds the whole sequence again (NOTE [a refill])

    @property
    def rows(self) -> int:
        return self.prompt.shape[0] // self.microbatches

    def q(self, step: int) -> int:
        """How many tokens step `step` feeds: the prompt, the whole sequence at a refill, or one."""
        return self.prompt.shape[1] + step if step in (0, self.refill) else 1

    def data(self, step: int, mb: int, history: list[torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """The inputs of (step, mb); the token ids only where they are known (`history`: the
        microbatch's tokens of the steps before, on stage 0), as only stage 0 reads them."""
        rows = slice(mb * self.rows, (mb + 1) * self.rows)
        prompt, q = self.prompt[rows], self.q(step)
        if step == 0:
            ids: torch.Tensor | None = prompt
        elif history is None:
            ids = None
        else:
            ids = history[-1] if q == 1 else torch.cat([prompt, *history], dim=1)
        last = self.positions[rows, -1:]
        if q == 1:
            pos = last + step
        else:  # the prompt's positions, then those of the tokens fed since
            new = last + torch.arange(1, step + 1, device=last.device)
            pos = torch.cat([self.positions[rows], new], dim=1)
        offset = self.prompt.shape[1] + step - q
        out = {"mask": self.mask[rows], "positions": pos, "offset": torch.tensor(offset)}
        return out if ids is None else {"ids": ids, **out}


class StageCaches:
    """The K/V buffers of this rank's stages, one set per microbatch, allocated here only."""

    def __init__(self, progs: Programs, stages: list[int], feed: Feed) -> None:
        rows, n = feed.rows, feed.mask.shape[1]
        self.layers = [i for s in stages for i in progs.layers_of(s)]
        self.buffers = [
            {
                f"{kind}{i}": torch.zeros(rows, heads, n, dim, dtype=dtype, device=feed.prompt.device)
                for i in self.layers
                for kind, (heads, dim, dtype) in zip("kv", progs.layout[2 * i : 2 * i + 2])
            }
            for _ in range(feed.microbatches)
        ]

    def nbytes(self) -> int:
        return sum(t.nbytes for per_mb in self.buffers for t in per_mb.values())


def run_stage(
    progs: Programs, stage: int, env: dict[str, torch.Tensor], params: dict[str, torch.Tensor]
) -> None:
    """Run `stage`'s program on the values in `env` (by data name or value name); add its outputs."""
    prog = progs.program(stage)
    data = progs.data_of

    def bound(n: str) -> torch.Tensor:  # only this program's inputs: it runs per (step, microbatch)
        if n in progs.params:
            return params[progs.params[n]]
        if data.get(n) in env:
            return env[data[n]]
        return progs.const(n) if n in progs.consts else env[n]

    env.update(zip(prog.outputs, prog.gm(*map(bound, prog.inputs))))


def run_local(
    programs: Callable[[int], Programs],
    params: dict[str, torch.Tensor],
    feed: Feed,
    caches: StageCaches,
    select: Select,
    on_step: OnStep,
) -> list[list[torch.Tensor]]:
    """Every stage in this process, in order at each (step, microbatch); `on_step` returning
    True after a step ends the generation early (every sequence finished). Returns
    tokens[step][mb]."""
    tokens: list[list[torch.Tensor]] = []
    for step in range(feed.steps):
        progs = programs(step)
        row = []
        for mb in range(feed.microbatches):
            env: dict[str, Any] = {
                **feed.data(step, mb, [row[mb] for row in tokens]),
                **caches.buffers[mb],
            }
            for stage in range(progs.staged.n_stages):
                run_stage(progs, stage, env, params)
            row.append(select(env[progs.logits], step, mb))
        tokens.append(row)
        if on_step(step, row):
            break
    return tokens


def run_rank(
    programs: Callable[[int], Programs],
    params: dict[str, torch.Tensor],
    feed: Feed,
    caches: StageCaches,
    select: Select,
    pg: PPGroup,
    timeout: float,
    on_step: OnStep,
    ends: Ends | None = None,
) -> list[list[torch.Tensor]]:
    """This rank's stages (stage s on rank s mod ranks) over every (step, microbatch) (NOTE [the
    decode schedule], NOTE [ranks stop together]). Stage 0's rank returns tokens[step][mb] of the
    steps run (the last stage sends every token back to it), the others an empty list; it calls
    `on_step` as each step's tokens are complete. `ends` (EOS ids, pad id): stop a microbatch
    whose sequences have all ended."""
    rank = RankWalk(pg, timeout, feed, on_step, programs(0).staged.n_stages, ends)
    try:
        return rank.run(programs, params, caches, select)
    except (PeerFailure, TimeoutError):
        raise
    except Exception as err:
        msg = f"{pg.me} failed at {rank.where}: {type(err).__name__}: {err}"
        pg.report_failure(msg)
        exit_hard_after_failure()
        raise RuntimeError(f"fpipe {msg}") from err


class RankWalk:
    """One rank's walk over (step, microbatch, stage): receive, run the stage, send."""

    def __init__(
        self, pg: PPGroup, timeout: float, feed: Feed, on_step: OnStep, n_stages: int, ends: Ends | None
    ) -> None:  # fmt: skip
        self.pg, self.timeout, self.feed, self.on_step = pg, timeout, feed, on_step
        self.n, self.last = n_stages, n_stages - 1
        self.mine = [s for s in range(n_stages) if s % pg.size == pg.rank]
        self.reaper = send_reaper(pg, timeout)
        self.reaper.timeout = timeout
        self.where = "setup"
        self.mail: dict[tuple[int, int, int, int], list[torch.Tensor]] = {}  # same-rank hand-offs
        self.stopped: dict[tuple[int, int], int] = {}  # (stage, mb) -> the step it stopped at
        self.got: dict[tuple[int, int], torch.Tensor] = {}  # stage 0: (step, mb) -> its token
        self.ends = ends
        self.reported: list[list[torch.Tensor]] = []

    def run(
        self,
        programs: Callable[[int], Programs],
        params: dict[str, torch.Tensor],
        caches: StageCaches,
        select: Select,
    ) -> list[list[torch.Tensor]]:
        for step, mb, stage in walk_order(self.feed.steps, self.feed.microbatches, self.n, self.mine):
            if (stage, mb) in self.stopped:
                continue
            self.where = f"step {step} (stage {stage}, microbatch {mb})"
            if stage == 0 and step:
                self._fed(step, mb)
            if step < self.feed.steps:  # (at step == steps: the last tokens' receive only)
                self._op(programs(step), params, caches, select, step, mb, stage)
        self.reaper.drain()
        return self.reported if 0 in self.mine else []

    def _op(
        self, progs: Programs, params: dict[str, torch.Tensor], caches: StageCaches, select: Select,
        step: int, mb: int, stage: int,
    ) -> None:  # fmt: skip
        """Run (step, mb) at `stage`, or pass the stop on (NOTE [ranks stop together])."""
        history = [self.got[u, mb] for u in range(step)] if stage == 0 else None
        env: dict[str, Any] = {**self.feed.data(step, mb, history), **caches.buffers[mb]}
        stop = (0, mb) in self.stopped if stage == 0 else self._receive(progs, env, step, mb, stage)
        if stop:
            self.stopped[stage, mb] = step
        else:
            run_stage(progs, stage, env, params)
        self._send(progs, env, step, mb, stage, select, stop)

    def _fed(self, step: int, mb: int) -> None:
        """Stage 0, before (step, mb): receive the token of (step - 1, mb); the microbatch stops
        at `step` if its sequences have all ended (this op then sends the stop on)."""
        tok = self._channel_recv(
            [torch.empty(self.feed.rows, 1, dtype=torch.long, device=self.pg.device)],
            self.last, 0, step - 1, mb, f"the tokens of step {step - 1}, microbatch {mb}",
        )[0]  # fmt: skip
        self.got[step - 1, mb] = tok
        if step < self.feed.steps and self._ended(step, mb):
            self.stopped[0, mb] = step
        self._report()

    def _ended(self, step: int, mb: int) -> bool:
        """Whether every sequence of `mb` has ended by the tokens of steps < `step`."""
        if self.ends is None or not self.ends[0]:
            return False
        eos = torch.tensor(self.ends[0])
        seen = torch.cat([self.got[u, mb] for u in range(step)], dim=1)
        return bool(torch.isin(seen, eos).any(dim=1).all())

    def _report(self) -> None:
        """`on_step` for each step whose tokens are all known (a stopped microbatch's: the pad)."""
        m = self.feed.microbatches
        while True:
            t = len(self.reported)
            live = [(t, i) in self.got for i in range(m)]
            done = [live[i] or self.stopped.get((0, i), t + 1) <= t for i in range(m)]
            if t >= self.feed.steps or not all(done) or not any(live):
                return
            row = [self.got[t, i] if live[i] else self._pad() for i in range(m)]
            self.reported.append(row)
            self.on_step(t, row)

    def _pad(self) -> torch.Tensor:
        """A stopped microbatch's tokens: the pad (it stops at EOS only, so there is a pad id)."""
        assert self.ends is not None and self.ends[1] is not None
        return torch.full((self.feed.rows, 1), int(self.ends[1]), dtype=torch.long, device=self.pg.device)

    def _receive(self, progs: Programs, env: dict[str, Any], step: int, mb: int, stage: int) -> bool:
        """Every value `stage` reads from earlier stages into `env`; True if they carry the stop."""
        mine, stop = set(progs.program(stage).inputs), False
        for src in range(stage):
            names = [n for n in progs.program(src).outputs if n in mine]
            if not names:
                continue
            bufs = [self._buffer(progs, n) for n in names] + [
                torch.zeros(1, dtype=torch.long, device=self.pg.device)
            ]
            what = f"stage {src}'s outputs for step {step}, microbatch {mb}"
            *got, flag = self._channel_recv(bufs, src, stage, step, mb, what)
            stop = stop or bool(flag.item())
            env.update({n: _laid_out(progs, n, b) for n, b in zip(names, got)})
        return stop

    def _buffer(self, progs: Programs, name: str) -> torch.Tensor:
        shape, dtype = progs.staged.meta[name][:2]
        return torch.empty(shape, dtype=dtype, device=self.pg.device)

    def _send(
        self, progs: Programs, env: dict[str, Any], step: int, mb: int, stage: int, select: Select, stop: bool
    ) -> None:  # fmt: skip
        prog = progs.program(stage)
        flag = torch.tensor([int(stop)], dtype=torch.long, device=self.pg.device)
        for dst in range(stage + 1, self.n):
            names = [n for n in prog.outputs if n in set(progs.program(dst).inputs)]
            if names:
                values = [self._buffer(progs, n) if stop else env[n].contiguous() for n in names]
                self._channel_send(
                    [*values, flag], stage, dst, step, mb, f"step {step}, microbatch {mb}'s values"
                )
        if stage == self.last and not stop:
            token = select(env[progs.logits], step, mb)
            self._channel_send([token], stage, 0, step, mb, f"step {step}, microbatch {mb}'s tokens")

    def _channel_send(
        self, tensors: list[torch.Tensor], src: int, dst: int, step: int, mb: int, what: str
    ) -> None:  # fmt: skip
        """To stage `dst`: handed over in this process if it is this rank's, else sent under the
        (src, dst) stage pair's tag (NOTE [several stages per rank])."""
        peer = dst % self.pg.size
        if peer == self.pg.rank:
            self.mail[src, dst, step, mb] = tensors
            return
        glob = self.pg.global_rank(peer)
        ops = [dist.P2POp(dist.isend, t, glob, self.pg.group, self._tag(src, dst)) for t in tensors]
        self.reaper.submit(dist.batch_isend_irecv(ops), tensors, f"sending {what} to rank {peer}", peer)

    def _channel_recv(
        self, bufs: list[torch.Tensor], src: int, dst: int, step: int, mb: int, what: str
    ) -> list[torch.Tensor]:  # fmt: skip
        peer = src % self.pg.size
        if peer == self.pg.rank:
            return self.mail.pop((src, dst, step, mb))
        glob, tag = self.pg.global_rank(peer), self._tag(src, dst)
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, glob, self.pg.group, tag) for b in bufs])
        where = f"at {self.where} receiving {what} from rank {peer}"
        self.pg.wait_all(works, self.timeout, functools.partial(str, where), peer)
        return bufs

    def _tag(self, src: int, dst: int) -> int:
        return src * self.n + dst


def _laid_out(progs: Programs, name: str, buf: torch.Tensor) -> torch.Tensor:
    """A received (contiguous) value in the layout it was traced with, if that differs."""
    stride = progs.staged.strides.get(name)
    if stride is None:
        return buf
    return torch.empty_strided(buf.shape, stride, dtype=buf.dtype, device=buf.device).copy_(buf)
