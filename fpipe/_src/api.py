"""The public transforms: `pipeline`, `value_and_grad`, `grad`.

`Pipelined.__call__` and `value_and_grad` both go through `Pipelined._compile`, which reads like
the data path: trace -> (partition) -> split -> schedule -> run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import re
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

from . import tree
from .agree import check_same_program, digest, fingerprint, gather_digests, graph_text, odd_ranks
from .dist import DEFAULT_TIMEOUT, PeerFailure, PPGroup, pp_group
from .marker import BOUNDARY
from .measure import measure_costs
from .partition import auto_partition
from .reduction import batch_reduction
from .rng import set_step
from .run import LocalRunner, Results, Timeline
from .run_dist import DistRunner
from .schedule import Schedule, build, names, stages_per_rank
from .simulate import validate
from .split import Staged, count_stages, split, split_backward
from .trace import Forward, Joint, make_fakes, trace_forward, trace_joint

__all__ = ["pipeline", "value_and_grad", "grad", "Pipelined"]

_REDUCTIONS = ("mean", "sum")


def _fn_name(f: Callable[..., Any]) -> str:
    return getattr(f, "__name__", None) or repr(f)


@dataclasses.dataclass
class _Inputs:
    """A call's inputs, flattened: params leaves, data leaves (split per microbatch), statics."""

    param_leaves: list[torch.Tensor]
    param_spec: Any
    data_leaves: list[torch.Tensor]  # whole-batch tensors
    axes: list[int | None]  # split axis of each data leaf
    statics: list[Any]  # non-tensor leaves of (args, kwargs), in order
    is_tensor: list[bool]
    data_spec: Any

    def key(self, device_type: str) -> tuple[Any, ...]:
        """Everything a trace depends on (NOTE [trace key]); `device_type`: where meta tensors
        are traced (the data's device)."""
        return (
            str(self.param_spec),
            tuple(_tensor_key(t, device_type) for t in self.param_leaves),
            str(self.data_spec),
            tuple(_tensor_key(t, device_type) for t in self.data_leaves),
            tuple(self.axes),
            tuple(_Static(s) for s in self.statics),
            _ambient_key(),
        )


# NOTE [trace key]
# A trace is reused for a call whose key equals the traced call's, so the key holds everything
# that can change what the trace records: each tensor's shape, dtype, device type and strides
# (kernels and views differ by layout); every non-tensor argument by type, hash and equality
# (jax.jit's static arguments: a value that prints alike but differs, such as two numpy arrays
# that differ in the middle, must not share a trace, so unhashable values are refused); and the
# ambient state the function runs under: autocast per device type, grad mode, default dtype.
# Every rank must compute an equal key for the same inputs (`_check_same_signature` compares a
# digest of its repr): a meta tensor (another rank's parameter) is keyed as a tensor on the
# device it is traced on, the device *type* is keyed (cuda:0 and cuda:1 trace alike), and a
# static's repr drops object addresses.


def _tensor_key(t: torch.Tensor, device_type: str) -> tuple[Any, ...]:
    # a meta parameter (another rank's) traces like a real one on the data's device: same key
    dev = device_type if t.is_meta else t.device.type
    strides = tuple(st if n > 1 else 0 for st, n in zip(t.stride(), t.shape))  # size-1 dims: any
    return (tuple(t.shape), t.dtype, dev, strides)


def _ambient_key() -> tuple[Any, ...]:
    autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))
    return (autocast, torch.is_grad_enabled(), torch.get_default_dtype())


@dataclasses.dataclass(frozen=True, eq=False)
class _Static:
    """A non-tensor argument in a trace key: equal by type and value, hashed by value."""

    value: Any

    def __hash__(self) -> int:
        return hash((type(self.value), self.value))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Static) or type(self.value) is not type(other.value):
            return False
        return bool(self.value is other.value or self.value == other.value)

    def __repr__(self) -> str:  # the same on every rank: no object addresses
        return re.sub(r" at 0x[0-9a-fA-F]+", "", f"{type(self.value).__qualname__}:{self.value!r}")


@dataclasses.dataclass
class _Compiled:
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


class Pipelined:
    """A function cut into pipeline stages. Call it like the function it wraps."""

    def __init__(
        self,
        f: Callable[..., Any],
        *,
        stages: int | None,
        microbatches: int,
        schedule: str | Schedule | Callable[..., Schedule],
        in_axes: Any,
        out_axes: Any,
        mesh: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
        compile: bool | dict[str, Any] = False,
        partition: str = "estimate",
    ) -> None:
        self.f = f
        self.compile = compile
        self.partition = partition
        self.mesh = mesh
        self.timeout = timeout
        self._pg: PPGroup | None | bool = False  # False: not looked up yet
        self.stages = stages
        self.microbatches = microbatches
        self.schedule = schedule
        self.in_axes = in_axes
        self.out_axes = out_axes
        self._cache: dict[tuple[Any, ...], _Compiled] = {}
        self._measured: dict[tuple[Any, ...], list[float]] = {}  # see _measured_costs
        self._steps = 0
        self._busy = threading.Lock()  # one call at a time (see _guarded)
        functools.update_wrapper(self, f, updated=())

    @property
    def pg(self) -> PPGroup | None:
        """The pipeline process group (None when every stage runs in this process)."""
        if self._pg is False:
            self._pg = pp_group(self.mesh, self.timeout)
        return self._pg  # type: ignore[return-value]

    def _call_str(self) -> str:
        parts = [_fn_name(self.f)]
        if self.stages is not None:
            parts.append(f"stages={self.stages}")
        parts.append(f"microbatches={self.microbatches}")
        return f"pipeline({', '.join(parts)})"

    def __repr__(self) -> str:
        return self._call_str()

    # -- inputs ------------------------------------------------------------------------------
    def _flatten(self, params: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Inputs:
        call = self._call_str()
        p_leaves, p_spec = tree.flatten(params)
        for path_i, leaf in enumerate(p_leaves):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"{call}: leaf {path_i} of params is a {type(leaf).__name__}; params must be a "
                    "pytree of tensors (pass other values as later arguments)."
                )
        leaves, spec = tree.flatten((args, kwargs))
        arg_axes = tree.broadcast_prefix(self.in_axes, args)
        n_arg_leaves = len(arg_axes)
        data, axes, statics, is_tensor = [], [], [], []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                axis = arg_axes[i] if i < n_arg_leaves else 0
                if axis is not None and leaf.dim() == 0:
                    axis = None
                data.append(leaf)
                axes.append(axis)
                is_tensor.append(True)
            else:
                statics.append(leaf)
                is_tensor.append(False)
        _check_hashable(call, self.f, statics, spec, is_tensor)
        return _Inputs(p_leaves, p_spec, data, axes, statics, is_tensor, spec)

    def _split_data(self, inp: _Inputs) -> list[list[torch.Tensor]]:
        m = self.microbatches
        names = _leaf_names(self.f, inp.data_spec, inp.is_tensor)
        chunks = []
        for j, (t, axis) in enumerate(zip(inp.data_leaves, inp.axes)):
            if axis is None:
                chunks.append([t] * m)
                continue
            size = t.shape[axis]
            if size % m:
                good = [d for d in range(1, size + 1) if size % d == 0 and d <= m]
                raise ValueError(
                    f"{self._call_str()}: batch size {size} of argument {names[j]} (dim {axis}) is "
                    f"not divisible by microbatches={m}; use a batch that is a multiple of {m} or "
                    f"microbatches={good[-1]}."
                )
            chunks.append(list(torch.split(t, size // m, dim=axis)))
        return [[c[i] for c in chunks] for i in range(m)]

    def _rebuild(
        self, inp: _Inputs
    ) -> Callable[[list[torch.Tensor]], tuple[Any, tuple[Any, ...], dict[str, Any]]]:
        n_p = len(inp.param_leaves)

        def rebuild(leaves: list[torch.Tensor]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
            params = tree.unflatten(leaves[:n_p], inp.param_spec)
            data, statics = iter(leaves[n_p:]), iter(inp.statics)
            flat = [next(data) if t else next(statics) for t in inp.is_tensor]
            args, kwargs = tree.unflatten(flat, inp.data_spec)
            return params, args, kwargs

        return rebuild

    # -- compile: trace -> partition -> split -> schedule ---------------------------------------
    def _compile(
        self, inp: _Inputs, mb0: list[torch.Tensor], grad_of: tuple[int, ...] | None, has_aux: bool
    ) -> _Compiled:
        call = self._call_str()
        data_device = self._device(inp)
        mode, fakes = make_fakes([*inp.param_leaves, *mb0], data_device)
        wanting = _wanting_grad(fakes, inp, grad_of)
        fwd = trace_forward(call, self.f, self._rebuild(inp), wanting, len(inp.param_leaves), data_device)
        stage_costs = self._cut(fwd, [*inp.param_leaves, *mb0], data_device)
        reductions = self._reductions(fwd, inp)
        const_fakes = [trace_fake(mode, c, data_device) for c in fwd.consts]
        if grad_of is None:
            joint = _forward_as_joint(fwd)
            diff: list[int] = []
        else:
            diff = self._diff_positions(inp, grad_of, fwd, reductions, has_aux)
            with mode:  # the 1/M factor in the loss's precision (at least fp32): exact enough
                ct = torch.empty((), dtype=_cotangent_dtype(fwd), device=data_device)
            joint = trace_joint(call, fwd, [*fakes, *const_fakes, ct], diff, has_aux)
        staged = split(call, joint, self.stages)
        sched = self._schedule(staged.n_stages)
        staged = self._split_backward(staged, sched)
        if self.compile:
            opts = self.compile if isinstance(self.compile, dict) else {}
            for prog in staged.programs.values():
                prog.compile = opts
        pg = self.pg
        runner: Any = (
            LocalRunner(staged, sched) if pg is None else DistRunner(staged, sched, pg, self.timeout)
        )
        keys = _param_keys(inp)
        return _Compiled(
            staged, runner, fwd.consts, fwd.out_spec, reductions, diff, stage_costs, keys, fwd.sources
        )

    def _split_backward(self, staged: Staged, sched: Schedule) -> Staged:
        """Split B into I and W on the stages where the schedule uses I/W actions."""
        kinds: dict[int, set[str]] = {}
        for a in sched.actions():
            kinds.setdefault(a.stage, set()).add(a.kind)
        mixed = sorted(s for s, k in kinds.items() if "B" in k and k & {"I", "W"})
        if mixed:
            raise ValueError(
                f"{self._call_str()}: schedule {sched.name!r} uses both B and I/W actions on "
                f"stage(s) {mixed}; on each stage use either full backwards or the I/W split."
            )
        return split_backward(staged, [s for s, k in kinds.items() if k & {"I", "W"}])

    def _cut(self, fwd: Forward, mb0: list[torch.Tensor], device: torch.device) -> list[float] | None:
        has_markers = bool(fwd.gm.graph.find_nodes(op="call_function", target=BOUNDARY))
        stages = self.stages
        if stages is None and not has_markers and self.pg is not None:
            per = stages_per_rank(self.schedule) if isinstance(self.schedule, str) else 1
            stages = self.pg.size * per  # the schedule's stages per rank, chosen automatically
        if stages is None or stages == 1 and not has_markers:
            return None
        if has_markers:
            found = count_stages(fwd.gm.graph)
            if found != stages:
                raise ValueError(
                    f"{self._call_str()}: stages={stages} but the function's stage_boundary calls "
                    f"make {found} stages (the most boundaries on one path from the inputs); pass "
                    f"stages={found} (or stages=None to follow the boundaries), or remove the "
                    "stage_boundary calls to let fpipe choose the cuts."
                )
            return None
        measure = None
        if self.partition == "measure":
            measure = functools.partial(self._measured_costs, fwd, mb0, device)
        return auto_partition(self._call_str(), fwd, stages, measure)

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
                check_same_program(self._call_str(), self.pg, parts, self.timeout)
            seconds = measure_costs(fwd, mb0, device, self.pg, self.timeout)
            self._measured[key] = [seconds.get(n, 0.0) for n in nodes]
        return dict(zip(nodes, self._measured[key]))

    def _schedule(self, n_stages: int) -> Schedule:
        s = self.schedule
        if isinstance(s, Schedule):
            sched = s
        elif callable(s):
            sched = s(pp=n_stages, microbatches=self.microbatches)
        else:
            pp = self.pg.size if self.pg is not None else None
            sched = build(s, pp=pp, microbatches=self.microbatches, stages=n_stages)
        validate(sched)
        if self.pg is not None and sched.pp != self.pg.size:
            raise ValueError(
                f"{self._call_str()}: the schedule has {sched.pp} ranks but the pipeline group has "
                f"{self.pg.size}; launch with --nproc-per-node {sched.pp} or change the stages."
            )
        if sched.n_stages != n_stages or sched.n_microbatches != self.microbatches:
            raise ValueError(
                f"{self._call_str()}: the schedule covers {sched.n_stages} stages and "
                f"{sched.n_microbatches} microbatches but the program has {n_stages} stages and "
                f"microbatches={self.microbatches}; build the schedule for those numbers."
            )
        return sched

    def _reductions(self, fwd: Forward, inp: _Inputs) -> list[str | int]:
        """Per output: 'mean', 'sum' or a concatenation axis. A scalar output the user gave no
        reduction for is summed when its function sums the batch (NOTE [an honest reduction])."""
        outs = fwd.gm.graph.find_nodes(op="output")[0].args[0]
        dims = [o.meta["val"].dim() for o in outs]  # type: ignore[union-attr]
        if self.out_axes is None:
            return [self._scalar_reduction(fwd, inp, i) if d == 0 else 0 for i, d in enumerate(dims)]
        template = tree.unflatten(list(range(len(dims))), fwd.out_spec)
        given = tree.broadcast_prefix(self.out_axes, template)
        for r in given:
            if not (r in _REDUCTIONS or isinstance(r, int)):
                raise ValueError(
                    f"{self._call_str()}: out_axes entry {r!r} is not 'mean', 'sum' or an int "
                    "(the axis along which microbatch outputs are concatenated)."
                )
        return list(given)

    def _scalar_reduction(self, fwd: Forward, inp: _Inputs, i: int) -> str:
        axes = {fwd.n_params + j: a for j, a in enumerate(inp.axes) if a is not None}
        kind = batch_reduction(fwd.gm, axes, i) if self.microbatches > 1 else None
        if kind == "divided":  # a count (a mean) or a constant (a sum)? trace at twice the batch
            again = self._trace_at_twice_the_batch(inp)
            kind = "mean" if again is None else batch_reduction(again.gm, axes, i)
        if kind == "mixed":
            warnings.warn(
                f"{self._call_str()}: output {i} adds a sum over the batch to a term that is not "
                "summed over the batch (a constant, or a mean); no combination of the "
                f"{self.microbatches} microbatch values reproduces the unsplit function, so fpipe "
                "averages them. Pass out_axes='sum' to add them instead, or make the loss a mean "
                "(or a sum) throughout.",
                stacklevel=5,
            )
        return "sum" if kind == "sum" else "mean"

    def _trace_at_twice_the_batch(self, inp: _Inputs) -> Forward | None:
        """The forward graph at microbatches twice as large (fake tensors: no memory), or None
        if the function does not trace at that size."""
        m = self.microbatches
        shapes = [list(t.shape) for t in inp.data_leaves]
        for shape, axis in zip(shapes, inp.axes):
            if axis is not None:
                shape[axis] = 2 * shape[axis] // m
        mode, fakes = make_fakes(inp.param_leaves, self._device(inp))
        with mode:
            fakes += [
                torch.empty(s, dtype=t.dtype, device=self._device(inp))
                for s, t in zip(shapes, inp.data_leaves)
            ]
        try:
            return trace_forward(self._call_str(), self.f, self._rebuild(inp), fakes, len(inp.param_leaves))
        except Exception:
            return None

    def _diff_positions(
        self, inp: _Inputs, argnums: tuple[int, ...], fwd: Forward, reductions: list[str | int], has_aux: bool
    ) -> list[int]:
        call = f"value_and_grad({self._call_str()})"
        outs = fwd.gm.graph.find_nodes(op="output")[0].args[0]
        loss = outs[0].meta["val"]  # type: ignore[index, union-attr]
        if loss.dim() != 0 or (not has_aux and len(outs) != 1):  # type: ignore[arg-type]
            what = f"a tensor of shape {tuple(loss.shape)}" if len(outs) == 1 else f"{len(outs)} tensors"  # type: ignore[arg-type]
            raise ValueError(
                f"{call}: the function must return a scalar loss{' and an aux value' if has_aux else ''}, "
                f"but returns {what}; reduce it to a scalar, or pass has_aux=True and return (loss, aux)."
            )
        if reductions[0] not in _REDUCTIONS:
            raise ValueError(
                f"{call}: the loss must be reduced over microbatches by 'mean' or 'sum', not {reductions[0]!r}."
            )
        return _argnum_positions(call, inp, argnums)

    # -- call --------------------------------------------------------------------------------
    def _get(
        self,
        params: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        grad_of: tuple[int, ...] | None,
        has_aux: bool,
    ) -> tuple[_Inputs, list[list[torch.Tensor]], _Compiled]:
        self._begin_call()
        inp = self._flatten(params, args, kwargs)
        mbs = self._split_data(inp)
        key = (inp.key(self._device(inp).type), grad_of, has_aux)
        if self.pg is not None:
            self._check_same_signature(key, inp)
        compiled = self._cache.get(key)
        if compiled is None:
            # Trace outside any active torch.func transform (grad(piped), vmap(piped)): the
            # program is a function of its inputs, whatever transform later runs it.
            with temporarily_clear_interpreter_stack():
                compiled = self._compile(inp, mbs[0], grad_of, has_aux)
            if self.pg is not None:  # before any transfer: the ranks must agree on what to send
                parts = fingerprint(compiled.staged, compiled.runner.schedule)
                check_same_program(self._call_str(), self.pg, parts, self.timeout)
            self._cache[key] = compiled
        return inp, mbs, compiled

    def _begin_call(self) -> None:
        """In a group, before anything in this call can fail: name the pipeline's store keys
        (first call), and start a new generation of failure reports -- a report written during
        this call is read during this call, one from an earlier call (caught) is never read."""
        if self.pg is not None:
            self.pg.name_at_first_call()
            self.pg.generation += 1

    def _check_same_signature(self, key: tuple[Any, ...], inp: _Inputs) -> None:
        """Every rank must run the same program: compare the input signatures (one all-gather of
        a hash per call) so different shapes on two ranks fail loudly instead of corrupting."""
        pg = self.pg
        assert pg is not None
        every = gather_digests(
            pg, [digest(repr(key))], self.timeout, "comparing input signatures before the step"
        )
        differ = odd_ranks([v[0] for v in every])
        if differ is not None:
            raise ValueError(
                f"{self._call_str()}: ranks {differ[0]} were called with inputs whose shapes, dtypes "
                f"or structure differ from ranks {differ[1]}; every pipeline "
                "rank must pass inputs of the same signature (a rank that does not use an input may "
                "pass a meta tensor of the same shape). This rank's data shapes: "
                f"{[tuple(t.shape) for t in inp.data_leaves]}."
            )

    def _execute(
        self, inp: _Inputs, mbs: list[list[torch.Tensor]], c: _Compiled, ct: float | None
    ) -> Results:
        st = c.staged
        self._check_local_params(inp, c)
        glob = dict(zip(st.param_inputs, inp.param_leaves))
        glob.update(zip(st.const_inputs, _current_consts(self._call_str(), c)))
        if ct is not None:
            glob[st.ct_input] = torch.tensor(ct, dtype=st.meta[st.ct_input][1], device=self._device(inp))
        data = [dict(zip(st.data_inputs, mb)) for mb in mbs]
        self._steps += 1
        set_step(torch.initial_seed(), self._steps)
        summed = frozenset(c.staged.n_outs + j for j, pos in enumerate(c.diff) if _axis_of(inp, pos) is None)
        # value_and_grad computes its gradients explicitly (the joint programs): recording
        # autograd history as well, for inputs that require grad, would keep every program's
        # intermediates alive for the whole step. Under a torch.func transform, the transform
        # decides.
        explicit = ct is not None and torch._C._functorch.peek_interpreter_stack() is None
        with torch.no_grad() if explicit else contextlib.nullcontext():
            results = c.runner.run(glob, data, summed)
        self._last = c
        trace = os.environ.get("FPIPE_TRACE")
        if trace:
            c.runner.timeline.write(f"{trace}.rank{self.pg.rank if self.pg else 0}.json")
        return results

    def _check_local_params(self, inp: _Inputs, c: _Compiled) -> None:
        if c.local_params is None:
            c.local_params = sorted(self._local_inputs(c, c.staged.param_inputs))
        meta = [i for i in c.local_params if inp.param_leaves[i].is_meta]
        if meta:
            names = [str(c.param_keys[i]) if c.param_keys else f"leaf {i}" for i in meta[:4]]
            raise ValueError(
                f"{self._call_str()}: parameter(s) {names} are on the meta device, but this rank's "
                "stages use them. Pass the dict that piped.materialize(...) returned (the one from "
                "functionalize still holds the meta tensors), or real tensors."
            )

    @property
    def timeline(self) -> Timeline | None:
        """The last step's executed actions with timestamps (`.chrome()` gives trace JSON; set
        FPIPE_TRACE=prefix to write `prefix.rankR.json` after every step)."""
        last = getattr(self, "_last", None)
        return last.runner.timeline if last is not None else None

    def _device(self, inp: _Inputs) -> torch.device:
        if self.pg is not None:
            return self.pg.device
        real = [t for t in [*inp.data_leaves, *inp.param_leaves] if not t.is_meta]
        return real[0].device if real else torch.device("cpu")

    def __call__(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        return self._guarded(self._forward, params, args, kwargs)

    # -- stage-sharded parameters --------------------------------------------------------------
    def materialize(
        self,
        module: torch.nn.Module,
        *args: Any,
        state_dict: dict[str, torch.Tensor] | None = None,
        init: Callable[[torch.nn.Module], None] | None = None,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        """Allocate and initialise this rank's parameters of a module built on the meta device.

        Traces the pipeline with example inputs `args`/`kwargs` (real or meta tensors of the
        shapes the step will use) and the module's parameters as `functionalize` names them,
        then materialises only what this rank's stages read, initialised by the owning
        modules' `reset_parameters()`, by `init(submodule)` (called on each submodule that owns
        a materialised parameter, like `module.apply(init)`), or copied from `state_dict`.
        Each submodule draws from a generator seeded by (`torch.initial_seed()`, its name), so
        a module two ranks hold (a tied embedding) is initialised alike on both.

        Returns:
            The params dict to pass to the pipeline: this rank's entries are real tensors on
            this rank's device; the rest stay on the meta device (no memory). Build the
            optimizer over the real ones: `{k: v for k, v in params.items() if not v.is_meta}`.
        """
        from .materialize import materialize_module, remap

        params = {n: p.detach() for n, p in module.named_parameters()}
        inp, _, c = self._get(params, args, kwargs, None, False)
        local = self._local_inputs(c, c.staged.param_inputs)
        names = [k for i, k in enumerate(c.param_keys) if i in local]
        const_local = self._local_inputs(c, c.staged.const_inputs)
        buffers = [b for i, b in enumerate(c.consts) if i in const_local]
        dev = (
            torch.device(device)
            if device is not None
            else (self.pg.device if self.pg else torch.device("cpu"))
        )
        replaced = materialize_module(module, set(names), buffers, dev, state_dict, init)
        for compiled in self._cache.values():
            compiled.consts[:] = remap(compiled.consts, replaced)
        return {n: p.detach() for n, p in module.named_parameters()}

    @staticmethod
    def local(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's entries of a params dict (those not on the meta device): what to give the
        optimizer."""
        return {k: v for k, v in params.items() if not v.is_meta}

    @property
    def local_stages(self) -> list[int]:
        """The stages this rank runs (all of them in one process), from the last call."""
        last = getattr(self, "_last", None) or next(iter(self._cache.values()), None)
        if last is None:
            return []
        rank = self.pg.rank if self.pg is not None else None
        stage_rank = last.runner.schedule.stage_rank
        return [s for s, r in enumerate(stage_rank) if rank is None or r == rank]

    def _local_inputs(self, c: _Compiled, names: list[str]) -> set[int]:
        """Positions of the inputs in `names` that this rank's programs read."""
        if self.pg is None:
            return set(range(len(names)))
        mine = self.pg.rank
        return {
            i
            for i, n in enumerate(names)
            if any(c.runner.rank_of(p) == mine for p in c.staged.consumers.get(n, []))
        }

    def param_owner(self) -> dict[str, int]:
        """For a params dict: the lowest pipeline rank that uses each parameter (from the last
        compiled program); a parameter several ranks share is counted by its owner alone."""
        out: dict[str, int] = {}
        for c in self._cache.values():
            keys = c.param_keys
            for i, name in enumerate(c.staged.param_inputs):
                ranks = [c.runner.rank_of(p) for p in c.staged.consumers.get(name, [])]
                if ranks and i < len(keys):
                    out[keys[i]] = min(ranks)
        return out

    def _forward(self, params: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        inp, mbs, c = self._get(params, args, kwargs, None, False)
        results = self._execute(inp, mbs, c, None)
        outs = self._values(c, results.per_mb)
        return tree.unflatten(outs, c.out_spec)

    def value_and_grad(
        self,
        argnums: int | tuple[int, ...],
        has_aux: bool,
        params: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        return self._guarded(self._value_and_grad, params, args, kwargs, argnums, has_aux)

    def _value_and_grad(
        self,
        params: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        argnums: int | tuple[int, ...],
        has_aux: bool,
    ) -> Any:
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        inp, mbs, c = self._get(params, args, kwargs, nums, has_aux)
        ct = 1.0 / self.microbatches if c.reductions[0] == "mean" else 1.0
        results = self._execute(inp, mbs, c, ct)
        value = tree.unflatten(self._values(c, results.per_mb), c.out_spec)
        grads = self._gather_grads(inp, c, results, nums)
        return value, (grads[0] if isinstance(argnums, int) else tuple(grads))

    def _guarded(
        self, fn: Callable[..., Any], params: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *rest: Any
    ) -> Any:
        """Run `fn`, one call at a time; in a process group, a failure here is reported so
        every rank stops."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"{self._call_str()}: called while another call of the same pipeline is running "
                "(from another thread); a pipeline runs one call at a time (its ranks match "
                "transfers by order). Call it from one thread at a time."
            )
        try:
            return fn(params, args, kwargs, *rest)
        except (PeerFailure, TimeoutError):
            raise
        except BaseException as err:
            pg = self.pg
            if pg is not None:
                pg.report_failure(f"rank {pg.rank} failed: {type(err).__name__}: {err}")
            raise
        finally:
            self._busy.release()

    def _values(self, c: _Compiled, results: list[list[Any]]) -> list[torch.Tensor]:
        """Reduce each value output over microbatches; in a group, broadcast it from its rank."""
        n = c.staged.n_outs
        pg = self.pg
        if pg is None:
            return _reduce([r[:n] for r in results], c.reductions)
        out = []
        for i in range(n):
            src = c.runner.rank_of(c.staged.producer[c.staged.out_names[i]])
            if src == pg.rank:
                val = _reduce([[r[i]] for r in results], [c.reductions[i]])[0].contiguous()
            else:
                val = torch.empty(
                    _reduced_shape(c, i, self.microbatches),
                    dtype=c.staged.meta[c.staged.out_names[i]][1],
                    device=pg.device,
                )
            work = dist.broadcast(val, pg.global_rank(src), group=pg.group, async_op=True)
            pg.wait_all([work], self.timeout, functools.partial(str, f"receiving output {i} from rank {src}"))
            out.append(val)
        return out

    def _gather_grads(self, inp: _Inputs, c: _Compiled, results: Results, nums: tuple[int, ...]) -> list[Any]:
        flat: dict[int, Any] = {pos: self._grad_of(inp, c, results, j, pos) for j, pos in enumerate(c.diff)}
        return [
            _rebuild_grad_tree(inp, num, [flat[p] for p in _positions_of_argnum(inp, num)]) for num in nums
        ]

    def _grad_of(self, inp: _Inputs, c: _Compiled, results: Results, j: int, pos: int) -> torch.Tensor | None:
        """One input's gradient over all microbatches: summed as the step ran (parameters, and
        arguments passed whole), or concatenated (split arguments). In a group: a parameter's
        gradient is returned on the ranks that use it (broadcast when several do, e.g. a tied
        embedding); a data argument's gradient on every rank."""
        axis = _axis_of(inp, pos)
        st, pg = c.staged, self.pg
        i = st.n_outs + j
        local = pg is None or c.runner.rank_of(st.producer[st.out_names[i]]) == pg.rank
        g = None
        if local:
            g = results.sums.get(i) if axis is None else torch.cat([r[i] for r in results.per_mb], dim=axis)
        if pg is None:
            return g
        name = st.out_names[i]
        src = c.runner.rank_of(st.producer[name])
        users = {c.runner.rank_of(p) for p in st.consumers.get((st.param_inputs + st.data_inputs)[pos], [])}
        is_param = pos < len(inp.param_leaves)
        if is_param and len(users | {src}) == 1:
            return g
        if g is None:
            shape, dtype = st.meta[name]
            if axis is not None:
                shape = torch.Size([d * self.microbatches if k == axis else d for k, d in enumerate(shape)])
            g = torch.empty(shape, dtype=dtype, device=pg.device)
        g = g.contiguous()
        work = dist.broadcast(g, pg.global_rank(src), group=pg.group, async_op=True)
        pg.wait_all([work], self.timeout, lambda: f"receiving a gradient from rank {src}")
        return g if (not is_param or pg.rank in users) else None


def _cotangent_dtype(fwd: Forward) -> torch.dtype:
    """The loss's dtype, at least fp32: 1/M in bf16 is off by up to 0.4 %, a bias in every gradient."""
    loss = fwd.gm.graph.find_nodes(op="output")[0].args[0][0].meta["val"]  # type: ignore[index, union-attr]
    return torch.promote_types(loss.dtype, torch.float32)


def _current_consts(call: str, c: _Compiled) -> list[torch.Tensor]:
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


def _shapes(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), str(val.dtype))
    if isinstance(val, (tuple, list)):
        return tuple(_shapes(v) for v in val)
    return None


def _wanting_grad(
    fakes: list[torch.Tensor], inp: _Inputs, grad_of: tuple[int, ...] | None
) -> list[torch.Tensor]:
    """The forward trace sees the inputs to be differentiated as requiring grad, as eager would:
    kernels are chosen by that (attention with a learned mask must take the differentiable path),
    and the trace finds the custom autograd.Functions a gradient would pass through by them
    (NOTE [custom autograd.Function] in trace.py). A plain call traces like `value_and_grad`'s
    default (argnums=0: the params): `materialize` and the step then trace the same operations,
    and `torch.func.grad(piped)` differentiates a program that was checked."""
    wanted = {p for num in (grad_of or (0,)) for p in _positions_of_argnum(inp, num)}
    return [
        f.detach().requires_grad_(True) if i in wanted and (f.is_floating_point() or f.is_complex()) else f
        for i, f in enumerate(fakes)
    ]


def _axis_of(inp: _Inputs, pos: int) -> int | None:
    """The microbatch split axis of flat input `pos` (None for parameters and whole arguments)."""
    n_p = len(inp.param_leaves)
    return None if pos < n_p else inp.axes[pos - n_p]


def _param_keys(inp: _Inputs) -> list[Any]:
    """For a params dict: the key of each flat parameter leaf, in leaf order (else [])."""
    positions = tree.unflatten(list(range(len(inp.param_leaves))), inp.param_spec)
    if not isinstance(positions, dict):
        return []
    keys: list[Any] = [None] * len(positions)
    for k, i in positions.items():
        keys[i] = k
    return keys


def _reduced_shape(c: _Compiled, i: int, m: int) -> torch.Size:
    shape, _ = c.staged.meta[c.staged.out_names[i]]
    r = c.reductions[i]
    if isinstance(r, int):
        return torch.Size([d * m if k == r else d for k, d in enumerate(shape)])
    return shape


def trace_fake(mode: Any, t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    from .trace import fake_like

    return fake_like(mode, t, device)


def _sum(gs: list[torch.Tensor]) -> torch.Tensor:
    acc = gs[0]
    for g in gs[1:]:
        acc = acc + g
    return acc


def _reduce(per_mb: list[list[torch.Tensor]], reductions: Sequence[str | int]) -> list[torch.Tensor]:
    out = []
    for i, r in enumerate(reductions):
        vals = [mb[i] for mb in per_mb]
        if r == "mean":
            out.append(_sum(vals) / len(vals))
        elif r == "sum":
            out.append(_sum(vals))
        else:
            out.append(torch.cat(vals, dim=int(r)))
    return out


def _check_hashable(
    call: str, f: Callable[..., Any], statics: list[Any], spec: Any, is_tensor: list[bool]
) -> None:
    """Non-tensor arguments key the trace by hash and equality (NOTE [trace key])."""
    for i, s in enumerate(statics):
        try:
            hash(s)
        except TypeError:
            name = _leaf_names(f, spec, [not t for t in is_tensor])[i]
            raise TypeError(
                f"{call}: argument {name} is a {type(s).__name__}, which is not hashable; fpipe "
                "traces the function once per input signature and keys it by the value of every "
                "non-tensor argument (like jax.jit's static arguments), so those must be hashable. "
                "Pass it as a tensor (torch.as_tensor(...); it is then an input of the program) or "
                "as a tuple of hashable values."
            ) from None


def _leaf_names(f: Callable[..., Any], spec: Any, is_tensor: list[bool]) -> list[str]:
    """Readable names of the tensor leaves of (args, kwargs): 'tokens', "batch['ids']", 'mask'."""
    import torch.utils._pytree as py

    try:
        params = list(inspect.signature(f).parameters.values())[1:]
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        positional = []
    template = tree.unflatten(list(range(len(is_tensor))), spec)
    paths, _ = py.tree_flatten_with_path(template)
    names = []
    for (path, _), t in zip(paths, is_tensor):
        if not t:
            continue
        head, rest = path[1], "".join(str(k) for k in path[2:])
        if path[0].idx == 1:  # type: ignore[attr-defined]
            root = str(head.key)  # type: ignore[attr-defined]
        else:
            i = head.idx  # type: ignore[attr-defined]
            root = positional[i] if i < len(positional) else f"args[{i}]"
        names.append(f"'{root}{rest}'")
    return names


def _positions_of_argnum(inp: _Inputs, num: int) -> list[int]:
    n_p = len(inp.param_leaves)
    if num == 0:
        return list(range(n_p))
    args_template = tree.unflatten(list(range(len(inp.is_tensor))), inp.data_spec)[0]
    if num - 1 >= len(args_template):
        return []
    arg_leaf_ids, _ = tree.flatten(args_template[num - 1])
    tensor_rank = {leaf: k for k, leaf in enumerate(i for i, t in enumerate(inp.is_tensor) if t)}
    return [n_p + tensor_rank[i] for i in arg_leaf_ids if i in tensor_rank]


def _argnum_positions(call: str, inp: _Inputs, argnums: tuple[int, ...]) -> list[int]:
    n_args = len(tree.unflatten(list(range(len(inp.is_tensor))), inp.data_spec)[0])
    out: list[int] = []
    for num in argnums:
        if not 0 <= num <= n_args:
            raise ValueError(
                f"{call}: argnums={num} is out of range for a call with {n_args + 1} positional arguments."
            )
        positions = _positions_of_argnum(inp, num)
        leaves = inp.param_leaves + inp.data_leaves
        for p in positions:
            if not leaves[p].is_floating_point() and not leaves[p].is_complex():
                raise ValueError(
                    f"{call}: argnums={num} asks for the gradient of a {leaves[p].dtype} tensor; "
                    "only floating-point inputs have gradients."
                )
        out.extend(positions)
    return out


def _rebuild_grad_tree(inp: _Inputs, num: int, grads: list[torch.Tensor]) -> Any:
    if num == 0:
        out = tree.unflatten(grads, inp.param_spec)
        return {k: v for k, v in out.items() if v is not None} if isinstance(out, dict) else out
    args_template = tree.unflatten(list(range(len(inp.is_tensor))), inp.data_spec)[0]
    leaf_ids, spec = tree.flatten(args_template[num - 1])
    it = iter(grads)
    return tree.unflatten([next(it) if inp.is_tensor[i] else None for i in leaf_ids], spec)


def _forward_as_joint(fwd: Forward) -> Joint:
    """The forward graph with an (unused) cotangent input, so `split` treats both alike."""
    gm = fwd.gm
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last):
        gm.graph.placeholder("ct")
    gm.recompile()
    n_outs = len(gm.graph.find_nodes(op="output")[0].args[0])
    return Joint(gm, fwd.n_params, fwd.n_data, len(fwd.consts), n_outs, [])


def pipeline(
    f: Callable[..., Any],
    *,
    stages: int | None = None,
    microbatches: int = 1,
    schedule: str | Schedule | Callable[..., Schedule] = "1f1b",
    in_axes: Any = 0,
    out_axes: Any = None,
    mesh: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
    compile: bool | dict[str, Any] = False,
    partition: str = "estimate",
) -> Pipelined:
    """Cut `f` into pipeline stages and run it over microbatches.

    Args:
        f: a pure function `f(params, *args, **kwargs)`; `params` is a pytree of tensors.
        stages: number of stages. None: one more than the number of `stage_boundary` calls in
            `f`. N with no boundaries in `f`: fpipe chooses N balanced stages.
        microbatches: number of equal chunks each tensor argument is split into.
        schedule: a registered schedule name (`fpipe.schedules.names()`), a `Schedule`, or a
            function `(pp=, microbatches=) -> Schedule`.
        in_axes: the axis along which each positional argument after `params` is split
            (a prefix pytree of ints or None = passed whole to every microbatch). Keyword
            tensors are split along dim 0; 0-dim tensors are never split.
        out_axes: how each output is combined over microbatches: 'mean', 'sum' or an int axis to
            concatenate along (a prefix pytree). Default: 'mean' for scalars, 0 otherwise.
        mesh: a DeviceMesh with a "pp" dimension; by default, under torchrun, all ranks form one
            pipeline (the process group is initialised from torchrun's environment if needed:
            NCCL with CUDA, gloo otherwise). Stage s runs on pipeline rank
            `schedule.stage_rank[s]`. Without a process group every stage runs in this process.
        timeout: seconds a rank waits for a peer before failing with an error naming the peer
            and the action it waited on (a peer that is alive but stopped or stuck). A peer
            that crashes or is killed ends the others at once (its connections close; they wait
            up to 2 s for its own report of why, then name it): no timeout is involved.
        compile: compile every stage program with `torch.compile` (True, or a dict of its
            keyword arguments) at its first run. Off by default: on the benchmark GPT it took
            40-50 s at the first call on a 2-core CPU and the programs ran no faster there or
            on one H200 (see docs/BENCHMARKS.md); try it on your model and device.
        partition: how `stages=N` cuts a function without boundaries: "estimate" (default;
            a static cost model, deterministic, needs no real tensors) or "measure" (each
            operation's forward + backward timed on the device at one microbatch's shapes,
            averaged over the pipeline ranks; costs a forward-backward's time or so at the
            first call, and balances what the estimate misjudges, such as attention on CPU).

    Returns:
        A `Pipelined` callable with `f`'s signature; use it under `fpipe.value_and_grad`,
        `fpipe.grad`, or torch.func transforms.

    Raises:
        ValueError: unknown schedule or bad microbatches (at once); bad inputs (on call).

    Example:
        >>> import torch, fpipe
        >>> def f(w, x):
        ...     h = fpipe.stage_boundary(torch.tanh(x @ w))
        ...     return (h @ w).pow(2).mean()
        >>> w, x = torch.randn(4, 4), torch.randn(8, 4)
        >>> piped = fpipe.pipeline(f, microbatches=4)
        >>> loss, g = fpipe.value_and_grad(piped)(w, x)
        >>> torch.allclose(g, torch.func.grad(f)(w, x), atol=1e-6)
        True
    """
    call = f"pipeline({_fn_name(f)}, microbatches={microbatches})"
    if isinstance(schedule, str) and schedule not in names():
        raise ValueError(
            f"{call.rstrip(')')}, schedule={schedule!r}): unknown schedule; known schedules are {names()}."
        )
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"{call}: microbatches must be a positive int, got {microbatches!r}.")
    if partition not in ("estimate", "measure"):
        raise ValueError(
            f"{call.rstrip(')')}, partition={partition!r}): partition must be 'estimate' (a static "
            "cost model) or 'measure' (time each operation on the device)."
        )
    if stages is not None and (not isinstance(stages, int) or stages < 1):
        raise ValueError(
            f"pipeline({_fn_name(f)}, stages={stages!r}): stages must be a positive int or None."
        )
    return Pipelined(
        f, stages=stages, microbatches=microbatches, schedule=schedule, in_axes=in_axes, out_axes=out_axes,
        mesh=mesh, timeout=timeout, compile=compile, partition=partition,
    )  # fmt: skip


def value_and_grad(
    piped: Pipelined, argnums: int | tuple[int, ...] = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """`torch.func.grad_and_value`'s meaning, computed by the pipeline schedule, value first.

    Returns a function `(params, *args, **kwargs) -> (value, grads)`; with `has_aux=True`, `f`
    returns `(loss, aux)` and value is `(loss, aux)`. `grads` mirrors `argnums` (an int gives
    one pytree, a tuple gives a tuple). Per microbatch each stage runs one forward and one
    backward action; gradients are accumulated over microbatches.

    Example:
        >>> import torch, fpipe
        >>> piped = fpipe.pipeline(lambda w, x: (x @ w).sum(), microbatches=2, out_axes="sum")
        >>> loss, g = fpipe.value_and_grad(piped)(torch.ones(3), torch.ones(4, 3))
        >>> g
        tensor([4., 4., 4.])
    """
    if not isinstance(piped, Pipelined):
        raise TypeError(
            f"value_and_grad(piped): expected the result of fpipe.pipeline, got {type(piped).__name__}."
        )

    @functools.wraps(piped)
    def vg(params: Any, *args: Any, **kwargs: Any) -> Any:
        return piped.value_and_grad(argnums, has_aux, params, args, kwargs)

    return vg


def grad(piped: Pipelined, argnums: int | tuple[int, ...] = 0, has_aux: bool = False) -> Callable[..., Any]:
    """Like `value_and_grad`, returning only the gradients (with `has_aux`, `(grads, aux)`)."""
    vg = value_and_grad(piped, argnums, has_aux)

    @functools.wraps(piped)
    def g(*args: Any, **kwargs: Any) -> Any:
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return g
