"""Multi-process worker: `fpipe.generate` of GPT-2, Llama and Qwen2 on 2 and 4 gloo ranks.

Run last by `tests/support/four_ranks_worker.py` (one 4-rank launch for tests/generate/test_generate_cache.py and
two other modules: a process group costs seconds to start), or alone as

    torchrun --standalone --nproc-per-node 4 tests/support/generate_worker.py --out DIR

Last, a failure: one rank's stage raises mid-generation, and every rank records the error it got
(`fail{R}.json`). On the 4 processes, a case with pp=4 is one pipeline over all ranks; a case with pp=2 runs on a
DeviceMesh (dp=2, pp=2): two independent 2-rank pipelines (`generate(..., mesh=mesh)`), each
generating the same batch. Every rank builds the same tiny models (also imported by the test: `build`, `prompt`) and runs,
per family: greedy generation of left-padded prompts with 2 microbatches; generation with EOS
per sequence; a seeded sampled generation; then Phi-3 with long rope (refused on ranks,
`phi3_on_ranks`), and one generation where rank 1's prompt differs in
one token (`values_differ`) (the test compares them with the unsplit
`model.generate` and the one-process sampled result); and what this rank did -- the stages whose programs it ran, the operations
they executed, the decoder layers whose K/V buffers it allocated -- and, on rank 0, the
streamer's calls. It writes `DIR/rank{R}.json`. A case that raises ends the process (its peers then stop naming it,
NOTE [failures never hang]), and the test shows the output.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from typing import Any

import torch

import fpipe

DT = torch.float64
VOCAB, LAYERS, BATCH, PROMPT, NEW, MICROBATCHES = 64, 4, 4, 6, 8, 2
FAMILIES = ["gpt2", "llama", "qwen2"]
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=7)
REFILL_AT = 8  # phi3's original_max_position_embeddings: prompt 6 + 8 new tokens pass it


def build(name: str) -> torch.nn.Module:
    import transformers  # here, not at the top: pytest --doctest-modules imports this file

    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=0, initializer_range=0.3
    )
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=LAYERS, n_embd=32, n_head=4, n_positions=32, **common)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        sizes = dict(
            num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32,
        )  # fmt: skip
        if name == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes, **common))
        elif name == "phi3":  # long rope: refused on ranks
            rope = dict(
                rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 4,
                long_factor=[1.0, 4.0, 7.0, 10.0], original_max_position_embeddings=REFILL_AT,
            )  # fmt: skip
            cfg = transformers.Phi3Config(
                **sizes, **common, original_max_position_embeddings=REFILL_AT, rope_parameters=rope
            )
            model = transformers.Phi3ForCausalLM(cfg)
        else:
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes, **common))
    return model.to(DT).eval()


def prompt() -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of lengths 6, 4, 5, 6 (pad id 0 where the mask is 0)."""
    ids = torch.randint(1, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def reference(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, **kw: Any) -> torch.Tensor:
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **kw)


def eos_of(expected: torch.Tensor) -> int:
    """An EOS id that ends row 0 early and others later or never: row 0's third new token."""
    return int(expected[0, PROMPT + 2])


class Recorder:
    """A transformers-style streamer that records its calls."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def put(self, value: torch.Tensor) -> None:
        self.calls.append(value.tolist())

    def end(self) -> None:
        self.calls.append("end")


class Share:
    """What this rank runs: counts the stage programs and their operations (`run_stage`) and
    records the decoder layers whose K/V buffers it allocates (`StageCaches`)."""

    def __init__(self) -> None:
        import fpipe._src.generate.decode_run as decode_run

        self.stages: Counter[int] = Counter()
        self.ops = 0
        self.layers: list[int] = []
        self.cache_bytes = 0
        run_stage, caches_init = decode_run.run_stage, decode_run.StageCaches.__init__

        def counting(progs: Any, stage: int, env: Any, params: Any) -> None:
            self.stages[stage] += 1
            self.ops += progs.program(stage).n_nodes
            run_stage(progs, stage, env, params)

        def recording(caches: Any, *args: Any) -> None:
            caches_init(caches, *args)
            self.layers, self.cache_bytes = caches.layers, caches.nbytes()

        decode_run.run_stage = counting
        decode_run.StageCaches.__init__ = recording  # type: ignore[method-assign]

    def reset(self) -> None:
        self.stages, self.ops = Counter(), 0


def case(model: torch.nn.Module, share: Share, mesh: Any) -> dict[str, Any]:
    """One family on one layout; the references are the test's (one process, eager)."""
    ids, mask = prompt()
    streamer = Recorder()
    share.reset()
    kw = dict(attention_mask=mask, max_new_tokens=NEW, microbatches=MICROBATCHES, mesh=mesh)
    out = fpipe.generate(model, ids, streamer=streamer, **kw)
    res: dict[str, Any] = {"greedy": out.tolist()}
    res.update(stages=dict(share.stages), ops=share.ops, layers=share.layers, cache_bytes=share.cache_bytes)
    res["streamer"] = streamer.calls
    res["eos"] = fpipe.generate(model, ids, eos_token_id=eos_of(out), **kw).tolist()
    res["sampled"] = fpipe.generate(model, ids, **SAMPLING, **kw).tolist()
    return res


def values_differ(model: torch.nn.Module, rank: int) -> str:
    """Rank 1 passes a prompt with one token changed (same shapes): every rank's error."""
    ids, mask = prompt()
    if rank == 1:
        ids[0, -1] = ids[0, -1] % (VOCAB - 1) + 1
    try:
        fpipe.generate(model, ids, attention_mask=mask, max_new_tokens=2)
    except ValueError as err:
        return str(err)
    return "ran"


def run(out: str) -> None:
    """Every case, then the failure (which ends the process), in an initialised 4-rank group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, results = dist.get_rank(), {}
    meshes = {4: None, 2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))}
    share = Share()
    for name in FAMILIES:
        model = build(name)  # one model per family: both layouts reuse its traced step
        for pp, mesh in meshes.items():
            results[f"{name}-pp{pp}"] = case(model, share, mesh)
    try:  # refused on ranks: it stalled there (docs/GENERATION.md)
        fpipe.generate(build("phi3"), prompt()[0], max_new_tokens=2, microbatches=MICROBATCHES)
        results["phi3_on_ranks"] = "ran"
    except ValueError as err:
        results["phi3_on_ranks"] = str(err)
    results["values_differ"] = values_differ(model, rank)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.barrier()
    fail(model, rank, out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    run(args.out)


FAILING_RANK = 2


def fail(model: torch.nn.Module, rank: int, out: str) -> None:
    """Last: rank 2's stage raises at step 2 of a 4-rank generation. Every rank records what it
    raised and how long that took, then leaves at once with status 0 (so torchrun lets the
    others finish theirs; the process group is broken, so no teardown)."""
    import fpipe._src.generate.decode_run as decode_run

    inner = decode_run.run_stage

    def failing(progs: Any, stage: int, env: Any, params: Any) -> None:
        if rank == FAILING_RANK and int(env["offset"]) > PROMPT:
            raise RuntimeError("injected failure")
        inner(progs, stage, env, params)

    decode_run.run_stage = failing
    ids, mask = prompt()
    start = time.monotonic()
    try:
        fpipe.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, microbatches=MICROBATCHES)
        record = {"error": None}
    except Exception as err:
        record = {"error": f"{type(err).__name__}: {err}"}
    record["seconds"] = time.monotonic() - start
    with open(f"{out}/fail{rank}.json", "w") as f:
        json.dump(record, f)
    os._exit(0)


if __name__ == "__main__":
    main()
