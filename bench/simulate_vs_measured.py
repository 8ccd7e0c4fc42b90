"""Does the schedule simulator predict a real run? Measure per-action costs, simulate, compare.

Runs a small GPT under each schedule across processes (one pipeline rank per process, one thread
each), reads every rank's `piped.timeline` for the measured steps, and

1. takes, per stage, the median duration of its F, B (or I and W) actions, and a communication
   delay from the wait events that can be attributed to a transfer (else 0);
2. feeds those costs to `fpipe.schedules.simulate`;
3. prints the predicted against the measured step time (the runner's wall time: first rank
   starting its action list to the last rank finishing its last action, on the shared
   monotonic clock) and each rank's bubble (measured: 1 - busy / step time, busy = the sum of
   that rank's action durations), with the relative errors.

A second prediction ("+gaps") adds to every action the median gap this rank leaves between
actions while it is not waiting for a peer (Python bookkeeping, posting receives, queueing sends):
the simulator's actions run back to back, the runtime's do not.

    torchrun --standalone --nproc-per-node 2 bench/simulate_vs_measured.py
    torchrun --standalone --nproc-per-node 4 bench/simulate_vs_measured.py --warmup 1 --steps 3

Results and their discussion: docs/BENCHMARKS.md, "Simulator vs measured (issue 4)".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import statistics
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fpipe
from fpipe.schedules import Action, Schedule, build, dependencies, simulate

SCHEDULES = ("1f1b", "gpipe", "zb-h1", "interleaved-1f1b", "zbv")


# -- the model: a GPT-like stack, plain torch -------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, n_head: int, n_layer: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# -- measuring ------------------------------------------------------------------------------------


_ACTION = re.compile(r"([A-Z])(\d+)\.(\d+)")


def parse_action(text: str) -> Action:
    """'F0.3' -> Action('F', 0, 3): the timeline's event names are the actions' text form. An
    action may log several events (a full backward that sends to another rank runs as two
    halves, each an event), under its own name or with a suffix ('B1.0/w'): all are that action's."""
    m = _ACTION.match(text)
    if m is None:
        raise ValueError(f"not an action's event: {text!r}")
    return Action(m[1], int(m[2]), int(m[3]))


@dataclasses.dataclass
class Span:
    """One action's events in a step: the first start, the last end, the time spent inside its
    events (their durations summed: the action's cost; the rest of the span is the runtime's
    work between its halves, a send), and the first event's end (when a full backward that
    runs as two halves sends its input gradients: its peer's data leaves then, not at `end`)."""

    start: float
    end: float
    busy: float
    sent: float

    def add(self, start: float, end: float) -> Span:
        sent = end if start < self.start else self.sent
        return Span(min(self.start, start), max(self.end, end), self.busy + end - start, sent)


def _merge(into: dict[Action, Span], a: Action, start: float, end: float) -> None:
    into[a] = into[a].add(start, end) if a in into else Span(start, end, end - start, end)


@dataclasses.dataclass
class Step:
    """One step on every rank, on the shared monotonic clock (perf_counter, seconds)."""

    begin: float  # the earliest rank's runner start
    skew: float  # the latest rank's runner start minus the earliest's
    actions: dict[Action, Span]  # every rank's actions, on the absolute clock
    waits: dict[Action, Span]  # waits for a peer, keyed by the waiting action

    @property
    def wall(self) -> float:
        return max(sp.end for sp in self.actions.values()) - self.begin


def gather_step(piped: fpipe.Pipelined) -> Step:
    """Every rank's timeline of the last step, with times made absolute (perf_counter's clock is
    CLOCK_MONOTONIC, shared by the processes of one host)."""
    tl = piped.timeline
    assert tl is not None
    mine = (tl.origin, tl.events)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    actions: dict[Action, Span] = {}
    waits: dict[Action, Span] = {}
    for origin, events in everyone:
        for name, _, s, e, kind in events:
            if kind == "wait":
                _merge(waits, parse_action(name.split()[-1]), origin + s, origin + e)
            else:
                _merge(actions, parse_action(name), origin + s, origin + e)
    origins = [o for o, _ in everyone]
    return Step(min(origins), max(origins) - min(origins), actions, waits)


def per_stage_costs(sched: Schedule, steps: list[Step]) -> dict[str, list[float]]:
    """Median duration of each kind of action per stage, as `simulate`'s forward/backward/weight."""
    durations: dict[tuple[str, int], list[float]] = defaultdict(list)
    for st in steps:
        for a, sp in st.actions.items():
            durations[(a.kind, a.stage)].append(sp.busy)

    def med(kind: str, stage: int) -> float:
        d = durations.get((kind, stage))
        return statistics.median(d) if d else 0.0

    stages = range(sched.n_stages)
    forward = [med("F", s) for s in stages]
    # a full B costs backward + weight in the simulator: put it all in `backward`
    backward = [med("B", s) if (("B", s) in durations) else med("I", s) for s in stages]
    weight = [0.0 if (("B", s) in durations) else med("W", s) for s in stages]
    return {"forward": forward, "backward": backward, "weight": weight}


def comm_delay(sched: Schedule, steps: list[Step], min_wait: float = 2e-4) -> tuple[float, int]:
    """Median delay from a peer's action sending (when it finishes, or a full backward's first
    half does) to the data being here, over the waits that actually blocked (longer than
    `min_wait`) and whose awaited action is known: the wait ends when the last transfer arrives. Waits that did not block say only that the data was early;
    they are not attributable. Returns (delay, samples); (0, 0) when none is attributable."""
    deps = dependencies(sched)
    samples = []
    for st in steps:
        for a, w in st.waits.items():
            if w.busy < min_wait:
                continue
            r = sched.stage_rank[a.stage]
            remote = [
                st.actions[d].sent for d in deps(a) if sched.stage_rank[d.stage] != r and d in st.actions
            ]
            if remote:
                samples.append(max(w.end - max(remote), 0.0))
    return (statistics.median(samples), len(samples)) if samples else (0.0, 0)


def gaps(sched: Schedule, steps: list[Step]) -> list[float]:
    """Per rank, the median time between consecutive actions that is not spent waiting for a peer,
    plus the time inside an action's span between its events (a full backward's send between
    its two halves): the runtime's work that no event covers."""
    out = []
    for acts in sched.ranks:
        g = []
        for st in steps:
            for prev, a in zip(acts, acts[1:]):
                idle = st.actions[a].start - st.actions[prev].end
                if a in st.waits:
                    idle -= st.waits[a].busy
                g.append(max(idle, 0.0) + st.actions[a].end - st.actions[a].start - st.actions[a].busy)
        out.append(statistics.median(g) if g else 0.0)
    return out


def measured_bubbles(sched: Schedule, steps: list[Step]) -> list[float]:
    """Per rank, the median over steps of 1 - busy / step wall time."""
    return [
        statistics.median(1 - sum(st.actions[a].busy for a in acts) / st.wall for st in steps)
        for acts in sched.ranks
    ]


def with_gaps(sched: Schedule, costs: dict[str, list[float]], gap: list[float]) -> dict[str, list[float]]:
    """Costs with each stage's actions lengthened by its rank's median gap (a full B by one gap)."""
    g = [gap[sched.stage_rank[s]] for s in range(sched.n_stages)]
    split = [costs["weight"][s] > 0 for s in range(sched.n_stages)]
    return {
        "forward": [c + x for c, x in zip(costs["forward"], g)],
        "backward": [c + x for c, x in zip(costs["backward"], g)],
        "weight": [c + (x if sp else 0.0) for c, x, sp in zip(costs["weight"], g, split)],
    }


# -- one schedule -----------------------------------------------------------------------------------


def run_schedule(name: str, args: argparse.Namespace, params: dict[str, torch.Tensor], loss_fn: Any) -> dict:
    world = dist.get_world_size()
    torch.manual_seed(1)  # same data on every rank
    tokens = torch.randint(args.vocab, (args.batch, args.seq))
    targets = torch.randint(args.vocab, (args.batch, args.seq))
    piped = fpipe.pipeline(loss_fn, microbatches=args.microbatches, schedule=name)
    step = fpipe.value_and_grad(piped)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        dist.barrier()
        step(params, tokens, targets)
    warm = time.perf_counter() - t0
    steps, calls = [], []
    for _ in range(args.steps):
        dist.barrier()
        t = time.perf_counter()
        step(params, tokens, targets)
        calls.append(time.perf_counter() - t)
        steps.append(gather_step(piped))
    sched = build(name, pp=world, microbatches=args.microbatches)
    costs = per_stage_costs(sched, steps)
    comm, n_comm = comm_delay(sched, steps)
    gap = gaps(sched, steps)
    sim = simulate(sched, **costs, comm=comm)
    sim_gaps = simulate(sched, **with_gaps(sched, costs, gap), comm=comm)
    return {
        "schedule": name,
        "stages": sched.n_stages,
        "warmup_s": warm,
        "measured": statistics.median(st.wall for st in steps),
        "measured_all": [st.wall for st in steps],
        "call": statistics.median(calls),
        "predicted": sim.makespan,
        "predicted_gaps": sim_gaps.makespan,
        "bubble_measured": measured_bubbles(sched, steps),
        "bubble_predicted": sim.bubble,
        "bubble_predicted_gaps": sim_gaps.bubble,
        "costs": costs,
        "comm": comm,
        "comm_samples": n_comm,
        "gap": gap,
        "skew": statistics.median(st.skew for st in steps),
    }


# -- report -----------------------------------------------------------------------------------------


def rel(pred: float, meas: float) -> str:
    return f"{(pred - meas) / meas:+.1%}" if meas else "n/a"


def table(results: list[dict]) -> str:
    head = (
        "| schedule | stages | measured step (s) | predicted (s) | error | predicted +gaps (s) | error "
        "| bubble per rank: measured / predicted / +gaps |"
    )
    lines = [head, "|" + "---|" * 8]
    for r in results:
        bub = "; ".join(
            f"r{i}: {m:.1%} / {p:.1%} / {g:.1%}"
            for i, (m, p, g) in enumerate(
                zip(r["bubble_measured"], r["bubble_predicted"], r["bubble_predicted_gaps"])
            )
        )
        lines.append(
            f"| {r['schedule']} | {r['stages']} | {r['measured']:.3f} | {r['predicted']:.3f} | "
            f"{rel(r['predicted'], r['measured'])} | {r['predicted_gaps']:.3f} | "
            f"{rel(r['predicted_gaps'], r['measured'])} | {bub} |"
        )
    return "\n".join(lines)


def details(results: list[dict]) -> str:
    lines = []
    for r in results:
        c = r["costs"]
        ms = ", ".join(f"{x * 1e3:.0f}" for x in r["measured_all"])
        lines.append(
            f"{r['schedule']}: steps [{ms}] ms, whole call {r['call'] * 1e3:.0f} ms; per stage (ms) "
            f"F {_ms(c['forward'])}, B/I {_ms(c['backward'])}, W {_ms(c['weight'])}; "
            f"comm {r['comm'] * 1e3:.2f} ms ({r['comm_samples']} attributable waits); "
            f"gap per rank {_ms(r['gap'], 2)} ms; ranks' runner starts within {r['skew'] * 1e3:.2f} ms"
        )
    return "\n".join(lines)


def _ms(xs: list[float], digits: int = 1) -> str:
    return "[" + ", ".join(f"{x * 1e3:.{digits}f}" for x in xs) + "]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", help="write the results here (rank 0)")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(args.vocab, args.d_model, args.heads, args.layers, args.seq)
    fn, params = fpipe.functionalize(model)

    def loss_fn(params: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fn(params, tokens).flatten(0, 1), targets.flatten())

    results = []
    for name in args.schedules:
        r = run_schedule(name, args, params, loss_fn)
        results.append(r)
        if rank == 0:
            print(f"{name}: measured {r['measured']:.3f} s, predicted {r['predicted']:.3f} s", flush=True)
    if rank == 0:
        n_params = sum(t.numel() for t in params.values())
        print(
            f"\n{world} ranks x 1 thread, GPT {args.layers} layers d_model {args.d_model} seq {args.seq} "
            f"vocab {args.vocab} ({n_params / 1e6:.1f} M params), batch {args.batch}, "
            f"{args.microbatches} microbatches, {args.warmup} warm-up + {args.steps} measured steps; "
            f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs\n"
        )
        print(table(results))
        print()
        print(details(results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "world": world, "results": results}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
