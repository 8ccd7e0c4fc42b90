"""Resident memory per rank of pipelined generation (issue 28): stage-local weights against the
whole model on every rank.

    torchrun --standalone --nproc-per-node 2 bench/generate_memory.py
    torchrun --standalone --nproc-per-node 2 bench/generate_memory.py --stages 4

Model: a transformers Llama (`--layers` blocks, `--hidden` wide, MLP 4x, 8 heads of which 4
key/value heads, vocabulary `--vocab`), fp32, random weights, saved by rank 0 with
`save_pretrained` into a temporary folder (removed at the end). `--batch` random prompts of
`--prompt` tokens, greedy, `--new` tokens, 2 microbatches. One torch thread per rank.

Per rank, in this order:
1. `stage-local`: the model built on the meta device, `fpipe.generate(..., weights=folder)`.
2. `whole model`: `from_pretrained(folder)` on every rank (what a rank holds without
   `weights=`), then `fpipe.generate`.
Reported per rank: the tensors the model holds (count and MB of its non-meta parameters and
buffers) and the peak resident growth of the process over the mode (VmHWM after, less VmRSS
before, freed heap returned with malloc_trim and the peak reset through /proc/self/clear_refs
first; after one small generation, so that first-call imports do not count): the traces, the
weights, the cache and the activations; and at marks: the growth as the load starts and ends,
and the anonymous and file-backed (memory-mapped) resident growth at the end. The two modes'
tokens are checked equal.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import shutil
import tempfile
from typing import Any

import torch
import torch.distributed as dist

import fpipe
import fpipe._src.generate.generate as generate_module
from fpipe._src.generate.stage_weights import resident_bytes


def config(args: argparse.Namespace) -> Any:
    import transformers

    return transformers.LlamaConfig(
        num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=args.vocab,
        max_position_embeddings=args.prompt + args.new, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def fresh() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


MARKS: dict[str, int] = {}


def _marking() -> None:
    """Record the resident bytes as the stage weights' load starts and ends (after the traces)."""
    load = generate_module.load_stage_weights

    def loading(*args: Any) -> None:
        MARKS["before load"] = status("VmRSS")
        load(*args)
        MARKS["after load"] = status("VmHWM")

    generate_module.load_stage_weights = loading


def measure(make: Any, ids: torch.Tensor, args: argparse.Namespace, **kw: Any) -> tuple[Any, ...]:
    MARKS.clear()
    base = fresh()
    anon, file = status("RssAnon"), status("RssFile")
    model = make()
    out = fpipe.generate(model, ids, max_new_tokens=args.new, microbatches=2, stages=args.stages, **kw)
    count, nbytes = resident_bytes(model)
    growth = status("VmHWM") - base
    MARKS["anonymous at the end"] = status("RssAnon") - anon + base
    MARKS["file-backed at the end"] = status("RssFile") - file + base
    del model
    marks = "; ".join(f"{k} {(v - base) / 1e6:.1f}" for k, v in MARKS.items())
    return out, count, nbytes, growth, marks


def warm_up(cfg: Any, stages: int) -> None:
    """One small generation first: the imports and code paths of a first call (tens of MB of
    modules on a rank that has not run them) do not count in the measured growth."""
    import safetensors.torch  # noqa: F401
    import transformers

    small = transformers.LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": stages, "hidden_size": 64,
                                        "intermediate_size": 128})  # fmt: skip
    model = transformers.LlamaForCausalLM(small).eval()
    fpipe.generate(model, torch.ones(2, 4, dtype=torch.long), max_new_tokens=2, microbatches=2, stages=stages)


def main() -> None:
    import transformers

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--stages", type=int, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = config(args)
    where = [tempfile.mkdtemp(prefix="fpipe-bench-") if rank == 0 else None]
    if rank == 0:
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(where[0])
    dist.broadcast_object_list(where, 0)
    folder = where[0]
    ids = torch.randint(1, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))

    def on_meta() -> torch.nn.Module:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(cfg).eval()

    warm_up(cfg, args.stages or dist.get_world_size())
    _marking()
    rows = [("stage-local", *measure(on_meta, ids, args, weights=folder))]
    rows.append(
        (
            "whole model",
            *measure(lambda: transformers.LlamaForCausalLM.from_pretrained(folder).eval(), ids, args),
        )
    )
    assert torch.equal(rows[0][1], rows[1][1]), "the two modes' tokens differ"
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, [r[:1] + r[2:] for r in rows])
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder)
        whole = sum(p.numel() * 4 for p in on_meta().parameters())
        print(f"model: {whole / 1e6:.1f} MB of weights (fp32); stages={args.stages or dist.get_world_size()}")
        print("| mode | rank | tensors held | MB held | peak resident growth MB | growth at marks MB |")
        print("|---|---|---|---|---|---|")
        for r, got in enumerate(every):
            for mode, count, nbytes, growth, marks in got:
                print(f"| {mode} | {r} | {count} | {nbytes / 1e6:.1f} | {growth / 1e6:.1f} | {marks} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
