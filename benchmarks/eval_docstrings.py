"""`engram eval` on text no run was trained on: docstrings of the Python standard library.

Writes the docstrings (one paragraph per blank-line block) to a text file, scores each given run on
it with `engram eval` (unseen tokens as context, left out as targets), and counts how many
paragraphs a run could score at all if unseen tokens were refused (the old behaviour).

    python benchmarks/eval_docstrings.py RUN_DIR [RUN_DIR ...] --json out/eval.json
    python benchmarks/eval_docstrings.py --smoke --json out/eval.json   # a tiny run trained here (CI)
"""

from __future__ import annotations

import argparse
import importlib
import inspect
from pathlib import Path

import torch

from engram.serving.loader import open_model
from engram.studies.evaluate import EvalConfig, run_eval
from record import write_json  # benchmarks/record.py: the script's folder is on sys.path

MODULES = ("os", "json", "re", "collections", "itertools", "functools", "pathlib", "string",
           "textwrap", "argparse", "shutil", "subprocess", "random", "statistics", "datetime",
           "heapq", "bisect")


def docstrings(modules: tuple[str, ...] = MODULES) -> str:
    docs = []
    for m in modules:
        for name, obj in sorted(vars(importlib.import_module(m)).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)
                                            or inspect.isbuiltin(obj)):
                continue
            if inspect.getdoc(obj):
                docs.append(inspect.getdoc(obj).strip())
    return "\n\n".join(docs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", help="engram train --out_dir folders")
    p.add_argument("--json", default="out/eval_docstrings.json")
    p.add_argument("--text", default="out/python_docstrings.txt")
    p.add_argument("--smoke", action="store_true",
                   help="train a tiny run (2 steps) in a temp folder and score it on two modules")
    a = p.parse_args()
    if not a.runs and not a.smoke:
        p.error("give at least one run folder (or --smoke)")
    torch.set_num_threads(1)
    modules = MODULES
    if a.smoke:
        import tempfile

        from engram.training.train import TrainConfig, train

        tmp = tempfile.mkdtemp(prefix="engram-eval-docstrings-")
        a.runs, a.text, modules = [f"{tmp}/run"], f"{tmp}/docstrings.txt", MODULES[:2]
        train(TrainConfig(out_dir=a.runs[0], max_chars=30_000, n_layer=2, d_model=32, n_head=2,
                          table_size=997, n_embed_per_ngram=32, n_head_per_ngram=2,
                          engram_layers=(0,), steps=2, batch_size=2, seq_len=16, eval_every=2,
                          eval_batches=1, warmup=1), progress=False)
    Path(a.text).parent.mkdir(parents=True, exist_ok=True)
    Path(a.text).write_text(docstrings(modules))
    out = {}
    for run in a.runs:
        res = run_eval(run, EvalConfig(text=a.text), progress=False)
        served = open_model(run)
        paras = [x for x in Path(a.text).read_text().split("\n\n") if x.strip()]
        encs = served.tokenizer.encode_batch(paras, add_special_tokens=False)
        whole = sum(bool((served.ids.to_local(torch.tensor(e.ids)) >= 0).all()) for e in encs)
        res["paragraphs_without_unseen_tokens"] = int(whole)
        out[run] = res
        print(f"{run}: loss {res['loss']:.4f} on {res['scored']:,} of {res['targets']:,} targets "
              f"({res['left_out_fraction']:.1%} left out, {res['unseen_ids']} unseen ids); "
              f"{whole} of {res['documents']} paragraphs have no unseen token")
    write_json(a.json, out)


if __name__ == "__main__":
    main()
