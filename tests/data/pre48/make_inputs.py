"""Inputs for the pre-48 fixtures (README.txt; run with 7f918d9's code on the path): a 320-id
byte-level BPE trained on 30k chars of KJV, a tiny random Llama base carrying it (for
`engram finetune`), and the corpus as JSONL. python make_inputs.py OUT BASE_FOLDER"""
import json
import sys
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engram.training.corpus import load_documents


def _chunks(docs):
    """Documents of ~600 characters (whole lines), so that the held-out split is not empty."""
    out = []
    for d in docs:
        cur = ""
        for ln in d.splitlines():
            cur += ln + "\n"
            if len(cur) > 600:
                out.append(cur)
                cur = ""
        if cur.strip():
            out.append(cur)
    return out


root, base = Path(sys.argv[1]), Path(sys.argv[2])
root.mkdir(parents=True, exist_ok=True)
docs = [d.text for d in load_documents("kjv", max_chars=30_000)]
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
bpe.train_from_iterator(docs, trainers.BpeTrainer(
    vocab_size=320, special_tokens=["<pad>", "<eos>"], show_progress=False,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>",
                                          eos_token="<eos>")
docs = _chunks(docs)
with open(root / "docs.jsonl", "w") as f:
    for d in docs:
        f.write(json.dumps({"text": d}) + "\n")
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               pad_token_id=0, eos_token_id=1, bos_token_id=1)
model = transformers.LlamaForCausalLM(cfg).eval()
model.save_pretrained(base)
tok.save_pretrained(base)
print(len(docs), "docs", sum(map(len, docs)), "chars", len(tok), "ids")
