"""An ``engram export-hf`` folder opened as a ``Runtime``: its parts as artifacts/export.py reads
and checks them (config.json, model.safetensors, the tokenizer, the hot index, row counts), its
tables opened on the tier config.json's ``engram_serving`` names (or the caller's), the model built
on meta and loaded with assign. The folder's names, its writer and its checks are
artifacts/export.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..artifacts.export import CONFIG, REWRITE, WEIGHTS, read
from ..artifacts.run import load_dense_state
from ..errors import InputNotFound, UserError, one_line
from ..tables.registry import open_tier
from ..tables.tablefile import TableFileError


class TierUnavailable(UserError, RuntimeError):
    """The export's tables cannot be opened on the tier asked, on this machine."""


def open_export(out_dir: str | Path, serving: dict[str, Any] | None = None, **options: Any):
    """The export as a ``Runtime``: tables on the tier config.json's
    ``engram_serving`` names (``serving`` overrides its keys), dense weights from
    model.safetensors, the tokenizer and compression map it was written with."""
    from ..models.nine_model import build_lm
    from ..models.vocab import VocabMap
    from .runtime import Runtime

    files = read(out_dir, serving)
    out, serving, mc = files.folder, files.serving, files.model
    tables: dict[int, Any] = {}
    if mc.engram is not None:
        try:
            tables = open_tier(serving["tier"], files.table_dir, mc.engram, files.hasher,
                               counts=files.row_counts, cache_fraction=serving["cache_fraction"],
                               prefetch=serving["prefetch"], verify=serving["verify"], **options)
        except FileNotFoundError as e:
            raise InputNotFound(f"{out} is missing a table file ({e}); {REWRITE}") from e
        except TableFileError as e:  # torn, or of another model: named with the folder
            line = " ".join(str(e).split())  # tables/ names the file by its whole path
            line = line if str(out) in line else f"{out}: {line}"
            raise TableFileError(line if "re-export" in line else f"{line}; {REWRITE}") from e
        except (OSError, ImportError, RuntimeError) as e:
            raise TierUnavailable(f"engram_serving.tier={serving['tier']!r}: the tables in {out} "
                                  f"could not be opened on this machine ({type(e).__name__}: "
                                  f"{e}); choose another tier, e.g. "
                                  "engram_serving={'tier': 'memory'}") from e
    # Built on meta, loaded with assign (as serving/loader.py opens a run): nothing drawn, the
    # file's tensors are the parameters; the tables come from their files.
    lm = build_lm(mc, files.hasher, tables or None, init=False)
    try:
        load_dense_state(lm, files.state, outside=lm.config.engram_layers)
    except (KeyError, ValueError, RuntimeError) as e:  # weights not of config.json's model
        if isinstance(e, UserError):
            raise
        raise UserError(f"{out}: {WEIGHTS} does not fit {CONFIG}'s engram_model "
                        f"({type(e).__name__}: {one_line(e)}); {REWRITE}") from e
    lm.eval()
    return Runtime(lm, files.hasher, VocabMap(files.vocab, files.raw_vocab_size), files.tokenizer,
                   files.config.get("eos_token_id"), out, files.config.get("engram_checkpoint", ""),
                   serving["tier"], tables, files.row_counts, tokenizer_file=files.tokenizer_file)



# Imported from here by callers outside serving/ (the CLI, studies, benchmarks).
__all__ = ["TierUnavailable", "open_export"]
