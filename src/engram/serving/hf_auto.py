"""transformers' Auto classes learn "engram_lm" when ``engram`` is imported, without ``import
engram`` importing transformers.

Importing transformers' model machinery costs seconds (~6 s here on top of torch), and most uses
of engram never touch it, so ``engram/__init__.py`` only calls ``register_when_imported``:
when transformers' own Auto modules are already loaded it registers at once; otherwise it leaves
a finder on ``sys.meta_path`` that registers right after Python finishes loading them:

- ``transformers.models.auto.configuration_auto`` (AutoConfig): the config class, at no extra
  cost (the module has just imported transformers' config machinery);
- ``transformers.models.auto.modeling_auto`` (AutoModelForCausalLM, and AutoTokenizer, which
  imports it): the model class, which imports transformers' modeling code (the ~6 s).

So ``import engram`` then ``AutoModelForCausalLM.from_pretrained(OUT)`` works in either order,
and nothing is paid by code that never imports transformers. A failure to register (a
transformers too old or too new for serving/hf_model.py) is a warning, never a failed import.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from typing import Any

CONFIG_AUTO = "transformers.models.auto.configuration_auto"
MODEL_AUTO = "transformers.models.auto.modeling_auto"


def register_config() -> None:
    from transformers import AutoConfig

    from .hf_config import EngramLMConfig
    from ..artifacts.export import MODEL_TYPE

    AutoConfig.register(MODEL_TYPE, EngramLMConfig, exist_ok=True)


def register_model() -> None:
    from transformers import AutoModelForCausalLM

    from .hf_model import EngramLMConfig, EngramLMForCausalLM

    register_config()
    AutoModelForCausalLM.register(EngramLMConfig, EngramLMForCausalLM, exist_ok=True)


_AFTER = {CONFIG_AUTO: register_config, MODEL_AUTO: register_model}


def register_when_imported() -> None:
    """Register now for the Auto modules already loaded, later for the others (idempotent)."""
    for name, register in _AFTER.items():
        if name in sys.modules:
            _safely(register)
    if not all(name in sys.modules for name in _AFTER) and \
            not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def _safely(register: Any) -> None:
    try:
        register()
    except Exception as e:  # never break the import of transformers or engram
        warnings.warn(f"engram could not register its transformers classes ({type(e).__name__}: "
                      f"{e}); load exports with engram.serving.hf_model.EngramLMForCausalLM",
                      stacklevel=3)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of a watched module to register after it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _AFTER:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenRegister(spec.loader, _AFTER[fullname])
                return spec
        return None


class _ThenRegister(importlib.abc.Loader):
    def __init__(self, loader: Any, register: Any):
        self.loader, self.register = loader, register

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _safely(self.register)
        if all(name in sys.modules for name in _AFTER):  # nothing left to watch
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterImport)]

    def __getattr__(self, name: str) -> Any:  # get_data, get_filename, resource readers, ...
        return getattr(self.loader, name)
