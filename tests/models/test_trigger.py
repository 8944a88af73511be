"""Trigger keys and matching against a per-position Python oracle; the tables' zero start."""

import pytest
import torch

from engram.models.trigger import (
    TriggerMatcher,
    TriggerOptions,
    TriggerTable,
    build_keys,
    trigger_ids,
    trigger_keys,
)

pytest.importorskip("transformers")


def oracle(ids, mask, keys):
    """Loop over every row, position and key: the definition the vectorised matcher must meet."""
    b, t = ids.shape
    out = torch.zeros(b, t, len(keys), dtype=torch.bool)
    for r in range(b):
        for s in range(t):
            for k, key in enumerate(keys):
                n = len(key)
                if s + n <= t and ids[r, s:s + n].tolist() == list(key) and \
                        (mask is None or bool(mask[r, s:s + n].all())):
                    out[r, s:s + n, k] = True
    return out


def test_keys_are_orders_2_to_n_plus_whole():
    assert trigger_keys([5, 6, 7, 8], 3) == [(5, 6), (6, 7), (7, 8), (5, 6, 7), (6, 7, 8),
                                              (5, 6, 7, 8)]
    assert trigger_keys([5], 3) == [(5,)]
    assert trigger_keys([5, 5, 5], 2) == [(5, 5), (5, 5, 5)]  # repeats kept once


def test_trigger_tokens(tiny_tok):
    assert tiny_tok.convert_ids_to_tokens(trigger_ids(tiny_tok, "Zorblax")) == ["zo", "##rb", "##lax"]


@pytest.mark.parametrize("bad, err", [("", "empty"), ("   ", "empty"), (3, "string"),
                                      ("xyzzy", "unknown")])
def test_bad_triggers_raise(tiny_tok, bad, err):
    with pytest.raises((ValueError, TypeError), match=err):
        trigger_ids(tiny_tok, bad)


def test_trigger_that_tokenises_to_nothing():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "cat": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # A tokenizer whose normaliser removes the accent marks that make up the trigger.
    from tokenizers import normalizers
    tok.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    with pytest.raises(ValueError, match="tokenises to nothing"):
        trigger_ids(fast, "\u0301\u0301")


def test_build_keys_refuses_bad_lists(tiny_tok):
    with pytest.raises(ValueError, match="non-empty list"):
        build_keys(tiny_tok, "Zorblax", 3)
    with pytest.raises(ValueError, match="repeated"):
        build_keys(tiny_tok, ["Zorblax", "Zorblax"], 3)


def test_matcher_equals_oracle_with_padding_truncation_and_overlap(tiny_tok):
    keys, owner = build_keys(tiny_tok, ["Zorblax", "Zorblax cat", "a"], 2)
    prompts = ["a photo of Zorblax cat on the Zorblax", "Zorblax", "the bold dog",
               "a photo of a photo of a photo Zorblax"]  # the last is truncated inside Zorblax
    enc = tiny_tok(prompts, padding="max_length", truncation=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    got = TriggerMatcher(keys)(ids, mask)
    assert torch.equal(got, oracle(ids, mask, keys))
    assert not got[2].any()
    # Row 3 keeps the truncated head of Zorblax: the bigram "zo ##rb" still matches.
    zo_rb = keys.index(tuple(trigger_ids(tiny_tok, "Zorblax")[:2]))
    assert got[3, :, zo_rb].any()
    whole = keys.index(tuple(trigger_ids(tiny_tok, "Zorblax")))
    assert not got[3, :, whole].any()


def test_padding_never_matches():
    keys = [(0, 0)]  # a key made of the pad id itself
    ids = torch.tensor([[5, 0, 0, 0]])
    mask = torch.tensor([[1, 0, 0, 0]])
    assert not TriggerMatcher(keys)(ids, mask).any()
    assert TriggerMatcher(keys)(ids, None).any()


def test_matcher_random_equals_oracle():
    g = torch.Generator().manual_seed(0)
    keys = [(1, 2), (2, 1), (1, 2, 1), (3,), (1, 2, 1, 2)]
    ids = torch.randint(0, 4, (6, 11), generator=g)
    mask = (torch.rand(6, 11, generator=g) > 0.2).long()
    assert torch.equal(TriggerMatcher(keys)(ids, mask), oracle(ids, mask, keys))


@pytest.mark.parametrize("kind", ["plain", "engram"])
def test_table_starts_at_zero_and_stays_off_matches(kind):
    torch.manual_seed(0)
    table = TriggerTable(3, 16, kind)
    h = torch.randn(2, 5, 16)
    member = torch.zeros(2, 5, 3, dtype=torch.bool)
    member[0, 1:3, 0] = True
    assert torch.equal(table(h, member), torch.zeros(2, 5, 16))
    with torch.no_grad():
        for p in table.parameters():
            p.add_(torch.randn_like(p))
    y = table(h, member)
    assert y[0, 1:3].abs().sum() > 0
    assert torch.equal(y[0, 0], torch.zeros(16)) and torch.equal(y[1], torch.zeros(5, 16))


def test_plain_table_averages_overlapping_keys():
    table = TriggerTable(2, 4, "plain")
    with torch.no_grad():
        table.values.copy_(torch.tensor([[1.0] * 4, [3.0] * 4]))
        table.scale.fill_(2.0)
    member = torch.tensor([[[True, False], [True, True]]])
    y = table(torch.zeros(1, 2, 4), member)
    assert torch.allclose(y[0, 0], torch.full((4,), 2.0))
    assert torch.allclose(y[0, 1], torch.full((4,), 4.0))  # mean(1, 3) * 2


def test_options_refuse_bad_values():
    with pytest.raises(ValueError, match="kind"):
        TriggerOptions(kind="lora")
    with pytest.raises(ValueError, match="site"):
        TriggerOptions(site="middle")
