"""A user's text for ``engram prepare``: files, folders and globs -> documents, with what was left
out counted.

- A folder: every file under it, in sorted order; hidden files and folders (``.git``) are skipped
  and counted; a file reached twice (named twice, or through a link) is read once.
- ``.jsonl`` / ``.parquet`` / ``.csv``: one document per record, its ``text_field``. The field is
  checked before anything is tokenised (the first record, or the file's columns); a later record
  without it, with an empty or non-text value, or a line that is not JSON, is skipped and counted.
- Any other file that decodes as text is one document, whatever its name (a folder of notes or
  licence files has no ``.txt``); a binary file (a NUL byte, or mostly control bytes, in its head) is
  skipped and counted.
- Bytes that are not UTF-8 are replaced (U+FFFD) or, with ``non_utf8="skip"``, the file or record is
  skipped; either way counted, with file and line.

Parquet and CSV are read by pyarrow, in batches (a file larger than memory streams). JSON Lines are
read by the standard library a line at a time: pyarrow's JSON reader fails a whole file on one bad
line or one value of another type, and reports rows, not lines.

Document ids (the split hashes them) are paths relative to the parent of what was named: ``notes/a.md``
for ``--input ~/notes``, ``a.jsonl:12`` for line 12 of ``--input data/a.jsonl``.
"""

from __future__ import annotations

import glob
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..errors import InputNotFound, UserError

RECORDS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".csv": "csv"}
_CONTROL = bytes(set(range(32)) - {9, 10, 12, 13, 27, 8})  # not in text (tab, newlines, ESC, BS...)


class Skips:
    """What was left out or changed, by reason, with the first few places of each."""

    def __init__(self, examples: int = 5):
        self.counts: Counter[str] = Counter()
        self.where: dict[str, list[str]] = {}
        self.examples = examples

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] += 1
        seen = self.where.setdefault(reason, [])
        if len(seen) < self.examples:
            seen.append(where)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {r: {"count": n, "examples": self.where[r]} for r, n in sorted(self.counts.items())}


@dataclass(frozen=True)
class InputFile:
    path: Path
    doc_id: str  # the document id (records add ":line" or ":row")
    source: str  # the --input it came from, for the per-source counts
    kind: str  # "text", "jsonl", "parquet" or "csv"


# -- finding the files -----------------------------------------------------------------------------

def discover(inputs: list[str], skips: Skips,
             out: str | Path | None = None) -> tuple[list[InputFile], list[Path]]:
    """(the files to read in order, the folders walked). A missing path or a glob matching nothing is
    an error before anything is read. ``out`` (the folder being written) is never read, and a
    folder holding it is not recorded (writing ``out`` changes it)."""
    own = os.path.realpath(out) if out is not None else None
    files: list[InputFile] = []
    folders: list[Path] = []
    seen: set[str] = set()
    for arg in inputs:
        if glob.has_magic(arg):
            matches = sorted(glob.glob(os.path.expanduser(arg), recursive=True))
            if not matches:
                raise UserError(f"--input {arg!r}: the pattern matches nothing")
            base = Path(os.path.expanduser(arg.split("*")[0].split("?")[0].split("[")[0])).parent
            found = [(Path(m), base) for m in matches]
        else:
            p = Path(os.path.expanduser(arg))
            if not p.exists():
                raise InputNotFound(f"--input {arg}: no such file or folder")
            found = [(p, p.parent)]
        for path, root in found:
            if own is not None and os.path.realpath(path) == own:
                continue  # a glob matching the folder being written
            if not path.is_dir():
                _add(files, seen, path, root, arg, skips)
                continue
            folders.append(path)
            inside = list(_walk(path, skips, folders, own))
            if not inside:
                raise UserError(f"--input {arg}: no files in {path}")
            for sub in inside:
                _add(files, seen, sub, root, arg, skips)
    if own is not None:
        folders = [f for f in folders if not (own + os.sep).startswith(os.path.realpath(f) + os.sep)]
    return files, folders


def _walk(folder: Path, skips: Skips, folders: list[Path], own: str | None) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(folder):
        for d in [d for d in dirnames if d.startswith(".")]:
            skips.add("hidden folder", str(Path(dirpath) / d))
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")
                             and os.path.realpath(Path(dirpath) / d) != own)
        folders.extend(Path(dirpath) / d for d in dirnames)
        for name in sorted(filenames):
            if name.startswith("."):
                skips.add("hidden file", str(Path(dirpath) / name))
            else:
                yield Path(dirpath) / name


def _add(files: list[InputFile], seen: set[str], path: Path, root: Path, arg: str,
         skips: Skips) -> None:
    real = os.path.realpath(path)
    if real in seen:
        skips.add("duplicate file (read once)", str(path))
        return
    if not os.path.isfile(real):  # a broken link, a socket, a device
        skips.add("not a regular file", str(path))
        return
    seen.add(real)
    files.append(InputFile(path, Path(os.path.relpath(path, root)).as_posix(), arg,
                           RECORDS.get(path.suffix.lower(), "text")))


# -- checks before tokenising ----------------------------------------------------------------------

def check_fields(files: list[InputFile], field: str) -> None:
    """Every record file has ``field``: its columns (Parquet, CSV) or its first record (JSON
    Lines). A wrong --text_field is found here, not after an hour of tokenising."""
    for f in files:
        if f.kind == "parquet":
            schema = _parquet(f.path).schema_arrow
            names = schema.names
            if field in names and not _textual(schema.field(field).type):
                raise UserError(f"{f.path}: column {field!r} holds {schema.field(field).type}, not "
                                "text; pass --text_field NAME")
        elif f.kind == "csv":
            names = _csv_names(f.path)
        elif f.kind == "jsonl":
            names = _first_record_fields(f.path)
        else:
            continue
        if names is not None and field not in names:
            raise UserError(f"{f.path} has no field {field!r} (it has: {', '.join(map(str, names))});"
                            " pass --text_field NAME")


def _textual(t) -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) \
        or pa.types.is_large_binary(t) or pa.types.is_null(t)


def _first_record_fields(path: Path) -> list[str] | None:
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if raw.strip():
                try:
                    rec = json.loads(raw.decode("utf-8", "replace"))
                except ValueError:
                    raise UserError(f"{path}:{lineno} is not JSON: a .jsonl file holds one JSON "
                                    "object per line") from None
                if not isinstance(rec, dict):
                    raise UserError(f"{path}:{lineno} is a JSON {type(rec).__name__}, not an object "
                                    "with a text field")
                return list(rec)
    return None  # no records: an empty file, counted when read


def _pyarrow(module: str, path: Path):
    """pyarrow's ``module``, or a clear error: Parquet and CSV need the ``data`` extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"reading {path} needs pyarrow: pip install 'engram[data]'") from None


def _parquet(path: Path):
    pq = _pyarrow("pyarrow.parquet", path)
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError...: all mean "not Parquet"
        raise UserError(f"{path} is not a readable Parquet file ({e})") from None


def _csv_names(path: Path) -> list[str] | None:
    pacsv = _pyarrow("pyarrow.csv", path)
    try:
        return pacsv.open_csv(path).schema.names
    except Exception as e:
        if "Empty CSV file" in str(e):
            return None
        raise UserError(f"{path} is not a readable CSV file ({e})") from None


# -- reading ---------------------------------------------------------------------------------------

def read(f: InputFile, field: str, skips: Skips,
         non_utf8: str = "replace") -> Iterator[tuple[str, str]]:
    """(document id, text) of one file, in order; what is left out goes to ``skips``."""
    if f.kind == "text":
        text = _text_file(f, skips, non_utf8)
        if text is not None:
            yield f.doc_id, text
        return
    records = {"jsonl": _jsonl, "parquet": _parquet_values, "csv": _csv_values}[f.kind]
    n = 0
    for where, value in records(f, field, skips):
        text = _as_text(value, where, skips, non_utf8)
        if text is not None:
            n += 1
            yield f"{f.doc_id}:{where.rsplit(' ', 1)[-1]}", text
    if n == 0:
        skips.add("file without records", str(f.path))


def _text_file(f: InputFile, skips: Skips, non_utf8: str) -> str | None:
    try:
        data = f.path.read_bytes()
    except OSError as e:
        skips.add("unreadable file", f"{f.path} ({e.strerror})")
        return None
    head = data[:1 << 16]
    if b"\0" in head or len(head) - len(head.translate(None, _CONTROL)) > 0.1 * len(head):
        skips.add("binary file", str(f.path))
        return None
    text = _decode(data, str(f.path), skips, non_utf8, by_line=True)
    if text is not None and not text.strip():
        skips.add("empty file", str(f.path))
        return None
    return text


def _decode(data: bytes, where: str, skips: Skips, non_utf8: str,
            by_line: bool = False) -> str | None:
    try:
        return data.decode("utf-8-sig")  # a leading byte-order mark is not text
    except UnicodeDecodeError:
        pass
    bad = [f"{where}:{i}" for i, line in enumerate(data.split(b"\n"), 1) if not _utf8(line)] \
        if by_line else [where]
    if non_utf8 == "skip":
        skips.add("not UTF-8 (skipped)", bad[0])
        return None
    for b in bad:
        skips.add("not UTF-8 (bytes replaced)", b)
    return data.decode("utf-8-sig", errors="replace")


def _utf8(line: bytes) -> bool:
    try:
        line.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _as_text(value: Any, where: str, skips: Skips, non_utf8: str) -> str | None:
    if value is None:
        skips.add("missing field", where)
        return None
    if isinstance(value, bytes):
        value = _decode(value, where, skips, non_utf8)
        if value is None:
            return None
    if not isinstance(value, str):
        skips.add(f"field is not text ({type(value).__name__})", where)
        return None
    if not value.strip():
        skips.add("empty record", where)
        return None
    return value


def _jsonl(f: InputFile, field: str, skips: Skips) -> Iterator[tuple[str, Any]]:
    with open(f.path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            where = f"{f.path} line {lineno}"
            try:
                rec = json.loads(raw)  # bytes: the decoder takes UTF-8 and rejects bad bytes
            except UnicodeDecodeError:
                rec = _bad_utf8_record(raw)
                if rec is None:
                    skips.add("not JSON", where)
                    continue
                if field not in rec:
                    skips.add("missing field", where)
                    continue
                value = rec[field]  # str with the bad bytes as surrogates: back to those bytes
                yield where, value.encode("utf-8", "surrogateescape") if isinstance(value, str) \
                    else value
                continue
            except ValueError:
                skips.add("not JSON", where)
                continue
            if not isinstance(rec, dict) or field not in rec:
                skips.add("missing field", where)
                continue
            yield where, rec[field]


def _bad_utf8_record(raw: bytes) -> dict | None:
    """A JSON line with bytes that are not UTF-8, parsed with those bytes kept (as surrogates),
    so the text field comes back as bytes to replace or skip like any other."""
    try:
        rec = json.loads(raw.decode("utf-8", "surrogateescape"))
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def _parquet_values(f: InputFile, field: str, skips: Skips) -> Iterator[tuple[str, Any]]:
    row = 0
    for batch in _parquet(f.path).iter_batches(batch_size=1024, columns=[field]):
        for value in batch.column(0).to_pylist():
            row += 1
            yield f"{f.path} row {row}", value


def _csv_values(f: InputFile, field: str, skips: Skips) -> Iterator[tuple[str, Any]]:
    pa, pacsv = _pyarrow("pyarrow", f.path), _pyarrow("pyarrow.csv", f.path)

    def bad_row(row) -> str:
        skips.add("malformed CSV row", f"{f.path} line {row.number}")
        return "skip"

    try:
        reader = pacsv.open_csv(
            f.path, read_options=pacsv.ReadOptions(block_size=1 << 22),
            parse_options=pacsv.ParseOptions(newlines_in_values=True, invalid_row_handler=bad_row),
            # bytes, decoded here: a bad byte costs one record, not the file
            convert_options=pacsv.ConvertOptions(include_columns=[field],
                                                 column_types={field: pa.binary()}))
    except Exception as e:
        if "Empty CSV file" in str(e):
            return
        raise UserError(f"{f.path} is not a readable CSV file ({e})") from None
    row = 0
    for batch in reader:
        for value in batch.column(0).to_pylist():
            row += 1
            yield f"{f.path} row {row}", value
