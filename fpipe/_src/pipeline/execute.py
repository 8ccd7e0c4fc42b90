"""Execute: one step of a compiled plan on this rank's inputs.

Binds the call's tensors to the programs' input names (parameters, the module buffers as they
are now, the loss cotangent, each microbatch's data), checks that this rank's parameters are
real, numbers the step for the random-number policy (NOTE [random-number policy] in rng.py)
and hands everything to the runner, which runs the schedule's actions.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..parallel import Gatherer, GradReducer, local_leaves
from ..runtime import PPGroup, Results, hand_back
from ..schedules import Action
from ..tracing import set_step
from .compiler import Compiled
from .config import Config
from .inputs import Inputs, device_of
from .outputs import local_inputs

BEFORE_CALLS: list[Callable[[str], None]] = []  # run first by every pipeline call (api.py)


def check_before_calls(check: Callable[[str], None]) -> None:
    """Run `check(call)` first in every pipeline call, before anything runs (a raise is the
    call's failure). The checkpoints register theirs (an earlier `async_save` that failed:
    NOTE [a save's failure is never lost]): they build on the pipeline, which cannot import them."""
    BEFORE_CALLS.append(check)


def execute(
    cfg: Config,
    pg: PPGroup | None,
    dp: PPGroup | None,
    inp: Inputs,
    mbs: list[list[torch.Tensor]],
    c: Compiled,
    ct: float | None,
    step: int,
) -> Results:
    """Run step number `step` (1, 2, ...) of plan `c`; `ct` is the loss cotangent (None: forward
    only). With data-parallel replicas (`dp`), gradient sums come back summed over them
    (NOTE [gradients over replicas] in replicas.py)."""
    st = c.staged
    check_local_params(cfg, pg, inp, c)
    glob = dict(zip(st.param_inputs, local_leaves(inp.param_leaves)))
    glob.update(zip(st.const_inputs, current_consts(cfg.call, c)))
    if ct is not None:
        glob[st.ct_input] = torch.tensor(ct, dtype=st.meta[st.ct_input][1], device=device_of(pg, inp))
    data = [dict(zip(st.data_inputs, mb)) for mb in mbs]
    set_step(torch.initial_seed(), step)
    summed = frozenset(st.n_outs + j for j, pos in enumerate(c.diff) if inp.axis_of(pos) is None)
    # value_and_grad computes its gradients explicitly (the joint programs): recording autograd
    # history as well, for inputs that require grad, would keep every program's intermediates
    # alive for the whole step. Under a torch.func transform, the transform decides.
    # In a process group autograd history is no use either: a backward cannot cross ranks
    # (outputs.refuse_backward makes one fail with a clear error).
    grouped = pg is not None or dp is not None
    explicit = (ct is not None or grouped) and torch._C._functorch.peek_interpreter_stack() is None
    reducer = _reducer(cfg, dp, inp, c, summed) if ct is not None else None
    gatherer = _gatherer(cfg, dp, inp, c, glob)
    with torch.no_grad() if explicit else contextlib.nullcontext():
        results = c.runner.run(
            glob,
            data,
            summed,
            after=_each(reducer and reducer.after, gatherer and gatherer.after),
            before=gatherer.before if gatherer else None,
            precision=cfg.precision,
        )
        if reducer is not None:
            reducer.finish(results)
        hand_back(cfg.precision, inp, c, results)
    trace = os.environ.get("FPIPE_TRACE")
    if trace:
        c.runner.timeline.write(f"{trace}.rank{pg.rank if pg else 0}.json")
    return results


def _reducer(cfg: Config, dp: PPGroup | None, inp: Inputs, c: Compiled, summed: frozenset[int]) -> Any:
    """With replicas: what sums the gradients over them (NOTE [gradients over replicas])."""
    if dp is None:
        return None
    st, params = c.staged, inp.param_leaves
    positions = {st.n_outs + j: pos for j, pos in enumerate(c.diff) if pos < len(params)}
    sharded = {i: params[pos] for i, pos in positions.items() if isinstance(params[pos], DTensor)}
    actions = c.runner.local_actions
    return GradReducer(dp, c.staged, actions, summed, sharded, cfg.timeout, cfg.precision)  # type: ignore[arg-type]


def _gatherer(
    cfg: Config, dp: PPGroup | None, inp: Inputs, c: Compiled, glob: dict[str, torch.Tensor]
) -> Gatherer | None:
    """With sharded parameters: what makes them whole stage by stage (NOTE [gathered stage by
    stage] in sharding.py). A parameter the step returns as an output stays whole."""
    st, local = c.staged, set(c.local_params or ())
    sharded = {
        st.param_inputs[i]: p for i, p in enumerate(inp.param_leaves) if isinstance(p, DTensor) and i in local
    }
    if dp is None or not sharded:
        return None
    actions = c.runner.local_actions
    return Gatherer(dp, sharded, st.consumers, actions, glob, cfg.timeout, keep=set(st.out_names))  # type: ignore[arg-type]


def _each(*hooks: Any) -> Callable[[Action, Results], None] | None:
    """One after-action hook calling each of `hooks` (None if there are none)."""
    live = [h for h in hooks if h]
    if not live:
        return None

    def each(a: Action, results: Results) -> None:
        for h in live:
            h(a, results)

    return each


def check_local_params(cfg: Config, pg: PPGroup | None, inp: Inputs, c: Compiled) -> None:
    """Refuse meta tensors among the parameters this rank's stages read."""
    if c.local_params is None:
        c.local_params = sorted(local_inputs(pg, c, c.staged.param_inputs))
    meta = [i for i in c.local_params if inp.param_leaves[i].is_meta]
    if meta:
        names = [str(c.param_keys[i]) if c.param_keys else f"leaf {i}" for i in meta[:4]]
        raise ValueError(
            f"{cfg.call}: parameter(s) {names} are on the meta device, but this rank's "
            "stages use them. Pass the dict that piped.materialize(...) returned (the one from "
            "functionalize still holds the meta tensors), or real tensors."
        )


def current_consts(call: str, c: Compiled) -> list[torch.Tensor]:
    """The module buffers the programs read, as the module holds them now (a buffer reassigned
    since the trace, by `load_state_dict(..., assign=True)` or `module.buf = t`, is read anew);
    captured tensors that are not a module's buffer, as traced."""
    out = []
    for traced, source in zip(c.consts, c.const_sources or [None] * len(c.consts)):
        now = traced if source is None else source[0].get_buffer(source[1])
        if now is not traced and (now.shape, now.dtype) != (traced.shape, traced.dtype):
            raise ValueError(
                f"{call}: buffer {source[1]!r} of {type(source[0]).__name__} is now a {now.dtype} "
                f"tensor of shape {tuple(now.shape)}, but the pipeline was traced with a "
                f"{traced.dtype} tensor of shape {tuple(traced.shape)}; build a new pipeline for "
                "the changed module (fpipe.pipeline(...)), or assign buffers of the traced shape."
            )
        out.append(now)
    return out
