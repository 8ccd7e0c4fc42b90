"""A Poisson stream of requests (issue 28): `fpipe.Generator` (continuous batching) against static
batches of `fpipe.generate` on 2 gloo ranks and against `model.generate` on one process; the
per-token time over a long generation; the cost of a new prompt length.

    torchrun --standalone --nproc-per-node 2 bench/generate_stream.py
    python bench/generate_stream.py --one-process    # the same, 2 stages in one process

Model: a transformers Llama (`--layers` blocks, `--hidden` wide, 8 heads of which 4 key/value
heads, vocabulary `--vocab`), fp32, random weights, one torch thread per rank. The stream:
`--requests` prompts of uniform random length in [`--min-prompt`, `--max-prompt`], arriving as a
Poisson process of `--rate` requests per second (seeded), `--new` greedy tokens each.

Modes (each run on the same stream once "cold", tracing the shapes it meets, then `--repeats`
times "warm", the best wall time reported; static batches of a width or size not met before
trace again even warm):
1. `Generator`: `fpipe.Generator(max_batch=--slots)` on 2 ranks, driven by `step()`; before each
   step rank 0 submits what has arrived by its clock (the count is broadcast, so every rank
   submits the same stream).
2. `fpipe.generate static batches`: whenever the previous batch is done, the requests that have
   arrived (at most `--slots`; if none, the next one) form one left-padded batch.
3. `fpipe.generate static batches padded to --max-prompt`: the same, every batch left-padded to
   the longest possible prompt (one trace per batch size).
4. `model.generate static batches`: the same batching as 2, the unsplit model on rank 0 alone.

Reported: tokens/s = requests x new / (the last token's time - the first arrival), and the
time to first token (first token - arrival) mean and 90th percentile, on rank 0's clock. Every
request's greedy tokens are checked equal across the three modes. Then, Generator only: the
per-token step time over a `--long`-token generation of one request (first and last eighth),
and the step that joins a prompt of a new length bucket (traced there) against one of a bucket
already traced, against `buckets=None` (a trace per length).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import fpipe

STAGES: int | None = None  # under torchrun: one per rank; `--one-process`: 2 in this process


def build(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=args.vocab,
        max_position_embeddings=args.max_len, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def stream(args: argparse.Namespace) -> tuple[list[torch.Tensor], list[float]]:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.requests,), generator=gen)
    prompts = [torch.randint(1, args.vocab, (int(n),), generator=gen) for n in lengths]
    gaps = torch.empty(args.requests).exponential_(args.rate, generator=gen)
    return prompts, (gaps.cumsum(0) - gaps[0]).tolist()


def arrived(start: float, arrivals: list[float], taken: int, limit: int, wait: bool) -> int:
    """How many more requests to take (rank 0's clock, broadcast): those arrived, up to `limit`;
    with `wait`, at least one (sleeping until it arrives)."""
    n = torch.zeros((), dtype=torch.long)
    if rank() == 0:
        now = time.perf_counter() - start
        if wait and taken < len(arrivals) and arrivals[taken] > now:
            time.sleep(arrivals[taken] - now)
            now = arrivals[taken]
        n += sum(1 for a in arrivals[taken : taken + limit] if a <= now)
    if dist.is_initialized():
        dist.broadcast(n, 0)
    return int(n)


def with_generator(args: argparse.Namespace, model: torch.nn.Module, prompts: list, arrivals: list) -> Any:
    gen = fpipe.Generator(model, max_len=args.max_len, max_batch=args.slots, stages=STAGES)
    start, handles = time.perf_counter(), []
    while len(handles) < len(prompts) or not gen.idle:
        n = arrived(start, arrivals, len(handles), len(prompts), gen.idle)
        for p in prompts[len(handles) : len(handles) + n]:
            handles.append(gen.submit(p, max_new_tokens=args.new))
        gen.step()
    firsts = [h.first_token_at - start for h in handles]
    return [h.new_tokens for h in handles], firsts, time.perf_counter() - start


def static_batches(
    run: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor],
    args: argparse.Namespace,
    prompts: list,
    arrivals: list,
    width: int | None = None,
) -> Any:
    """Batches of what has arrived when the previous batch is done, left-padded to their longest
    prompt (or to `width`); `run(ids, mask, streamer)`."""
    start, done, tokens, firsts = time.perf_counter(), 0, [], []
    while done < len(prompts):
        n = arrived(start, arrivals, done, args.slots, True)
        batch = prompts[done : done + n]
        wide = width or max(p.numel() for p in batch)
        ids = torch.zeros(n, wide, dtype=torch.long)
        mask = torch.zeros(n, wide, dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, wide - p.numel() :], mask[i, wide - p.numel() :] = p, 1
        clock = Clock()
        out = run(ids, mask, clock)
        if rank() == 0:
            firsts += [clock.first - start] * n
            tokens += out[:, wide:].tolist()
        done += n
    return tokens, firsts, time.perf_counter() - start


class Clock:
    """A streamer that records when the first new tokens came (the second `put`)."""

    def __init__(self) -> None:
        self.puts: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        pass

    @property
    def first(self) -> float:
        return self.puts[1]


def modes(args: argparse.Namespace, model: torch.nn.Module) -> dict[str, Callable[..., Any]]:
    def fp(ids: torch.Tensor, mask: torch.Tensor, clock: Clock) -> torch.Tensor:
        return fpipe.generate(
            model, ids, attention_mask=mask, max_new_tokens=args.new, streamer=clock, stages=STAGES
        )

    def hf(ids: torch.Tensor, mask: torch.Tensor, clock: Clock) -> torch.Tensor:
        if rank() != 0:
            return ids
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=args.new, do_sample=False, pad_token_id=0, streamer=clock
        )

    return {
        "Generator (2 stages)": lambda p, a: with_generator(args, model, p, a),
        "fpipe.generate static batches (2 stages)": lambda p, a: static_batches(fp, args, p, a),
        "fpipe.generate static batches padded to --max-prompt (2 stages)": lambda p, a: static_batches(
            fp, args, p, a, args.max_prompt
        ),
        "model.generate static batches (unsplit, rank 0)": lambda p, a: static_batches(hf, args, p, a),
    }


def per_token(args: argparse.Namespace, model: torch.nn.Module) -> tuple[float, float]:
    """Step times (ms) over one request's `--long` tokens: mean of the first and last eighth."""
    gen = fpipe.Generator(model, max_len=args.long + 8, max_batch=1, stages=STAGES)
    gen.submit(torch.arange(1, 9), max_new_tokens=args.long)
    marks = [time.perf_counter()]
    while gen.step():
        marks.append(time.perf_counter())
    steps = [b - a for a, b in zip(marks, marks[1:])]
    k = max(1, len(steps) // 8)
    return 1e3 * sum(steps[:k]) / k, 1e3 * sum(steps[-k:]) / k


def new_length(args: argparse.Namespace, buckets: Any) -> list[float]:
    """Step times (ms) that join a prompt of 20, then 19, then 20 tokens (decode traced before)."""
    model = build(args)  # a fresh model: nothing traced
    gen = fpipe.Generator(model, max_len=args.max_len, max_batch=2, buckets=buckets, stages=STAGES)
    gen.submit(torch.arange(1, 4), max_new_tokens=2)
    gen.run()
    times = []
    for n in (20, 19, 20):
        gen.submit(torch.arange(1, n + 1), max_new_tokens=1)
        barrier()
        t = time.perf_counter()
        gen.step()
        times.append(1e3 * (time.perf_counter() - t))
    return times


def report(name: str, tokens: int, got: Any, arrivals: list[float]) -> None:
    _, firsts, wall = got
    ttft = sorted(f - a for f, a in zip(firsts, arrivals))
    p90 = ttft[int(0.9 * (len(ttft) - 1))]
    mean = sum(ttft) / len(ttft)
    print(f"| {name} | {tokens / wall:.0f} | {1e3 * mean:.0f} | {1e3 * p90:.0f} | {wall:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag, default in [("layers", 4), ("hidden", 256), ("vocab", 1024), ("requests", 24), ("slots", 4),
                          ("min-prompt", 4), ("max-prompt", 48), ("new", 16), ("max-len", 64), ("long", 256), ("repeats", 3)]:  # fmt: skip
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--one-process", action="store_true", help="no torchrun: 2 stages in one process")
    args = parser.parse_args()
    torch.set_num_threads(1)
    global STAGES
    if args.one_process:
        STAGES = 2
    else:
        dist.init_process_group("gloo")
    model, (prompts, arrivals) = build(args), stream(args)
    results = {}
    for name, run in modes(args, model).items():
        barrier()
        results[f"{name}, cold"] = run(prompts, arrivals)  # traces the shapes it meets
        warm = []
        for _ in range(args.repeats):  # the same stream again: the best wall time
            barrier()
            warm.append(run(prompts, arrivals))
        results[f"{name}, warm"] = min(warm, key=lambda r: r[2])
    if rank() == 0:
        tokens = [r[0] for r in results.values()]
        print("every request's tokens equal across the modes:", all(t == tokens[0] for t in tokens))
        print(f"{args.requests} requests, {args.new} new tokens each, rate {args.rate}/s, {args.slots} slots")
        print("| mode | tokens/s | TTFT mean (ms) | TTFT p90 (ms) | wall (s) |")
        for name, got in results.items():
            report(name, args.requests * args.new, got, arrivals)
    per_token(args, model)  # warm-up: traces
    first, last = per_token(args, model)
    bucketed, exact = new_length(args, "default"), new_length(args, None)
    if rank() == 0:
        print(
            f"Generator per-token step: first eighth {first:.1f} ms, last eighth {last:.1f} ms ({args.long} tokens)"
        )
        print(
            f"join step, prompt 20 / 19 / 20 tokens, buckets: {' / '.join(f'{t:.0f}' for t in bucketed)} ms"
        )
        print(
            f"join step, prompt 20 / 19 / 20 tokens, buckets=None: {' / '.join(f'{t:.0f}' for t in exact)} ms"
        )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
