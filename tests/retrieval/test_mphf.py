"""The hot tier's MPHF: every key its own slot, fingerprints reject non-members at ~2^-bits."""

import pytest
import torch

from engram.retrieval.hot import HotIndex
from engram.retrieval.mphf import (
    TorchMPHF,
    build_mphf,
    fingerprint,
    mphf_from_state_dict,
    popcount64,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _keys(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.unique(torch.randint(-2**62, 2**62, (n,), generator=g))


def _engines():
    out = ["torch"]
    try:
        import bbhash  # noqa: F401
        out.append("bbhash")
    except ImportError:
        pass
    return out


def test_popcount_matches_python():
    words = torch.cat([_keys(500), torch.tensor([0, -1, -2**63, 2**63 - 1, 1])])
    want = [bin(w & (2**64 - 1)).count("1") for w in words.tolist()]
    assert popcount64(words).tolist() == want


@pytest.mark.parametrize("engine", _engines())
@pytest.mark.parametrize("keys", [_keys(20_000), torch.arange(5_000) * 3, torch.tensor([7])],
                         ids=["random", "arithmetic", "one"])
def test_every_key_gets_its_own_slot(engine, keys):
    m = build_mphf(keys, engine)
    slots = m.lookup(keys)
    assert sorted(slots.tolist()) == list(range(len(keys)))  # a bijection onto 0..n-1
    again = mphf_from_state_dict(m.state_dict())
    assert torch.equal(again.lookup(keys), slots)


def test_fallback_level_serves_leftover_keys():
    keys = _keys(3_000)
    m = TorchMPHF.build(keys, max_levels=1)  # most keys cannot be placed in one level
    assert m.fallback.numel() > 0
    assert sorted(m.lookup(keys).tolist()) == list(range(len(keys)))


@pytest.mark.parametrize("bits", [4, 6])
def test_non_members_pass_at_two_to_the_minus_bits(bits):
    keys, others = _keys(20_000, 1), _keys(200_000, 2)
    others = others[~torch.isin(others, keys)]
    idx = HotIndex.build(keys, "mphf", bits=bits)
    assert torch.equal(idx.lookup(keys), idx.mphf.lookup(keys))  # members always accepted
    got_slot = (idx.mphf.lookup(others) >= 0).float().mean().item()
    fp = (idx.lookup(others) >= 0).float().mean().item()
    expected = got_slot * 2.0 ** -bits  # a non-member passes if it reaches a slot and its fp matches
    assert 0.85 * expected < fp < 1.15 * expected, (fp, expected)


def test_exact_index_has_no_false_positives():
    keys, others = _keys(5_000, 3), _keys(50_000, 4)
    others = others[~torch.isin(others, keys)]
    idx = HotIndex.build(keys, "exact")
    assert (idx.lookup(others) == -1).all()
    assert torch.equal(idx.keys[idx.lookup(keys)], keys)
    assert idx.nbytes()["bits_per_key"] == 64


def test_fingerprints_are_uniform_and_bounded():
    f = fingerprint(_keys(50_000), 8)
    assert int(f.min()) >= 0 and int(f.max()) < 256
    counts = torch.bincount(f, minlength=256).float()
    assert counts.std() / counts.mean() < 0.15


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="duplicates"):
        build_mphf(torch.tensor([1, 2, 2]))
    with pytest.raises(ValueError, match="int64"):
        build_mphf(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="bits"):
        HotIndex.build(torch.tensor([1, 2]), "mphf", bits=40)
    with pytest.raises(ValueError, match="engine"):
        build_mphf(torch.tensor([1, 2]), "cuckoo")
    with pytest.raises(ValueError, match="kind"):
        HotIndex.build(torch.tensor([1, 2]), "bloom")
