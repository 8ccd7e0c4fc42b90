"""Run: an interpreter of schedule actions over staged programs, in one process.

The runner owns every value that crosses programs: it hands each program its inputs, stores its
outputs per microbatch and frees each value as soon as its last reader has run, so a schedule's
memory is exactly what its order implies (1F1B holds fewer microbatches than GPipe).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.profiler import record_function

from ..schedules import Action, Schedule, execution_order
from ..stages import Place, Staged
from ..tracing import set_microbatch
from . import precision as precision_
from .precision import FLOATS, Precision

aten = torch.ops.aten

__all__ = [
    "LocalRunner", "Timeline", "accumulating", "action_place", "compiled", "execute", "live_bytes", "outputs_by_program",
    "release", "run_program",
]  # fmt: skip


class Timeline:
    """What a real step executed: each action (and, across processes, each wait for a peer)
    with its wall-clock start and end, per rank. `chrome()` is Chrome/Perfetto trace JSON."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.wall_origin = time.time()  # shared by the processes of a host: traces line up
        self.events: list[tuple[str, int, float, float, str]] = []  # name, rank, start, end, kind

    def add(self, name: str, rank: int, start: float, end: float, kind: str = "action") -> None:
        self.events.append((name, rank, start - self.origin, end - self.origin, kind))

    def chrome(self) -> dict[str, Any]:
        """Trace JSON; timestamps are wall-clock microseconds, so files of several ranks merge."""
        base = self.wall_origin * 1e6
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}}
            for r in sorted({e[1] for e in self.events})
        ]
        events += [
            {"name": n, "cat": k, "ph": "X", "ts": base + s * 1e6, "dur": (e - s) * 1e6, "pid": r, "tid": 0}
            for n, r, s, e, k in self.events
        ]
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome(), f)


class Results:
    """A step's outputs: per microbatch, except those summed over microbatches as they arrive
    (parameter gradients), so no microbatch's gradient outlives the next one's."""

    def __init__(
        self,
        n_mb: int,
        n_out: int,
        summed: frozenset[int],
        inputs: Iterable[torch.Tensor] = (),
        precision: Precision | None = None,
    ) -> None:
        self.per_mb: list[list[Any]] = [[None] * n_out for _ in range(n_mb)]
        self.summed = summed
        self.widen = precision_.of(precision).widen  # NOTE [precision policy] in precision.py
        self.dtypes: dict[int, torch.dtype] = {}  # the dtype each summed gradient is handed back in
        self.sums: dict[int, torch.Tensor] = {}
        self._owned: set[int] = set()
        self._inputs: set[int] | None = None
        self._input_tensors = inputs

    def _is_fresh(self, t: torch.Tensor) -> bool:
        """A program output that shares no memory with an input may be added into in place."""
        if t._is_view() or torch._C._functorch.is_functorch_wrapped_tensor(t):
            return False
        if self._inputs is None:
            self._inputs = {x.untyped_storage().data_ptr() for x in self._input_tensors if not x.is_meta}
        return t.untyped_storage().data_ptr() not in self._inputs

    def running_sum(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """Output i's running sum, for a program to add into in place (`accumulating`): created as
        zeros shaped `like` (a fake tensor) at the first microbatch, so it is this object's own
        memory from the start (a program's output may be a view of memory others share)."""
        if i not in self.sums:
            self.sums[i] = torch.zeros(like.shape, dtype=self.widen(like.dtype), device=like.device)
            self._owned.add(i)
        elif i not in self._owned:
            self.sums[i] = self.sums[i].clone()
            self._owned.add(i)
        return self.sums[i]

    def put(self, mb: int, i: int, value: torch.Tensor) -> None:
        if i not in self.summed:
            self.per_mb[mb][i] = value
        elif i not in self.sums:
            wide = self.widen(value.dtype)
            self.sums[i] = value if wide == value.dtype else value.to(wide)
            if wide != value.dtype or self._is_fresh(value):
                self._owned.add(i)
        elif i not in self._owned or torch._C._functorch.is_functorch_wrapped_tensor(self.sums[i]):
            self.sums[i] = self.sums[i] + value
            self._owned.add(i)
        else:
            self.sums[i].add_(value)


def execute(
    prog: Any,
    args: list[Any],
    a: Action,
    rank: int,
    timeline: Timeline,
    gm: Any = None,
    label: str | None = None,
) -> Any:
    """Run one action's program (or `gm`, a variant of it), labelled (`label`, else the action)
    for torch.profiler and in the timeline; compiled first if the program asks for it (once per
    variant)."""
    label = str(a) if label is None else label
    fn = prog.gm if gm is None else gm
    if prog.compile is not None:
        fn = compiled(prog, fn)
    set_microbatch(a.mb)
    start = time.perf_counter()
    with record_function(f"fpipe {label}"):
        outs = fn(*args)
    timeline.add(label, rank, start, time.perf_counter())
    return outs


def compiled(prog: Any, gm: fx.GraphModule) -> Any:
    """`torch.compile(gm, **prog.compile)`, built once per variant `gm` of `prog`."""
    cache: dict[int, Any] = prog.__dict__.setdefault("_compiled", {})
    if id(gm) not in cache:
        cache[id(gm)] = torch.compile(gm, **prog.compile)
    return cache[id(gm)]


def run_program(
    prog: Any,
    a: Action,
    rank: int,
    env: dict[str, Any],
    glob: dict[str, torch.Tensor],
    timeline: Timeline,
    out_index: dict[Place, list[tuple[int, str, bool]]],
    results: Results,
    label: str | None = None,
) -> None:
    """Run action `a`'s program on its microbatch's values `env` (else `glob`), store its outputs
    in `env`, and hand those that are outputs of the step (`out_index`) to `results`; `label`
    names it in the timeline (default: the action).

    With several microbatches, gradients summed over them are added into their running sums by
    the program itself (`accumulating`) where no torch.func transform is active (their values
    are then plain tensors), each as soon as it is computed."""
    args = [env[n] if n in env else glob[n] for n in prog.inputs]
    outs_of = out_index.get(prog.place, ())
    gm, fused = None, {}
    if len(results.per_mb) > 1 and torch._C._functorch.peek_interpreter_stack() is None:
        own = {n: i for i, n, only in outs_of if only and i in results.summed}
        if own:
            gm, sums_like = accumulating(prog, tuple(own), results.widen)
            fused = {own[n]: like for n, like in sums_like}
            args += [results.running_sum(i, like) for i, like in fused.items()]
    outs = execute(prog, args, a, rank, timeline, gm, label)
    env.update(zip(prog.outputs, outs))
    del args, outs
    for i, name, _ in outs_of:
        if i not in fused:
            results.put(a.mb, i, env[name])


def outputs_by_program(
    staged: Staged, here: Callable[[Place], bool]
) -> dict[Place, list[tuple[int, str, bool]]]:
    """Per program that runs `here`: the step outputs it computes, as (output index, name, whether
    the value is its own: read by no program and no other output, so a program may add it
    into a running sum instead of returning it). A stage's contribution to a gradient computed
    on several stages is handed in as that gradient (NOTE [tied gradients] in split_tied.py)."""
    index: dict[Place, list[tuple[int, str, bool]]] = {}
    for i, name in enumerate(staged.out_names):
        place = staged.producer.get(name)
        if place is not None and here(place):
            only = not staged.consumers.get(name) and staged.out_names.count(name) == 1
            index.setdefault(place, []).append((staged.partial_of.get(i, i), name, only))
    return index


def accumulating(
    prog: Any, names: tuple[str, ...], widen: Callable[[torch.dtype], torch.dtype] = lambda d: d
) -> tuple[Any, list[tuple[str, Any]]]:
    """`prog` rewritten to take, for each output in `names` it can, one more input (the output's
    running sum) into which the output is added in place right after the operation computing
    it, returning None in its place: the gradient is added while it is still in cache, freed at
    once, and one microbatch's gradients never all exist at the same time. Returns the program
    (None if nothing could be rewritten: outputs that are inputs, a non-fx program) and the
    rewritten outputs with their fake values (shape, dtype, device), in input order. Built once
    per `names`; a program compiled by the runtime has its variant compiled too. A sum `widen`ed
    to a wider dtype than its output's is added into by `add_` (not inside a product)."""
    cache: dict[Any, Any] = prog.__dict__.setdefault("_accumulating", {})
    key = (names, tuple(widen(d) for d in FLOATS))
    if key in cache:
        return cache[key]
    gm, done = None, []
    if isinstance(prog.gm, fx.GraphModule) and prog.inputs:
        graph = copy.deepcopy(prog.gm.graph)
        output = graph.find_nodes(op="output")[0]
        outs = list(output.args[0])  # type: ignore[arg-type]
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]  # inputs: in placeholder order
        for name in names:
            k = prog.outputs.index(name)
            src = outs[k]
            like = src.meta.get("val") if isinstance(src, fx.Node) else None
            if not (
                isinstance(src, fx.Node) and src.op == "call_function" and isinstance(like, torch.Tensor)
            ):
                continue
            with graph.inserting_after(last):
                acc = last = graph.placeholder(f"{name}_sum")
            if widen(like.dtype) != like.dtype or not _accumulate_in_product(graph, src, acc, output):
                with graph.inserting_after(src):
                    graph.call_function(aten.add_.Tensor, (acc, src))
            outs[k] = None
            done.append((name, like))
        if done:
            output.args = (outs,)
            gm = fx.GraphModule({}, graph)
    cache[key] = (gm, done)
    return gm, done


def _accumulate_in_product(graph: fx.Graph, src: fx.Node, acc: fx.Node, output: fx.Node) -> bool:
    """If `src` is a matrix product seen through transposes (a weight gradient: `mm`, `t(mm)`,
    `t(t(mm))`) that nothing else reads, add it into `acc` inside the product instead
    (`acc.addmm_(a, b)`, or `acc.addmm_(b.t(), a.t())` for an odd number of transposes): the
    gradient is never materialised on its own and the separate pass that adds it disappears."""
    chain, node = [], src
    while node.op == "call_function" and node.target is aten.t.default:
        chain.append(node)
        node = node.args[0]  # type: ignore[assignment]
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten.mm.default):
        return False
    path = [node, *reversed(chain)]  # the product, then each transpose of it
    if set(src.users) != {output} or any(set(n.users) != {up} for n, up in zip(path, path[1:])):
        return False
    a, b = node.args
    with graph.inserting_after(node):
        if len(chain) % 2:
            b_t = graph.call_function(aten.t.default, (b,))
            a_t = graph.call_function(aten.t.default, (a,))
            graph.call_function(aten.addmm_.default, (acc, b_t, a_t))
        else:
            graph.call_function(aten.addmm_.default, (acc, a, b))
    output.args = ([None if o is src else o for o in output.args[0]],)  # type: ignore[union-attr]
    for n in reversed(path):
        graph.erase_node(n)
    return True


def release(prog: Any, env: dict[str, Any], rem: dict[str, int]) -> None:
    """After `prog` ran: drop each value it read or wrote that no later program here reads
    (`rem`: readers left per value, counted down)."""
    for n in prog.inputs:
        if n in rem:
            rem[n] -= 1
            if rem[n] <= 0:
                env.pop(n, None)
    for n in prog.outputs:
        if rem.get(n, 0) <= 0:
            env.pop(n, None)


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of the memory `t` holds: its storage, shared by its views; a tensor under
    a torch.func transform counts as its own elements."""
    if torch._C._functorch.is_functorch_wrapped_tensor(t) or t.is_meta:
        return id(t), t.numel() * t.element_size()
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _input_storages(glob: dict[str, torch.Tensor], data: Sequence[dict[str, torch.Tensor]]) -> list[int]:
    return [_storage(t)[0] for t in [*glob.values(), *(v for d in data for v in d.values())]]


def live_bytes(envs: Iterable[dict[str, Any]], skip: Iterable[int] = ()) -> int:
    """Bytes of the tensors held in `envs`, each storage counted once, except the storages in
    `skip` (the step's inputs: the caller's memory, not the runner's)."""
    seen = set(skip)
    total = 0
    for env in envs:
        for v in env.values():
            if isinstance(v, torch.Tensor):
                key, size = _storage(v)
                if key not in seen:
                    seen.add(key)
                    total += size
    return total


def action_place(a: Action) -> Place:
    return (a.kind, a.stage)


class LocalRunner:
    """Runs a `Schedule` over a `Staged` program with every stage in this process."""

    def __init__(self, staged: Staged, schedule: Schedule) -> None:
        self.staged = staged
        self.schedule = schedule
        self.order = execution_order(schedule, self.deps)
        self.timeline = Timeline()
        self.refcount = {name: len(places) for name, places in staged.consumers.items()}
        self.out_index = outputs_by_program(staged, lambda place: True)
        # Set `record_memory` to have each step record, after every action, the bytes of the
        # values the runner holds for the microbatches (`live_bytes`) in `memory`: (action, bytes).
        self.record_memory = False
        self.memory: list[tuple[str, int]] = []

    @property
    def local_actions(self) -> list[Action]:
        """The actions this process runs, in order."""
        return list(self.order)

    def rank_of(self, place: Place) -> int:
        return self.schedule.stage_rank[place[1]]

    def deps(self, a: Action) -> list[Action]:
        return [Action(k, s, a.mb) for (k, s) in self.staged.deps(action_place(a))]

    def run(
        self,
        glob: dict[str, torch.Tensor],
        data: Sequence[dict[str, torch.Tensor]],
        summed: frozenset[int] = frozenset(),
        after: Callable[[Action, Results], None] | None = None,
        before: Callable[[Action], None] | None = None,
        precision: Precision | None = None,
    ) -> Results:
        """Run all actions. `glob` holds params, consts and ct; `data[m]` microbatch m's inputs;
        `before(action)` and `after(action, results)` are called around each action this
        process runs.

        Returns, per microbatch, the joint graph's outputs (values, then gradients).
        """
        n_out = len(self.staged.out_names)
        results = Results(len(data), n_out, summed, glob.values(), precision)
        self.timeline = Timeline()
        envs = [dict(d) for d in data]
        left = [dict(self.refcount) for _ in data]
        programs = self.staged.programs
        self.memory = []
        inputs = _input_storages(glob, data) if self.record_memory else []
        for a in self.order:
            prog = programs.get(action_place(a))
            if prog is None:
                continue
            rank = self.schedule.stage_rank[a.stage]
            if before is not None:
                before(a)
            run_program(prog, a, rank, envs[a.mb], glob, self.timeline, self.out_index, results)
            release(prog, envs[a.mb], left[a.mb])
            if after is not None:
                after(a, results)
            if self.record_memory:
                self.memory.append((str(a), live_bytes(envs, inputs)))
        for m, row in enumerate(results.per_mb):  # outputs that are inputs (f returns an argument)
            for i, name in enumerate(self.staged.out_names):
                if row[i] is None and name and i not in summed:
                    row[i] = data[m].get(name, glob.get(name))
        return results
