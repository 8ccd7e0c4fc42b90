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
run in order at each (step, microbatch). Every wait is failure-aware (`PPGroup.wait_all`): a
rank that fails reports where, and every other rank stops naming it.
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

__all__ = ["Feed", "StageCaches", "run_local", "run_rank"]

Select = Callable[[torch.Tensor, int, int], torch.Tensor]  # (logits, step, microbatch) -> tokens
OnStep = Callable[[int, list[torch.Tensor]], bool]  # (step, its tokens per microbatch) -> stop?


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
) -> list[list[torch.Tensor]]:
    """This rank's stage (stage = rank) over every (step, microbatch) (NOTE [the decode
    schedule]). Rank 0 returns tokens[step][mb] (the last rank sends every token back to it),
    the others an empty list; rank 0 calls `on_step` as each step's tokens are complete."""
    rank = _Rank(pg, timeout, feed, on_step)
    try:
        return rank.run(programs, params, caches, select)
    except (PeerFailure, TimeoutError):
        raise
    except Exception as err:
        msg = f"{pg.me} failed at {rank.where}: {type(err).__name__}: {err}"
        pg.report_failure(msg)
        exit_hard_after_failure()
        raise RuntimeError(f"fpipe {msg}") from err


class _Rank:
    """One rank's walk over (step, microbatch): receive, run its stage, send."""

    def __init__(self, pg: PPGroup, timeout: float, feed: Feed, on_step: OnStep) -> None:
        self.pg, self.timeout, self.feed, self.on_step = pg, timeout, feed, on_step
        self.stage, self.last = pg.rank, pg.size - 1
        self.reaper = send_reaper(pg, timeout)
        self.reaper.timeout = timeout
        self.where = "setup"

    def run(
        self,
        programs: Callable[[int], Programs],
        params: dict[str, torch.Tensor],
        caches: StageCaches,
        select: Select,
    ) -> list[list[torch.Tensor]]:
        feed = self.feed
        tokens: list[list[Any]] = []  # on stage 0: tokens[step][mb], the tokens it fed
        for step in range(feed.steps):
            progs = programs(step)
            row: list[Any] = []  # on stage 0: the tokens of the step before
            for mb in range(feed.microbatches):
                self.where = f"step {step} (stage {self.stage}, microbatch {mb})"
                fed = self._token(step - 1, mb) if self.stage == 0 and step else None
                row.append(fed)
                history = [r[mb] for r in tokens[1:]] + [fed] if fed is not None else None
                env: dict[str, Any] = {**feed.data(step, mb, history), **caches.buffers[mb]}
                env.update(self._receive(progs, step, mb))
                run_stage(progs, self.stage, env, params)
                self._send(progs, env, step, mb, select)
            if self.stage == 0 and step:  # the tokens of the step before are all back
                self.on_step(step - 1, row)
            tokens.append(row)
        if self.stage == 0:  # the last step's tokens, and every token shifted by one step
            self.where = "the end (stage 0)"
            last = [self._token(feed.steps - 1, mb) for mb in range(feed.microbatches)]
            self.on_step(feed.steps - 1, last)
            tokens = [*tokens[1:], last]
        self.reaper.drain()
        return tokens if self.stage == 0 else []

    def _receive(self, progs: Programs, step: int, mb: int) -> dict[str, torch.Tensor]:
        mine = set(progs.program(self.stage).inputs)
        got: dict[str, torch.Tensor] = {}
        for src in range(self.stage):
            names = [n for n in progs.program(src).outputs if n in mine]
            if names:
                got.update(
                    zip(
                        names,
                        self._recv(
                            progs, names, src, f"stage {src}'s outputs for step {step}, microbatch {mb}"
                        ),
                    )
                )
        return got

    def _recv(self, progs: Programs, names: list[str], src: int, what: str) -> list[torch.Tensor]:
        bufs = [
            torch.empty(progs.staged.meta[n][0], dtype=progs.staged.meta[n][1], device=self.pg.device)
            for n in names
        ]
        return [_laid_out(progs, n, b) for n, b in zip(names, self._recv_raw(bufs, src, what))]

    def _token(self, step: int, mb: int) -> torch.Tensor:
        (tok,) = self._recv_raw(
            [torch.empty(self.feed.rows, 1, dtype=torch.long, device=self.pg.device)],
            self.last,
            f"the tokens of step {step}, microbatch {mb}",
        )
        return tok

    def _recv_raw(self, bufs: list[torch.Tensor], src: int, what: str) -> list[torch.Tensor]:
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.irecv, b, self.pg.global_rank(src), self.pg.group) for b in bufs]
        )
        self.pg.wait_all(
            works,
            self.timeout,
            functools.partial(str, f"at {self.where} receiving {what} from rank {src}"),
            src,
        )
        return bufs

    def _send(self, progs: Programs, env: dict[str, Any], step: int, mb: int, select: Select) -> None:
        prog = progs.program(self.stage)
        for dst in range(self.stage + 1, self.last + 1):
            names = [n for n in prog.outputs if n in set(progs.program(dst).inputs)]
            if names:
                self._isend(
                    [env[n].contiguous() for n in names], dst, f"step {step}, microbatch {mb}'s values"
                )
        if self.stage == self.last:
            self._isend([select(env[progs.logits], step, mb)], 0, f"step {step}, microbatch {mb}'s tokens")

    def _isend(self, tensors: list[torch.Tensor], dst: int, what: str) -> None:
        ops = [dist.P2POp(dist.isend, t, self.pg.global_rank(dst), self.pg.group) for t in tensors]
        self.reaper.submit(dist.batch_isend_irecv(ops), tensors, f"sending {what} to rank {dst}", dst)


def _laid_out(progs: Programs, name: str, buf: torch.Tensor) -> torch.Tensor:
    """A received (contiguous) value in the layout it was traced with, if that differs."""
    stride = progs.staged.strides.get(name)
    if stride is None:
        return buf
    return torch.empty_strided(buf.shape, stride, dtype=buf.dtype, device=buf.device).copy_(buf)
