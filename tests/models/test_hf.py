"""Engram injected into Hugging Face causal LMs: identity at start, cached generation == full
recompute, adapters round-trip and refuse foreign bases. Tiny random models of each family, with a
real byte-level BPE tokenizer trained offline on a slice of the KJV (so its compression is real)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engram import EngramConfig  # noqa: E402
from engram.artifacts.adapter import load_engram, save_engram  # noqa: E402
from engram.models.adapter import AdapterMismatch  # noqa: E402
from engram.models.hf import eject, engram_runtime, freeze_base, inject  # noqa: E402
from engram.retrieval.compress import build_compression  # noqa: E402

PROMPTS = ["In the beginning God created the heaven", "And the earth was"]
NEW = 8


@pytest.fixture(scope="module")
def comp(tok):
    return build_compression(tok, cache=False)


def ecfg(**kw):
    base = dict(engram_vocab_size=[101, 211], max_ngram_size=3, n_embed_per_ngram=16,
                n_head_per_ngram=4, layer_ids=[0, 1], pad_id=0)
    return EngramConfig(**{**base, **kw})


FAMILIES = ("llama", "qwen2", "mistral", "gpt2")


def tiny_model(family, vocab, seed=0, hidden=32):
    t = transformers
    ids = dict(pad_token_id=0, eos_token_id=1, bos_token_id=1)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, **ids)
    make = {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**common)),
        "qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**common)),
        "mistral": lambda: t.MistralForCausalLM(t.MistralConfig(**common, sliding_window=None)),
        "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=2,
                                                       n_head=4, n_positions=64, **ids)),
    }[family]
    torch.manual_seed(seed)
    return make().eval()


def batch(tok):
    enc = tok(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    return enc.input_ids, enc.attention_mask


def randomise(model, std=0.5):
    """Make the memory matter: random tables, projections and conv (zero-init would hide bugs)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in engram_runtime(model).engram_parameters():
            p.normal_(0, std)


def full_logits(model, seq, mask):
    """Logits of a full recompute (no cache), positions as generate() derives them."""
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        return model(seq, attention_mask=mask, position_ids=pos, use_cache=False).logits


def injected(family, tok, comp, **kw):
    model = tiny_model(family, len(tok))
    inject(model, ecfg(**kw), compression=comp)
    randomise(model)
    return model


# -- identity at start ----------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_zero_init_leaves_logits_equal(family, tok, comp):
    model = tiny_model(family, len(tok))
    ids, mask = batch(tok)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        inject(model, ecfg(), tokenizer=tok)
        assert torch.equal(model(ids, attention_mask=mask).logits, ref)
        # The memory is really there: random parameters change the logits...
        randomise(model)
        assert not torch.allclose(model(ids, attention_mask=mask).logits, ref, atol=1e-3)
        # ... and eject gives back the exact base model.
        eject(model)
        assert torch.equal(model(ids, attention_mask=mask).logits, ref)
    assert not any("engram" in k for k in model.state_dict())


# -- generation keeps the history -----------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_cached_greedy_generate_equals_full_recompute(family, tok, comp):
    model = injected(family, tok, comp)
    ids, mask = batch(tok)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    full_mask = torch.cat([mask, torch.ones(len(ids), NEW, dtype=mask.dtype)], dim=1)
    full = full_logits(model, out.sequences, full_mask)
    steps = torch.stack(out.logits, dim=1)  # [b, NEW, V]
    torch.testing.assert_close(steps, full[:, ids.shape[1] - 1:-1], atol=1e-5, rtol=1e-5)
    no_cache = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              use_cache=False, pad_token_id=0)
    assert torch.equal(no_cache, out.sequences)


def test_cached_sampling_equals_full_recompute(tok, comp):
    model = injected("llama", tok, comp)
    ids, mask = batch(tok)
    torch.manual_seed(123)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=0,
                         return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    full_mask = torch.cat([mask, torch.ones(len(ids), NEW, dtype=mask.dtype)], dim=1)
    full = full_logits(model, out.sequences, full_mask)
    torch.testing.assert_close(torch.stack(out.logits, 1), full[:, ids.shape[1] - 1:-1],
                               atol=1e-5, rtol=1e-5)
    torch.manual_seed(123)
    again = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=0,
                           use_cache=False, pad_token_id=0)
    assert torch.equal(again, out.sequences)


def test_beam_search_reorders_the_history(tok, comp):
    model = injected("llama", tok, comp)
    ids, mask = batch(tok)
    kw = dict(attention_mask=mask, max_new_tokens=NEW, num_beams=3, do_sample=False,
              pad_token_id=0, early_stopping=True)
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))


def test_chunked_forward_with_cache_equals_one_pass(tok, comp):
    """Prefill, then several multi-token chunks through the same cache (the hasher and the conv
    carry their context across calls)."""
    model = injected("qwen2", tok, comp)
    seq = tok(PROMPTS[0] + " and the earth", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model(seq, use_cache=False).logits
        cache, parts = None, []
        for a, b in ((0, 4), (4, 5), (5, 9), (9, seq.shape[1])):
            out = model(seq[:, a:b], cache=cache, use_cache=True)
            cache = out.cache
            parts.append(out.logits)
    torch.testing.assert_close(torch.cat(parts, 1), ref, atol=1e-5, rtol=1e-5)


def test_left_padded_row_matches_unpadded(tok, comp):
    """Padding is dead to the hasher and feeds zeros to the conv: the padded row sees no pads."""
    model = injected("llama", tok, comp)
    ids, mask = batch(tok)
    alone = tok(PROMPTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model(alone).logits[0]
    padded = full_logits(model, ids, mask)[1, -alone.shape[1]:]
    torch.testing.assert_close(padded, ref, atol=1e-5, rtol=1e-5)


def test_foreign_cache_and_embeds_refused(tok, comp):
    model = tiny_model("llama", len(tok))
    seq = tok(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        cache = model(seq, use_cache=True).past_key_values  # made before Engram saw the tokens
        inject(model, ecfg(), compression=comp)
        with pytest.raises(RuntimeError, match="token history"):
            model(seq[:, -1:], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="input_ids"):
            model(inputs_embeds=model.get_input_embeddings()(seq))


# -- injection errors -----------------------------------------------------------------------------

def test_unsupported_architecture(tok):
    cfg = transformers.OPTConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                 ffn_dim=64, num_attention_heads=4, word_embed_proj_dim=32)
    with pytest.raises(TypeError, match="does not support OPTForCausalLM.*LlamaForCausalLM"):
        inject(transformers.OPTForCausalLM(cfg), ecfg(), tokenizer=tok)


def test_injection_checks(tok, comp):
    model = tiny_model("llama", len(tok))
    with pytest.raises(ValueError, match="out of range"):
        inject(model, ecfg(), layer_ids=[0, 2], compression=comp)
    with pytest.raises(ValueError, match="tokenizer"):
        inject(model, ecfg())
    with pytest.raises(ValueError, match="embeds"):
        inject(tiny_model("llama", 100), ecfg(), compression=comp)
    inject(model, ecfg(), layer_ids=[1], compression=comp)
    assert list(engram_runtime(model).engrams) == [1]
    with pytest.raises(ValueError, match="already"):
        inject(model, ecfg(), compression=comp)


def test_freeze_base_trains_only_the_memory(tok, comp):
    from engram.training.optim import build_optimizers

    model = tiny_model("llama", len(tok))
    inject(model, ecfg(), compression=comp)
    base = {k: v.clone() for k, v in model.state_dict().items() if "engram" not in k}
    trainable = freeze_base(model)
    assert {id(p) for p in trainable} == {id(p) for p in engram_runtime(model).engram_parameters()}
    opt = build_optimizers(model, 1e-2, weight_decay=0.0)
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    for _ in range(2):  # step 1 moves the value projection, step 2 the tables behind it
        loss = model(ids, labels=ids, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert opt.tables is not None and len(opt.tables.touched_rows(
        engram_runtime(model).engrams[0].table.weight)) > 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in base.items())


# -- adapters -------------------------------------------------------------------------------------

def test_save_load_round_trip(tok, comp, tmp_path):
    model = injected("mistral", tok, comp)
    ids, mask = batch(tok)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    save_engram(model, tmp_path)
    fresh = tiny_model("mistral", len(tok))  # same seed: the same base weights
    load_engram(fresh, tmp_path, tokenizer=tok)
    with torch.no_grad():
        assert torch.equal(fresh(ids, attention_mask=mask).logits, want)
    a, b = engram_runtime(model), engram_runtime(fresh)
    for lid in a.engrams:
        sa, sb = a.engrams[lid].state_dict(), b.engrams[lid].state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    # Loading into an already injected model of the same config also works.
    other = tiny_model("mistral", len(tok))
    inject(other, ecfg(), compression=comp)
    load_engram(other, tmp_path)
    with torch.no_grad():
        assert torch.equal(other(ids, attention_mask=mask).logits, want)


def test_save_pretrained_writes_the_base_checkpoint(tok, comp, tmp_path):
    model = injected("llama", tok, comp)
    base = tiny_model("llama", len(tok))
    ids, mask = batch(tok)
    model.save_pretrained(tmp_path)
    save_engram(model, tmp_path)  # the adapter can sit beside it
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not any("engram" in k for k in reloaded.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids, attention_mask=mask).logits,
                                   base(ids, attention_mask=mask).logits, atol=0, rtol=0)
        load_engram(reloaded, tmp_path, tokenizer=tok)
        torch.testing.assert_close(reloaded(ids, attention_mask=mask).logits,
                                   model(ids, attention_mask=mask).logits, atol=0, rtol=0)


def test_tokenizer_fingerprint_ignores_padding_state(tok):
    """A transformers tokenizer called with padding=True stores that in its backend; the adapter
    must still recognise its own tokenizer afterwards."""
    from transformers import PreTrainedTokenizerFast

    from engram.retrieval.compress import tokenizer_fingerprint

    fresh = PreTrainedTokenizerFast(tokenizer_object=type(tok.backend_tokenizer).from_str(
        tok.backend_tokenizer.to_str()), pad_token="<pad>", eos_token="<eos>")
    fresh.backend_tokenizer.no_padding()
    fresh.backend_tokenizer.no_truncation()
    before = tokenizer_fingerprint(fresh)
    fresh(PROMPTS, padding=True, truncation=True, max_length=4)
    assert fresh.backend_tokenizer.padding is not None
    assert tokenizer_fingerprint(fresh) == before


def test_mismatched_adapter_refused(tok, comp, tmp_path):
    model = injected("llama", tok, comp)
    save_engram(model, tmp_path)
    with pytest.raises(AdapterMismatch, match="different weights"):
        load_engram(tiny_model("llama", len(tok), seed=1), tmp_path, tokenizer=tok)
    with pytest.raises(AdapterMismatch, match="hidden_size"):
        load_engram(tiny_model("llama", len(tok), hidden=48), tmp_path, tokenizer=tok)
    with pytest.raises(AdapterMismatch, match="another base model"):
        load_engram(tiny_model("qwen2", len(tok)), tmp_path, tokenizer=tok)
    target = tiny_model("llama", len(tok))
    with pytest.raises(AdapterMismatch, match="tokenizer"):
        # The same ids, a different map: another tokenizer's compression.
        load_engram(target, tmp_path, compression=type(comp)(comp.lookup[::-1].copy()))
    assert engram_runtime(target, required=False) is None  # a refusal leaves the model untouched
    inject(target, ecfg(layer_ids=[1]), compression=comp)
    with pytest.raises(AdapterMismatch, match="layer_ids"):
        load_engram(target, tmp_path)


# -- a real model ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_identity_and_cached_generate():
    pytest.importorskip("gguf")
    from engram.models.pretrained import load_pretrained

    try:
        model, tokenizer = load_pretrained()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    enc = tokenizer(["In the beginning God created", "And God said, Let there be"],
                    padding=True, padding_side="left", return_tensors="pt")
    with torch.no_grad():
        ref = model(**enc).logits
        inject(model, ecfg(engram_vocab_size=[5003, 5009], layer_ids=[1, 15],
                           pad_id=tokenizer.eos_token_id), tokenizer=tokenizer)
        assert torch.equal(model(**enc).logits, ref)
    randomise(model, std=0.05)
    out = model.generate(**enc, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                         output_logits=True, pad_token_id=tokenizer.pad_token_id)
    mask = torch.cat([enc.attention_mask, torch.ones(2, 6, dtype=torch.long)], 1)
    full = full_logits(model, out.sequences, mask)
    torch.testing.assert_close(torch.stack(out.logits, 1), full[:, enc.input_ids.shape[1] - 1:-1],
                               atol=1e-4, rtol=1e-4)
