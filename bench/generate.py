"""Pipelined generation with a K/V cache per stage (issue 16): tokens/s on 2 gloo ranks against
the unsplit `model.generate` and the prefix-recomputing loop, and the time per token over a long
generation.

    torchrun --standalone --nproc-per-node 2 bench/generate.py
    torchrun --standalone --nproc-per-node 2 bench/generate.py --hidden 512 --batch 16 --new 32 --skip-recompute

Model: a transformers Llama (`--layers` blocks, `--hidden` wide, 8 heads of which 4 key/value
heads, vocabulary `--vocab`), fp32, random weights; `--batch` random prompts of `--prompt`
tokens, greedy, `--new` new tokens each. One torch thread per rank.

Modes:
1. `model.generate`: the unsplit model on rank 0 alone with transformers' own (dynamic) cache
   (rank 1 waits).
2. `recompute, unsplit`: rank 0 alone, every step the whole prefix again (`use_cache=False`).
3. `recompute, fpipe 2 ranks`: `tests/generate/test_generate.py`'s fixed loop: `fpipe.pipeline` over 2
   stages, 2 microbatches, the prompt right-padded to its final length (one trace), each step a
   pipelined forward of the whole buffer.
4. `fpipe.generate 2 ranks, m microbatches`: the cache per stage, m = 1, 2, 4.

Every mode runs once first (traces, warm-up), then `--repeats` times; reported: the best wall
time of a generation (max over ranks, between barriers), tokens/s = batch x new / that, and the
per-token time at the start and the end of the generation (mean step time over the first and
the last eighth of the steps; for fpipe.generate from its streamer's calls on rank 0).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import fpipe


def build(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=args.vocab,
        max_position_embeddings=args.prompt + args.new, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


class Clock:
    """Step timestamps, as a streamer (`put` per step) or called by a loop."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.marks.append(time.perf_counter())

    def end(self) -> None:
        pass

    def per_token(self) -> tuple[float, float]:
        """Mean step time over the first and the last eighth of the steps (s)."""
        gaps = [b - a for a, b in zip(self.marks[1:], self.marks[2:])]  # from the first token on
        k = max(1, len(gaps) // 8)
        return sum(gaps[:k]) / k, sum(gaps[-k:]) / k


def recompute_unsplit(model: torch.nn.Module, ids: torch.Tensor, new: int, clock: Clock) -> torch.Tensor:
    clock.put(ids)
    for _ in range(new):
        logits = model(input_ids=ids, use_cache=False).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        clock.put(ids)
    return ids


_PIPED: dict[int, fpipe.Pipelined] = {}


def _fixed_timed(fn, params, buf, mask, p, new, clock):  # type: ignore[no-untyped-def]
    """tests/generate/test_generate.py's fixed loop, with a timestamp per step."""

    def logits_at(params, ids, mask, pos):  # type: ignore[no-untyped-def]
        logits = fn(params, input_ids=ids, attention_mask=mask, use_cache=False).logits
        index = pos.view(-1, 1, 1).expand(-1, 1, logits.shape[-1])
        return logits.gather(1, index).squeeze(1)

    piped = _PIPED.setdefault(id(fn), fpipe.pipeline(logits_at, stages=2, microbatches=2))
    b = buf.shape[0]
    for t in range(p, p + new):
        pos = torch.full((b,), t - 1)
        buf[:, t] = piped(params, buf, mask, pos).argmax(-1)
        mask[:, t] = 1
        clock.put(buf)
    return buf


def timed(run: Callable[[Clock], torch.Tensor], repeats: int, on_rank0_only: bool) -> tuple[float, Clock]:
    """Best wall time over `repeats` runs (after one warm-up), max over ranks; its clock."""
    rank = dist.get_rank()
    best, best_clock = float("inf"), Clock()
    for i in range(repeats + 1):
        dist.barrier()
        clock = Clock()
        start = time.perf_counter()
        if rank == 0 or not on_rank0_only:
            run(clock)
        wall = torch.tensor(time.perf_counter() - start if (rank == 0 or not on_rank0_only) else 0.0)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        if i and wall.item() < best:
            best, best_clock = wall.item(), clock
    return best, best_clock


def recompute(
    args: argparse.Namespace, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, rows: list
) -> None:
    """The two prefix-recomputing modes (2 and 3)."""
    new = args.new
    rows.append(
        ("recompute, unsplit", *timed(lambda c: recompute_unsplit(model, ids, new, c), args.repeats, True))
    )
    fn, params = fpipe.functionalize(model)
    fixed_run = lambda c: _fixed_timed(fn, params, torch.cat([ids, ids.new_zeros(args.batch, new)], 1),  # noqa: E731
                                       torch.cat([mask, mask.new_zeros(args.batch, new)], 1), args.prompt, new, c)  # fmt: skip
    rows.append(("recompute, fpipe 2 ranks (2 microbatches)", *timed(fixed_run, args.repeats, False)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip-recompute", action="store_true", help="only the cached modes")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = build(args)
    ids = torch.randint(1, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    new, mask = args.new, torch.ones_like(ids)
    rows: list[tuple[str, float, Clock]] = []
    with torch.no_grad():

        def hf(clock: Clock) -> torch.Tensor:
            return model.generate(
                ids, attention_mask=mask, max_new_tokens=new, do_sample=False, streamer=clock
            )

        rows.append(("model.generate (unsplit, its cache)", *timed(hf, args.repeats, True)))
        expected = hf(Clock())
        if not args.skip_recompute:
            recompute(args, model, ids, mask, rows)
        for m in (1, 2, 4):

            def gen(clock: Clock, m: int = m) -> torch.Tensor:
                out = fpipe.generate(
                    model, ids, attention_mask=mask, max_new_tokens=new, microbatches=m, streamer=clock
                )
                assert torch.equal(out, expected), "fpipe.generate differs from model.generate"
                return out

            rows.append(
                (
                    f"fpipe.generate 2 ranks, {m} microbatch{'es' if m > 1 else ''}",
                    *timed(gen, args.repeats, False),
                )
            )
    if dist.get_rank() == 0:
        report(args, rows)
    dist.barrier()
    dist.destroy_process_group()


def report(args: argparse.Namespace, rows: list[tuple[str, float, Clock]]) -> None:
    tokens = args.batch * args.new
    print(
        f"Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, fp32; batch {args.batch}, "
        f"prompt {args.prompt}, {args.new} new tokens; 1 thread per rank"
    )
    print("| mode | s per generation | tokens/s | ms/token step, first 1/8 | last 1/8 |")
    print("|---|---|---|---|---|")
    for name, wall, clock in rows:
        first, last = clock.per_token() if len(clock.marks) > 3 else (float("nan"),) * 2
        print(f"| {name} | {wall:.3f} | {tokens / wall:.0f} | {1e3 * first:.1f} | {1e3 * last:.1f} |")


if __name__ == "__main__":
    main()
