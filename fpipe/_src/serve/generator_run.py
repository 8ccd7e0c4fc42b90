"""One pass of `fpipe.Generator`'s step programs through the pipeline: every stage in this process,
or this rank's stage under torchrun (receive what it reads from earlier stages, run, send on)."""

from __future__ import annotations

from typing import Any

import torch

from ..generate import Programs, RankWalk, run_stage
from ..runtime import PeerFailure, PPGroup, exit_hard_after_failure

__all__ = ["LocalPasses", "RankPasses"]


class LocalPasses:
    """Every stage in this process, in order."""

    last = True

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params

    def run(self, progs: Programs, env: dict[str, torch.Tensor], what: str) -> torch.Tensor | None:
        for stage in range(progs.staged.n_stages):
            run_stage(progs, stage, env, self.params)
        return env[progs.logits]

    def share(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens

    def guard(self, fn: Any) -> Any:
        return fn()


class RankPasses:
    """This rank's stage (stage = rank): the decode runtime's receives and sends (decode_run's
    `RankWalk`), one pass at a time; the last rank picks the tokens and `share` broadcasts them."""

    def __init__(self, params: dict[str, torch.Tensor], pg: PPGroup, timeout: float) -> None:
        self.params, self.pg, self.timeout = params, pg, timeout
        self.rank: RankWalk | None = None  # made at the first pass (it needs the stage count)
        self.last = pg.rank == pg.size - 1

    def run(self, progs: Programs, env: dict[str, torch.Tensor], what: str) -> torch.Tensor | None:
        n, stage = progs.staged.n_stages, self.pg.rank
        if self.rank is None:
            self.rank = RankWalk(self.pg, self.timeout, None, None, n, None)  # type: ignore[arg-type]
        rank = self.rank
        rank.where = f"{what} (stage {stage})"
        rank._receive(progs, env, 0, 0, stage)  # (never a stop: the Generator's passes all run)
        run_stage(progs, stage, env, self.params)
        prog, go = progs.program(stage), torch.zeros(1, dtype=torch.long, device=self.pg.device)
        for dst in range(stage + 1, n):
            names = [name for name in prog.outputs if name in set(progs.program(dst).inputs)]
            if names:
                values = [env[name].contiguous() for name in names]
                rank._channel_send([*values, go], stage, dst, 0, 0, f"{what}'s values")
        return env[progs.logits] if self.last else None

    def share(self, tokens: torch.Tensor) -> torch.Tensor:
        """The last rank's tokens of this step on every rank (one broadcast)."""
        what = "broadcasting the step's tokens from the last rank"
        return self.pg.broadcast(tokens.contiguous(), self.pg.size - 1, self.timeout, what)

    def guard(self, fn: Any) -> Any:
        """`fn()`; an error here is reported to every rank, which stop naming this one."""
        try:
            return fn()
        except (PeerFailure, TimeoutError):
            raise
        except Exception as err:
            msg = f"{self.pg.me} failed at {self.rank.where if self.rank else 'setup'}: {type(err).__name__}: {err}"
            self.pg.report_failure(msg)
            exit_hard_after_failure()
            raise RuntimeError(f"fpipe {msg}") from err
