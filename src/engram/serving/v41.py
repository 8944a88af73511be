"""DeepSeek-V4.1 checkpoints from what this package serves: a layer set (``engram import-v41``)
or a trained run with the v4.1 profile, written in the engine's layout (``engram export-v41``)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from ..artifacts.layer_set import META, export_v41, write_layer_set
from .loader import open_model


def export_v41_checkpoint(source: str | Path, out_dir: str | Path, *,
                          engram_layers: str | Path | None = None, progress: bool = False) -> Path:
    """``source``: a layer set folder, or a run (``engram train --engram_profile=v4.1``) whose
    Engram layers (with ``engram_layers``' weights and tables, when given) are written out."""
    source = Path(source)
    if (source / META).exists():
        return export_v41(source, out_dir, progress=progress)
    served = open_model(source, engram_layers=engram_layers)
    Path(out_dir).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".engram-v41-", dir=Path(out_dir).parent) as tmp:
        layers = write_layer_set(served.model, served.hasher, Path(tmp) / "layers",
                                 tag=served.checkpoint, progress=progress)
        return export_v41(layers, out_dir, progress=progress)
