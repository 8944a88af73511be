import subprocess
import sys

import numpy as np
import pytest
import torch
from golden_data import golden_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engram import DEAD, Compression, EngramConfig, NgramHasher
from engram.retrieval.reference import NumpyReferenceHasher

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def test_golden_demo_hash_exact(golden):
    cfg = golden_config(golden)
    h = NgramHasher(cfg, golden["lookup"])  # the plain array form
    lid = int(golden["layer_ids"][0])
    assert h.table_sizes(lid) == golden[f"primes_layer_{lid}"].tolist()
    np.testing.assert_array_equal(h.multipliers[lid], golden[f"multipliers_layer_{lid}"])
    out = h.hash(torch.from_numpy(golden["input_ids"]))
    assert out[lid].dtype == torch.long
    assert out[lid].shape == golden[f"hash_layer_{lid}"].shape
    np.testing.assert_array_equal(out[lid].numpy(), golden[f"hash_layer_{lid}"])


def test_golden_with_compression_object_and_numpy_input(golden):
    cfg = golden_config(golden)
    h = NgramHasher(cfg, Compression(golden["lookup"]))
    out = h.hash(golden["input_ids"])  # numpy in, torch out
    np.testing.assert_array_equal(out[2].numpy(), golden["hash_layer_2"])


def test_golden_streamed_token_by_token(golden):
    h = NgramHasher(golden_config(golden), golden["lookup"])
    ids = torch.from_numpy(golden["input_ids"])
    stream = h.stream(ids.shape[0])
    steps = [stream.step(ids[:, t])[2] for t in range(ids.shape[1])]
    np.testing.assert_array_equal(torch.cat(steps, 1).numpy(), golden["hash_layer_2"])


def test_v41_global_ids_are_local_plus_offsets(tiny_lookup):
    base = dict(engram_vocab_size=97, max_ngram_size=4, n_embed_per_ngram=16, n_head_per_ngram=2,
                layer_ids=[1, 14], pad_id=0)
    v41 = NgramHasher(EngramConfig(profile="v4.1", **base), tiny_lookup)
    demo = NgramHasher(EngramConfig(profile="demo-v1", seed=0, **base), tiny_lookup)
    x = torch.randint(0, 300, (2, 30))
    for lid in (1, 14):
        glob, loc = v41.hash(x)[lid], demo.hash(x)[lid]
        np.testing.assert_array_equal(glob - loc, np.broadcast_to(v41.offsets(lid), loc.shape))
        assert int(glob.max()) < v41.num_rows(lid)


@given(n=st.integers(2, 5), k=st.integers(1, 4), layers=st.lists(st.integers(0, 30), min_size=1,
       max_size=3, unique=True), seed=st.integers(0, 2**31), b=st.integers(1, 3), t=st.integers(1, 40),
       data=st.data())
@FAST
def test_matches_numpy_port_of_official_code(n, k, layers, seed, b, t, data, tiny_lookup):
    sizes = data.draw(st.lists(st.integers(2, 5000), min_size=n - 1, max_size=n - 1))
    cfg = EngramConfig(engram_vocab_size=sizes, max_ngram_size=n, n_embed_per_ngram=4 * k,
                       n_head_per_ngram=k, layer_ids=layers, pad_id=data.draw(st.integers(0, 299)),
                       seed=seed)
    x = np.random.default_rng(seed).integers(0, 300, size=(b, t))
    ours = NgramHasher(cfg, tiny_lookup).hash(torch.from_numpy(x))
    ref = NumpyReferenceHasher(cfg, tiny_lookup).hash(x)
    for lid in layers:
        np.testing.assert_array_equal(ours[lid].numpy(), ref[lid])


@given(t=st.integers(1, 30), pos=st.data(), seed=st.integers(0, 10**6))
@FAST
def test_changing_token_t_changes_only_t_to_t_plus_n_minus_1(tiny_config, tiny_lookup, t, pos, seed):
    h = NgramHasher(tiny_config, tiny_lookup)
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.integers(0, 250, size=(1, t)))  # ids < 250 map to distinct compressed ids
    p = pos.draw(st.integers(0, t - 1))
    y = x.clone()
    y[0, p] = (y[0, p] + 1 + int(rng.integers(0, 248))) % 250
    n_max = tiny_config.max_ngram_size
    for lid, a in h.hash(x).items():
        bb = h.hash(y)[lid]
        changed = (a != bb).any(-1)[0]
        assert not changed[:p].any() and not changed[p + n_max:].any()
        # The unigram-free suffix n-grams at p all include x[p]: they must all move
        # (a head may collide by chance, but not all heads of all orders).
        assert changed[p]


@given(t=st.integers(1, 25), chunks=st.lists(st.integers(1, 6), min_size=1, max_size=10),
       seed=st.integers(0, 10**6))
@FAST
def test_stream_equals_full_sequence(tiny_config, tiny_lookup, t, chunks, seed):
    h = NgramHasher(tiny_config, tiny_lookup)
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.integers(-1, 300, size=(2, t)))  # includes dead positions
    mask = torch.from_numpy(rng.random((2, t)) > 0.2)
    full = h.hash(x, attention_mask=mask)
    stream, outs, i = h.stream(2), [], 0
    for c in chunks * t:
        if i >= t:
            break
        outs.append(stream.step(x[:, i:i + c], attention_mask=mask[:, i:i + c]))
        i += c
    for lid in full:
        torch.testing.assert_close(torch.cat([o[lid] for o in outs], 1), full[lid], rtol=0, atol=0)


def test_left_padding_masked_equals_unpadded(tiny_config, tiny_lookup):
    h = NgramHasher(tiny_config, tiny_lookup)
    x = torch.randint(0, 300, (1, 12))
    padded = torch.cat([torch.full((1, 5), 7), x], 1)  # 7 is a real token id used as padding
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], 1)
    a, b = h.hash(x), h.hash(padded, attention_mask=mask)
    for lid in a:
        torch.testing.assert_close(b[lid][:, 5:], a[lid], rtol=0, atol=0)
    # The same with the dead sentinel instead of a mask.
    c = h.hash(torch.cat([torch.full((1, 5), DEAD), x], 1))
    for lid in a:
        torch.testing.assert_close(c[lid][:, 5:], a[lid], rtol=0, atol=0)


def test_hash_of_rows_is_those_rows_of_the_batch_hash(tiny_config, tiny_lookup):
    # torchrun on the file tier hashes the global batch once and each rank takes its rows of the
    # ids (training/distributed.local_batch): each row must hash alone, whatever the other rows,
    # dead positions (a row's start) included.
    h = NgramHasher(tiny_config, tiny_lookup)
    x = torch.randint(0, 300, (8, 17), generator=torch.Generator().manual_seed(5))
    x[1, 4] = x[6, 0] = DEAD  # some slices hold a dead position, others none
    whole = h.hash(x)
    for world in (2, 4, 8):
        for rank in range(world):
            s = slice(rank * 8 // world, (rank + 1) * 8 // world)
            part = h.hash(x[s])
            for lid in h.layer_ids:
                torch.testing.assert_close(part[lid], whole[lid][s], rtol=0, atol=0)


def test_dead_position_cuts_ngrams_in_the_middle(tiny_config, tiny_lookup):
    h = NgramHasher(tiny_config, tiny_lookup)
    x = torch.randint(0, 300, (1, 20))
    y = x.clone()
    y[0, :10] = torch.randint(0, 300, (10,))  # different prefix
    x[0, 10] = y[0, 10] = DEAD
    for lid in h.layer_ids:
        # After the dead position nothing before it is visible: the suffix hashes agree.
        torch.testing.assert_close(h.hash(x)[lid][:, 10:], h.hash(y)[lid][:, 10:], rtol=0, atol=0)


def test_deterministic_across_processes(tiny_config, tiny_lookup):
    x = torch.randint(0, 300, (2, 50), generator=torch.Generator().manual_seed(3))
    here = NgramHasher(tiny_config, tiny_lookup).hash(x)
    code = (
        "import numpy as np, torch, sys\n"
        "from engram import EngramConfig, NgramHasher\n"
        f"cfg = EngramConfig(**{tiny_config.to_dict()!r})\n"
        "x = torch.randint(0, 300, (2, 50), generator=torch.Generator().manual_seed(3))\n"
        "out = NgramHasher(cfg, np.arange(300) % 250).hash(x)\n"
        "sys.stdout.write(repr({k: v.sum().item() * 1000003 + v[0, -1].sum().item() "
        "for k, v in out.items()}))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"})
    expect = {k: v.sum().item() * 1000003 + v[0, -1].sum().item() for k, v in here.items()}
    assert eval(res.stdout) == expect


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_same_on_cuda(golden):
    h = NgramHasher(golden_config(golden), golden["lookup"])
    out = h.hash(torch.from_numpy(golden["input_ids"]).cuda())
    np.testing.assert_array_equal(out[2].cpu().numpy(), golden["hash_layer_2"])


def test_real_tokenizer_sentence(deepseek):
    from engram import default_tokenizer
    cfg = EngramConfig.demo_v1(compressed_vocab_size=len(deepseek))
    ids = default_tokenizer().encode("The Engram module looks up n-grams. the engram Module").ids
    h = NgramHasher(cfg, deepseek)
    out = h.hash(torch.tensor([ids]))
    ref = NumpyReferenceHasher(cfg, deepseek.lookup).hash(np.array([ids]))
    for lid in cfg.layer_ids:
        np.testing.assert_array_equal(out[lid].numpy(), ref[lid])
        assert out[lid].shape == (1, len(ids), 16)
        assert (out[lid] < torch.tensor(h.table_sizes(lid))).all()


# -- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, err, match", [
    (torch.tensor([[1.0, 2.0]]), TypeError, "integer"),
    (torch.tensor([[1, 300]]), ValueError, "out of range"),
    (torch.tensor([[1, -2]]), ValueError, "negative"),
    (torch.tensor([1, 2, 3]), ValueError, "shape"),
    (torch.zeros(1, 2, 3, dtype=torch.long), ValueError, "shape"),
    (torch.tensor([[True, False]]), TypeError, "integer"),
])
def test_bad_ids_raise(tiny_config, tiny_lookup, bad, err, match):
    with pytest.raises(err, match=match):
        NgramHasher(tiny_config, tiny_lookup).hash(bad)


def test_bad_compression_and_config_raise(tiny_config, tiny_lookup):
    with pytest.raises(ValueError, match="V'=250"):
        NgramHasher(tiny_config.replace(compressed_vocab_size=99_092), tiny_lookup)
    with pytest.raises(ValueError, match="pad_id"):
        NgramHasher(tiny_config.replace(pad_id=300), tiny_lookup)
    with pytest.raises(TypeError, match="integers"):
        NgramHasher(tiny_config, np.linspace(0, 1, 10))
    with pytest.raises(ValueError, match="negative"):
        NgramHasher(tiny_config, np.array([0, -1, 2]))
    with pytest.raises(ValueError, match="1-D"):
        NgramHasher(tiny_config, np.zeros((2, 2), dtype=np.int64))
    h = NgramHasher(tiny_config, tiny_lookup)
    with pytest.raises(KeyError, match="layer 5"):
        h.table_sizes(5)
    with pytest.raises(ValueError, match="attention_mask"):
        h.hash(torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="shape"):
        h.stream(2).step(torch.zeros(3, 1, dtype=torch.long))


def _control_hasher(**kw):
    cfg = EngramConfig(engram_vocab_size=[101, 103], max_ngram_size=3, n_embed_per_ngram=8,
                       n_head_per_ngram=2, layer_ids=[0], pad_id=0, **kw)
    return NgramHasher(cfg, np.arange(50))


def test_constant_lookup_reads_one_row_per_head_everywhere():
    """Capacity 1 (compare's pathway control): every position, pad, sequence start and dead
    positions included, reads row 0 of each head, whose table has one row."""
    h = _control_hasher(lookup="constant")
    assert h.table_sizes(0) == [1, 1, 1, 1]
    ids = torch.tensor([[5, 7, 0, 9, 3], [0, 0, 4, 4, 4]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    out = h.hash(ids, attention_mask=mask)[0]
    assert out.shape == (2, 5, 4) and int(out.abs().sum()) == 0
    stream = h.stream(2)
    assert int(stream.step(ids[:, :2])[0].abs().sum()) == 0
    assert h.profile(0)["lookup"] == "constant"  # its table files are told apart


def test_unigram_lookup_keys_on_the_current_token_alone():
    h, ngram = _control_hasher(lookup="unigram"), _control_hasher()
    a = h.hash(torch.tensor([[5, 7, 9]]))[0]
    b = h.hash(torch.tensor([[8, 2, 9]]))[0]  # same last token, other context
    assert torch.equal(a[0, 2], b[0, 2]) and not torch.equal(a[0, 1], b[0, 1])
    n = ngram.hash(torch.tensor([[5, 7, 9]]))[0]
    assert not torch.equal(n[0, 2], a[0, 2])
    assert h.table_sizes(0) == ngram.table_sizes(0)  # the same tables, keyed on less
    # every order's heads hash the same product x'[t] * mult[0] modulo their own primes
    mix = 9 * int(h.multipliers[0][0])
    assert a[0, 2].tolist() == [mix % p for p in h.table_sizes(0)]


def test_exact_sizes_without_primes():
    h = _control_hasher(prime_sizes=False)
    assert h.table_sizes(0) == [101, 101, 103, 103]
    assert "lookup" not in h.profile(0)  # the plain n-gram stamp is unchanged


def test_controls_are_demo_v1_only():
    from engram.errors import UserError
    with pytest.raises(UserError, match="lookup must be one of"):
        _control_hasher(lookup="bigram")
    with pytest.raises(UserError, match="demo-v1 only"):
        EngramConfig.v4_1(lookup="constant")
