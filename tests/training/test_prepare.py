"""engram.training.prepare, inputs and tokenise: a user's files and records -> a prepared folder.

Real text throughout (the KJV from its package), written out as the files a user would have:
Markdown notes, a licence file with no extension, JSON Lines, Parquet, CSV.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engram.errors import InputNotFound, OutputExists, UserError
from engram.training.corpus import open_corpus
from engram.training.prepare import PrepareConfig, prepare, tokenizer_threads
from engram.training.tokenizer import load_tokenizer
from engram.training.sources import load_documents

EOS = 1


@pytest.fixture(scope="module")
def chapters():
    return [d.text for d in load_documents("kjv", max_chars=60_000)]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("deepseek")[0]


def segments(stream: np.ndarray, eos: int = EOS) -> list[list[int]]:
    cuts = np.flatnonzero(np.asarray(stream) == eos)
    return [s.tolist() for s in np.split(np.asarray(stream), cuts + 1)[:-1]]


def write_tree(root: Path, chapters: list[str]) -> dict[str, str]:
    """A user's folder: {document id: text} of what should be read from it."""
    notes = root / "notes"
    (notes / "sub").mkdir(parents=True)
    (notes / ".git").mkdir()
    (notes / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (notes / "a.md").write_text("# Genesis\n\n" + chapters[0])
    (notes / "sub" / "LICENSE").write_text(chapters[1])  # no extension: still text
    (notes / "image.bin").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)))
    return {"notes/a.md": "# Genesis\n\n" + chapters[0], "notes/sub/LICENSE": chapters[1]}


def run(tmp: Path, inputs, **kw) -> dict:
    cfg = PrepareConfig(out=str(tmp / kw.pop("out", "out")), input=[str(i) for i in inputs],
                        workers=kw.pop("workers", 0), val_fraction=kw.pop("val_fraction", 0.3), **kw)
    return prepare(cfg, progress=False)


# -- what is read ----------------------------------------------------------------------------------

def test_folder_glob_and_records_become_documents(tmp_path, chapters, tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    want = write_tree(tmp_path, chapters)
    lines = [{"text": chapters[2], "id": 1}, {"body": "no text field"}, {"text": ""},
             {"text": 7}, {"text": chapters[3]}]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\nnot json\n")
    pq.write_table(pa.table({"text": [chapters[4], None, chapters[5]]}), tmp_path / "r.parquet")
    (tmp_path / "r.csv").write_text('title,text\none,"' + chapters[6].replace('"', '""') + '"\n')
    (tmp_path / "old.txt").write_bytes("caf\xe9 au lait\nline two\n\xff\n".encode("latin-1"))
    want.update({"r.jsonl:1": chapters[2], "r.jsonl:5": chapters[3], "r.parquet:1": chapters[4],
                 "r.parquet:3": chapters[5], "r.csv:1": chapters[6],
                 "old.txt": "caf\ufffd au lait\nline two\n\ufffd\n"})
    m = run(tmp_path, [tmp_path / "notes", tmp_path / "r.*", tmp_path / "old.txt"])
    skipped = {r: v["count"] for r, v in m["skipped"].items()}
    assert skipped == {"binary file": 1, "hidden folder": 1, "missing field": 2,
                       "empty record": 1, "field is not text (int)": 1, "not JSON": 1,
                       "not UTF-8 (bytes replaced)": 2}
    assert m["skipped"]["not UTF-8 (bytes replaced)"]["examples"] == [
        f"{tmp_path / 'old.txt'}:1", f"{tmp_path / 'old.txt'}:3"]  # file and line
    assert m["skipped"]["missing field"]["examples"][0] == f"{tmp_path / 'r.jsonl'} line 2"
    corpus = open_corpus(tmp_path / "out")
    got = {}
    for split in ("train", "val"):
        for doc_id, ids in zip(corpus.doc_ids[split], segments(corpus.streams[split].array())):
            got[doc_id] = tok.decode(ids[:-1], skip_special_tokens=False)
    assert got == want  # every document, its tokens decoding to its text, nothing else
    assert m["summary"]["documents"] == len(want) and corpus.doc_ids["val"]


def test_skip_mode_drops_non_utf8_and_counts_it(tmp_path, chapters):
    (tmp_path / "ok.txt").write_text(chapters[0])
    (tmp_path / "old.txt").write_bytes(b"caf\xe9\n")
    m = run(tmp_path, [tmp_path / "ok.txt", tmp_path / "old.txt"], non_utf8="skip",
            val_fraction=0.5)
    assert m["skipped"]["not UTF-8 (skipped)"] == {"count": 1,
                                                    "examples": [f"{tmp_path / 'old.txt'}:1"]}
    assert m["summary"]["documents"] == 1


# -- bad input: a clear error before any work, or a counted skip -----------------------------------

@pytest.mark.parametrize("case, error, match", [
    ("glob", UserError, "matches nothing"),
    ("missing", InputNotFound, "no such file"),
    ("empty folder", UserError, "no files in"),
    ("only empty", UserError, "no documents to prepare.*1 empty file"),
    ("field", UserError, "has no field 'text' \\(it has: body\\); pass --text_field"),
    ("not jsonl", UserError, "is not JSON"),
    ("nothing", UserError, "nothing to prepare"),
    ("out is a file", OutputExists, "is a file"),
    ("out holds files", OutputExists, "is not a corpus folder: it holds files engram did not"),
    ("eos", UserError, "not a token of this tokenizer"),
])
def test_bad_input_is_a_clear_error(tmp_path, monkeypatch, case, error, match):
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank.txt").write_text("  \n")
    (tmp_path / "b.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "c.jsonl").write_text("[1, 2\n")
    (tmp_path / "ok.txt").write_text("some text")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep me")
    inputs = {"glob": ["nope/*.md"], "missing": ["nope.txt"], "empty folder": ["empty"],
              "only empty": ["blank.txt"], "field": ["b.jsonl"], "not jsonl": ["c.jsonl"],
              "nothing": []}.get(case, ["ok.txt"])
    kw = {"out": {"out is a file": "afile", "out holds files": "full"}.get(case, "out")}
    if case == "eos":
        kw["eos_token"] = "<nope>"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=match):
        run(tmp_path, inputs, **kw)
    assert (tmp_path / "full" / "mine.txt").read_text() == "keep me"  # nothing lost


def test_cli_prepare_prints_a_summary_and_exits_2_on_bad_input(tmp_path, chapters, capsys):
    from engram.cli import main

    (tmp_path / "a.txt").write_text(chapters[0])
    (tmp_path / "b.txt").write_text(chapters[1])
    assert main(["prepare", "--input", str(tmp_path / "*.txt"), "--out", str(tmp_path / "o"),
                 "--workers=0", "--val_fraction=0.5"]) == 0
    out = capsys.readouterr().out
    assert "2 documents" in out and f"engram train --data {tmp_path / 'o'}" in out
    assert main(["prepare", "--input", str(tmp_path / "*.nope"), "--out", str(tmp_path / "p")]) == 2
    assert "matches nothing" in capsys.readouterr().err


# -- shards, workers, resuming ---------------------------------------------------------------------

def test_many_shards_and_workers_give_the_same_tokens(tmp_path, chapters):
    folder = tmp_path / "in"
    folder.mkdir()
    for i, text in enumerate(chapters[:12]):
        (folder / f"{i:02d}.txt").write_text(text)
    one = run(tmp_path, [folder], out="one")
    many = run(tmp_path, [folder], out="many", shard_mb=0.01)
    had = os.environ.pop("RAYON_NUM_THREADS", None)
    try:
        par = run(tmp_path, [folder], out="par", shard_mb=0.01, workers=2)
        assert "RAYON_NUM_THREADS" not in os.environ  # prepare() sets no process-wide setting
        with tokenizer_threads(2):  # the entry point's (engram prepare): set, then unset
            assert os.environ["RAYON_NUM_THREADS"] == "2"
        with tokenizer_threads(0):
            assert "RAYON_NUM_THREADS" not in os.environ
        assert "RAYON_NUM_THREADS" not in os.environ
        os.environ["RAYON_NUM_THREADS"] = "3"
        with tokenizer_threads(2):  # the user's own setting stays
            assert os.environ["RAYON_NUM_THREADS"] == "3"
        assert os.environ.pop("RAYON_NUM_THREADS") == "3"
    finally:
        if had is not None:
            os.environ["RAYON_NUM_THREADS"] = had
    assert one["summary"]["shards"] == 1 and many["summary"]["shards"] >= 4
    assert par["fingerprint"] == many["fingerprint"]  # worker threads change nothing
    a, b = open_corpus(tmp_path / "one"), open_corpus(tmp_path / "many")
    for split in ("train", "val"):
        np.testing.assert_array_equal(a.streams[split].array(), b.streams[split].array())
    assert a.doc_ids == b.doc_ids and (a.counts == b.counts).all()


def test_sigkill_mid_prepare_reruns_to_the_same_result(tmp_path, chapters):
    folder = tmp_path / "in"
    folder.mkdir()
    text = "\n".join(d.text for d in load_documents("kjv"))
    for i in range(0, len(text), 40_000):
        (folder / f"{i:08d}.txt").write_text(text[i:i + 40_000])
    whole = run(tmp_path, [folder], out="whole", shard_mb=0.08, val_fraction=0.05)
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "engram", "prepare", "--input", str(folder), "--out", str(out),
           "--shard_mb=0.08", "--workers=1", "--val_fraction=0.05"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(out.glob("shards/*.json"))) < 3:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the command and its worker
    proc.wait()
    assert not (out / "manifest.json").exists()  # no manifest naming what was not written
    with pytest.raises(UserError, match="did not finish; rerun the same command"):
        open_corpus(out)
    done = {p: p.stat().st_mtime_ns for p in out.glob("shards/*.train.npy")
            if p.with_name(p.name.replace(".train.npy", ".json")).exists()}
    assert len(done) >= 3
    again = run(tmp_path, [folder], out="killed", shard_mb=0.08, val_fraction=0.05)
    assert again["fingerprint"] == whole["fingerprint"]
    assert again["summary"]["shards_kept"] >= len(done)
    assert all(p.stat().st_mtime_ns == t for p, t in done.items())  # finished shards not redone


def test_a_changed_input_redoes_only_its_shard(tmp_path, chapters):
    folder = tmp_path / "in"
    folder.mkdir()
    for i, text in enumerate(chapters[:6]):
        (folder / f"{i}.txt").write_text(text)
    run(tmp_path, [folder], shard_mb=0.001)  # one document per shard
    with pytest.raises(UserError, match="inputs that have changed since: .*5.txt"):
        (folder / "5.txt").write_text(chapters[7])
        open_corpus(tmp_path / "out")
    m = run(tmp_path, [folder], shard_mb=0.001)
    assert (m["summary"]["shards_made"], m["summary"]["shards_kept"]) == (1, 5)
    open_corpus(tmp_path / "out")  # and it trains again


# -- tokenizers ------------------------------------------------------------------------------------

def bpe(texts: list[str], eos: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=[eos]))
    return t


@pytest.mark.parametrize("form", ["tokenizer.json", "folder"])
def test_any_tokenizer_with_its_compression_stored(tmp_path, chapters, form):
    from engram.retrieval.compress import compute_lookup

    t = bpe(chapters, "<eot>" if form == "folder" else "<|endoftext|>")
    if form == "folder":  # a transformers tokenizer folder: its config names the end token
        spec = tmp_path / "tok"
        spec.mkdir()
        t.save(str(spec / "tokenizer.json"))
        (spec / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<eot>"}}))
    else:
        spec = tmp_path / "tokenizer.json"
        t.save(str(spec))
    for i, text in enumerate(chapters[:6]):
        (tmp_path / f"{i}.md").write_text(text)
    m = run(tmp_path, [tmp_path / "*.md"], tokenizer=str(spec), val_fraction=0.5)
    corpus = open_corpus(tmp_path / "out")
    assert m["tokenizer"]["eos_id"] == corpus.eos_id == t.token_to_id(m["tokenizer"]["eos_token"])
    assert m["tokenizer"]["vocab_size"] == t.get_vocab_size() == corpus.counts.shape[1]
    np.testing.assert_array_equal(corpus.compression().lookup, compute_lookup(t))
    ids = segments(corpus.streams["train"].array(), corpus.eos_id)[0][:-1]
    assert corpus.tokenizer().decode(ids) in chapters[:6]


def test_out_inside_an_input_folder_is_not_read(tmp_path, chapters, monkeypatch):
    for i, text in enumerate(chapters[:6]):
        (tmp_path / f"{i}.md").write_text(text)
    monkeypatch.chdir(tmp_path)
    first = prepare(PrepareConfig(out="corpus", input=["."], workers=0, val_fraction=0.5),
                    progress=False)
    again = prepare(PrepareConfig(out="corpus", input=["."], workers=0, val_fraction=0.5),
                    progress=False)
    assert first["summary"]["documents"] == again["summary"]["documents"] == 6
    assert again["fingerprint"] == first["fingerprint"] and again["summary"]["shards_kept"] == 1
    open_corpus(tmp_path / "corpus")  # writing it did not count as a changed input


def test_the_closing_line_names_the_next_step_for_its_tokenizer():
    """A corpus in DeepSeek's tokenizer trains the reference LM; one in a pretrained model's own
    tokenizer is for `engram finetune` (issue 50: it said `engram train` for smollm2)."""
    from engram.training.prepare import summary_lines
    s = {"documents": 2, "tokens": 10, "train_tokens": 8, "val_tokens": 2, "mb": 0.1, "shards": 1,
         "shards_made": 1, "shards_kept": 0, "seconds": 1.0, "tokens_per_s": 10, "mb_per_s": 0.1}
    base = {"summary": s, "skipped": {}}
    assert summary_lines({**base, "tokenizer_spec": "deepseek"}, "c")[-1].endswith(
        "engram train --data c")
    assert summary_lines({**base, "tokenizer_spec": "smollm2"}, "c")[-1].endswith(
        "engram finetune smollm2 --data c")
    assert "engram finetune MODEL" in summary_lines({**base, "tokenizer_spec": "tok.json"}, "c")[-1]
