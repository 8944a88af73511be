"""An `engram finetune` adapter's tables as table files (issue 47: formats for adapters too): a tiny
random Llama finetuned a few steps, `engram export-tables ADAPTER --table_dtype D` gated on the
adapter's own held-out split (its finetune data's), and every file tier serving it: fp32 files give
the memory tier's logits and tokens bit for bit, a lossy format the same greedy tokens through the
command line and the Python runtime, its rows the format's rounding of the adapter's; stale or
missing files, a hot cache and an export folder are refused in one line."""

import contextlib
import io
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import engram  # noqa: E402
from engram.artifacts.adapter import TABLES  # noqa: E402
from engram.cli import main  # noqa: E402
from engram.errors import UserError  # noqa: E402
from engram.serving.generate import GenerationConfig, Generator  # noqa: E402
from engram.studies.table_cost import QUALITY  # noqa: E402
from engram.tables.tablefile import read_header, table_paths  # noqa: E402
from engram.training.finetune import FinetuneConfig, finetune  # noqa: E402

from hf_models import model_and_corpus  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "In the beginning God created the heaven"
NEW = 8


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tok):
    """A tiny Llama's adapter, finetuned 4 steps on KJV text prepared with its tokenizer."""
    root = tmp_path_factory.mktemp("adapter_tables")
    model_and_corpus(root, "llama", tok)
    finetune(str(root / "model"), FinetuneConfig(
        data=str(root / "corpus"), out_dir=str(root / "adapter"), layers=(0, 1), steps=4,
        seq_len=32, batch_size=2, table_size=101, n_embed_per_ngram=16, n_head_per_ngram=2,
        ckpt_every=4, eval_batches=1, lr=1e-2, threads=1), progress=False)
    return root / "adapter"


def _main(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, err.getvalue()


def _tokens(adapter, js, *args):
    rc, err = _main(["generate", str(adapter), "--prompt", PROMPT, "--max_new_tokens", str(NEW),
                     "--no-stop", "--json", str(js), *args])
    assert rc == 0, err
    return json.loads(js.read_text())["tokens"][0], err


@torch.no_grad()
def _logits(rt):
    x = torch.tensor([rt.encode(PROMPT)])
    return rt.model.logits(rt.forward(x, warn=False).hidden)


def _rows(rt):
    """{layer: every row of its table [r, e]} as the runtime serves them."""
    out = {}
    for lid, e in rt.model.engrams().items():
        out[lid] = e.table.lookup(torch.arange(e.table.num_rows)).float()
    return out


def test_fp32_files_serve_the_memory_tier_exactly(adapter, tmp_path):
    rc, err = _main(["export-tables", str(adapter)])
    assert rc == 0, err
    memory = engram.open(adapter)
    for p in table_paths(adapter / TABLES, memory.hasher):
        assert read_header(p).tag == memory.checkpoint and read_header(p).dtype == "fp32"
    want, _ = _tokens(adapter, tmp_path / "memory.json")
    for tier in ("file", "pinned", "pool"):
        rt = engram.open(adapter, tier=tier)
        got = _rows(rt)
        for lid, rows in _rows(memory).items():
            assert torch.equal(got[lid], rows), (tier, lid)
        assert torch.equal(_logits(rt), _logits(memory)), tier
    tokens, _ = _tokens(adapter, tmp_path / "file.json", "--tier", "file")
    assert tokens == want


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_lossy_format_is_gated_on_the_adapters_held_out_split(adapter, tmp_path, kind):
    folder = tmp_path / kind
    rc, err = _main(["export-tables", str(adapter), "--table_dtype", kind, "--table_dir",
                     str(folder), "--accept_loss", "1"])
    assert rc == 0, err
    rec = json.loads((folder / QUALITY).read_text())
    assert rec["source"]["name"] == "held-out" and rec["tokens"] > 0 and rec["format"] == kind
    assert rec["seq_len"] == 32  # the windows it was finetuned on, not the base model's context
    assert f"engram export-tables: {kind} table files, cost" in err
    # the command line and the Python runtime read the same rows: the same greedy tokens
    tokens, err = _tokens(adapter, tmp_path / "gen.json", "--tier", "file", "--table_dtype",
                          kind, "--table_dir", str(folder), "--accept_loss", "1")
    assert f"{kind} table files, recorded cost" in err
    rt = engram.open(adapter, tier="file", table_dir=folder, table_dtype=kind)
    out = Generator(rt, config=GenerationConfig(max_new_tokens=NEW)).generate(
        [rt.encode(PROMPT)])
    assert out.tokens[0] == tokens
    # the format rounds the rows, within its block scale
    exact = _rows(engram.open(adapter))
    for lid, rows in _rows(rt).items():
        err = (rows - exact[lid]).abs().max()
        assert 0 < err <= exact[lid].abs().max() / (7 if kind == "int4" else 127), (lid, err)


def test_stale_or_unfit_tables_are_refused_in_one_line(adapter, tmp_path):
    with pytest.raises(UserError, match=r"holds no current table files of the adapter .*"
                       r"is missing.*engram export-tables"):
        engram.open(adapter, tier="file", table_dir=tmp_path / "none")
    rc, _ = _main(["export-tables", str(adapter), "--table_dir", str(tmp_path / "t")])
    assert rc == 0
    with pytest.raises(UserError, match="holds fp32 rows, int8 asked"):
        engram.open(adapter, tier="file", table_dir=tmp_path / "t", table_dtype="int8")
    with pytest.raises(UserError, match="no row counts on its training text for a hot cache"):
        engram.open(adapter, tier="file", cache_fraction=0.1)
    # another adapter's files (the same shapes, other rows) are stale: the tag is its digest
    header = read_header(next((tmp_path / "t").glob("*.table")))
    assert header.tag.startswith("adapter-") and header.tag == engram.open(adapter).checkpoint


def test_a_lossy_format_without_the_adapters_data_is_one_line(adapter, tmp_path):
    import shutil

    moved = tmp_path / "moved"
    shutil.copytree(adapter, moved, ignore=shutil.ignore_patterns(TABLES))
    summary = json.loads((moved / "finetune.json").read_text())
    (moved / "finetune.json").write_text(json.dumps({**summary, "data": str(tmp_path / "gone")}))
    rc, err = _main(["export-tables", str(moved), "--table_dtype", "int8"])
    lines = [line for line in err.splitlines() if "error:" in line]
    assert rc != 0 and len(lines) == 1, err
    assert "needs the data it was finetuned on" in lines[0] and str(tmp_path / "gone") in lines[0]
    assert "int8 table files written are removed" in lines[0]
    assert not list((moved / TABLES).glob("*.table"))  # refused: no lossy file left to serve


def test_a_file_tier_reads_no_table_from_the_adapters_file(adapter, tmp_path):
    """On a file tier the adapter's tables are hashed from engram.safetensors a slice at a time and
    not kept (the table files serve them): same digest as reading everything, and a flipped byte
    in a table is still refused."""
    import shutil

    from engram.artifacts.adapter import TABLE_KEY, WEIGHTS, read, read_meta

    whole, lean = read(adapter), read(adapter, tables=False)
    tables = sorted(k for k in whole.tensors if k.endswith(TABLE_KEY))
    assert tables and sorted(set(whole.tensors) - set(lean.tensors)) == tables
    assert whole.digest == lean.digest == read_meta(adapter)["tensors_sha256"]
    assert whole.tag == lean.tag
    # a byte flipped inside a table's rows (safetensors' header gives where they are): refused on
    # the file tier, which hashes the table without keeping it
    damaged = tmp_path / "damaged"
    shutil.copytree(adapter, damaged)
    data = bytearray((damaged / WEIGHTS).read_bytes())
    n = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8:8 + n])[tables[-1]]["data_offsets"]
    data[8 + n + (start + end) // 2] ^= 0xFF
    (damaged / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(UserError, match="is damaged"):
        engram.open(damaged, tier="file")
