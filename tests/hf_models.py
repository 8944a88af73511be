"""Tiny random transformers causal LMs of each family Engram injects into (tests of finetune and of
the adapter runtime)."""

import torch

from engram import EngramConfig
from engram.artifacts.adapter import save_engram
from engram.models.hf import engram_runtime, inject
from engram.retrieval.compress import build_compression


def tiny_model(family, vocab, seed=0):
    import transformers as t

    ids = dict(pad_token_id=0, eos_token_id=1, bos_token_id=1)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, **ids)
    make = {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**common)),
        "qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**common)),
        "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2,
                                                       n_head=4, n_positions=128, **ids)),
    }[family]
    torch.manual_seed(seed)
    return make().eval()


def make_adapter(tmp_path, family, tok):
    """base/ (a saved tiny model) and adapter/ (random Engram on it: zero-init would hide bugs)."""
    base = tiny_model(family, len(tok))
    base.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    backend = tok.backend_tokenizer
    cfg = EngramConfig(engram_vocab_size=[101, 211], max_ngram_size=3, n_embed_per_ngram=16,
                       n_head_per_ngram=4, layer_ids=[0, 1], pad_id=1)
    inject(base, cfg, compression=build_compression(backend, cache=False))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in engram_runtime(base).engram_parameters():
            p.normal_(0, 0.5)
    save_engram(base, tmp_path / "adapter", base_model=str(tmp_path / "base"), tokenizer=backend,
                eos_id=1)
    return tmp_path / "adapter"


def model_and_corpus(root, family, tok, docs=None):
    """root/model (a saved tiny model of ``family`` and its tokenizer) and root/corpus (``docs``,
    default 40 KJV documents, prepared with that tokenizer: 20% held out)."""
    from engram.training.corpus import load_documents
    from engram.training.prepare import PrepareConfig, prepare

    if docs is None:
        docs = [d.text for d in load_documents("kjv", max_chars=40_000)][:40]
    tiny_model(family, len(tok)).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    (root / "text").mkdir()
    for i, d in enumerate(docs):
        (root / "text" / f"{i}.txt").write_text(d)
    prepare(PrepareConfig(out=str(root / "corpus"), input=[str(root / "text")],
                          tokenizer=str(root / "model"), workers=0, val_fraction=0.2),
            progress=False)
