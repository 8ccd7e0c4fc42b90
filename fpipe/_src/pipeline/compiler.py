"""Compile: one input signature -> an executable plan, cached per signature.

`Compiler.get` is the data path's middle, in the order docs/ARCHITECTURE.md draws it: trace the
forward graph on fake tensors -> partition (only `stages=N` without markers) -> choose the
output reductions -> trace the joint (value-and-grad) graph -> split into per-stage programs ->
build and validate the schedule, split backwards into I/W where it asks -> a runner (this
process, or this rank of a process group). In a group, the ranks compare input signatures at
every call and the staged programs at each compile, before any transfer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

from ..memory import choose, predict, tagged
from ..parallel import (
    check_no_loss_parallel,
    check_sharded,
    plain_outputs,
    refusing_loss_parallel,
    rewrite,
    trace_joint_tp,
    wrapping,
)
from ..runtime import (
    DistRunner,
    LocalRunner,
    PPGroup,
    check_same_program,
    check_same_signature,
    check_same_slices,
    digest,
    fingerprint,
    graph_text,
)
from ..schedules import Schedule, build, stages_per_rank, validate
from ..stages import Staged, auto_partition, count_stages, measure_costs, split_backward
from ..stages import split as split_
from ..tracing import (
    BOUNDARY,
    Forward,
    Joint,
    fake_like,
    following_checkpoints,
    forward_as_joint,
    make_fakes,
    trace_forward,
    trace_joint,
    warn_lost_regions,
)
from . import inputs as inputs_
from .config import REDUCTIONS, Config
from .inputs import Inputs
from .out_reduce import choose_reductions


@dataclasses.dataclass
class Compiled:
    """The plan for one input signature: the staged programs and the runner that executes them."""

    staged: Staged
    runner: LocalRunner
    consts: list[torch.Tensor]
    out_spec: Any
    reductions: list[str | int]
    diff: list[int]
    stage_costs: list[float] | None
    param_keys: list[Any]
    const_sources: list[Any]  # Forward.sources: where each const is read at every call
    local_params: list[int] | None = None
    base: Staged | None = None  # before recomputation (remat_choose.py): what every rank agrees on
    loss_shape: tuple[int, ...] = ()  # of output 0: checked at every value-and-grad call (_check_loss)


Key = tuple[Any, ...]


class Compiler:
    """Compiles a pipeline's function per input signature and keeps the plans (`cache`)."""

    def __init__(
        self,
        cfg: Config,
        pg: PPGroup | None,
        dp: PPGroup | None = None,
        dp_mesh: Any = None,
        tp: PPGroup | None = None,
        tp_mesh: Any = None,
    ) -> None:
        self.cfg, self.pg, self.dp, self.dp_mesh, self.tp = cfg, pg, dp, dp_mesh, tp
        self.tp_mesh = tp_mesh  # mesh["tp"], also at size 1 (then `tp` is None)
        self.cache: dict[Key, Compiled] = {}
        # see _measured_costs; `fpipe.plan` hands its measurements in, so its cuts are reproduced
        self._measured: dict[Key, list[float]] = cfg.costs if cfg.costs is not None else {}

    def get(
        self, inp: Inputs, mb0: list[torch.Tensor], grad_of: tuple[int, ...] | None, has_aux: bool | None
    ) -> Compiled:
        """The plan for these inputs, compiled at the first call of their signature. `has_aux`
        does not change the program, only what is refused (None: `memory`, which predicts the
        step the function's outputs call for, with or without aux)."""
        if inp.tp:
            check_no_loss_parallel(self.cfg.call)
        check_sharded(self.cfg.call, self.dp_mesh, inp.param_leaves, inputs_.param_keys(inp))
        key = (inp.key(inputs_.device_of(self.pg, inp).type), grad_of, has_aux)
        shapes = [tuple(t.shape) for t in inp.data_leaves]
        if self.pg is not None:
            check_same_signature(self.cfg.call, self.pg, key, shapes, self.cfg.timeout)
        if self.tp is not None:  # the tp ranks' shards may differ in shape (uneven)
            tp_key = (key[0][:1] + key[0][2:], grad_of, has_aux, bool(inp.tp))
            check_same_signature(self.cfg.call, self.tp, tp_key, shapes, self.cfg.timeout, "tensor-parallel")
        if self.dp is not None:
            names = inputs_.leaf_names(self.cfg.f, inp.data_spec, inp.is_tensor)
            check_same_slices(self.cfg.call, self.dp, key, inp.data_leaves, names, self.cfg.timeout)
        compiled = self.cache.get(key[:2])
        if compiled is None:
            # Trace outside any active torch.func transform (grad(piped), vmap(piped)): the
            # program is a function of its inputs, whatever transform later runs it.
            with (
                temporarily_clear_interpreter_stack(),
                following_checkpoints() as regions,
                refusing_loss_parallel(self.cfg.call),
            ):
                compiled = self._compile(inp, mb0, grad_of, has_aux, regions)
            if self.pg is not None:  # before any transfer: the ranks must agree on what to send
                parts = fingerprint(compiled.base or compiled.staged, compiled.runner.schedule)
                check_same_program(self.cfg.call, self.pg, parts, self.cfg.timeout)
            self.cache[key[:2]] = compiled
        if grad_of is not None:
            _check_loss(self.cfg.call, compiled.loss_shape, len(compiled.reductions), has_aux)
        return compiled

    def _compile(
        self,
        inp: Inputs,
        mb0: list[torch.Tensor],
        grad_of: tuple[int, ...] | None,
        has_aux: bool | None,
        regions: list[Any] | None = None,  # filled by the traces: following_checkpoints
    ) -> Compiled:
        cfg, device = self.cfg, inputs_.device_of(self.pg, inp)
        mode, fakes = make_fakes([*inp.param_leaves, *mb0], device)
        wanting = _wanting_grad(fakes, inp, grad_of)
        f, rebuild = self._function(inp)
        fwd = trace_forward(cfg.call, f, rebuild, wanting, len(inp.param_leaves), device, cfg.cuts)
        if inp.tp:
            fwd.gm = rewrite(cfg.call, fwd.gm, self._tp_name(), self.tp is None)
        stage_costs = self._cut(fwd, [*inp.param_leaves, *mb0], device, bool(inp.tp))
        reductions = self._reductions(fwd, inp)
        diff: list[int] = []
        loss_shape: tuple[int, ...] = ()
        if grad_of is None:
            joint = forward_as_joint(fwd)
        else:
            outs = fwd.gm.graph.find_nodes(op="output")[0].args[0]
            loss_shape = tuple(outs[0].meta["val"].shape)  # type: ignore[index, union-attr]
            _check_loss(cfg.call, loss_shape, len(outs), has_aux)  # type: ignore[arg-type]
            diff = _diff_positions(cfg, inp, grad_of, reductions)
            const_fakes = [fake_like(mode, c, device) for c in fwd.consts]
            with mode:  # the 1/M factor in the loss's precision (at least fp32): exact enough
                ct = torch.empty((), dtype=_cotangent_dtype(fwd), device=device)
            if inp.tp:
                joint = trace_joint_tp(cfg.call, f, rebuild, fwd, [*fakes, ct], diff, cfg.cuts)
                joint.gm = rewrite(cfg.call, joint.gm, self._tp_name(), self.tp is None)
            else:
                joint = trace_joint(cfg.call, fwd, [*fakes, *const_fakes, ct], diff, bool(has_aux))
        base, sched = self._stage(joint)
        staged = base
        if grad_of is not None:  # NOTE [meeting a memory limit] in remat_choose.py
            if regions and not any(tagged(n) for n in joint.gm.graph.nodes):
                warn_lost_regions(cfg.call)
            staged = self._remat(base, sched, inp, diff)
        keys = inputs_.param_keys(inp)
        return Compiled(
            staged, self._runner(staged, sched), fwd.consts, fwd.out_spec, reductions, diff,
            stage_costs, keys, fwd.sources, base=base, loss_shape=loss_shape,
        )  # fmt: skip

    def _runner(self, staged: Staged, sched: Schedule) -> Any:
        if self.pg is None:
            return LocalRunner(staged, sched)
        return DistRunner(staged, sched, self.pg, self.cfg.timeout, self.cfg.memory_limit is not None)

    def _remat(self, base: Staged, sched: Schedule, inp: Inputs, diff: list[int]) -> Staged:
        """Checkpointed regions recomputed, and what `memory_limit` needs (remat_choose.py)."""
        summed = frozenset(base.n_outs + j for j, pos in enumerate(diff) if inp.axis_of(pos) is None)
        rank = self.pg.rank if self.pg is not None else None
        mine = [s for s in range(base.n_stages) if rank is None or sched.stage_rank[s] == rank]

        def predicted(st: Staged) -> Any:
            return predict(st, self._runner(st, sched), summed, self.cfg.microbatches, self.cfg.precision)

        return choose(self.cfg.call, base, self.cfg.memory_limit, predicted, mine)

    def _function(self, inp: Inputs) -> tuple[Any, Any]:
        """The function to trace and the rebuilder of its arguments (NOTE [tensor-parallel
        tracing] in tp.py for DTensor parameters)."""
        if not inp.tp:
            return self.cfg.f, inputs_.rebuilder(inp)
        return plain_outputs(self.cfg.f), wrapping(inputs_.rebuilder(inp), inp.tp)

    def _tp_name(self) -> str | None:
        return self.tp_mesh.get_group().group_name if self.tp_mesh is not None else None

    def _stage(self, joint: Joint) -> tuple[Staged, Schedule]:
        """Split the joint graph, schedule its stages, split backwards where the schedule asks."""
        staged = split_.split(self.cfg.call, joint, self.cfg.stages)
        sched = self._schedule(staged.n_stages)
        staged = self._split_backward(staged, sched)
        if self.cfg.compile:
            opts = self.cfg.compile if isinstance(self.cfg.compile, dict) else {}
            for prog in staged.programs.values():
                prog.compile = opts
        return staged, sched

    def _split_backward(self, staged: Staged, sched: Schedule) -> Staged:
        """Split B into I and W on the stages where the schedule uses I/W actions."""
        kinds: dict[int, set[str]] = {}
        for a in sched.actions():
            kinds.setdefault(a.stage, set()).add(a.kind)
        mixed = sorted(s for s, k in kinds.items() if "B" in k and k & {"I", "W"})
        if mixed:
            raise ValueError(
                f"{self.cfg.call}: schedule {sched.name!r} uses both B and I/W actions on "
                f"stage(s) {mixed}; on each stage use either full backwards or the I/W split."
            )
        return split_backward(staged, [s for s, k in kinds.items() if k & {"I", "W"}])

    def _cut(
        self, fwd: Forward, mb0: list[torch.Tensor], device: torch.device, tp: bool = False
    ) -> list[float] | None:
        """Check the markers' stage count, or choose the cuts (stages=N without markers)."""
        has_markers = bool(fwd.gm.graph.find_nodes(op="call_function", target=BOUNDARY))
        stages = self.cfg.stages
        if stages is None and not has_markers and self.pg is not None:
            sched = self.cfg.schedule
            per = stages_per_rank(sched) if isinstance(sched, str) else 1
            stages = self.pg.size * per  # the schedule's stages per rank, chosen automatically
        if stages is None or stages == 1 and not has_markers:
            return None
        if has_markers:
            found = count_stages(fwd.gm.graph)
            if found != stages and self.cfg.cuts is not None:
                raise ValueError(
                    f"{self.cfg.call}: stages={stages} but cuts={self.cfg.cuts!r} make {found} "
                    f"stages; pass stages={found} (or stages=None to follow the cuts)."
                )
            if found != stages:
                raise ValueError(
                    f"{self.cfg.call}: stages={stages} but the function's stage_boundary (or "
                    f"pipe_split()) calls make {found} stages (the most boundaries on one path from "
                    f"the inputs); pass stages={found} (or stages=None to follow the boundaries), or "
                    "remove the calls to let fpipe choose the cuts."
                )
            return None
        if tp:  # the joint is traced from the function again, not from the cut forward graph
            raise ValueError(
                f"{self.cfg.call}: stages={stages} without stage boundaries, but the parameters are "
                "tensor-parallel DTensors; fpipe cannot yet choose the cuts of a tensor-parallel "
                "function. Say where stages begin: cuts={'blocks': k} (every k-th block), a list "
                "of module paths, or fpipe.stage_boundary calls."
            )
        measure = None
        if self.cfg.partition == "measure":
            measure = functools.partial(self._measured_costs, fwd, mb0, device)
        return auto_partition(self.cfg.call, fwd, stages, measure)

    def _measured_costs(
        self, fwd: Forward, mb0: list[torch.Tensor], device: torch.device
    ) -> dict[Any, float]:
        """`measure_costs`, once per forward program: the forward-only trace (a plain call,
        `materialize`) and the value_and_grad one trace the same operations, and must cut them
        alike -- `materialize` gave this rank the parameters of *its* cut, and timings vary from
        one measurement to the next. Every rank sees the same programs, so every rank skips the
        measurement (and its all-reduce) alike."""
        nodes = list(fwd.gm.graph.nodes)
        key = tuple((n.op, str(n.target), _shapes(n.meta.get("val"))) for n in nodes)
        if key not in self._measured:
            if self.pg is not None:  # the ranks average per-operation times: same operations first
                parts = {"the traced function": digest(graph_text(fwd.gm))}
                check_same_program(self.cfg.call, self.pg, parts, self.cfg.timeout)
            seconds = measure_costs(fwd, mb0, device, self.pg, self.cfg.timeout)
            self._measured[key] = [seconds.get(n, 0.0) for n in nodes]
        return dict(zip(nodes, self._measured[key]))

    def _reductions(self, fwd: Forward, inp: Inputs) -> list[str | int]:
        """Per output: 'mean', 'sum' or a concatenation axis (out_reduce.py)."""
        replicas = self.dp.size if self.dp is not None else 1
        return choose_reductions(self.cfg, fwd, inp, replicas, lambda: self._trace_at_twice_the_batch(inp))

    def _trace_at_twice_the_batch(self, inp: Inputs) -> Forward | None:
        """The forward graph at microbatches twice as large (fake tensors: no memory), or None
        if the function does not trace at that size."""
        m, device = self.cfg.microbatches, inputs_.device_of(self.pg, inp)
        shapes = [list(t.shape) for t in inp.data_leaves]
        for shape, axis in zip(shapes, inp.axes):
            if axis is not None:
                shape[axis] = 2 * shape[axis] // m
        mode, fakes = make_fakes(inp.param_leaves, device)
        with mode:
            fakes += [torch.empty(s, dtype=t.dtype, device=device) for s, t in zip(shapes, inp.data_leaves)]
        f, rebuild = self._function(inp)
        try:
            return trace_forward(
                self.cfg.call,
                f,
                rebuild,
                fakes,
                len(inp.param_leaves),
                None,
                self.cfg.cuts,
            )
        except Exception:
            return None

    def _schedule(self, n_stages: int) -> Schedule:
        """The schedule for `n_stages` stages, built or given, validated against the group."""
        cfg, pg, s = self.cfg, self.pg, self.cfg.schedule
        if isinstance(s, Schedule):
            sched = s
        elif callable(s):
            sched = s(pp=n_stages, microbatches=cfg.microbatches)
        else:
            sched = build(
                s, pp=pg.size if pg is not None else None, microbatches=cfg.microbatches, stages=n_stages
            )
        validate(sched)
        if pg is not None and sched.pp != pg.size:
            raise ValueError(
                f"{cfg.call}: the schedule has {sched.pp} ranks but the pipeline group has "
                f"{pg.size}; launch with --nproc-per-node {sched.pp} or change the stages."
            )
        if sched.n_stages != n_stages or sched.n_microbatches != cfg.microbatches:
            raise ValueError(
                f"{cfg.call}: the schedule covers {sched.n_stages} stages and "
                f"{sched.n_microbatches} microbatches but the program has {n_stages} stages and "
                f"microbatches={cfg.microbatches}; build the schedule for those numbers."
            )
        return sched


def _check_loss(call: str, loss_shape: tuple[int, ...], n_outs: int, has_aux: bool | None) -> None:
    """Refuse a loss that is not a scalar, or (has_aux=False) aux outputs; `has_aux` None is
    `memory`'s step, which takes a second output as aux."""
    if not loss_shape and (has_aux is not False or n_outs == 1):
        return
    what = f"a tensor of shape {loss_shape}" if n_outs == 1 else f"{n_outs} tensors"
    where = f"value_and_grad({call})" if has_aux is not None else f"{call}.memory(...)"
    fix = "pass has_aux=True and return (loss, aux)" if has_aux is not None else "return (loss, aux)"
    raise ValueError(
        f"{where}: the function must return a scalar loss{' and an aux value' if has_aux else ''}, "
        f"but returns {what}; reduce it to a scalar, or {fix}."
    )


def _diff_positions(
    cfg: Config, inp: Inputs, argnums: tuple[int, ...], reductions: list[str | int]
) -> list[int]:
    """The flat positions to differentiate; refuse a loss reduced otherwise than by 'mean' or 'sum'."""
    call = f"value_and_grad({cfg.call})"
    if reductions[0] not in REDUCTIONS:
        raise ValueError(
            f"{call}: the loss must be reduced over microbatches by 'mean' or 'sum', not {reductions[0]!r}."
        )
    return inputs_.argnum_positions(call, inp, argnums)


def _cotangent_dtype(fwd: Forward) -> torch.dtype:
    """The loss's dtype, at least fp32: 1/M in bf16 is off by up to 0.4 %, a bias in every gradient."""
    loss = fwd.gm.graph.find_nodes(op="output")[0].args[0][0].meta["val"]  # type: ignore[index, union-attr]
    return torch.promote_types(loss.dtype, torch.float32)


def _wanting_grad(
    fakes: list[torch.Tensor], inp: Inputs, grad_of: tuple[int, ...] | None
) -> list[torch.Tensor]:
    """The forward trace sees the inputs to be differentiated as requiring grad, as eager would:
    kernels are chosen by that (attention with a learned mask must take the differentiable path),
    and the trace finds the custom autograd.Functions a gradient would pass through by them
    (NOTE [custom autograd.Function] in trace.py). A plain call traces like `value_and_grad`'s
    default (argnums=0: the params): `materialize` and the step then trace the same operations,
    and `torch.func.grad(piped)` differentiates a program that was checked."""
    wanted = {p for num in (grad_of or (0,)) for p in inputs_.positions_of_argnum(inp, num)}
    return [
        f.detach().requires_grad_(True) if i in wanted and (f.is_floating_point() or f.is_complex()) else f
        for i, f in enumerate(fakes)
    ]


def _shapes(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), str(val.dtype))
    if isinstance(val, (tuple, list)):
        return tuple(_shapes(v) for v in val)
    return None
