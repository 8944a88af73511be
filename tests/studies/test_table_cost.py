"""The quality gate on lossy table files (studies/table_cost.py, issue 47): a trained tiny run's
tables exported in each lossy dtype are measured against its own fp32 tables on its held-out
split (quality.json beside the files, one line on stderr); fp32 files measured the same way cost
exactly nothing; a format over the threshold is refused in one line and its files removed (no
tier opens them), and --accept_loss keeps it; --text that overlaps the training stream is refused;
`engram export-hf` is gated the same way, leaving its folder as it was when it refuses, and so are
the public engram.write_tables and engram.export_hf; `engram generate` and `engram eval` print the
recorded cost of the table files they read."""

import json

import numpy as np
import pytest

from engram.cli import main
from engram.errors import UserError
from engram.serving.loader import export_hf, open_model, write_tables
from engram.studies.table_cost import LOSS_THRESHOLD, QUALITY, cost_line, export_gated
from engram.studies.table_scoring import BLOCK_TOKENS, block_interval, measure
from engram.training.corpus import build_corpus
from engram.training.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = dict(max_chars=30_000, n_layer=2, d_model=32, n_head=2, seq_len=32, batch_size=4,
            table_size=997, n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,),
            warmup=1, eval_batches=1, log_every=1, eval_every=6, ckpt_every=6, lr=3e-3)
NEW_TEXT = ("The lighthouse keeper counted the ships that passed in the fog each night, and wrote "
            "their names in a small green notebook.\n\nIn the morning the harbour was quiet again, "
            "and the gulls stood on the wet stones waiting for the fishing boats.\n")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny Engram run (6 steps) on real text, and its held-out split's length."""
    run = tmp_path_factory.mktemp("cost") / "run"
    train(TrainConfig(out_dir=str(run), steps=6, **TINY), progress=False)
    val = build_corpus(TrainConfig(**TINY).data_config(), open_model(run).tokenizer).val
    return run, len(val)


def test_fp32_files_cost_exactly_nothing(run, tmp_path):
    """The file tier's fp32 rows are the memory tier's bit for bit: every paired change is 0."""
    run_dir, n_val = run
    folder = write_tables(run_dir, tmp_path / "fp32")
    rec = measure(run_dir, folder, "fp32")
    assert rec["mean"] == 0.0 and rec["kl"] == 0.0 and rec["top1"] == 1.0
    assert (rec["interval"]["low"], rec["interval"]["high"]) == (0.0, 0.0)
    assert rec["tokens"] == n_val - 1  # the whole split: fewer than the cap, every target seen
    assert rec["loss"] == rec["loss_fp32"] > 0
    # an fp32 export is exact: nothing measured, nothing written beside the files
    assert export_gated(run_dir, folder, "fp32") == (folder, None)
    assert not (folder / QUALITY).exists()


@pytest.mark.parametrize("kind", ["bf16", "fp8", "int8", "int4"])
def test_every_lossy_export_records_its_cost(run, tmp_path, kind):
    run_dir, n_val = run
    said: list[str] = []
    folder, rec = export_gated(run_dir, tmp_path / kind, kind, say=said.append)
    assert any(line.startswith(f"measuring what {kind} rows cost") for line in said)
    saved = json.loads((folder / QUALITY).read_text())
    assert {k: saved[k] for k in ("format", "checkpoint", "tokens", "threshold", "verdict")} == {
        "format": kind, "checkpoint": open_model(run_dir).checkpoint, "tokens": n_val - 1,
        "threshold": LOSS_THRESHOLD, "verdict": "kept"}
    assert saved["source"]["name"] == "held-out" and saved["accept_loss"] is None
    iv = saved["interval"]
    assert iv["low"] <= saved["mean"] <= iv["high"] and iv["level"] == 0.95
    assert iv["block_tokens"] == BLOCK_TOKENS and iv["seed"] == 0
    assert abs(saved["mean"]) < LOSS_THRESHOLD  # a 6-step run barely leans on its tables
    assert saved["kl"] > -1e-9 and 0.9 <= saved["top1"] <= 1.0
    assert saved["loss"] == pytest.approx(saved["loss_fp32"] + saved["mean"])
    line = cost_line(folder)
    assert line.startswith(f"{kind} table files, recorded cost {saved['mean']:+.3g} nats/token")
    # a rerun on the same files keeps the measurement: nothing is scored again
    said.clear()
    assert export_gated(run_dir, folder, kind, say=said.append)[1]["mean"] == saved["mean"]
    assert said == []


def test_over_threshold_refused_in_one_line_and_accept_loss_keeps(run, tmp_path):
    """A threshold just below int4's measured rise refuses it: one line naming the format, the
    rise, its interval, the threshold and the override; the files go, so no tier opens them."""
    run_dir, _ = run
    folder = tmp_path / "int4"
    _, rec = export_gated(run_dir, folder, "int4", accept_loss=1.0)
    below = rec["mean"] - 1e-6
    with pytest.raises(UserError) as e:
        export_gated(run_dir, folder, "int4", accept_loss=below)
    msg = str(e.value)
    assert "\n" not in msg
    for part in ("int4 table files raise the loss by", f"{rec['mean']:+.3g}", "95% interval",
                 f"--accept_loss {below:g}", "refused", "removed the 1 table file", "keep them "
                 "with --accept_loss"):
        assert part in msg, part
    assert not list(folder.glob("*.table"))
    assert json.loads((folder / QUALITY).read_text())["verdict"] == "refused"
    with pytest.raises(UserError, match="holds no current table files"):
        open_model(run_dir, tier="file", table_dir=folder, table_dtype="int4")
    # the override keeps it (the same files again: the recorded measurement holds)
    _, kept = export_gated(run_dir, folder, "int4", accept_loss=rec["mean"])
    assert kept["verdict"] == "kept" and kept["mean"] == rec["mean"]
    assert open_model(run_dir, tier="file", table_dir=folder, table_dtype="int4").checkpoint
    # fp32 files written over them are exact: the measurement of the int4 ones goes
    export_gated(run_dir, folder, "fp32")
    assert not (folder / QUALITY).exists() and cost_line(folder) is None


def test_text_that_overlaps_training_is_refused(run, tmp_path):
    run_dir, _ = run
    rt = open_model(run_dir)
    train = build_corpus(TrainConfig(**TINY).data_config(), rt.tokenizer).train
    train_ids = np.asarray(train[500:700])
    trained = tmp_path / "trained.txt"
    trained.write_text("A new first line.\n\n" + rt.tokenizer.decode(train_ids.tolist()))
    with pytest.raises(UserError, match="overlaps the run's training stream: 32 consecutive "
                                        "tokens") as e:
        export_gated(run_dir, tmp_path / "t", "int8", text=trained)
    assert "\n" not in str(e.value)
    new = tmp_path / "new.txt"
    new.write_text(NEW_TEXT)
    _, rec = export_gated(run_dir, tmp_path / "t", "int8", text=new)
    assert rec["source"]["name"] == "--text new.txt" and rec["tokens"] > 20


def test_block_interval():
    assert block_interval(np.full(1000, 0.25)) == pytest.approx((0.25, 0.25))
    x = np.random.default_rng(1).normal(0.1, 1.0, 20_000)
    lo, hi = block_interval(x)
    assert lo < x.mean() < hi and hi - lo < 0.05
    assert block_interval(x) == (lo, hi)  # a fixed seed: the same interval every time


def test_commands_measure_refuse_and_print_the_cost(run, tmp_path, capsys):
    run_dir, _ = run
    folder = tmp_path / "int8"
    assert main(["export-tables", str(run_dir), "--table_dtype", "int8",
                 "--table_dir", str(folder)]) == 0
    err = capsys.readouterr().err
    assert "engram export-tables: int8 table files, cost " in err and "kept" in err
    assert json.loads((folder / QUALITY).read_text())["written_by"] == "engram export-tables"
    # int4 costs this run a little (+8.8e-05 nats, interval [+8.5e-06, +2.2e-04] when written):
    # over --accept_loss 0, so exit 2, one line, nothing left to serve
    assert main(["export-tables", str(run_dir), "--table_dtype", "int4",
                 "--table_dir", str(tmp_path / "int4"), "--accept_loss", "0"]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert line.startswith("engram export-tables: error: int4 table files raise the loss by +")
    assert "--accept_loss 0;" in line and not list((tmp_path / "int4").glob("*.table"))
    # generate reads the int8 files and says what they cost
    assert main(["generate", str(run_dir), "--tier", "file", "--table_dtype", "int8",
                 "--table_dir", str(folder), "--prompt", "In the beginning",
                 "--max_new_tokens", "2"]) == 0
    assert "engram generate: int8 table files, recorded cost " in capsys.readouterr().err
    # eval of an export whose int8 files were never measured says so
    out = export_hf(run_dir, tmp_path / "export", table_dtype="int8")
    text = tmp_path / "new.txt"
    text.write_text(NEW_TEXT)
    assert main(["eval", str(out), "--text", str(text)]) == 0
    assert "engram eval: int8 table files: cost never measured" in capsys.readouterr().err


def test_the_python_exports_are_gated(run, tmp_path):
    """engram.write_tables and engram.export_hf, the public names, take the commands' path: a lossy
    format over the threshold is refused in one line with no table file left; a kept one has its
    cost beside its files and said; a layer set's rows go only to the formats that hold them."""
    import engram

    run_dir, _ = run
    for call in (lambda: engram.write_tables(run_dir, tmp_path / "t", "int4", accept_loss=0.0),
                 lambda: engram.export_hf(run_dir, tmp_path / "x", table_dtype="int4",
                                          accept_loss=0.0)):
        with pytest.raises(UserError) as e:
            call()
        assert "\n" not in str(e.value) and "int4 table files raise the loss by" in str(e.value)
    assert not list(tmp_path.rglob("*.table"))
    said: list[str] = []
    folder = engram.write_tables(run_dir, tmp_path / "t", "int8", say=said.append)
    assert json.loads((folder / QUALITY).read_text())["verdict"] == "kept"
    out = engram.export_hf(run_dir, tmp_path / "x", table_dtype="int8", say=said.append)
    assert json.loads((out / "tables" / QUALITY).read_text())["verdict"] == "kept"
    assert sum(line.startswith("int8 table files, cost ") for line in said) == 2
    with pytest.raises(UserError, match="a V4.1 layer set's rows are fp8"):
        engram.export_hf(run_dir, tmp_path / "v", table_dtype="int8",
                         engram_layers=tmp_path / "layers")
    assert not (tmp_path / "v").exists()


def test_export_hf_is_gated(run, tmp_path, capsys):
    """`engram export-hf --table_dtype` measures a lossy format as export-tables does, before it
    replaces a table file: kept, its quality.json lies beside the export's files (which generate
    and eval then print); refused, one line, OUT left as it was (a new OUT not created, an
    existing export's files untouched); a rerun reuses the measurement; fp32 drops it."""
    run_dir, _ = run
    out = tmp_path / "export"
    # refused: one line, nothing left (the command's new folder goes again)
    assert main(["export-hf", str(run_dir), str(out), "--table_dtype", "int4",
                 "--accept_loss", "0"]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert line.startswith("engram export-hf: error: int4 table files raise the loss by +")
    assert f"refused: {out} left as it was; keep them with --accept_loss" in line
    assert not out.exists()
    # kept: measured, recorded beside the export's files, printed in one line
    assert main(["export-hf", str(run_dir), str(out), "--table_dtype", "int8"]) == 0
    err = capsys.readouterr().err
    assert "engram export-hf: measuring what int8 rows cost" in err
    assert "engram export-hf: int8 table files, cost " in err and "kept" in err
    assert "already written" not in err  # the gate's files moved in: this command wrote them
    rec = json.loads((out / "tables" / QUALITY).read_text())
    assert rec["written_by"] == "engram export-hf" and rec["verdict"] == "kept"
    assert rec["format"] == "int8" and rec["threshold"] == LOSS_THRESHOLD
    assert not (out / ".tables-gate").exists()
    assert cost_line(out / "tables").startswith("int8 table files, recorded cost ")
    before = {p.name: p.read_bytes() for p in (out / "tables").iterdir() if p.is_file()}
    # an over-threshold format over an existing export: refused, its files as they were
    assert main(["export-hf", str(run_dir), str(out), "--table_dtype", "int4",
                 "--accept_loss", "0"]) == 2
    assert f"refused: {out} left as it was" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (out / "tables").iterdir() if p.is_file()} == before
    assert not (out / ".tables-gate").exists()
    # a rerun keeps the files and their measurement: nothing scored again
    assert main(["export-hf", str(run_dir), str(out), "--table_dtype", "int8"]) == 0
    err = capsys.readouterr().err
    assert "measuring" not in err and "engram export-hf: int8 table files, cost " in err
    # generate (either tier) and eval on the export print the recorded cost
    for tier in ("memory", "file"):
        assert main(["generate", str(out), "--tier", tier, "--prompt", "In the beginning",
                     "--max_new_tokens", "2"]) == 0
        assert "engram generate: int8 table files, recorded cost " in capsys.readouterr().err
    text = tmp_path / "new.txt"
    text.write_text(NEW_TEXT)
    assert main(["eval", str(out), "--text", str(text)]) == 0
    assert "engram eval: int8 table files, recorded cost " in capsys.readouterr().err
    # fp32 files over them are exact: the measurement goes
    assert main(["export-hf", str(run_dir), str(out)]) == 0
    assert not (out / "tables" / QUALITY).exists() and cost_line(out / "tables") is None
    # a layer set's rows are fp8 + E8M0: another lossy format is refused before any work
    assert main(["export-hf", str(run_dir), str(tmp_path / "v41"), "--table_dtype", "int4",
                 "--engram_layers", str(tmp_path / "layers")]) == 2
    assert "a V4.1 layer set's rows are fp8 with E8M0 scales" in capsys.readouterr().err
    assert not (tmp_path / "v41").exists()
