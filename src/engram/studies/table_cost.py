"""What a lossy table format costs, measured on every lossy export, and the gate that refuses one
that costs too much (issue 47).

Only fp32 table files give the memory tier's tokens exactly; bf16, fp16, fp8, int8 and int4 round
every trained row once, at export (tables/fp8.py, tables/blocks.py). ``export_gated`` writes the
files (serving/loader.py's ``write_tables``), then measures them against the run's fp32 tables
(studies/table_scoring.py: paired loss change with its block-bootstrap interval, KL, top-1
agreement, on the held-out split or a ``--text`` file). The result is written beside the files
as quality.json; ``engram generate`` and ``engram eval`` print it (``cost_line``) when they read
those files.

A format whose mean loss rise exceeds the threshold (``LOSS_THRESHOLD``, or ``accept_loss``
given by the user) is refused in one line, and the table files it wrote are removed, so no
tier opens them (``stale_tables`` then names a missing file); quality.json stays, saying why.

``engram export-hf`` goes through the same gate (``export_hf_gated``): the lossy files are
written and measured by ``export_gated`` in a folder of their own inside the export, and replace
the export's table files only when kept, so a refusal leaves the export as it was (issue 47:
every lossy export measured, none left half written).
"""

from __future__ import annotations

import hashlib
import json
import math
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

from ..errors import UserError
from .table_scoring import MAX_TOKENS, measure

# The gate, fixed before any int4 result was seen: a format whose mean loss rises more than 0.01
# nats a token is refused. 0.01 nats is ~1% perplexity, and about an eighth of the memory's
# measured part of Engram's gain in compare's default (0.078 nats, benchmarks/results/compare/
# arms4_zen3/): a format costing more eats a visible share of what the tables are for.
LOSS_THRESHOLD = 0.01
QUALITY = "quality.json"  # the measurement, beside the table files
EXACT = ("fp32",)  # the table dtypes that hold the trained rows exactly


def is_lossy(dtype: str) -> bool:
    return dtype not in EXACT


# -- the export and its gate -----------------------------------------------------------------------

def export_gated(run_dir: str | Path, table_dir: str | Path | None, dtype: str, *,
                 accept_loss: float | None = None, text: str | Path | None = None,
                 max_tokens: int = MAX_TOKENS, command: str = "engram export-tables",
                 say: Callable[[str], None] | None = None) -> tuple[Path, dict[str, Any] | None]:
    """The table files of a run's newest checkpoint in ``dtype`` (``write_tables``), and for a
    lossy dtype their measured cost (quality.json, reused while the files, the tokens' source and
    ``max_tokens`` are the same): (folder, the record; None for fp32). A cost over the threshold
    (``accept_loss``, None: ``LOSS_THRESHOLD``) removes the files and raises a one-line
    UserError."""
    from ..outputs import writer
    from ..serving.loader import write_tables

    folder = write_tables(run_dir, table_dir, dtype, say=say)
    quality = folder / QUALITY
    if not is_lossy(dtype):
        if quality.exists():
            with writer(folder, "table_dir"):
                quality.unlink(missing_ok=True)  # it described other files, now replaced
        return folder, None
    source = _source(text)
    threshold = _threshold(accept_loss)
    rec = read_record(folder)
    if _current(rec, folder, source, max_tokens) and rec.get("threshold") == threshold and \
            rec["mean"] <= threshold:
        return folder, rec  # measured and kept already: nothing to write (readers need no lock)
    with writer(folder, "table_dir"):
        try:
            rec = _measured(run_dir, folder, dtype, text, source, max_tokens, say)
        except UserError as e:  # no tokens to score (the data moved, --text overlaps, ...)
            removed = remove_tables(folder, dtype)  # those write_tables just wrote
            raise UserError(f"{e} (the {removed} {dtype} table file{'s' if removed != 1 else ''} "
                            "written are removed: a lossy format is not served unmeasured)") from e
        kept = _judge(rec, folder, threshold, accept_loss, command)
        if kept:
            return folder, rec
        removed = remove_tables(folder, dtype, rec["checkpoint"])
        raise Refused(_refusal(rec, dtype, threshold, accept_loss,
                               f"removed the {removed} table file{'s' if removed != 1 else ''} "
                               f"written (measurement in {quality})"), rec)


def _threshold(accept_loss: float | None) -> float:
    return LOSS_THRESHOLD if accept_loss is None else float(accept_loss)


def _current(rec: dict[str, Any] | None, folder: Path, source: dict[str, Any],
             max_tokens: int) -> bool:
    """Whether ``rec`` measured the table files now in ``folder``, on these tokens."""
    return rec is not None and (rec.get("files"), rec.get("source"), rec.get("max_tokens")) == (
        files_fingerprint(folder), source, max_tokens)


def _measured(run_dir: str | Path, folder: Path, dtype: str, text: str | Path | None,
              source: dict[str, Any], max_tokens: int,
              say: Callable[[str], None] | None) -> dict[str, Any]:
    """The record of the files in ``folder``: quality.json's when it measured them on these
    tokens, else measured now (the caller holds the folder's writer lock)."""
    rec = read_record(folder)
    if _current(rec, folder, source, max_tokens):
        return rec
    files = files_fingerprint(folder)  # under the lock: the files measured
    if say is not None:
        say(f"measuring what {dtype} rows cost against the checkpoint's fp32 tables on "
            f"at most {max_tokens:,} {source['name']} tokens")
    return {**measure(run_dir, folder, dtype, text=text, max_tokens=max_tokens),
            "files": files, "source": source, "max_tokens": max_tokens}


def _judge(rec: dict[str, Any], folder: Path, threshold: float, accept_loss: float | None,
           command: str) -> bool:
    """Give ``rec`` its verdict under ``threshold`` and write it as ``folder``/quality.json;
    whether the files are kept."""
    from ..outputs import write_json

    kept = rec["mean"] <= threshold
    rec.update(threshold=threshold, accept_loss=accept_loss, verdict="kept" if kept else "refused")
    write_json(folder / QUALITY, rec, command, indent=1)
    return kept


class Refused(UserError):
    """A format over the gate's threshold: the one line, and its measurement (``record``)."""

    def __init__(self, line: str, record: dict[str, Any]) -> None:
        super().__init__(line)
        self.record = record


def _refusal(rec: dict[str, Any], dtype: str, threshold: float, accept_loss: float | None,
             done: str) -> str:
    """The one line refusing ``dtype``'s files; ``done``: what became of them."""
    lo, hi = rec["interval"]["low"], rec["interval"]["high"]
    over = (f"the gate's threshold of {threshold:g} nats" if accept_loss is None
            else f"--accept_loss {threshold:g}")
    name = rec["source"]["name"] if isinstance(rec.get("source"), dict) else "scored"
    return (
        f"{dtype} table files raise the loss by {rec['mean']:+.3g} nats/token (95% interval "
        f"[{lo:+.3g}, {hi:+.3g}], {rec['tokens']:,} {name} tokens), over {over}; "
        f"refused: {done}; keep them with --accept_loss {_round_up(rec['mean']):g}, or choose "
        "another --table_dtype")


# -- the gate on an export (engram export-hf) ------------------------------------------------------

STAGE = ".tables-gate"  # in an export's folder: a lossy format's files while they are measured


def export_hf_gated(run_dir: str | Path, out_dir: str | Path, dtype: str,
                    write: Callable[[], Path], *, accept_loss: float | None = None,
                    text: str | Path | None = None, max_tokens: int = MAX_TOKENS,
                    command: str = "engram export-hf", say: Callable[[str], None] | None = None,
                    placed: list[Path] | None = None) -> tuple[Path, dict[str, Any] | None]:
    """``engram export-hf``'s gate: ``write()`` writes the export of the run's newest checkpoint
    with ``dtype`` table files into ``out_dir`` (serving/loader.py's ``export_hf``); for a lossy
    dtype the files are first written into ``out_dir``/.tables-gate and measured there as
    ``export_gated`` measures a run's (the same function, threshold and record). A kept format's
    files and quality.json move into the export's table folder, where ``write()`` keeps them (a
    file holding exactly its rows is not written again); a refused one leaves ``out_dir`` as it
    was: no lossy file, no half export (its table files are replaced only once the gate has
    passed). A rerun whose export already holds the measured files decides from their
    quality.json without measuring. Returns (the export, the record; None for fp32); ``placed``,
    given, is extended with the files the gate wrote into the export's table folder."""
    import shutil

    from ..artifacts.checkpoint import newest_checkpoint
    from ..artifacts.export import SERVING_DEFAULTS

    out = Path(out_dir)
    tables = out / SERVING_DEFAULTS["table_dir"]
    stage = out / STAGE
    if not is_lossy(dtype):
        path = write()
        (tables / QUALITY).unlink(missing_ok=True)  # it described other files, now replaced
        shutil.rmtree(stage, ignore_errors=True)  # a killed earlier gate's
        return path, None
    source, threshold = _source(text), _threshold(accept_loss)
    rec = read_record(tables)
    ckpt = newest_checkpoint(run_dir)
    if _current(rec, tables, source, max_tokens) and rec.get("format") == dtype and \
            ckpt is not None and rec.get("checkpoint") == ckpt.name:
        # the export's files were measured (an earlier export-hf): the record decides
        if rec["mean"] > threshold:
            raise Refused(_refusal(rec, dtype, threshold, accept_loss, f"{out} left as it was"),
                          rec)
        if (rec.get("threshold"), rec.get("accept_loss")) != (threshold, accept_loss):
            _judge(rec, tables, threshold, accept_loss, command)
        path = write()
        shutil.rmtree(stage, ignore_errors=True)  # a killed earlier gate's
        return path, rec
    try:
        folder, rec = export_gated(run_dir, stage, dtype, accept_loss=accept_loss, text=text,
                                   max_tokens=max_tokens, command=command, say=say)
    except Refused as e:  # its files are gone already; nor is its quality.json kept: out_dir
        shutil.rmtree(stage, ignore_errors=True)  # is left as it was
        raise Refused(_refusal(e.record, dtype, threshold, accept_loss, f"{out} left as it was"),
                      e.record) from None
    # kept: the measured files become the export's, quality.json last (it names them)
    tables.mkdir(parents=True, exist_ok=True)
    for p in sorted(folder.iterdir(), key=lambda p: p.name == QUALITY):
        if p.is_file() and not p.name.startswith("."):
            p.replace(tables / p.name)
            if placed is not None:
                placed.append(tables / p.name)
    shutil.rmtree(stage, ignore_errors=True)
    path = write()
    if files_fingerprint(tables) != rec["files"]:  # write() replaced them: not what was measured
        (tables / QUALITY).unlink(missing_ok=True)
        raise UserError(f"the table files in {tables} changed while the export was written (a "
                        f"new checkpoint of {run_dir}?); run the command again to measure them")
    return path, rec


# -- the exports a user calls (engram.write_tables, engram.export_hf): the commands' own path ---

def write_tables(run_dir: str | Path, table_dir: str | Path | None = None, dtype: str = "fp32",
                 *, accept_loss: float | None = None, text: str | Path | None = None,
                 max_tokens: int = MAX_TOKENS, say: Callable[[str], None] | None = None) -> Path:
    """The table files of a run's newest checkpoint in ``table_dir`` (default RUN/tables), as
    ``engram export-tables`` writes them: a lossy ``dtype`` (all but fp32) is measured against
    the fp32 tables (quality.json beside the files; ``say``, given, hears its one line) and
    refused in one UserError line, its files removed, when the loss rises more than
    ``LOSS_THRESHOLD`` nats a token (or ``accept_loss``). Returns the folder."""
    folder, rec = export_gated(run_dir, table_dir, dtype, accept_loss=accept_loss, text=text,
                               max_tokens=max_tokens, say=say)
    if rec is not None and say is not None:
        say(describe(rec))
    return folder


def export_hf(run_dir: str | Path, out_dir: str | Path, *, tier: str = "memory",
              table_dtype: str = "fp32", cache_fraction: float = 0.0, prefetch: bool = False,
              engram_layers: str | Path | None = None, accept_loss: float | None = None,
              text: str | Path | None = None, max_tokens: int = MAX_TOKENS,
              say: Callable[[str], None] | None = None, kept: list[Path] | None = None) -> Path:
    """An export of the newest checkpoint of ``run_dir`` in ``out_dir`` (artifacts/export.py),
    as ``engram export-hf`` writes it: a lossy ``table_dtype`` is measured before it replaces any
    table file and refused in one UserError line, ``out_dir`` left as it was, when the loss rises
    more than ``LOSS_THRESHOLD`` nats a token (or ``accept_loss``); ``engram_layers``: a V4.1
    layer set replacing its Engram layers (fp8 or fp32 table files, which hold its rows exactly).
    ``kept``, given, is extended with the files already there and current, not written again.
    Returns the export's folder."""
    from ..outputs import claim_folder, release
    from ..serving.loader import export_hf as write_export

    if engram_layers is not None and table_dtype not in ("fp32", "fp8"):
        # Every lossy export is measured, against the rows it rounds; a layer set's are fp8 +
        # E8M0 (fp8 and fp32 files hold them exactly), and the gate measures against a run's own
        # tables, not a layer set's.
        raise UserError(f"table_dtype {table_dtype} with engram_layers: a V4.1 layer set's rows "
                        "are fp8 with E8M0 scales, held exactly by fp8 or fp32 table files; "
                        "another format's cost against them is not measured, so it is not "
                        "exported (choose table_dtype fp8)")
    ours: list[Path] = []  # files the export found current (the gate's own are not "kept")

    def write() -> Path:
        return write_export(run_dir, out_dir, tier=tier, table_dtype=table_dtype,
                            cache_fraction=cache_fraction, prefetch=prefetch,
                            engram_layers=engram_layers, kept=ours)

    # The folder is an export's before the gate stages its files in it (the command claims it
    # first too; a claim nests), and goes again when this call made it and the gate refused.
    with ExitStack() as hold:
        created = claim_folder(out_dir, "export", "engram export-hf", "out_dir",
                               of=str(Path(run_dir).resolve()), hold=hold)
        try:
            if engram_layers is not None:  # the layer set's own rows (fp8 + E8M0), or fp32
                out = write()
            else:
                placed: list[Path] = []
                out, rec = export_hf_gated(run_dir, out_dir, table_dtype, write,
                                           accept_loss=accept_loss, text=text,
                                           max_tokens=max_tokens, say=say, placed=placed)
                if rec is not None and say is not None:
                    say(describe(rec))
                ours = [p for p in ours if p not in placed]  # written through the gate
        except BaseException:
            release(created, out_dir)
            raise
    if kept is not None:
        kept.extend(ours)
    return out


def remove_tables(folder: Path, dtype: str, tag: str | None = None) -> int:
    """Remove the table files in ``folder`` holding ``dtype`` rows of checkpoint ``tag`` (the
    refused export's; None: of any); how many."""
    from ..tables.tablefile import read_header

    n = 0
    for p in sorted(folder.glob("*.table")):
        h = read_header(p)
        if h.dtype == dtype and tag in (None, h.tag):
            p.unlink()
            n += 1
    return n


def _round_up(x: float) -> float:
    """x rounded up to two significant digits: an --accept_loss that keeps it."""
    if x <= 0:
        return 0.0
    step = 10.0 ** (math.floor(math.log10(x)) - 1)
    return math.ceil(x / step - 1e-9) * step


def _source(text: str | Path | None) -> dict[str, Any]:
    """Where the tokens come from, as quality.json records it (a text file with its digest, so an
    edited file is measured again)."""
    if text is None:
        return {"name": "held-out", "text": None, "sha256": None}
    digest = hashlib.sha256(Path(text).read_bytes()).hexdigest()
    return {"name": f"--text {Path(text).name}", "text": str(text), "sha256": digest}


def files_fingerprint(folder: Path) -> str:
    """The table files in ``folder`` as their headers name them (dtype, checkpoint, every
    chunk's crc32): another export, even of the same dtype, changes it."""
    from ..tables.tablefile import read_header

    heads = []
    for p in sorted(folder.glob("*.table")):
        h = read_header(p)
        heads.append([p.name, h.dtype, h.tag, h.scale_block, h.chunks])
    return hashlib.sha256(json.dumps(heads).encode()).hexdigest()


def read_record(folder: Path) -> dict[str, Any] | None:
    """quality.json in ``folder``, or None (absent or unreadable: measured again)."""
    from ..outputs import WRITTEN_BY

    try:
        rec = json.loads((folder / QUALITY).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or "mean" not in rec:
        return None
    rec.pop(WRITTEN_BY, None)  # the writer is named again when it is written again
    return rec


# -- the measurement -------------------------------------------------------------------------------

def describe(rec: dict[str, Any], recorded: bool = False) -> str:
    """One line of a quality.json: the format, its cost and agreement."""
    iv = rec["interval"]
    name = rec["source"]["name"] if isinstance(rec.get("source"), dict) else "scored"
    what = "recorded cost" if recorded else "cost"
    line = (f"{rec['format']} table files, {what} {rec['mean']:+.3g} nats/token "
            f"[{iv['low']:+.3g}, {iv['high']:+.3g}], KL {rec['kl']:.3g}, top-1 "
            f"{rec['top1']:.2%} ({rec['tokens']:,} {name} tokens)")
    if not recorded:
        line += f"; threshold {rec['threshold']:g} nats: {rec['verdict']}"
    return line


def table_folder(path: str | Path, tier: str = "memory",
                 table_dir: str | Path | None = None) -> Path | None:
    """The folder of table files a command serving ``path`` reads: an export's own, a run's or an
    adapter's on a file tier (``table_dir``, default RUN/tables); None when it reads none (the
    memory tier of a run or an adapter)."""
    from ..artifacts import adapter, export, run

    path = Path(path)
    if export.detect(path):
        return path / export.read_export(path)["engram_serving"]["table_dir"]
    if tier == "memory":
        return None
    if table_dir is not None:
        return Path(table_dir)
    return path / (adapter.TABLES if adapter.detect(path) else run.TABLES)


def writes_tables(path: str | Path) -> bool:
    """Whether ``path`` is a run folder or an adapter, not an ``engram export-hf`` folder: the
    kinds whose table files a command writes (from the newest checkpoint, from the adapter's
    tensors); an export's are its own."""
    from ..artifacts import export

    return not export.detect(path)


def cost_line(folder: Path | None) -> str | None:
    """The format of the table files in ``folder`` and their recorded cost, in one line; None
    when there are none, or they are fp32 (exact)."""
    from ..tables.tablefile import read_header

    paths = sorted(folder.glob("*.table")) if folder is not None and folder.is_dir() else []
    if not paths:
        return None
    dtype = read_header(paths[0]).dtype
    if not is_lossy(dtype):
        return None
    rec = read_record(folder)
    if rec is None or rec.get("files") != files_fingerprint(folder):
        return (f"{dtype} table files: cost never measured (no quality.json of these files; "
                f"`engram export-tables --table_dtype {dtype}` measures it)")
    return describe(rec, recorded=True)
