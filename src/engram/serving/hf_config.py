"""The transformers config class of an ``engram export-hf`` directory (model_type "engram_lm").

Module-level so vLLM can pickle it into its engine processes; registered by the vLLM plugin and,
for transformers' Auto classes, on ``import engram`` (serving/hf_auto.py).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from ..artifacts.export import MODEL_TYPE


class EngramLMConfig(PretrainedConfig):
    """config.json as written by export-hf; the model reads its own keys (engram_model,
    engram_serving) from it."""

    model_type = MODEL_TYPE
