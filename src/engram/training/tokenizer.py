"""The tokenizer a corpus is made with: ``engram prepare --tokenizer SPEC`` (DeepSeek's, a packaged
model's, a tokenizer.json or a transformers folder) and the end-of-text token that ends every
document. Out of prepare.py, which writes corpora; ``engram finetune`` loads a model's tokenizer
here too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import InputNotFound, UserError
from ..retrieval.compress import EOS_TOKEN, default_tokenizer

# Names of end-of-text tokens, tried in order when the tokenizer's config names none.
EOS_NAMES = (EOS_TOKEN, "<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")


def load_tokenizer(spec: str) -> tuple[Any, str | None]:
    """(a tokenizers.Tokenizer, the end-of-text token its config names or None) for ``spec``."""
    from tokenizers import Tokenizer

    from ..models.pretrained import PACKAGED, packaged_tokenizer

    if spec == "deepseek":
        return default_tokenizer(), EOS_TOKEN
    if spec in PACKAGED:
        tok = packaged_tokenizer(spec)
        return tok.backend_tokenizer, tok.eos_token
    path = Path(spec).expanduser()
    if not path.exists():
        raise InputNotFound(f"--tokenizer {spec}: no such file or folder (or give 'deepseek' or "
                            f"{', '.join(repr(p) for p in PACKAGED)})")
    file = path / "tokenizer.json" if path.is_dir() else path
    eos = _config_eos(path / "tokenizer_config.json") if path.is_dir() else None
    if file.is_file():
        try:
            return Tokenizer.from_file(str(file)), eos
        except Exception as e:  # the Rust side raises a plain Exception on a bad file
            raise UserError(f"--tokenizer {file} is not a tokenizer.json ({e})") from None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError(f"{path} has no tokenizer.json; a transformers tokenizer folder needs "
                        "`pip install transformers`") from None
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if getattr(tok, "backend_tokenizer", None) is None:
        raise UserError(f"{path} holds a slow tokenizer only; save it as a fast one (tokenizer.json)")
    return tok.backend_tokenizer, eos or tok.eos_token


def _config_eos(path: Path) -> str | None:
    if not path.is_file():
        return None
    eos = json.loads(path.read_text("utf-8")).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def end_of_text(tok: Any, named: str | None, configured: str | None = None) -> tuple[str, int]:
    """The token that ends every document and its id: ``named``, else the tokenizer's own."""
    for name in ([named] if named else [configured] if configured else list(EOS_NAMES)):
        if name and tok.token_to_id(name) is not None:
            return name, int(tok.token_to_id(name))
    if named:
        raise UserError(f"--eos_token {named!r} is not a token of this tokenizer")
    raise UserError(f"the tokenizer has no end-of-text token (tried {', '.join(EOS_NAMES)}); name "
                    "one with --eos_token")
