"""lm-evaluation-harness on a trained run, on a local task built from the corpus's held-out slice.

Trains an Engram run (TrainConfig's defaults; or takes --run), writes it with `engram export-hf`,
builds a loglikelihood_rolling task (lm-eval's wikitext metrics: word and byte perplexity, bits per
byte) from the first documents of each source's validation split, runs `engram lm-eval` on it
(tables on the file tier) and `engram eval --per_document` on the same documents, and records both,
per document, with the timings. The task (YAML + JSONL) is written beside the results.

    python benchmarks/lm_eval_heldout.py --out benchmarks/results/lm_eval --work out/lm_eval
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time
from pathlib import Path

import numpy as np

from engram.compute import machine
from engram.cli import main
from engram.training.corpus import build_corpus, load_documents
from engram.training.train import TrainConfig, saved_config, train

TASK = """# Held-out documents of the run's own corpus (its validation split), scored whole.
# Built by benchmarks/lm_eval_heldout.py; data_files are relative: run from this folder.
task: engram_heldout
dataset_path: json
dataset_kwargs:
  data_files:
    test: heldout.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""



def heldout_docs(cfg: TrainConfig, per_source: int, max_chars: int) -> list[dict]:
    """The first ``per_source`` validation documents of each source (cut to ``max_chars``)."""
    corpus = build_corpus(cfg.data_config())
    val = set(corpus.doc_ids["val"])
    out = []
    for source in cfg.sources:
        docs = [d for d in load_documents(source, cfg.max_chars) if d.id in val][:per_source]
        out += [{"id": d.id, "text": d.text.strip()[:max_chars].strip()} for d in docs]
    return out


def main_(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/lm_eval", help="results and the task")
    p.add_argument("--work", default="out/lm_eval", help="the run and its export (large)")
    p.add_argument("--run", default=None, help="an existing `engram train` run (None: train)")
    p.add_argument("--steps", type=int, default=300, help="training steps when training")
    p.add_argument("--per_source", type=int, default=12, help="held-out documents per source")
    p.add_argument("--max_chars", type=int, default=3000, help="characters kept per document")
    p.add_argument("--batch_size", type=int, default=16, help="windows per forward")
    p.add_argument("--json", default=None,
                   help="where the summary goes (None: OUT/lm_eval_heldout.json)")
    p.add_argument("--smoke", action="store_true",
                   help="3 steps, 2 documents a source, in a temporary folder (CI: the script runs)")
    a = p.parse_args(argv)
    if a.smoke:
        import tempfile
        tmp = Path(tempfile.mkdtemp(prefix="lm_eval_smoke_"))
        a.out, a.work, a.steps, a.per_source, a.max_chars = tmp / "out", tmp / "work", 3, 2, 300
    out, work = Path(a.out).resolve(), Path(a.work).resolve()
    out.mkdir(parents=True, exist_ok=True)
    timings = {}
    run = Path(a.run) if a.run else work / "run"
    cfg = TrainConfig(out_dir=str(run), steps=a.steps)
    if a.run is None:
        t0 = time.perf_counter()
        train(cfg, progress=False)
        timings["train_s"] = time.perf_counter() - t0
    else:
        cfg = saved_config(run)
    hf = work / "hf"
    assert main(["export-hf", str(run), str(hf), "--tier", "file"]) == 0
    docs = heldout_docs(cfg, a.per_source, a.max_chars)
    (out / "heldout.jsonl").write_text("".join(json.dumps(d, ensure_ascii=False) + "\n"
                                               for d in docs))
    (out / "engram_heldout.yaml").write_text(TASK)
    (work / "heldout.txt").write_text("\n\n".join(d["text"] for d in docs))

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    here = os.getcwd()
    os.chdir(out)
    try:
        t0 = time.perf_counter()
        assert main(["lm-eval", "--model_args", f"pretrained={hf},tier=file", "--tasks",
                     "engram_heldout", "--include_path", str(out), "--output_path",
                     str(work / "lm_eval"), "--log_samples", "--batch_size",
                     str(a.batch_size)]) == 0
        timings["lm_eval_s"] = time.perf_counter() - t0
    finally:
        os.chdir(here)
    (res_path,) = glob.glob(str(work / "lm_eval" / "**" / "results_*.json"), recursive=True)
    (samples_path,) = glob.glob(str(work / "lm_eval" / "**" / "samples_engram_heldout_*.jsonl"),
                                recursive=True)
    results = json.load(open(res_path))["results"]["engram_heldout"]
    samples = sorted((json.loads(x) for x in open(samples_path)), key=lambda s: s["doc_id"])
    lm_eval_ll = [float(s["resps"][0][0]) for s in samples]
    t0 = time.perf_counter()
    assert main(["eval", str(run), "--text", str(work / "heldout.txt"), "--per_document",
                 "--batch_size", str(a.batch_size), "--json", str(work / "eval.json")]) == 0
    timings["engram_eval_s"] = time.perf_counter() - t0
    ev = json.load(open(work / "eval.json"))
    eval_ll = [d["loglikelihood"] for d in ev["per_document"]]
    scored = sum(d["scored"] for d in ev["per_document"])
    summary = {
        "task": "engram_heldout (loglikelihood_rolling)", "documents": len(docs),
        "doc_ids": [d["id"] for d in docs], "run": str(run), "train_steps": cfg.steps,
        "checkpoint": ev["checkpoint"], "tier": "file", "max_length": ev["seq_len"],
        "lm_eval": {k: v for k, v in results.items() if "," in k},
        "per_document_loglikelihood": {"lm_eval": lm_eval_ll, "engram_eval": eval_ll},
        "per_document_equal": lm_eval_ll == eval_ll,
        "max_abs_difference": float(np.max(np.abs(np.subtract(lm_eval_ll, eval_ll)))),
        "scored_tokens": scored, "nats_per_token": -sum(eval_ll) / scored,
        "engram_eval_stream_loss": ev["loss"], "timings_s": timings,
        "cpu": machine.cpu_id(), "threads": os.cpu_count(),
    }
    Path(a.json or out / "lm_eval_heldout.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("lm_eval", "per_document_equal", "nats_per_token",
                                              "timings_s")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main_())
