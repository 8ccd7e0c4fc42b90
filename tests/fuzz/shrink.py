"""Shrinking a failing example, and printing it so it can be run again.

`shrink` tries one-step reductions of an example -- drop a layer, make it a plain `lin`, drop a
boundary, an aux output, the data gradient, the save/load, the limit, replicas; fewer
microbatches; a simpler schedule -- and keeps the first that still fails with a part of the
same signature, until none does (or the budget of runs is spent). The runner takes a list of
candidates, so a multi-rank shrink runs each round in one torchrun launch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from .check import Outcome
from .grammar import Example, schedules_for

Runner = Callable[[list[Example]], list[Outcome]]


def candidates(ex: Example) -> Iterator[Example]:
    """One-step reductions of `ex`, largest first; each valid (its schedule builds)."""
    for c in _raw(ex):
        if c != ex:
            valid = schedules_for(c)
            if c.schedule in valid:
                yield c
            elif valid:
                yield dataclasses.replace(c, schedule=valid[0])


def _raw(ex: Example) -> Iterator[Example]:
    r = dataclasses.replace
    for i in range(len(ex.layers)):
        if len(ex.layers) > 1:
            cuts = tuple(c - (c > i) for c in ex.cuts if c != i)
            yield r(ex, layers=ex.layers[:i] + ex.layers[i + 1 :], cuts=tuple(sorted(set(cuts))))
    if ex.dp > 1:
        yield r(ex, dp=1, pp=ex.pp * ex.dp)
    for c in ex.cuts:
        yield r(ex, cuts=tuple(x for x in ex.cuts if x != c))
    for a in ex.aux:
        yield r(ex, aux=tuple(x for x in ex.aux if x != a))
    yield r(ex, save_load=False)
    yield r(ex, limit=None)
    yield r(ex, grad_x=False)
    yield r(ex, loss="mean")
    yield r(ex, stages=None)
    for m in (1, 2):
        if m < ex.microbatches:
            yield r(ex, microbatches=m)
    for s in ("gpipe", "1f1b"):
        yield r(ex, schedule=s)
    for i, kind in enumerate(ex.layers):
        if kind != "lin":
            yield r(ex, layers=ex.layers[:i] + ("lin",) + ex.layers[i + 1 :])


def same_failure(o: Outcome, target: Outcome) -> bool:
    return o.status == "fail" and bool(set(o.signature.split()) & set(target.signature.split()))


def shrink(
    ex: Example, outcome: Outcome, run: Runner, batch: bool, budget: int = 80
) -> tuple[Example, Outcome, int]:
    """The smallest failing example found from `ex` (with its outcome) and the runs it took."""
    runs = 0
    while runs < budget:
        cands = list(candidates(ex))
        if not cands:
            break
        found = None
        if batch:
            outs = run(cands[: budget - runs])
            runs += len(outs)
            found = next(((c, o) for c, o in zip(cands, outs) if same_failure(o, outcome)), None)
        else:
            for c in cands:
                if runs >= budget:
                    break
                runs += 1
                (o,) = run([c])
                if same_failure(o, outcome):
                    found = (c, o)
                    break
        if found is None:
            break
        ex, outcome = found
    return ex, outcome, runs


# -- printing -------------------------------------------------------------------------------------
LINES = {
    "lin": "h = tanh(h @ W{i} + b{i})",
    "res": "h = h + sin(h @ W{i})",
    "buf_rw": "self.step{i}.add_(1); h = tanh(h @ W{i} + self.step{i} * 0.25) + h   # a buffer written, then read",
    "buf_read": "h = h * self.scale{i}   # a buffer read",
    "bn_train": "h = BatchNorm1d{i}(h)   # training mode: running statistics written",
    "bn_eval": "h = BatchNorm1d{i}(h)   # eval mode",
    "dropout": "h = F.dropout(h, 0.3, training=True)",
    "inplace": "h = h @ W{i}; h += x; h.mul_(0.5)",
    "ckpt": "h = checkpoint(lambda h: tanh(h @ W{i}) + h, h, use_reentrant=False)",
    "tied": "h = tanh(h @ shared)   # one Parameter in every tied layer",
}


def program_text(ex: Example) -> str:
    """The example as the code it runs."""
    out = ["h = x"]
    for i, kind in enumerate(ex.layers):
        out.append(LINES[kind].format(i=i))
        if i in ex.cuts:
            out.append("h = fpipe.stage_boundary(h)")
    out.append(f"logits = head(h); loss = F.cross_entropy(logits, y, reduction={ex.loss!r})")
    aux = {
        "float_mean": "logits.pow(2).mean()",
        "float_rows": "logits[:, 0] * 2",
        "int_count": "(logits.argmax(-1) == y).sum()",
    }
    if ex.aux:
        out.append("return loss, {" + ", ".join(f"{a!r}: {aux[a]}" for a in ex.aux) + "}")
    else:
        out.append("return loss")
    kw = [f"microbatches={ex.microbatches}", f"schedule={ex.schedule!r}"]
    if ex.stages is not None:
        kw.insert(0, f"stages={ex.stages}")
    if ex.limit is not None:
        kw.append(f"memory_limit={ex.limit} x the predicted peak without a limit")
    if ex.dp * ex.pp > 1:
        kw.append(f"mesh=(dp={ex.dp}, pp={ex.pp}) on {ex.dp * ex.pp} gloo ranks")
    out.append(f"pipeline(f, {', '.join(kw)})")
    out.append(
        f"value_and_grad(argnums={(0, 1) if ex.grad_x else 0}, has_aux={bool(ex.aux)}), 2 steps of SGD(momentum)"
        + (", fpipe.save/fpipe.load between them" if ex.save_load else "")
    )
    return "\n".join("    " + line for line in out)


def snippet(ex: Example) -> str:
    """A command that runs the example again and prints its outcome."""
    if ex.dp * ex.pp > 1:
        return (
            f"python -m tests.fuzz --replay {ex.describe()!r}   # {ex.dp * ex.pp} ranks, one torchrun launch"
        )
    return (
        "python -c 'from tests.fuzz.grammar import *; from tests.fuzz.check import run_example; "
        f"print(run_example({ex.describe()}))'"
    )
