import pytest

from engram import EngramConfig, prime_table_sizes, rows_per_layer
from engram.retrieval.primes import head_offsets, is_prime, next_prime


def test_demo_v1_row_counts_without_allocating():
    # Spec section 3 facts (the official demo's defaults).
    assert rows_per_layer(EngramConfig.demo_v1()) == {1: 10_344_164, 15: 10_348_242}


def test_v41_row_counts_without_allocating():
    assert rows_per_layer(EngramConfig.v4_1()) == {1: 384_006_168, 14: 384_016_682}


def test_primes_unique_across_layers_and_orders():
    sizes = prime_table_sizes(EngramConfig.demo_v1())
    flat = [p for layer in sizes.values() for order in layer for p in order]
    assert len(flat) == len(set(flat)) == 2 * 2 * 8
    assert all(is_prime(p) for p in flat)
    # Each head continues the search from the previous head's prime.
    for layer in sizes.values():
        for order in layer:
            assert order == sorted(order)


def test_layer_order_changes_sizes():
    a = prime_table_sizes(EngramConfig.demo_v1(layer_ids=[1, 15]))
    b = prime_table_sizes(EngramConfig.demo_v1(layer_ids=[15, 1]))
    assert a[1] != b[1]


def test_is_prime_matches_sieve():
    n = 20_000
    sieve = [True] * n
    sieve[0] = sieve[1] = False
    for i in range(2, int(n ** 0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = [False] * len(sieve[i * i::i])
    assert [i for i in range(n) if is_prime(i)] == [i for i in range(n) if sieve[i]]
    assert is_prime(2_305_843_009_213_693_951)  # 2^61 - 1
    assert not is_prime(3_215_031_751)  # strong pseudoprime to bases 2, 3, 5, 7


def test_next_prime_skips_used():
    assert next_prime(10, set()) == 11
    assert next_prime(10, {11}) == 13
    assert head_offsets([3, 5, 7]) == [0, 3, 8]


def test_v41_ignores_seed_and_derived_sizes():
    c = EngramConfig.v4_1()
    assert c.layer_seed(14) == 10007 * 14 == EngramConfig.v4_1(seed=5).layer_seed(14)
    assert EngramConfig.demo_v1(seed=5).layer_seed(1) == 5 + 10007
    assert c.head_dim == 256 and c.d_mem == 3 * 2048 and c.num_heads == 24
    assert c.order_sizes == [16_000_000] * 3


def test_demo_config_ports_unchanged():
    demo = dict(tokenizer_name_or_path="deepseek-ai/DeepSeek-V3", engram_vocab_size=[129280 * 5] * 2,
                max_ngram_size=3, n_embed_per_ngram=512, n_head_per_ngram=8, layer_ids=[1, 15],
                pad_id=2, seed=0, kernel_size=4)
    c = EngramConfig.from_dict(demo)
    assert c.profile == "demo-v1" and c.to_dict()["engram_vocab_size"] == [646400, 646400]


@pytest.mark.parametrize("kwargs, match", [
    (dict(layer_ids=[1, 1]), "unique"),
    (dict(layer_ids=[]), "non-empty"),
    (dict(layer_ids=[-1]), ">= 0"),
    (dict(engram_vocab_size=[100, 0]), ">= 2"),
    (dict(engram_vocab_size=[100]), "entries"),
    (dict(engram_vocab_size=-5), ">= 2"),
    (dict(n_head_per_ngram=0), ">= 1"),
    (dict(n_embed_per_ngram=0), ">= 1"),
    (dict(n_embed_per_ngram=10, n_head_per_ngram=4), "divisible"),
    (dict(max_ngram_size=1), ">= 2"),
    (dict(kernel_size=0), ">= 1"),
    (dict(profile="v5"), "profile"),
    (dict(compressed_vocab_size=0), ">= 1"),
])
def test_bad_configs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngramConfig(**kwargs)


def test_float_sizes_raise():
    with pytest.raises(TypeError, match="integer"):
        EngramConfig(engram_vocab_size=[100.5, 200])
    with pytest.raises(ValueError, match="unknown"):
        EngramConfig.from_dict({"hidden_size": 3})
