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
streamer's calls. Then (issue 28) on the llama: ranks stopping when every sequence ended
(`stop-pp{2,4}`); stage-local weights from save_pretrained folders rank 0 writes into DIR
(`stage_local`: the fit model at 2 stages, its resident growth measured; the small Llama at
stages=4 on 2 ranks); a stage count that is not a multiple of the ranks (`stage_counts`). It writes `DIR/rank{R}.json`. A case that raises ends the process (its peers then stop naming it,
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


# -- stage-local weights, several stages per rank, early stop (issue 28) ---------------------------
FIT_LAYERS, FIT_LIMIT = 4, 0.6  # the fit test: each rank's resident growth under 60 % of the model


def fit_model(meta: bool) -> torch.nn.Module:
    """A Llama with tied embeddings whose weights (4 blocks, hidden 768, fp64: 283 MB) dwarf
    what a rank allocates besides (its traces: ~10 MB); on the meta device, or with
    deterministic weights (`_spread`: transformers' initialisation took 10 s) and the rotary
    module built from the config (not by the `_init_weights` that stage-local loading uses)."""
    import transformers

    cfg = transformers.LlamaConfig(
        num_hidden_layers=FIT_LAYERS, hidden_size=768, intermediate_size=3072, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=32, vocab_size=VOCAB, bos_token_id=None,
        eos_token_id=None, pad_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(DT).eval()
    if meta:
        return model
    model.to_empty(device="cpu")
    model.lm_head.weight = model.model.embed_tokens.weight  # (to_empty unties them)
    with torch.no_grad():
        for k, (name, p) in enumerate(model.named_parameters()):
            p.copy_(_spread(p.numel(), k).view_as(p)).add_(1.0 if name.endswith("norm.weight") else 0.0)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg).to(DT)
    return model


def _spread(n: int, k: int) -> torch.Tensor:
    """n values in [-0.1, 0.1] that look random to a matmul (a sine at an irrational step:
    vectorised, far cheaper than drawing 35 M numbers)."""
    return 0.1 * torch.sin(torch.arange(n, dtype=DT) * 0.7548776662 + 1.3 * k)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _fresh_peak() -> int:
    """This process's resident bytes now, with freed heap returned to the system and the peak
    (VmHWM) reset to it, so that VmHWM later is the peak since this call."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def stage_local(out: str, mesh: Any, share: Share) -> dict[str, Any]:
    """On 2-rank pipelines, from save_pretrained folders (rank 0 writes them first): the fit model
    at one stage per rank, its resident growth measured; the small Llama at stages=4."""
    import torch.distributed as dist

    import fpipe._src.generate.generate as generate_module
    from fpipe._src.generate.stage_weights import resident_bytes

    if dist.get_rank() == 0:
        fit_model(meta=False).save_pretrained(f"{out}/fit_weights")
        build("llama").save_pretrained(f"{out}/llama_weights")
    dist.barrier()
    traced = []  # the resident bytes as the load starts (after tracing)
    load = generate_module.load_stage_weights

    def loading(*args: Any) -> None:
        traced.append(_status("VmRSS"))
        load(*args)

    generate_module.load_stage_weights = loading
    ids, mask = prompt()
    kw = dict(attention_mask=mask, max_new_tokens=NEW, microbatches=MICROBATCHES, mesh=mesh)
    res: dict[str, Any] = {}
    for name, model, stages in [("fit", fit_model(meta=True), 2), ("llama", _on_meta(build), 4)]:
        base = _fresh_peak()
        share.reset()
        out_ids = fpipe.generate(model, ids, stages=stages, weights=f"{out}/{name}_weights", **kw)
        res[name] = {
            "tokens": out_ids.tolist(), "growth": _status("VmHWM") - base, "traced": traced[-1] - base,
            "resident": resident_bytes(model), "runs": dict(share.stages),
            "real": [n for n, p in model.named_parameters() if not p.is_meta],
        }  # fmt: skip
    generate_module.load_stage_weights = load
    return res


def _on_meta(make: Any) -> torch.nn.Module:
    """`make("llama")`'s model built on the meta device (its config and dtype, no weights)."""
    with torch.device("meta"):
        return make("llama")


def early_stop(model: torch.nn.Module, mesh: Any, share: Share) -> dict[str, Any]:
    """Every row's first token ends it: each stage runs the prefill of each microbatch and stops."""
    ids, mask = prompt()
    eos = [int(t) for t in reference(model, ids, mask)[:, PROMPT]]
    share.reset()
    out = fpipe.generate(
        model,
        ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        microbatches=MICROBATCHES,
        mesh=mesh,
        eos_token_id=eos,
    )
    return {"tokens": out.tolist(), "eos": eos, "runs": dict(share.stages)}


def stage_counts(model: torch.nn.Module, mesh: Any) -> str:
    """stages=3 on a 2-rank pipeline: refused before anything is sent."""
    try:
        fpipe.generate(model, prompt()[0], max_new_tokens=2, stages=3, mesh=mesh)
    except ValueError as err:
        return str(err)
    return "ran"


# fpipe.Generator's mixed stream: (prompt length, the step it is submitted before, max_new_tokens);
# 2 slots, so the later requests join slots that earlier ones freed
STREAM = [(5, 0, 6), (3, 0, 7), (9, 1, 5), (12, 3, 4), (4, 3, 6), (7, 6, 5)]
STREAM_SLOTS, STREAM_LEN = 2, 24


def stream_prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n, _, _ in STREAM]


def generator_stream(model: torch.nn.Module, eos: int | None = None, **kw: Any) -> dict[str, Any]:
    """The stream through a `fpipe.Generator` driven step by step: each request's new tokens,
    its slot, and the step counts."""
    gen = fpipe.Generator(model, max_len=STREAM_LEN, max_batch=STREAM_SLOTS, **kw)
    prompts, handles, step = stream_prompts(), {}, 0
    while len(handles) < len(STREAM) or not gen.idle:
        for i, (_, at, new) in enumerate(STREAM):
            if at == step:
                handles[i] = gen.submit(prompts[i], max_new_tokens=new, eos_token_id=eos)
        gen.step()
        step += 1
    order = sorted(handles)
    return {
        "tokens": [handles[i].new_tokens for i in order],
        "slots": [handles[i].slot for i in order],
        "steps": gen.steps,
    }


def stream_case(model: torch.nn.Module, mesh: Any, rank: int) -> dict[str, Any]:
    """The stream on a 2-rank pipeline, greedy then with an EOS id (request 0's third token in
    the greedy run); a seeded sampled request beside a greedy one (drawn on the last rank);
    then one where rank 1 submits another prompt (refused on both ranks of its
    pipeline, naming the step; the other pipeline, ranks 2 and 3, runs it)."""
    res: dict[str, Any] = {"greedy": generator_stream(model, mesh=mesh)}
    try:
        fpipe.Generator(model, max_len=STREAM_LEN, max_batch=STREAM_SLOTS, mesh=mesh, stages=4)
        res["stages4"] = "ran"
    except ValueError as err:
        res["stages4"] = str(err)
    eos = res["greedy"]["tokens"][0][2]
    res["eos"], res["eos_id"] = generator_stream(model, eos, mesh=mesh), eos
    gen = fpipe.Generator(model, max_len=STREAM_LEN, max_batch=STREAM_SLOTS, mesh=mesh)
    beside = gen.submit(stream_prompts()[0], max_new_tokens=4)
    sampled = gen.submit(stream_prompts()[3], max_new_tokens=NEW, **SAMPLING)
    gen.run()
    res["sampled"], res["beside"] = sampled.new_tokens, beside.new_tokens
    gen.submit(stream_prompts()[1 if rank == 1 else 0], max_new_tokens=2)
    try:
        gen.run()
        res["differ"] = "ran"
    except ValueError as err:
        res["differ"] = str(err)
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
    models = {}
    for name in FAMILIES:
        model = models[name] = build(name)  # one model per family: both layouts reuse its traced step
        for pp, mesh in meshes.items():
            results[f"{name}-pp{pp}"] = case(model, share, mesh)
    try:  # refused on ranks: it stalled there (docs/GENERATION.md)
        fpipe.generate(build("phi3"), prompt()[0], max_new_tokens=2, microbatches=MICROBATCHES)
        results["phi3_on_ranks"] = "ran"
    except ValueError as err:
        results["phi3_on_ranks"] = str(err)
    results["values_differ"] = values_differ(model, rank)
    for pp, mesh in meshes.items():
        results[f"stop-pp{pp}"] = early_stop(models["llama"], mesh, share)
    results["stage_local"] = stage_local(out, meshes[2], share)
    results["stage_counts"] = stage_counts(models["llama"], meshes[2])
    results["generator"] = stream_case(build("llama"), meshes[2], rank)
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
