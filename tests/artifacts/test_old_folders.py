"""Folders written before issue 48 still open (issue 48 item 6): a run, its export and an adapter,
made by commit 7f918d9 (tests/data/pre48/README.txt), give the greedy tokens that commit gave
(tests/data/pre48/tokens.json), through `engram generate` and through transformers, and opening
one writes nothing into it (each is opened from a read-only copy)."""

import hashlib
import json
import os
import shutil
import stat
import uuid
from pathlib import Path

import pytest
import torch

import engram
from engram.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")
DATA = Path(__file__).resolve().parent.parent / "data" / "pre48"
RECORD = json.loads((DATA / "tokens.json").read_text())
PROMPT, NEW = RECORD["prompt"], RECORD["max_new_tokens"]
KINDS = ("run", "export", "adapter")


def _tree(folder: Path) -> dict[str, tuple]:
    """Every entry under ``folder``: (kind, mode, mtime, size, sha256 of a file's bytes)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        out[str(p.relative_to(folder))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode),
                                           st.st_mtime_ns, st.st_size, digest)
    return out


def _set_writable(folder: Path, writable: bool) -> None:
    for p in [*folder.rglob("*"), folder]:
        if p.is_dir():
            p.chmod(0o755 if writable else 0o555)
        else:
            p.chmod(0o644 if writable else 0o444)


@pytest.fixture
def old(tmp_path):
    """A read-only copy of a fixture folder, and a check that nothing in it changed."""
    copies = []

    def copy(kind: str) -> Path:
        dst = tmp_path / "old" / kind
        shutil.copytree(DATA / kind, dst)
        _set_writable(dst, False)
        copies.append((dst, _tree(dst)))
        return dst

    yield copy
    for dst, before in copies:
        after = _tree(dst)
        _set_writable(dst, True)  # so that tmp_path can be removed
        assert after == before, f"opening {dst.name} changed its folder"


@pytest.fixture(scope="module")
def base():
    """The adapter names its base model by the absolute folder finetune was given
    (tests/data/pre48/README.txt); put the kept copy there when it is not."""
    recorded = Path(json.loads((DATA / "adapter" / "engram_config.json").read_text())["base_model"])
    if not recorded.exists():
        tmp = recorded.with_name(f"{recorded.name}.{uuid.uuid4().hex}")
        shutil.copytree(DATA / "base", tmp)
        try:
            os.rename(tmp, recorded)  # atomic; another process may have put it there first
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    assert _contents(recorded) == _contents(DATA / "base"), (
        f"{recorded} holds another model than tests/data/pre48/base; remove it")
    return recorded


def _contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("kind", KINDS)
def test_an_old_folder_opens_and_generates_its_tokens(kind, old, tmp_path, request):
    if kind == "adapter":
        pytest.importorskip("transformers")
        request.getfixturevalue("base")
    folder = old(kind)
    rt = engram.open(folder)
    if kind != "adapter":
        assert list(rt.encode(PROMPT)) == RECORD["prompt_ids"]
    cfg = engram.GenerationConfig(max_new_tokens=NEW)
    got = engram.Generator(rt, config=cfg).generate([rt.encode(PROMPT)]).tokens
    want = RECORD["engram_generate"][kind]["tokens"]
    assert [list(map(int, got[0]))] == [want]
    out = tmp_path / "generate.json"  # outside the folder
    assert main(["generate", str(folder), "--prompt", PROMPT, "--max_new_tokens", str(NEW),
                 "--no-stop", "--threads", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["tokens"] == [want]


def test_an_old_export_generates_its_tokens_in_transformers(old):
    transformers = pytest.importorskip("transformers")
    folder = old("export")
    m = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    want = RECORD["transformers_export"]
    assert type(m).__name__ == want["class"]
    ids = torch.tensor([RECORD["prompt_ids"]])
    res = m.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert res[0, ids.shape[1]:].tolist() == want["tokens"]


@pytest.mark.parametrize("where", ["recorded", "given"])
def test_an_old_adapter_loads_into_transformers_with_its_tokens(where, old, tmp_path, request):
    """engram.load_adapter with the base the adapter names, and with the base given (base=) from
    another folder."""
    pytest.importorskip("transformers")
    if where == "recorded":
        request.getfixturevalue("base")
        kw = {}
    else:
        shutil.copytree(DATA / "base", tmp_path / "moved_base")
        kw = {"base": str(tmp_path / "moved_base")}
    model, tok = engram.load_adapter(old("adapter"), **kw)
    want = RECORD["transformers_adapter"]
    assert type(model).__name__ == want["class"]
    ids = tok(PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
    res = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    assert res[0, ids.shape[1]:].tolist() == want["tokens"]
