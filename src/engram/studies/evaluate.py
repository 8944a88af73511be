"""`engram eval RUN_DIR --text FILE | --source NAME | --data DIR`: a trained run's loss on any text.

Text from elsewhere holds tokens the run never saw: they stay in the input as context and are left
out as targets, counted (the runtime's policy, serving/runtime.py).

Shape legend:
    n tokens in the stream, b windows per batch, t positions per window, d model width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from ..models.precision import PRECISIONS, check_names
from ..outputs import read_text, write_json
from ..ranges import AT_LEAST_1, check_ranges


@dataclass
class EvalConfig:
    text: str | None = None  # a UTF-8 text file; paragraphs (blank-line separated) are documents
    # or a corpus source by name
    source: str | None = field(default=None, metadata={"choices": "engram.training.corpus:SOURCES"})
    data: str | None = None  # or a folder written by `engram prepare`: its held-out documents
    max_chars: int | None = None  # keep the first max_chars characters (None: all)
    batch_size: int = 16  # windows per forward pass
    seq_len: int | None = None  # window length; None: the run's training length
    json: str | None = None  # also write the result here
    # Also score each document alone, after EOS (lm-evaluation-harness's rolling log-likelihood):
    # per-document log-likelihoods in nats under "per_document" (`engram lm-eval` gives the same).
    per_document: bool = False
    device: str = "cpu"  # where the model runs: cpu, cuda, cuda:N or auto
    # fp32, or bf16 / fp16: the forward under autocast (a bf16 run's checkpoint loads either way)
    precision: str = field(default="fp32", metadata={"choices": PRECISIONS})

    def __post_init__(self) -> None:
        check_ranges(self, max_chars=AT_LEAST_1, batch_size=AT_LEAST_1, seq_len=AT_LEAST_1)
        check_names(self.device, self.precision)


def read_documents(ec: EvalConfig) -> list[str]:
    """The text to score as documents, from ``text`` or ``source`` (``data`` is read as tokens)."""
    if sum(x is not None for x in (ec.text, ec.source, ec.data)) != 1:
        raise UserError("give exactly one of --text FILE, --source NAME or --data DIR")
    if ec.source is not None:
        from ..training.corpus import load_documents

        return [d.text for d in load_documents(ec.source, ec.max_chars)]
    path = Path(ec.text)
    text = read_text(path, "--text")[:ec.max_chars]  # a binary file is refused, not scored
    docs = [p.strip() for p in text.split("\n\n") if p.strip()]
    if not docs:
        raise UserError(f"--text {path} holds no text")
    return docs


def encode(tokenizer: Any, docs: list[str], eos_id: int) -> np.ndarray:
    """Documents -> one raw-id stream [n], each document followed by EOS (as the corpus does)."""
    encs = tokenizer.encode_batch(docs, add_special_tokens=False)
    return np.concatenate([np.asarray(e.ids + [eos_id], dtype=np.int64) for e in encs])


def held_out(folder: str, tokenizer: Any) -> tuple[np.ndarray, int]:
    """The validation stream [n] (raw ids, int64) of a prepared folder and its document count; the
    folder must have been tokenised as the run was."""
    from ..retrieval.compress import tokenizer_fingerprint
    from ..training.corpus import open_corpus
    from ..training.shards import DataError

    corpus = open_corpus(folder)
    if corpus.tokenizer_fingerprint != tokenizer_fingerprint(tokenizer):
        raise DataError(f"--data {folder} was tokenised with another tokenizer than the run's: "
                        "prepare it with the run's --tokenizer")
    return np.asarray(corpus.val, dtype=np.int64), corpus.manifest["stats"]["total"]["val"]["docs"]


def run_eval(run_dir: str, ec: EvalConfig, progress: bool = True) -> dict[str, Any]:
    from ..serving.loader import open_model

    rt = open_model(run_dir, device=ec.device, precision=ec.precision)
    eos = rt.eos_id
    if ec.data is not None:
        raw, n_docs = held_out(ec.data, rt.tokenizer)
        docs = None
    else:
        docs = read_documents(ec)
        raw, n_docs = encode(rt.tokenizer, docs, eos), len(docs)
    seq_len = ec.seq_len or rt.max_seq_len
    res = rt.score(raw, seq_len, ec.batch_size, progress)
    res.update({"run": str(run_dir), "checkpoint": rt.checkpoint, "documents": n_docs,
                "text": ec.text, "source": ec.source, "data": ec.data, "seq_len": seq_len})
    if ec.per_document:
        if docs is None:  # the held-out stream: each document is followed by its EOS
            ends = np.flatnonzero(raw == eos)
            ids = [raw[a + 1:b].tolist() for a, b in zip(np.r_[-1, ends[:-1]], ends)]
        else:
            ids = [e.ids for e in rt.tokenizer.encode_batch(docs, add_special_tokens=False)]
        res["per_document"] = rt.score_documents(ids, eos, seq_len, ec.batch_size)
    if ec.json:
        write_json(ec.json, res, "engram eval", indent=2)
    return res
