"""Shared fixtures: real tiny configs and the golden data from the official demo's hashing."""

from pathlib import Path

import numpy as np
import pytest
import torch
from golden_data import golden_config  # noqa: F401  (tests import it from here too)

from engram import EngramConfig

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def golden():
    """Hashes produced by running the official demo's code (shared/data/golden_hash_tiny.npz)."""
    return dict(np.load(DATA / "golden_hash_tiny.npz"))


@pytest.fixture(scope="session")
def tiny_config():
    return EngramConfig(engram_vocab_size=[101, 211], max_ngram_size=3, n_embed_per_ngram=16,
                        n_head_per_ngram=4, layer_ids=[0, 2], pad_id=0)


@pytest.fixture(scope="session")
def tiny_lookup():
    """A surjective map of 300 raw ids onto 250 compressed ids."""
    return np.arange(300) % 250


@pytest.fixture(scope="session")
def deepseek():
    from engram import build_compression
    return build_compression()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add overhead (and stall on a shared machine).
    Use per module with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    """A real byte-level BPE (320 ids) trained on KJV text, as a transformers tokenizer."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from engram.training.corpus import load_documents

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        [d.text for d in load_documents("kjv", max_chars=30_000)],
        trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<eos>"], show_progress=False,
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>",
                                                eos_token="<eos>")
