"""The official demo's golden hashing data as an EngramConfig (a module, not conftest: several
conftest.py files exist, and `from conftest import` would pick whichever loaded first)."""

from engram import EngramConfig


def golden_config(g) -> EngramConfig:
    heads = int(g["n_head_per_ngram"])
    return EngramConfig(
        engram_vocab_size=g["engram_vocab_size"].tolist(), max_ngram_size=int(g["max_ngram_size"]),
        n_embed_per_ngram=8 * heads, n_head_per_ngram=heads, layer_ids=g["layer_ids"].tolist(),
        pad_id=int(g["pad_id"]), seed=int(g["seed"]))
