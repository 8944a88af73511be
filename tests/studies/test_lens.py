"""LogitLens and linear CKA: the properties that define them, on real tiny models and tensors."""

import numpy as np
import pytest
import torch

import engram
from engram.models.model import EngramLM, ModelConfig
from engram.serving.runtime import Runtime
from engram.studies.lens import linear_cka, read_layers
from engram.training.batches import Batch

pytestmark = pytest.mark.usefixtures("one_thread")


def test_cka_of_a_representation_with_itself_is_one_and_rotation_invariant():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 16, generator=g)
    q, _ = torch.linalg.qr(torch.randn(16, 16, generator=g, dtype=torch.float64))
    assert linear_cka(x, x) == pytest.approx(1.0, abs=1e-12)
    assert linear_cka(x, (x.double() @ q).float()) == pytest.approx(1.0, abs=1e-6)
    y = torch.randn(500, 8, generator=g)
    assert linear_cka(x, y) == pytest.approx(linear_cka((x.double() @ q) * 3.0 + 1.0, y), abs=1e-9)
    assert linear_cka(x, y) < 0.2  # independent noise: little alignment
    with pytest.raises(ValueError, match="same tokens"):
        linear_cka(x, y[:10])


@pytest.mark.parametrize("head", ["full", "adaptive"])
def test_logit_lens_of_the_last_layer_is_the_output(head):
    ecfg = engram.EngramConfig(engram_vocab_size=[101, 211], max_ngram_size=3,
                               n_embed_per_ngram=16, n_head_per_ngram=4, layer_ids=[0], pad_id=0)
    torch.manual_seed(0)
    model = EngramLM(ModelConfig(vocab_size=97, n_layer=3, d_model=32, n_head=4, max_seq_len=32,
                                 engram=ecfg, head=head, head_cutoffs=(16, 48))).eval()
    with torch.no_grad():  # away from the near-uniform init, as after training
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    tokens = torch.randint(0, 97, (3, 20))
    ids = engram.NgramHasher(ecfg, np.arange(300) % 250).hash(tokens)
    batch = Batch(tokens, tokens, tokens, ids)
    rt = Runtime.from_parts(model, engram.NgramHasher(ecfg, np.arange(300) % 250))
    res = read_layers(rt, [batch, batch], cka_tokens=50)
    assert len(res["kl"]) == 4 and res["kl"][-1] == pytest.approx(0.0, abs=1e-5)
    assert all(k > 1e-4 for k in res["kl"][:-1])  # earlier layers are not the output yet
    assert [s.shape for s in res["states"]] == [(50, 32)] * 4
