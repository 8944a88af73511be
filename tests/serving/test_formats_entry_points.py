"""Greedy tokens equal across entry points for every table format (issue 47's "done when"): one tiny
trained run's tables in fp32, bf16, fp16, fp8, int8 and int4 give the same greedy tokens through
`engram generate` (the command line, file tier, that --table_dtype), the Python runtime
(`engram.open(run, tier="file", table_dtype=...)` and its Generator), `engram generate` on the
`engram export-hf --table_dtype` folder, and that folder loaded by transformers'
AutoModelForCausalLM (the export's tier and the file tier); lm-eval's and vLLM's generations too
(int4 by default, every format with -m slow; vLLM where it is installed, skipped otherwise). The
export's table files are the run's file-tier files byte for byte, and a lossy export carries its
measured cost (the quality gate, studies/table_cost.py). Each tier's rows equal the memory tier's dequantised rows bit for bit in
tests/tables/test_blocks.py (int8, int4) and tests/tables/test_fp8.py (fp8, bf16)."""

import contextlib
import filecmp
import io
import json

import pytest
import torch

import engram
from engram.cli import main
from engram.serving.generate import GenerationConfig, Generator
from engram.studies.table_cost import QUALITY, is_lossy
from engram.tables.tablefile import read_header, table_paths
from engram.training.train import TrainConfig, train
from lm_eval_run import lm_eval_samples  # tests/: the way every test runs lm-eval

pytestmark = pytest.mark.usefixtures("one_thread")
FORMATS = ("fp32", "bf16", "fp16", "fp8", "int8", "int4")
# Head width 64 (d_model 128 over 2 heads): vLLM's CPU attention refuses 16 ("Unsupported CPU
# attention configuration: head_dim=16"), which ended every vLLM case here in an engine traceback.
TINY = dict(max_chars=30_000, n_layer=2, d_model=128, n_head=2, seq_len=32, batch_size=4,
            table_size=997, n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,),
            warmup=1, eval_batches=1, log_every=1, eval_every=6, ckpt_every=6, lr=3e-3)
PROMPTS = ["In the beginning God created", "And God said, Let there be"]
MAX_NEW = 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny Engram run (6 steps) -> (root, run, raw prompt ids, the memory tier's logits)."""
    root = tmp_path_factory.mktemp("entry")
    run = root / "run"
    train(TrainConfig(out_dir=str(run), steps=6, **TINY), progress=False)
    memory = engram.open(run)
    prompts = [memory.encode(p) for p in PROMPTS]
    return root, run, prompts, _logits(memory, prompts)


@torch.no_grad()
def _logits(rt, prompts):
    """The runtime's logits over the first prompt (the rows a format rounds reach them)."""
    x = torch.tensor([prompts[0]])
    return rt.model.logits(rt.forward(x, warn=False).hidden)


def _main(argv):
    """(exit status, stderr) of a command."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, err.getvalue()


def _cli_tokens(args, js):
    rc, err = _main(["generate", *args, "--max_new_tokens", str(MAX_NEW), "--no-stop", "--json",
                     str(js), *[a for p in PROMPTS for a in ("--prompt", p)]])
    assert rc == 0, err
    return json.loads(js.read_text())["tokens"], err


_SERVED: dict = {}  # (run, kind) -> what served() gives: shared by the tests of one kind


def _served(run, kind):
    """One format's table files of the run (`engram export-tables`, gated), `engram generate
    --tier file` on them and `engram export-hf` -> (kind, table folder, export, the command's
    tokens)."""
    root, run_dir, _, _ = run
    if (run_dir, kind) in _SERVED:
        return _SERVED[run_dir, kind]
    folder, out = root / f"tables-{kind}", root / f"export-{kind}"
    rc, err = _main(["export-tables", str(run_dir), "--table_dtype", kind, "--table_dir",
                     str(folder)])
    assert rc == 0, err
    tokens, err = _cli_tokens([str(run_dir), "--tier", "file", "--table_dtype", kind,
                               "--table_dir", str(folder)], root / f"gen-{kind}.json")
    assert (f"{kind} table files, recorded cost" in err) == is_lossy(kind)
    rc, err = _main(["export-hf", str(run_dir), str(out), "--table_dtype", kind])
    assert rc == 0, err
    assert (f"engram export-hf: {kind} table files, cost " in err) == is_lossy(kind)
    _SERVED[run_dir, kind] = kind, folder, out, tokens
    return _SERVED[run_dir, kind]


@pytest.fixture(scope="module", params=FORMATS)
def served(request, run):
    return _served(run, request.param)


def test_greedy_tokens_equal_across_entry_points(run, served, tmp_path):
    root, run_dir, prompts, memory_logits = run
    kind, folder, out, want = served
    assert [len(t) for t in want] == [MAX_NEW] * len(PROMPTS)
    # the same rows everywhere: the export's table files are the run's file-tier files
    rt = engram.open(run_dir, tier="file", table_dir=folder, table_dtype=kind)
    for p in table_paths(folder, rt.hasher):
        assert read_header(p).dtype == kind
        assert filecmp.cmp(p, out / "tables" / p.name, shallow=False), p.name
    assert (out / "tables" / QUALITY).exists() == is_lossy(kind)
    assert not (out / ".tables-gate").exists()
    # the Python runtime
    gen = Generator(rt, config=GenerationConfig(max_new_tokens=MAX_NEW))
    assert gen.generate(prompts).tokens == want
    # the rows are the format's: rounded (so other logits) in every lossy format
    assert torch.equal(_logits(rt, prompts), memory_logits) == (not is_lossy(kind))
    # `engram generate` on the export, which prints the recorded cost of its files
    tokens, err = _cli_tokens([str(out)], tmp_path / "export.json")
    assert tokens == want
    assert (f"engram generate: {kind} table files, recorded cost" in err) == is_lossy(kind)
    tokens, _ = _cli_tokens([str(out), "--tier", "file"], tmp_path / "export-file.json")
    assert tokens == want


@pytest.mark.parametrize("tier", ["export's", "file"])
def test_transformers_generates_the_same_tokens(run, served, tier):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    _, _, prompts, _ = run
    kind, _, out, want = served
    extra = {} if tier != "file" else {"engram_serving": {"tier": "file"}}
    m = AutoModelForCausalLM.from_pretrained(out, **extra)
    for p, w in zip(prompts, want):
        got = m.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
        assert got[0, len(p):].tolist() == w, kind


# lm-eval starts in ~20 s a run: int4 (the most rounded rows) by default, the others with -m slow
@pytest.mark.parametrize("kind", [pytest.param(k, marks=() if k == "int4" else pytest.mark.slow)
                                  for k in FORMATS])
def test_lm_eval_generates_the_same_text(run, kind, tmp_path, monkeypatch):
    """lm-eval's generate_until on the export (tier file): the Python runtime's greedy tokens,
    stopped at EOS, decoded and cut at the task's stop strings."""
    pytest.importorskip("lm_eval")
    _, run_dir, _, _ = run
    _, folder, out, _ = _served(run, kind)
    found, _ = lm_eval_samples(f"pretrained={out},tier=file", tmp_path, monkeypatch, "engram_gen")
    samples = found["engram_gen"]
    rt = engram.open(run_dir, tier="file", table_dir=folder, table_dtype=kind)
    gen = Generator(rt, config=GenerationConfig(max_new_tokens=6, stop_ids=(rt.eos_id,)))
    assert len(samples) == 4
    for s in samples:
        prompt = rt.encode(s["arguments"]["gen_args_0"]["arg_0"])
        text = rt.tokenizer.decode(gen.generate([prompt]).tokens[0], skip_special_tokens=True)
        for stop in ("\n", ".", ":"):
            text = text.split(stop)[0]
        assert s["resps"][0][0] == text, kind


# vLLM's engine starts in ~40 s: int4 by default, as lm-eval above, the others with -m slow
@pytest.mark.parametrize("kind", [pytest.param(k, marks=() if k == "int4" else pytest.mark.slow)
                                  for k in FORMATS])
def test_vllm_generates_the_same_tokens(run, kind, tmp_path):
    """vLLM with the engram plugin on the export: `engram generate`'s tokens (where vLLM runs
    here: its own Python, ENGRAM_VLLM_PYTHON, as tests/serving/test_vllm.py)."""
    from test_vllm import VLLM_PYTHON, run_vllm

    if VLLM_PYTHON is None:
        pytest.skip("vLLM is not installed (see README)")
    _, _, prompts, _ = run
    _, _, out, want = _served(run, kind)
    got = run_vllm(out, prompts, tmp_path, kind, {"engram_serving": {"tier": "file"}},
                   max_new=MAX_NEW)
    assert got["tokens"] == want, kind
