"""`fpipe.generate(model_on_meta, ..., weights=path)`: a model built on the meta device gets only
the tensors its stages read, from a `save_pretrained` folder or an `fpipe.save` checkpoint
(NOTE [stage-local weights]); and the order ranks walk their stages in (NOTE [several stages
per rank]), simulated. One process here (every stage is this process's, so every tensor is
loaded); the per-rank share, several stages per rank and the fit test run on ranks
(tests/generate/test_generate_cache.py). Tiny Llamas in float64, compared with the unsplit
`model.generate(..., do_sample=False)` of the model the weights were saved from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fpipe

transformers = pytest.importorskip("transformers")

from fpipe._src.generate.stage_weights import resident_bytes  # noqa: E402

VOCAB, NEW = 64, 5


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def config(tie: bool = False) -> object:
    return transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, vocab_size=VOCAB, pad_token_id=0,
        bos_token_id=None, eos_token_id=None, initializer_range=0.3, tie_word_embeddings=tie,
    )  # fmt: skip


def real(tie: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config(tie)).to(torch.float64).eval()


def on_meta(tie: bool = False) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config(tie)).to(torch.float64).eval()


def prompt() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))


def expected(model: torch.nn.Module) -> torch.Tensor:
    ids = prompt()
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)


@pytest.mark.parametrize("tie", [False, True])
def test_a_meta_model_from_save_pretrained_equals_generate(tmp_path, tie):
    """The rotary inv_freq (a non-persistent buffer, not in the files) is rebuilt by the model's
    _init_weights: tokens equal; a tied lm_head is read under the embedding's name."""
    model = real(tie)
    model.save_pretrained(tmp_path)
    meta = on_meta(tie)
    out = fpipe.generate(meta, prompt(), max_new_tokens=NEW, stages=2, weights=tmp_path)
    assert torch.equal(out, expected(model)), out
    # one process: every tensor the programs read (tied ones once); the rotary module's
    # original_inv_freq (read only by dynamic rope) is read by none: it stays on meta
    assert meta.model.rotary_emb.original_inv_freq.is_meta
    count, nbytes = resident_bytes(model)
    assert resident_bytes(meta) == (count - 1, nbytes - model.model.rotary_emb.original_inv_freq.nbytes)
    assert torch.equal(meta.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    assert (
        fpipe.generate(meta, prompt(), max_new_tokens=NEW, stages=2).tolist() == out.tolist()
    )  # loaded once


def test_a_meta_model_from_an_fpipe_checkpoint_equals_generate(tmp_path):
    model = real()
    fpipe.save(tmp_path / "ckpt", fpipe.functionalize(model)[1])
    out = fpipe.generate(on_meta(), prompt(), max_new_tokens=NEW, stages=2, weights=tmp_path / "ckpt")
    assert torch.equal(out, expected(model)), out


def test_what_weights_cannot_honour_is_refused(tmp_path, monkeypatch):
    model = real()
    model.save_pretrained(tmp_path / "a")
    with pytest.raises(ValueError, match=r"are on the meta device; pass weights=<a save_pretrained folder"):
        fpipe.generate(on_meta(), prompt(), max_new_tokens=2)
    with pytest.raises(
        ValueError, match=r"this model has real parameters or buffers \(they would be overwritten\)"
    ):
        fpipe.generate(model, prompt(), max_new_tokens=2, weights=tmp_path / "a")
    meta = on_meta()
    fpipe.generate(meta, prompt(), max_new_tokens=2, weights=tmp_path / "a")
    with pytest.raises(ValueError, match=r"were loaded from .*/a'; weights=.*/b' differs"):
        fpipe.generate(meta, prompt(), max_new_tokens=2, weights=tmp_path / "b")
    with pytest.raises(FileNotFoundError):
        fpipe.generate(on_meta(), prompt(), max_new_tokens=2, weights=tmp_path / "missing")


def test_a_buffer_nothing_rebuilds_is_refused_by_name(tmp_path, monkeypatch):
    """Without the model's _init_weights the rotary inv_freq would be whatever memory held: refused."""
    real().save_pretrained(tmp_path)
    meta = on_meta()
    monkeypatch.setattr(type(meta), "_init_weights", lambda self, module: None)
    with pytest.raises(
        ValueError, match=r"the buffers \['model.rotary_emb.inv_freq'\] are not in .* did not rebuild them"
    ):
        fpipe.generate(meta, prompt(), max_new_tokens=2, weights=tmp_path)


def test_safetensors_are_read_straight_into_the_parameters(tmp_path):
    """A memory map's pages counted in the resident memory while the file was open: a loading
    rank's peak was twice its weights. The reader reads the bytes into the parameters."""
    from fpipe._src.training import checkpoint_hf as hf

    model = real()
    model.save_pretrained(tmp_path)
    params = {n: torch.empty_like(p) for n, p in model.named_parameters()}
    params["lm_head.weight"] = torch.empty_like(params["lm_head.weight"], dtype=torch.float32)  # a cast
    hf.read_whole("t", hf.safetensors_index("t", Path(tmp_path)), params)
    for n, p in model.named_parameters():
        assert torch.equal(params[n], p.detach().to(params[n].dtype)), n


@pytest.mark.parametrize(
    ("steps", "microbatches", "stages", "ranks"),
    [(3, 1, 4, 2), (4, 2, 4, 2), (3, 4, 4, 2), (5, 3, 6, 3), (2, 2, 2, 2), (3, 5, 6, 2)],
)
def test_the_walk_order_never_waits_on_a_waiting_peer(steps, microbatches, stages, ranks):
    """NOTE [several stages per rank]: each rank blocks on its operations' inputs in its order;
    simulated, every rank finishes (no two ranks wait on each other), and each stage takes its
    (step, microbatch)s in order (so a stage pair's channel is first in, first out)."""
    from fpipe._src.generate.decode_walk import walk_order

    orders = [walk_order(steps, microbatches, stages, list(range(r, stages, ranks))) for r in range(ranks)]
    done: set[tuple[int, int, int]] = set()

    def ready(t: int, i: int, s: int) -> bool:
        return (t, i, s - 1) in done if s else t == 0 or (t - 1, i, stages - 1) in done

    heads = [0] * ranks
    while any(h < len(o) for h, o in zip(heads, orders)):
        moved = False
        for r, order in enumerate(orders):
            while heads[r] < len(order) and ready(*order[heads[r]]):
                done.add(order[heads[r]])
                heads[r], moved = heads[r] + 1, True
        assert moved, f"deadlock: rank heads {[o[h] for h, o in zip(heads, orders) if h < len(o)]}"
    for s in range(stages):
        mine = [(t, i) for t, i, st in orders[s % ranks] if st == s]
        assert mine == sorted(mine)
    expected = steps * microbatches * stages + microbatches  # every operation, the last receives
    assert sum(map(len, orders)) == expected
