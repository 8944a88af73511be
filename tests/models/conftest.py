"""A tiny WordPiece tokenizer and tiny random text encoders, built in code (nothing downloads)."""

import pytest

WORDS = ["a", "an", "photo", "of", "handwritten", "bold", "seven", "two", "cat", "dog", "on",
         "the", "zo", "##rb", "##lax", "qu", "##ib", "!"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def make_tokenizer(max_length: int = 12, words=WORDS):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + list(words))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", model_max_length=max_length)


@pytest.fixture(scope="module")
def tiny_tok():
    pytest.importorskip("transformers")
    return make_tokenizer()


def make_encoder(kind: str, vocab: int = 32, seed: int = 0):
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "clip":
        cfg = tf.CLIPTextConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32,
                                num_hidden_layers=2, num_attention_heads=2,
                                max_position_embeddings=16, eos_token_id=3, pad_token_id=0,
                                bos_token_id=2)
        return tf.CLIPTextModel(cfg).eval()
    if kind == "bert":
        cfg = tf.BertConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=16)
        return tf.BertModel(cfg, add_pooling_layer=False).eval()
    cfg = tf.T5Config(vocab_size=vocab, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2)
    return tf.T5EncoderModel(cfg).eval()


@pytest.fixture(scope="module")
def new_encoder():
    pytest.importorskip("transformers")
    return make_encoder


@pytest.fixture(scope="module")
def new_tokenizer():
    pytest.importorskip("transformers")
    return make_tokenizer
