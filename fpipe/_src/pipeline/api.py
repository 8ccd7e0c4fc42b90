"""The public transforms: `pipeline`, `value_and_grad`, `grad`, and `Pipelined`, their result.

`Pipelined` is a facade over the data path (docs/ARCHITECTURE.md): `inputs` flattens and splits
a call's arguments, `compiler` turns their signature into a plan (trace -> partition -> split ->
schedule -> runner, cached), `execute` runs one step of it, `outputs` reduces what comes back.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeAlias

import torch

from ..memory import MemoryReport, predict_plan
from ..parallel import Groups, mesh_groups
from ..runtime import DEFAULT_TIMEOUT, PeerFailure, PPGroup, Precision, Results, Timeline, cast_inputs
from ..schedules import Schedule
from ..tracing import tree
from . import execute as execute_
from . import inputs as inputs_
from . import outputs, transforms
from .compiler import Compiled, Compiler
from .config import Config

__all__ = ["pipeline", "Pipelined"]

Args: TypeAlias = tuple[Any, ...]
Kwargs: TypeAlias = dict[str, Any]
Argnums: TypeAlias = int | tuple[int, ...]


class Pipelined:
    """A function cut into pipeline stages. Call it like the function it wraps."""

    def __init__(self, f: Callable[..., Any], **settings: Any) -> None:
        self.cfg = Config(f, **settings)
        self._steps = 0
        self._last: Compiled | None = None
        self._busy = threading.Lock()  # one call at a time (see _guarded)
        functools.update_wrapper(self, f, updated=())

    @property
    def pg(self) -> PPGroup | None:
        """The pipeline process group (None when every stage runs in this process)."""
        return self._groups.pp

    @property
    def dp(self) -> PPGroup | None:
        """The data-parallel group: the mesh's "dp" dimension (None without replicas)."""
        return self._groups.dp

    @functools.cached_property
    def _groups(self) -> Groups:  # looked up at the first use (may start the process group)
        return mesh_groups(self.cfg.mesh, self.cfg.timeout)

    @functools.cached_property
    def _compiler(self) -> Compiler:
        g = self._groups
        return Compiler(self.cfg, self.pg, self.dp, g.dp_mesh, g.tp, g.tp_mesh)

    @property
    def _cache(self) -> dict[Any, Compiled]:  # the compiled plans, by input signature
        return self._compiler.cache

    def __repr__(self) -> str:
        return self.cfg.call

    def __call__(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        return self._guarded(transforms.lifted_call(self) or self._forward, params, args, kwargs)

    def value_and_grad(self, argnums: Argnums, has_aux: bool, params: Any, args: Args, kwargs: Kwargs) -> Any:
        fn = transforms.lifted_call(self) or self._value_and_grad  # NOTE [transforms in a group]
        return self._guarded(fn, params, args, kwargs, argnums, has_aux)

    def _get(
        self, params: Any, args: Args, kwargs: Kwargs, grad_of: tuple[int, ...] | None, has_aux: bool | None
    ) -> tuple[inputs_.Inputs, list[list[torch.Tensor]], Compiled]:
        """The call's inputs, split into microbatches, and the plan for their signature."""
        (g := self._groups).begin_call()
        inputs_.refuse_transforms_in_a_group(self.cfg.call, g.pp or g.dp or g.tp)
        inp = inputs_.localize(self.cfg.call, inputs_.flatten(self.cfg, params, args, kwargs), g.tp_mesh)
        inp = cast_inputs(self.cfg.precision, inp)  # once per step (precision.py)
        mbs = inputs_.split(self.cfg, inp, self._groups.replicas)
        return inp, mbs, self._compiler.get(inp, mbs[0], grad_of, has_aux)

    def _run(
        self, inp: inputs_.Inputs, mbs: list[list[torch.Tensor]], c: Compiled, ct: float | None
    ) -> Results:
        self._steps += 1
        results = execute_.execute(self.cfg, self.pg, self.dp, inp, mbs, c, ct, self._steps)
        self._last = c
        return results

    def _forward(self, params: Any, args: Args, kwargs: Kwargs) -> Any:
        inp, mbs, c = self._get(params, args, kwargs, None, False)
        vals = self._values(c, self._run(inp, mbs, c, None))
        if self._groups.each():
            vals = outputs.refuse_backward(vals, inp)
        return tree.unflatten(vals, c.out_spec)

    def _value_and_grad(
        self, params: Any, args: Args, kwargs: Kwargs, argnums: Argnums, has_aux: bool
    ) -> Any:
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        inp, mbs, c = self._get(params, args, kwargs, nums, has_aux)
        results = self._run(inp, mbs, c, outputs.cotangent(c, self.cfg.microbatches * self._groups.replicas))
        value = tree.unflatten(self._values(c, results), c.out_spec)
        grads = outputs.grads(self.pg, inp, c, results, nums, self.cfg.timeout)
        return value, (grads[0] if isinstance(argnums, int) else tuple(grads))

    def _values(self, c: Compiled, results: Results) -> list[torch.Tensor]:
        return outputs.values(self.pg, self.dp, c, results.per_mb, self.cfg.microbatches, self.cfg.timeout)

    def _guarded(self, fn: Callable[..., Any], params: Any, args: Args, kwargs: Kwargs, *rest: Any) -> Any:
        """Run `fn`, one call at a time; in a process group, a failure is reported to every rank."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"{self.cfg.call}: called while another call of the same pipeline is running "
                "(from another thread); a pipeline runs one call at a time (its ranks match "
                "transfers by order). Call it from one thread at a time."
            )
        try:
            for check in execute_.BEFORE_CALLS:  # e.g. an async_save that failed: said before anything runs
                check(self.cfg.call)
            return fn(params, args, kwargs, *rest)
        except (PeerFailure, TimeoutError) as err:
            if "_groups" in self.__dict__:
                self._groups.forward_failure(err)
            raise
        except BaseException as err:
            if "_groups" in self.__dict__:  # (a mesh refused at lookup has no groups to tell)
                self._groups.report_failure(err)
            raise
        finally:
            self._busy.release()

    def memory(self, params: Any, *args: Any, **kwargs: Any) -> int:
        """This rank's predicted peak working memory in bytes for `fpipe.value_and_grad(self)(params,
        *args, **kwargs)` (with `has_aux=True` for a function returning `(loss, aux)`), from the
        traced programs and the schedule, before running anything."""
        return self.memory_report(params, *args, **kwargs).peak

    def memory_report(self, params: Any, *args: Any, **kwargs: Any) -> MemoryReport:
        """`memory` with a per-stage breakdown (`.table()`): NOTE [predicting memory] in memory.py."""
        return self._guarded(self._memory, params, args, kwargs)

    def _memory(self, params: Any, args: Args, kwargs: Kwargs) -> MemoryReport:
        inp, _, c = self._get(params, args, kwargs, (0,), None)  # None: aux or not, as f returns
        return predict_plan(c, inp, self.cfg.microbatches, self.cfg.precision)

    # -- what this rank holds -------------------------------------------------------------------
    @property
    def timeline(self) -> Timeline | None:
        """The last step's actions with timestamps (`.chrome()`: trace JSON; FPIPE_TRACE=prefix
        writes `prefix.rankR.json` each step)."""
        return self._last.runner.timeline if self._last is not None else None

    @property
    def local_stages(self) -> list[int]:
        """The stages this rank runs (all of them in one process), from the last call."""
        return outputs.local_stages(self.pg, self._last or next(iter(self._cache.values()), None))

    def param_owner(self) -> dict[str, int]:
        """For a params dict: the lowest pipeline rank that uses each parameter (from the last
        compiled program); a parameter several ranks share is counted by its owner alone."""
        return outputs.param_owner(self._cache)

    @staticmethod
    def local(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's entries of a params dict (not on the meta device): for the optimizer."""
        return {k: v for k, v in params.items() if not v.is_meta}

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
        from .materialize import materialize_plan

        params = {n: p.detach() for n, p in module.named_parameters()}
        _, _, c = self._get(params, args, kwargs, None, False)
        dev = self.pg.device if self.pg else torch.device("cpu")
        dev = torch.device(device) if device is not None else dev
        return materialize_plan(module, self.pg, c, self._cache.values(), dev, state_dict, init)


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
    cuts: Any = None,
    plan: Any = None,
    memory_limit: int | None = None,
    precision: Precision | None = None,
) -> Pipelined:
    """Cut `f` into pipeline stages and run it over microbatches.

    Args:
        f: a pure function `f(params, *args, **kwargs)`; `params` is a pytree of tensors.
        stages: number of stages. None: one more than the number of `stage_boundary` (or
            torch.distributed.pipelining `pipe_split()`) calls in `f` (or of `cuts`). N with no
            boundaries in `f`: fpipe chooses N balanced stages.
        microbatches: number of equal chunks each tensor argument is split into.
        schedule: a registered schedule name (`fpipe.schedules.names()`), a `Schedule`, or a
            function `(pp=, microbatches=) -> Schedule`.
        in_axes: the axis along which each positional argument after `params` is split
            (a prefix pytree of ints or None = passed whole to every microbatch). Keyword
            tensors are split along dim 0; 0-dim tensors are never split.
        out_axes: how each output is combined over microbatches: 'mean', 'sum' or an int axis to
            concatenate along (a prefix pytree). Default: 'mean' for scalars, 0 otherwise.
        mesh: a DeviceMesh with a "pp" dimension and optionally a "dp" one (replicas: each rank
            passes its dp slice of the global batch and gets the global loss and gradients;
            NOTE [gradients over replicas]); by default, under torchrun, all ranks form one
            pipeline (the process group is initialised from torchrun's environment if needed:
            NCCL with CUDA, gloo otherwise). Stage s runs on pipeline rank
            `schedule.stage_rank[s]`. Without a process group every stage runs in this process.
        timeout: seconds a rank waits for a peer before failing with an error naming the peer
            and the action it waited on (a peer that is alive but stopped or stuck). A peer
            that crashes or is killed ends the others at once (its connections close; they wait
            up to 2 s for its own report of why, then name it): no timeout is involved.
        compile: compile every stage program with `torch.compile` (True, or a dict of its
            keyword arguments) at its first run. Off by default: on the benchmark GPT it took 40-50 s
            at the first call on a 2-core CPU and ran no faster there or on one H200 (docs/BENCHMARKS.md).
        partition: how `stages=N` cuts a function without boundaries: "estimate" (default;
            a static cost model, deterministic, needs no real tensors) or "measure" (each
            operation's forward + backward timed on the device at one microbatch's shapes,
            averaged over the pipeline ranks; costs a forward-backward's time or so at the
            first call, and balances what the estimate misjudges, such as attention on CPU).
        cuts: where stages begin, by module path of the model `f` calls through
            `functionalize`, instead of `stage_boundary` calls: `["blocks.4", "blocks.8"]`, a
            compiled regex over paths, `{"blocks": 4}` (every 4th entry), or
            torch.distributed.pipelining's split_spec `{"blocks.4": SplitPoint.BEGINNING}`
            (or `SplitPoint.END`); NOTE [cuts by module path] in cuts.py.
        plan: a `fpipe.plan(...)` result: its stages, cuts, microbatches, schedule (and mesh
            under torchrun, when dp > 1) replace those arguments.
        memory_limit: bytes each rank's step may hold beyond its parameters (`memory`'s
            measure); fpipe recomputes saved values inside the backward programs, per stage, to
            fit (NOTE [meeting a memory limit] in remat_choose.py). A limit it cannot meet is a
            ValueError at the first call, before anything runs.
        precision: an `fpipe.Precision`: compute, accumulation, dp-reduction and gradient dtypes.

    Returns:
        A `Pipelined` callable with `f`'s signature; use it under `fpipe.value_and_grad`,
        `fpipe.grad`, or (in one process) torch.func transforms.

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
    settings = dict(
        stages=stages, microbatches=microbatches, schedule=schedule, in_axes=in_axes, out_axes=out_axes,
        mesh=mesh, timeout=timeout, compile=compile, partition=partition, cuts=cuts,
        memory_limit=memory_limit, precision=precision,
    )  # fmt: skip
    settings = plan.settings(settings) if plan is not None else settings
    Config(f, **settings).check()
    return Pipelined(f, **settings)
