"""engram/outputs.py: where a command may write (marked folders, file outputs), what it reads as
text; engram/ranges.py: config numbers; engram/files.py: published files' permissions."""

import json
import os
import stat

import pytest

from engram.errors import InputNotFound, OutputExists, UserError
from engram.files import publish_bytes, publish_text
from engram.outputs import (
    MARKER,
    check_file,
    check_folder,
    claim_folder,
    finite,
    read_marker,
    read_text,
    release,
    write_json,
)
from engram.ranges import AT_LEAST_1, FRACTION, POSITIVE, Range, check_ranges


def test_a_claimed_folder_is_marked_and_taken_again_by_its_kind_only(tmp_path):
    out = tmp_path / "a" / "b"
    created = claim_folder(out, "run", "engram train", "--out_dir")
    assert created == tmp_path / "a"
    assert read_marker(out) == {"kind": "run", "command": "engram train"}
    assert claim_folder(out, "run", "engram train", "--out_dir") is None  # again: fine
    with pytest.raises(OutputExists, match="holds an engram run .* not an export"):
        check_folder(out, "export", "OUT_DIR")


def test_release_removes_only_what_it_created_and_only_while_empty(tmp_path):
    out = tmp_path / "a" / "b"
    release(claim_folder(out, "run", "engram train", "--out_dir"), out)
    assert list(tmp_path.iterdir()) == []  # both levels it made are gone
    (tmp_path / "keep").mkdir()
    out = tmp_path / "keep" / "run"
    created = claim_folder(out, "run", "engram train", "--out_dir")
    (out / "config.json").write_text("{}")
    release(created, out)  # something was written: kept
    assert (out / "config.json").exists()
    release(None, tmp_path / "keep")  # a folder that was there is never removed
    assert (tmp_path / "keep").exists()


def test_foreign_folders_files_and_paths_under_files_are_refused(tmp_path):
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputExists, match="not a run folder: it holds files engram did not write"):
        check_folder(tmp_path / "f", "run", "--out_dir")
    with pytest.raises(OutputExists, match="is a file, not a folder"):
        check_folder(tmp_path / "file", "run", "--out_dir")
    with pytest.raises(OutputExists, match="is a file, so nothing can be written under it"):
        check_folder(tmp_path / "file" / "x" / "y", "run", "--out_dir")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / MARKER).write_text("not json")
    with pytest.raises(UserError, match="is not an engram marker"):
        check_folder(tmp_path / "m", "run", "--out_dir")


def test_empty_folders_outputs_parents_and_older_engram_outputs_are_taken(tmp_path):
    (tmp_path / "empty").mkdir()
    assert check_folder(tmp_path / "empty", "run", "--out_dir") is False
    parent = tmp_path / "out"
    claim_folder(parent / "sweep", "sweep", "engram sweep-slots", "--out_dir")
    assert check_folder(parent, "compare", "--out_dir") is False  # holds only marked folders
    old = tmp_path / "old"  # a run from before markers: a checkpoint pointer
    (old / "checkpoints").mkdir(parents=True)
    (old / "checkpoints" / "latest.json").write_text("{}")
    assert check_folder(old, "run", "--out_dir") is True
    with pytest.raises(OutputExists, match="holds an engram run, not an export"):
        check_folder(old, "export", "OUT_DIR")
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"engram_format": "engram-serving-1"}))
    assert check_folder(export, "export", "OUT_DIR") is True


def test_a_folder_tied_to_a_source_refuses_another(tmp_path):
    claim_folder(tmp_path / "e", "export", "engram export-hf", "OUT_DIR", of="/runs/a")
    check_folder(tmp_path / "e", "export", "OUT_DIR", of="/runs/a")
    with pytest.raises(OutputExists, match="holds an export of /runs/a, not of /runs/b"):
        check_folder(tmp_path / "e", "export", "OUT_DIR", of="/runs/b")


def test_a_file_output_is_new_or_the_same_command_s(tmp_path):
    js = tmp_path / "r.json"
    check_file(js, "engram eval", "--json")
    write_json(js, {"loss": float("nan"), "n": [1.0, float("inf")]}, "engram eval")
    assert json.loads(js.read_text()) == {"written_by": "engram eval", "loss": None,
                                          "n": [1.0, None]}
    check_file(js, "engram eval", "--json")  # its own: may be replaced
    with pytest.raises(OutputExists, match="was not written by `engram demo`"):
        check_file(js, "engram demo", "--json")
    (tmp_path / "mine.json").write_text('{"a": 1}')
    with pytest.raises(OutputExists, match="exists and was not written by `engram eval`"):
        check_file(tmp_path / "mine.json", "engram eval", "--json")
    with pytest.raises(OutputExists, match="is a folder"):
        check_file(tmp_path, "engram eval", "--json")
    assert finite({"a": (float("-inf"), 2)}) == {"a": [None, 2]}


def test_text_inputs_must_be_text(tmp_path):
    (tmp_path / "t.txt").write_text("héllo\n\nworld")
    assert read_text(tmp_path / "t.txt", "--text") == "héllo\n\nworld"
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1.txt is not UTF-8 text \(byte 3 is 0xe9\)"):
        read_text(tmp_path / "latin1.txt", "--text")
    (tmp_path / "nul.bin").write_bytes(b"abc\x00def")
    with pytest.raises(UserError, match="nul.bin holds NUL bytes"):
        read_text(tmp_path / "nul.bin", "--text")
    with pytest.raises(InputNotFound, match="no such file"):
        read_text(tmp_path, "--text")


def test_published_files_get_the_umask_s_permissions(tmp_path):
    old = os.umask(0o027)
    try:
        a = publish_text(tmp_path / "a.txt", "x")
        b = publish_bytes(tmp_path / "b.bin", lambda f: f.write(b"y"))

        def owner_only(tmp):  # a writer that replaces the file, as safetensors does (0600)
            os.unlink(tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600)
            os.close(fd)
        c = publish_text(tmp_path / "c.txt", "z")
        from engram.files import publish
        publish(c, owner_only)
    finally:
        os.umask(old)
    for p in (a, b, c):
        assert stat.S_IMODE(p.stat().st_mode) == 0o640, p
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin", "c.txt"]


def test_ranges_refuse_non_finite_floats_and_values_out_of_range():
    from dataclasses import dataclass

    @dataclass
    class C:
        n: int = 1
        lr: float = 0.1
        share: float = 0.5
        sizes: tuple[int, ...] = (1, 2)
        cap: int | None = None

    check_ranges(C(), n=AT_LEAST_1, lr=POSITIVE, share=FRACTION, sizes=AT_LEAST_1, cap=AT_LEAST_1)
    for bad, msg in [(C(lr=float("inf")), "lr must be a finite number, got inf"),
                     (C(share=float("nan")), "share must be a finite number, got nan"),
                     (C(n=0), "n must be >= 1, got 0"), (C(lr=0.0), "lr must be > 0, got 0.0"),
                     (C(share=1.0), r"share must be in \[0, 1\), got 1.0"),
                     (C(sizes=(1, 0)), "each of sizes must be >= 1, got 1,0"),
                     (C(cap=0), "cap must be >= 1, got 0")]:
        with pytest.raises(UserError, match=msg):
            check_ranges(bad, n=AT_LEAST_1, lr=POSITIVE, share=FRACTION, sizes=AT_LEAST_1,
                         cap=AT_LEAST_1)
    assert str(Range(0, 1, True, True)) == "in (0, 1)" and str(Range(hi=3)) == "<= 3"
