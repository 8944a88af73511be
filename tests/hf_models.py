"""Tiny random transformers causal LMs of each family Engram injects into (tests of finetune and of
the adapter runtime)."""

import torch


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
