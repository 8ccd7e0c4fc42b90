"""Which transformers models split and train with exact gradients: fpipe vs torch.distributed.pipelining.

    python scripts/models_table.py --write      # regenerate the model table in docs/MODELS.md
    python scripts/models_table.py              # the same table on stdout, with failures' last frames
    python scripts/models_table.py --check      # exit 1 if docs/MODELS.md's table is out of date
    python scripts/models_table.py --generation # greedy decoding through the pipeline: timings

The script measures the fpipe of its own checkout (it puts that checkout first on `sys.path`).
`--write` replaces what lies between the markers `<!-- models_table:begin ... -->` and
`<!-- models_table:end -->` in docs/MODELS.md, and records in the begin marker a hash of the
inputs the table depends on in this repository: every `fpipe/**/*.py` and this script.
`--check` (and tests/project/test_docs_tables.py) compares that hash with the current files: a change to
any of them makes the committed table stale until it is regenerated. A run takes about a minute
of CPU time, too slow to repeat in every test run; the hash check is instant.

Every model is a tiny random-init transformers model (2 layers, hidden 32, fp64, dropout off), used
as it is. For each one, in one process:

- fpipe: `fn, params = fpipe.functionalize(model)`, `fpipe.pipeline(loss, stages=3,
  microbatches=4)` with the loss computed in the model (`labels=`), fpipe choosing the cuts. Parity:
  the largest gradient difference against `torch.func.grad_and_value` of the unsplit loss, over
  the same microbatches (relative to the largest gradient entry).
- torch: `torch.distributed.pipelining.pipeline(model, mb_args=(), mb_kwargs=batch,
  split_spec={layer: SplitPoint.BEGINNING})` (torch.export tracing, one cut at the middle layer),
  then the split program run in this process on the microbatch it was traced with: its loss
  backward against the unsplit model's gradients (a tied weight's two copies summed). This checks
  the split, not torch's distributed runtime (which needs one process per stage).

A failure is recorded with the exception's class and first sentence, with this checkout's
absolute path removed from it (the table must not depend on where the repository lies).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # measure this checkout's fpipe, not another one installed

import fpipe  # noqa: E402

DT = torch.float64
BATCH, SEQ, MICROBATCHES, VOCAB, STAGES = 8, 8, 4, 64, 3
DOC = ROOT / "docs" / "MODELS.md"
BEGIN, END = "<!-- models_table:begin", "<!-- models_table:end -->"
WRITE = "python scripts/models_table.py --write"


# -- the models (the configs of tests/pipeline/test_hf_models.py) --------------------------------------------
def _lm_batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    pad = torch.tensor([0, 3, 1, 0, 5, 2, 0, 4])
    mask = (torch.arange(SEQ)[None, :] >= pad[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _mlm_batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    mask = (torch.arange(SEQ)[None, :] < SEQ - torch.tensor([0, 3, 1, 0, 2, 2, 0, 1])[:, None]).long()
    labels = torch.full_like(ids, -100)
    labels[:, 1], labels[:, 4] = ids[:, 1], ids[:, 4]
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _seq2seq_batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
    mask = (torch.arange(SEQ)[None, :] < SEQ - torch.tensor([0, 3, 1, 0, 2, 2, 0, 1])[:, None]).long()
    return dict(
        input_ids=ids * mask, attention_mask=mask, labels=torch.randint(2, VOCAB, (BATCH, 5), generator=g)
    )


def _image_batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return dict(
        pixel_values=torch.randn(BATCH, 3, 16, 16, generator=g, dtype=DT),
        labels=torch.randint(0, 5, (BATCH,), generator=g),
    )


def gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0,
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
        )
    )  # fmt: skip


def llama() -> nn.Module:
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
        )
    )  # fmt: skip


def bert() -> nn.Module:
    return transformers.BertForMaskedLM(
        transformers.BertConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=VOCAB,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
    )  # fmt: skip


def t5(attn: str | None = None) -> nn.Module:
    kw = {"attn_implementation": attn} if attn else {}
    return transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, d_kv=8, num_heads=4, vocab_size=VOCAB,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **kw,
        )
    )  # fmt: skip


def vit() -> nn.Module:
    return transformers.ViTForImageClassification(
        transformers.ViTConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, image_size=16,
            patch_size=4, num_channels=3, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
    )  # fmt: skip


def resnet() -> nn.Module:
    return transformers.ResNetForImageClassification(
        transformers.ResNetConfig(
            embedding_size=8,
            hidden_sizes=[32, 32],
            depths=[1, 1],
            layer_type="basic",
            num_labels=5,
            num_channels=3,
        )
    )


class GatedHead(nn.Module):
    """Custom code in a transformers model: Python control flow on a tensor's value."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.sum() > 0:
            return self.head(h)
        return self.head(-h)


def gpt2_gated() -> nn.Module:
    model = gpt2()
    model.lm_head = GatedHead(model.lm_head)
    return model


@dataclasses.dataclass(frozen=True)
class Row:
    label: str
    build: Callable[[], nn.Module]
    batch: Callable[[], dict[str, Any]]
    split_at: str  # torch pipelining: the module the second stage begins with
    no_cache: bool = False  # pass use_cache=False (a cache object is not a tensor output)


ROWS = [
    Row("GPT2LMHeadModel", gpt2, _lm_batch, "transformer.h.1", no_cache=True),
    Row("LlamaForCausalLM", llama, _lm_batch, "model.layers.1", no_cache=True),
    Row("BertForMaskedLM", bert, _mlm_batch, "bert.encoder.layer.1"),
    Row("T5ForConditionalGeneration (sdpa, the default)", t5, _seq2seq_batch, "decoder", no_cache=True),
    Row(
        "T5ForConditionalGeneration (eager attention)",
        lambda: t5("eager"),
        _seq2seq_batch,
        "decoder",
        no_cache=True,
    ),
    Row("ViTForImageClassification", vit, _image_batch, "vit.layers.1"),
    Row("ResNetForImageClassification (BatchNorm, train)", resnet, _image_batch, "resnet.encoder.stages.1"),
    Row("GPT2 + custom head with `if h.sum() > 0:`", gpt2_gated, _lm_batch, "transformer.h.1", no_cache=True),
]


# -- checks ----------------------------------------------------------------------------------------
def _fail(err: BaseException) -> str:
    return f"{type(err).__name__}: {_first_sentence(str(err))}"


def _first_sentence(message: str, limit: int = 220) -> str:
    """The first sentence of `message`'s first line, paths inside this checkout made relative."""
    first = (message.strip().splitlines() or [""])[0].replace(str(ROOT) + os.sep, "")
    first = re.sub(r"\S*[/\\]site-packages[/\\]", "", first)  # an installed package's path: from its name
    end = first.find(". ")
    first = first[: end + 1] if end >= 0 else first
    return first if len(first) <= limit else first[: limit - 1] + "…"


def _chunks(batch: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {k: (v.chunk(MICROBATCHES)[i] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        for i in range(MICROBATCHES)
    ]


def _rel_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    scale = max(v.abs().max().item() for v in ref.values())
    missing = set(ref) - set(got)
    if missing:
        raise AssertionError(f"no gradient for {sorted(missing)[:3]}")
    return max((got[k] - ref[k]).abs().max().item() for k in ref) / scale


def check_fpipe(row: Row, base: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    """Split into STAGES stages automatically; gradients against the unsplit loss."""
    model = copy.deepcopy(base)
    fn, params = fpipe.functionalize(model)

    def loss(params: dict[str, torch.Tensor], **b: Any) -> torch.Tensor:
        return fn(params, **b).loss

    piped = fpipe.pipeline(loss, stages=STAGES, microbatches=MICROBATCHES)
    try:
        value, grads = fpipe.value_and_grad(piped)(params, **batch)
    except Exception as err:
        return {"splits": _fail(err), "parity": "—", "error": traceback.format_exc()}
    (c,) = piped._cache.values()
    ops = [c.staged.programs[("F", s)].n_nodes for s in range(c.staged.n_stages)]
    costs = ", ".join(f"{x / 1e3:.0f}k" for x in c.stage_costs or [])
    ref = copy.deepcopy(base)
    buffers = {k: v.clone() for k, v in ref.named_buffers()}

    def ref_loss(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        per_mb = [torch.func.functional_call(ref, (params, buffers), (), mb).loss for mb in _chunks(batch)]
        return sum(per_mb) / MICROBATCHES

    rgrads, rvalue = torch.func.grad_and_value(ref_loss)(params, buffers)
    err = _rel_err(grads, rgrads)
    return {
        "splits": f"yes: {c.staged.n_stages} stages, {ops} forward ops, estimated costs [{costs}]",
        "parity": _parity(err),
        "err": err,
    }


def _parity(err: float) -> str:
    return f"{'yes' if err <= 1e-10 else 'NO'} (grad err {err:.1e})"


def check_torch(row: Row, base: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    """torch.distributed.pipelining.pipeline: trace + split, then the split program's gradients."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    model = copy.deepcopy(base)
    mb = _chunks(batch)[0]
    try:
        pipe = pipeline(model, mb_args=(), mb_kwargs=mb, split_spec={row.split_at: SplitPoint.BEGINNING})
    except Exception as err:
        return {"splits": _fail(err), "parity": "—", "error": traceback.format_exc()}
    n = pipe.num_stages
    splits = f"yes: {n} stages"
    try:
        # Pipe.forward detaches between stages (as the distributed runtime does); an interpreter
        # over the split program keeps one autograd graph across them.
        out = torch.fx.Interpreter(pipe.split_gm).run(*_bind(pipe.split_gm, mb))
        loss = out[0] if isinstance(out, (tuple, list)) else out
        stage_params, seen = [], set()
        for s in range(n):  # a tensor two stages share is one autograd leaf: count it once
            for name, p in pipe.get_stage_module(s).named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    stage_params.append((name, p))
        grads = torch.autograd.grad(loss, [p for _, p in stage_params], allow_unused=True)
    except Exception as err:
        return {"splits": splits, "parity": f"runs? {_fail(err)}", "error": traceback.format_exc()}
    summed: dict[str, torch.Tensor] = {}
    canonical = _canonical_names(base)
    for (name, _), g in zip(stage_params, grads):
        if g is not None:
            key = canonical.get(name, name)
            summed[key] = summed[key] + g if key in summed else g
    ref = copy.deepcopy(base)
    ref_out = ref(**mb)
    names = [k for k, _ in ref.named_parameters()]
    rgrads = dict(zip(names, torch.autograd.grad(ref_out.loss, [p for _, p in ref.named_parameters()])))
    try:
        err = _rel_err(summed, rgrads)
    except AssertionError as e:
        return {"splits": splits, "parity": f"NO: {e}"}
    return {"splits": splits, "parity": _parity(err), "err": err}


def _bind(gm: torch.fx.GraphModule, kwargs: dict[str, Any]) -> list[Any]:
    """The split program's placeholders (the model's keyword arguments, in order) from `kwargs`."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [kwargs[n.target] if n.target in kwargs else (n.args[0] if n.args else None) for n in phs]


def _canonical_names(model: nn.Module) -> dict[str, str]:
    """Every name of a parameter (tied ones have several) -> its first name."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def table() -> tuple[str, str]:
    """The markdown table, and the failures' last frames (for stdout, not for the doc)."""
    lines = [
        "| model | fpipe: splits | fpipe: trains with parity | torch pipelining: splits | torch pipelining: parity |",
        "|---|---|---|---|---|",
    ]
    details = []
    for row in ROWS:
        torch.manual_seed(0)
        base = row.build().to(DT).train()
        batch = row.batch()
        if row.no_cache:
            batch["use_cache"] = False
        f, t = check_fpipe(row, base, batch), check_torch(row, base, batch)
        lines.append(f"| {row.label} | {f['splits']} | {f['parity']} | {t['splits']} | {t['parity']} |")
        print(lines[-1], file=sys.stderr, flush=True)
        for lib, res in (("fpipe", f), ("torch", t)):
            if "error" in res:
                details.append(f"--- {row.label}, {lib}:\n{_key_lines(res['error'])}")
    return "\n".join(lines), "\n".join(details)


def _key_lines(tb: str, n: int = 6) -> str:
    lines = [ln for ln in tb.strip().splitlines() if ln.strip()]
    return "\n".join(lines[-n:])


# -- generation timings ----------------------------------------------------------------------------
def generation(prompt_len: int, new: int, batch: int, stages: int, repeat: int = 3) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_generate import build, fixed, growing  # the decode loops the tests check

    model = build("gpt2")
    ids = torch.randint(0, VOCAB, (batch, prompt_len), generator=torch.Generator().manual_seed(3))
    fn, params = fpipe.functionalize(model)
    rows: list[tuple[str, float, float]] = []

    def timed(run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        out = run()
        return out, time.perf_counter() - t0, time.process_time() - c0

    def best(label: str, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        runs = [timed(run) for _ in range(repeat)]
        rows.append((label, min(r[1] for r in runs), min(r[2] for r in runs)))
        return runs[0][0]

    with torch.no_grad():
        growing(fn, stages, 2)[1](params, ids[:, :2], 1)  # warm-up: the process's first trace is slower
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
        ref = best("model.generate (unsplit, KV cache)", lambda: model.generate(ids, **kw))

        def recompute() -> torch.Tensor:
            out = ids
            for _ in range(new):
                nxt = model(input_ids=out, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                out = torch.cat([out, nxt], 1)
            return out

        assert torch.equal(best("unsplit model, no cache (prefix recomputed)", recompute), ref)
        for name, loop in (("growing", growing), ("fixed", fixed)):
            piped, gen = loop(fn, stages=stages, microbatches=2)
            out, wall, cpu = timed(lambda gen=gen: gen(params, ids, new))
            assert torch.equal(out, ref), (name, out, ref)
            n = len(piped._cache)
            rows.append((f"fpipe {name}: first run ({n} trace{'s' if n > 1 else ''} + split)", wall, cpu))
            assert torch.equal(
                best(f"fpipe {name}: later runs (programs cached)", lambda gen=gen: gen(params, ids, new)),
                ref,
            )
            rows.append(("  = per trace + split", (wall - rows[-1][1]) / n, (cpu - rows[-1][2]) / n))
    head = (
        f"Greedy decoding, GPT-2 (2 layers, hidden 32, fp64), batch {batch}, prompt {prompt_len}, {new} new "
        f"tokens; fpipe stages={stages}, microbatches=2; {torch.get_num_threads()} torch threads; best of "
        f"{repeat} except first runs.\n\n| run | wall s | CPU s |\n|---|---|---|"
    )
    return "\n".join([head, *(f"| {label} | {w:.2f} | {c:.2f} |" for label, w, c in rows)])


# -- the table in docs/MODELS.md ------------------------------------------------------------------
def inputs_hash(root: Path = ROOT) -> str:
    """A hash of what the table depends on in the repository at `root`: fpipe/**/*.py and this
    script (paths relative to `root`, line endings normalised; caches and other files ignored)."""
    files = sorted([*(root / "fpipe").rglob("*.py"), root / "scripts" / "models_table.py"])
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        h.update(f.read_bytes().replace(b"\r\n", b"\n") + b"\0")
    return h.hexdigest()[:16]


_SECTION = re.compile(
    re.escape(BEGIN) + r" inputs=(?P<hash>\w*)[^\n]*-->\n(?P<body>.*?)" + re.escape(END), re.S
)


def section(doc: str) -> re.Match[str]:
    """The one generated section of `doc` (its stored hash and its body)."""
    found = list(_SECTION.finditer(doc))
    if len(found) != 1:
        raise ValueError(f"expected one `{BEGIN} inputs=... -->` ... `{END}` section, found {len(found)}")
    return found[0]


def with_table(doc: str, body: str, digest: str) -> str:
    """`doc` with its generated section replaced by `body`, stamped with `digest`."""
    m = section(doc)
    begin = f"{BEGIN} inputs={digest} (generated by `{WRITE}`: do not edit by hand) -->"
    return doc[: m.start()] + f"{begin}\n{body.rstrip()}\n{END}" + doc[m.end() :]


def stale(doc_path: Path = DOC, root: Path = ROOT) -> str | None:
    """Why the committed table is out of date, or None if it was generated from the current inputs."""
    stored, now = section(doc_path.read_text())["hash"], inputs_hash(root)
    if stored == now:
        return None
    return (
        f"{doc_path.relative_to(root).as_posix()}: the model table was generated from inputs with hash "
        f"{stored or '(none)'}, but fpipe/**/*.py and scripts/models_table.py now hash to {now}. "
        f"Regenerate it with `{WRITE}` (about a minute of CPU) and commit the result."
    )


def doc_body(rows: str) -> str:
    return f"Generated with torch {torch.__version__} and transformers {transformers.__version__}:\n\n{rows}"


def _commit() -> str:
    """The git commit of the fpipe being measured (it may be imported from another checkout)."""
    import subprocess

    where = os.path.dirname(os.path.abspath(fpipe.__file__))
    try:
        out = subprocess.run(
            ["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "-C", where, "status", "--porcelain", "--", "."], capture_output=True, text=True
        )
        return out.stdout.strip() + (" (+ uncommitted changes)" if dirty.stdout.strip() else "")
    except OSError:
        return "(unknown commit)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = p.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true", help=f"write the table into {DOC.relative_to(ROOT)}")
    what.add_argument("--check", action="store_true", help="exit 1 if the table there is out of date")
    what.add_argument("--generation", action="store_true", help="time greedy decoding instead")
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args()
    if args.check:
        why = stale()
        print(why or f"{DOC.relative_to(ROOT)}: the model table is up to date")
        sys.exit(1 if why else 0)
    transformers.logging.set_verbosity_error()
    print(f"fpipe {_commit()}, torch {torch.__version__}, transformers {transformers.__version__}\n")
    if args.generation:
        print(generation(args.prompt, args.new, args.batch, stages=2))
        return
    digest = inputs_hash()  # before the run: a source edited meanwhile makes the table stale, not wrong
    rows, failures = table()
    print(rows + "\n\nFailures (last frames):\n\n" + failures)
    if args.write:
        DOC.write_text(with_table(DOC.read_text(), doc_body(rows), digest))
        print(f"\nwrote the table into {DOC.relative_to(ROOT)} (inputs {digest})")


if __name__ == "__main__":
    main()
