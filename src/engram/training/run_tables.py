"""The table files of a training run's checkpoint: artifacts' ``export_tables``, told how the run's
saved config (its TrainConfig) names the Engram config that built the tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..artifacts import table_files
from ..retrieval.config import EngramConfig
from .train import TrainConfig


def engram_of(saved: dict[str, Any]) -> tuple[EngramConfig | None, bool]:
    """A run's saved TrainConfig -> (its Engram config, whether one table set is shared)."""
    tc = TrainConfig.from_record(saved, "the run's saved config")
    return tc.engram_config(), tc.shared_tables


def export_tables(source: Any, directory: str | Path, **kw: Any) -> dict[int, Path]:
    """``artifacts.table_files.export_tables`` for an EngramLM or a run's checkpoint (a
    ``.safetensors`` file, a checkpoints folder or a run folder)."""
    return table_files.export_tables(source, directory, engram_of=engram_of, **kw)
