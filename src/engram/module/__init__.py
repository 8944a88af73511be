"""The Engram module (paper section 2.3): lookup -> context-aware gate -> short causal conv.

engram.py holds the module and its decode state, gate.py the gate, conv.py the short conv.
"""

from .conv import ConvFn, EngramState, ShortConv
from .engram import (
    LEGACY_V41_GATE,
    LEGACY_V41_NORM_EPS,
    PROFILE_GATE,
    PROFILE_NORM_EPS,
    Engram,
    build_engram,
)
from .gate import GATES, GateFn, gate_fn

__all__ = ["ConvFn", "Engram", "EngramState", "GATES", "GateFn", "LEGACY_V41_GATE",
           "LEGACY_V41_NORM_EPS", "PROFILE_GATE", "PROFILE_NORM_EPS", "ShortConv", "build_engram",
           "gate_fn"]
