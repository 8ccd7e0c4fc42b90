"""Hugging Face `transformers` models, as they are, train through fpipe with exact gradients.

Each model is built from a tiny config (2 layers, hidden 32, dropout off, fp64, random init, no
download) and used unchanged: `fn, params = fpipe.functionalize(model)`, a loss function that
calls `fn(params, **batch).loss` (the loss computed inside the model from `labels=`, keyword
arguments, attention masks, a `ModelOutput` return value), `fpipe.pipeline(loss, stages=N)` with
no stage boundary anywhere (fpipe chooses the cuts). The pipelined loss and gradients are compared
with `torch.func.grad_and_value` of the same loss function, unsplit, on the whole batch (fp64,
within 1e-10 of the largest gradient entry).

How each model's loss relates to microbatching decides the reference:
- causal LMs (GPT-2, Llama) average over the non-padding tokens of the *whole* batch through
  transformers' own `num_items_in_batch` keyword, so the pipeline sums microbatch losses
  (`out_axes="sum"`) and the result is the whole-batch token mean whatever the padding is;
- BERT, T5 and ViT average per call (`CrossEntropyLoss()`); every microbatch has the same number of
  labelled tokens, so the mean over microbatches is the whole-batch mean;
- ResNet trains its BatchNorm statistics per microbatch: the reference runs the unsplit model on
  each microbatch in order with the buffers passed to `functional_call` explicitly, and the running
  statistics are compared with eager training over the same microbatches.

Transformers computes the causal-LM loss in float32 even for a float64 model (`logits.float()` in
`ForCausalLMLoss`); their loss *value* therefore agrees with the whole-batch reference only to
float32 rounding (the gradients are unaffected: the per-token gradient of a sum is split-invariant),
and is compared exactly with the same float32 sum taken microbatch by microbatch.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fpipe

transformers = pytest.importorskip("transformers")

DT = torch.float64
TOL = 1e-10  # relative to the largest entry of the reference tree
BATCH, SEQ, MICROBATCHES, VOCAB = 8, 8, 4, 64
STAGES = [2, 3, 4]
SCHEDULE = {2: "gpipe", 3: "1f1b", 4: "1f1b"}


# -- tiny configs ---------------------------------------------------------------------------------
def gpt2_config(**kw: Any) -> Any:
    base = dict(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    base.update(dict(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0))
    base.update(kw)
    return transformers.GPT2Config(**base)


def llama_config(**kw: Any) -> Any:
    base = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4)
    base.update(
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0, eos_token_id=0
    )
    base.update(kw)
    return transformers.LlamaConfig(**base)


def bert_config(**kw: Any) -> Any:
    base = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4)
    base.update(
        vocab_size=VOCAB,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    base.update(kw)
    return transformers.BertConfig(**base)


def t5_config(**kw: Any) -> Any:
    base = dict(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, d_kv=8, num_heads=4)
    base.update(vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    base.update(kw)
    return transformers.T5Config(**base)


def vit_config(**kw: Any) -> Any:
    base = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4)
    base.update(image_size=16, patch_size=4, num_channels=3, num_labels=5)
    base.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    base.update(kw)
    return transformers.ViTConfig(**base)


def resnet_config(**kw: Any) -> Any:
    # basic blocks: with bottlenecks this small the 7x7 stem would be most of the work (see
    # test_partition_gives_every_stage_work)
    base = dict(embedding_size=8, hidden_sizes=[32, 32], depths=[1, 1], layer_type="basic", num_labels=5)
    base.update(num_channels=3)
    base.update(kw)
    return transformers.ResNetConfig(**base)


# -- batches (keyword arguments of the model's forward) --------------------------------------------
def _gen(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def lm_batch() -> dict[str, torch.Tensor]:
    """Left-padded rows of different lengths; padding is neither attended to nor predicted."""
    g = _gen()
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    pad = torch.tensor([0, 3, 1, 0, 5, 2, 0, 4])  # different counts per microbatch of 2 rows
    mask = (torch.arange(SEQ)[None, :] >= pad[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    n_items = (labels[:, 1:] != -100).sum()  # the tokens the whole batch predicts (0-dim: not split)
    return dict(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n_items)


def mlm_batch() -> dict[str, torch.Tensor]:
    """Right padding of different lengths; two masked positions per row (equal per microbatch)."""
    g = _gen()
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    pad = torch.tensor([0, 3, 1, 0, 2, 2, 0, 1])
    mask = (torch.arange(SEQ)[None, :] < SEQ - pad[:, None]).long()
    labels = torch.full_like(ids, -100)
    labels[:, 1], labels[:, 4] = ids[:, 1], ids[:, 4]
    token_type_ids = (torch.arange(SEQ)[None, :] >= SEQ // 2).long().expand(BATCH, SEQ).contiguous()
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=token_type_ids, labels=labels)


def seq2seq_batch() -> dict[str, torch.Tensor]:
    g = _gen()
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
    pad = torch.tensor([0, 3, 1, 0, 2, 2, 0, 1])
    mask = (torch.arange(SEQ)[None, :] < SEQ - pad[:, None]).long()
    labels = torch.randint(2, VOCAB, (BATCH, 5), generator=g)
    return dict(input_ids=ids * mask, attention_mask=mask, labels=labels)


def image_batch() -> dict[str, torch.Tensor]:
    g = _gen()
    return dict(
        pixel_values=torch.randn(BATCH, 3, 16, 16, generator=g, dtype=DT),
        labels=torch.randint(0, 5, (BATCH,), generator=g),
    )


@dataclasses.dataclass(frozen=True)
class Spec:
    build: Callable[[], nn.Module]
    batch: Callable[[], dict[str, torch.Tensor]]
    out_axes: str = "mean"  # how the pipeline combines the microbatch losses
    fp32_loss: bool = False  # transformers computes this model's loss in float32
    batchnorm: bool = False


SPECS: dict[str, Spec] = {
    "gpt2": Spec(lambda: transformers.GPT2LMHeadModel(gpt2_config()), lm_batch, "sum", fp32_loss=True),
    "llama": Spec(lambda: transformers.LlamaForCausalLM(llama_config()), lm_batch, "sum", fp32_loss=True),
    "bert": Spec(lambda: transformers.BertForMaskedLM(bert_config()), mlm_batch),
    # attn_implementation="eager": see test_t5_sdpa (a learned attention bias through SDPA)
    "t5": Spec(
        lambda: transformers.T5ForConditionalGeneration(t5_config(attn_implementation="eager")), seq2seq_batch
    ),
    "vit": Spec(lambda: transformers.ViTForImageClassification(vit_config()), image_batch),
    "resnet": Spec(
        lambda: transformers.ResNetForImageClassification(resnet_config()), image_batch, batchnorm=True
    ),
}


def loss_of(fn: fpipe.Functionalized) -> Callable[..., torch.Tensor]:
    def loss(params: dict[str, torch.Tensor], **batch: torch.Tensor) -> torch.Tensor:
        out = fn(params, **batch)
        assert isinstance(out, transformers.utils.ModelOutput)
        return out.loss

    return loss


# -- comparisons -----------------------------------------------------------------------------------
def assert_close(actual: Any, expected: Any, tol: float = TOL) -> None:
    """Same keys, dtypes and shapes; every entry within `tol` of the largest entry of `expected`
    (norm-wise: a gradient that is zero in exact arithmetic, like a key bias under softmax, is
    compared at the scale of the whole tree, not at its own rounding noise)."""
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected)
        a, e = [actual[k] for k in sorted(expected)], [expected[k] for k in sorted(expected)]
    else:
        a, e = [actual], [expected]
    scale = max(x.abs().max().item() for x in e)
    for x, y in zip(a, e):
        assert x.dtype == y.dtype and x.shape == y.shape
        torch.testing.assert_close(x, y, rtol=tol, atol=tol * scale)


def compiled(piped: fpipe.Pipelined) -> Any:
    (entry,) = piped._cache.values()
    return entry


def forward_ops(piped: fpipe.Pipelined) -> list[int]:
    """Operations in each stage's forward program."""
    st = compiled(piped).staged
    return [st.programs[("F", s)].n_nodes for s in range(st.n_stages)]


# -- references (one per model, shared by the stage counts) ----------------------------------------
@dataclasses.dataclass
class Case:
    model: nn.Module
    params: dict[str, torch.Tensor]
    batch: dict[str, torch.Tensor]
    loss: Callable[..., torch.Tensor]
    ref_loss: torch.Tensor
    ref_grads: dict[str, torch.Tensor]
    mb_loss: torch.Tensor | None  # the loss summed microbatch by microbatch, as the pipeline does
    ref_buffers: dict[str, torch.Tensor] | None = None
    eager_buffers: dict[str, torch.Tensor] | None = None


def _chunks(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    split = {k: (v.chunk(MICROBATCHES) if v.dim() else [v] * MICROBATCHES) for k, v in batch.items()}
    return [{k: v[i] for k, v in split.items()} for i in range(MICROBATCHES)]


def _make_case(name: str) -> Case:
    spec = SPECS[name]
    torch.manual_seed(0)
    model = spec.build().to(DT).train()
    batch = spec.batch()
    fn, params = fpipe.functionalize(model)
    loss = loss_of(fn)
    if spec.batchnorm:
        return _batchnorm_case(model, params, batch, loss)
    grads, value = torch.func.grad_and_value(loss)(params, **batch)
    mb_loss = None
    if spec.fp32_loss:
        with torch.no_grad():
            mb_loss = sum(loss(params, **c) for c in _chunks(batch))
    return Case(model, params, batch, loss, value, grads, mb_loss)


def _batchnorm_case(model: nn.Module, params: dict, batch: dict, loss: Callable[..., torch.Tensor]) -> Case:
    """BatchNorm in training mode: statistics per microbatch, buffers updated in order."""
    base = copy.deepcopy(model)
    ref = copy.deepcopy(model)
    buffers = {k: v.clone() for k, v in ref.named_buffers()}

    def ref_loss(params: dict, buffers: dict, **batch: torch.Tensor) -> torch.Tensor:
        losses = [torch.func.functional_call(ref, (params, buffers), (), c).loss for c in _chunks(batch)]
        return sum(losses) / MICROBATCHES

    grads, value = torch.func.grad_and_value(ref_loss)(params, buffers, **batch)
    eager = copy.deepcopy(base)
    with torch.no_grad():
        for c in _chunks(batch):
            eager(**c)
    return Case(base, params, batch, loss, value, grads, None, buffers, dict(eager.named_buffers()))


@functools.cache
def case_of(name: str) -> Case:
    """The model, batch and reference of `name`, built once per test session."""
    return _make_case(name)


# -- the tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "stages"),
    [pytest.param(name, s, id=f"{name}-{s}") for name in SPECS for s in STAGES],
)
def test_trains_with_exact_gradients(name, stages):
    spec, case = SPECS[name], case_of(name)
    model = copy.deepcopy(case.model)  # BatchNorm statistics start from the same values each time
    fn, params = fpipe.functionalize(model)
    piped = fpipe.pipeline(
        loss_of(fn),
        stages=stages,
        microbatches=MICROBATCHES,
        schedule=SCHEDULE[stages],
        out_axes=spec.out_axes,
    )
    loss, grads = fpipe.value_and_grad(piped)(params, **case.batch)

    ops = forward_ops(piped)
    assert len(ops) == stages and min(ops) > 0, f"stage forward programs: {ops} operations"
    assert_close(grads, case.ref_grads)
    if spec.fp32_loss:
        assert loss.dtype == torch.float32
        assert_close(loss, case.mb_loss)
        torch.testing.assert_close(loss, case.ref_loss, rtol=1e-6, atol=0)
    else:
        assert_close(loss, case.ref_loss)
    if spec.batchnorm:
        for k, v in model.named_buffers():
            if v.is_floating_point():
                assert_close(v, case.ref_buffers[k])
                assert_close(v, case.eager_buffers[k])
                assert not torch.equal(v, dict(case.model.named_buffers())[k]), f"{k} did not train"
            else:
                assert v.item() == case.ref_buffers[k].item() == case.eager_buffers[k].item() == MICROBATCHES


def test_model_output_is_returned_whole():
    """A forward-only call returns the `ModelOutput` (a pytree): loss averaged, logits concatenated."""
    case = case_of("gpt2")
    fn = fpipe.functionalize(case.model)[0]
    piped = fpipe.pipeline(lambda p, **b: fn(p, use_cache=False, **b), stages=2, microbatches=MICROBATCHES)
    batch = {k: v for k, v in case.batch.items() if k != "num_items_in_batch"}
    out = piped(case.params, **batch)
    with torch.no_grad():
        ref = case.model(use_cache=False, **batch)
    assert type(out) is type(ref) and list(out.keys()) == ["loss", "logits"]
    assert not out.logits.requires_grad
    assert_close(out.logits, ref.logits)
    chunk_losses = [case.model(use_cache=False, **c).loss.detach() for c in _chunks(batch)]
    assert_close(out.loss, sum(chunk_losses) / MICROBATCHES)


def test_aux_logits_with_the_loss():
    case = case_of("llama")
    fn = fpipe.functionalize(case.model)[0]

    def loss_and_logits(params, **batch):
        out = fn(params, **batch)
        return out.loss, out.logits

    piped = fpipe.pipeline(loss_and_logits, stages=3, microbatches=MICROBATCHES, out_axes=("sum", 0))
    (loss, logits), grads = fpipe.value_and_grad(piped, has_aux=True)(case.params, **case.batch)
    assert_close(grads, case.ref_grads)
    with torch.no_grad():
        assert_close(logits, case.model(**case.batch).logits)


def test_t5_sdpa():
    """T5's relative position bias is a learned `attn_mask` of scaled_dot_product_attention."""
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(t5_config(attn_implementation="sdpa")).to(DT)
    model.load_state_dict(case_of("t5").model.state_dict())
    fn, params = fpipe.functionalize(model)
    piped = fpipe.pipeline(loss_of(fn), stages=2, microbatches=MICROBATCHES)
    loss, grads = fpipe.value_and_grad(piped)(params, **case_of("t5").batch)
    assert_close(grads, case_of("t5").ref_grads)


def test_partition_gives_every_stage_work():
    """A ResNet whose 7x7 stem is ~90% of the estimated cost (bottleneck blocks of width 2-4)."""
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(
        resnet_config(layer_type="bottleneck", hidden_sizes=[8, 16])
    )
    fn, params = fpipe.functionalize(model.to(DT).train())
    piped = fpipe.pipeline(loss_of(fn), stages=3, microbatches=MICROBATCHES)
    fpipe.value_and_grad(piped)(params, **image_batch())
    ops = forward_ops(piped)
    assert min(ops) > 0, (
        f"stage forward programs: {ops} operations, estimated costs {compiled(piped).stage_costs}"
    )


# -- dropout: not comparable with the unsplit model, but reproducible ---------------------------------
def test_dropout_is_reproducible():
    """fpipe seeds each random operation from (torch.initial_seed(), step, microbatch, operation):
    the same seed gives the same losses and gradients in a fresh pipeline (run to run), whatever
    the number of stages; the steps of one run and another seed draw other masks. (They are not
    the masks the unsplit model draws from the running generator: see fpipe/_src/tracing/rng.py.) One
    block: each of the four pipelines traces the model, and one block already holds every kind of
    dropout (embedding, attention, residual), cut over 2 and 3 stages."""
    torch.manual_seed(0)
    config = gpt2_config(n_layer=1, attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)
    model = transformers.GPT2LMHeadModel(config).to(DT).train()
    fn, params = fpipe.functionalize(model)
    batch = lm_batch()

    def run(stages: int, seed: int) -> tuple[list[float], torch.Tensor]:
        piped = fpipe.pipeline(
            loss_of(fn), stages=stages, microbatches=MICROBATCHES, schedule=SCHEDULE[stages], out_axes="sum"
        )
        torch.manual_seed(seed)
        losses, grads = [], None
        for _ in range(2):
            loss, grads = fpipe.value_and_grad(piped)(params, **batch)
            losses.append(loss.item())
        return losses, grads["transformer.h.0.attn.c_attn.weight"]

    first, g1 = run(2, seed=7)
    again, g2 = run(2, seed=7)
    three, g3 = run(3, seed=7)
    other, _ = run(2, seed=8)
    assert first == again and torch.equal(g1, g2)  # run to run: bitwise
    assert_close(torch.tensor(three), torch.tensor(first), tol=1e-6)  # float32 loss values
    assert_close(g3, g1)
    assert first[0] != first[1] and other[0] != first[0]  # the masks are random: dropout is on
    model.eval()
    with torch.no_grad():
        assert loss_of(fn)(params, **batch).item() not in first


# -- a model that cannot be traced ---------------------------------------------------------------------
class GatedHead(nn.Module):
    """Custom code dropped into a transformers model: a branch on a tensor's value."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.sum() > 0:  # data-dependent Python control flow
            return self.head(h)
        return self.head(-h)


def test_untraceable_model_names_the_line():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config()).to(DT)
    model.lm_head = GatedHead(model.lm_head)
    fn, params = fpipe.functionalize(model)
    src, first = inspect.getsourcelines(GatedHead.forward)
    line = first + next(i for i, s in enumerate(src) if "if h.sum() > 0:" in s)
    piped = fpipe.pipeline(lambda p, ids: fn(p, input_ids=ids, labels=ids).loss, stages=2, microbatches=2)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=_gen())
    with pytest.raises(ValueError, match=re.escape(f"{__file__}:{line} (`if h.sum() > 0:")) as err:
        fpipe.value_and_grad(piped)(params, ids)
    assert "depends on the value of a tensor" in str(err.value)
    with pytest.raises(ValueError, match=re.escape(f"{__file__}:{line} ")):
        piped(params, ids)  # the forward-only call traces the same way
