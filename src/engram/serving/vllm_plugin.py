"""vLLM general plugin (entry point ``vllm.general_plugins``): registers the reference LM with
Engram as an out-of-tree architecture. Import-safe without vLLM: nothing of vLLM or transformers
is imported until vLLM itself calls ``register`` (in every vLLM process)."""

from __future__ import annotations


def register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from .hf_config import EngramLMConfig
    from ..artifacts.export import ARCHITECTURE, MODEL_TYPE

    try:
        AutoConfig.register(MODEL_TYPE, EngramLMConfig)
    except ValueError:  # already registered in this process
        pass
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        # A string: vLLM imports the model lazily, in the worker that builds it.
        ModelRegistry.register_model(ARCHITECTURE,
                                     "engram.serving.vllm_model:EngramLMForCausalLM")
