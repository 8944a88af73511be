"""`engram eval` on text no run was trained on: docstrings of the Python standard library.

Writes the docstrings (one paragraph per blank-line block) to a text file, scores each given run on
it with `engram eval` (unseen tokens as context, left out as targets), and counts how many
paragraphs a run could score at all if unseen tokens were refused (the old behaviour).

    python benchmarks/eval_docstrings.py RUN_DIR [RUN_DIR ...] --json out/eval.json
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
from pathlib import Path

import numpy as np
import torch

from engram.serving.loader import load_run
from engram.studies.evaluate import EvalConfig, local_ids, run_eval

MODULES = ("os", "json", "re", "collections", "itertools", "functools", "pathlib", "string",
           "textwrap", "argparse", "shutil", "subprocess", "random", "statistics", "datetime",
           "heapq", "bisect")


def docstrings() -> str:
    docs = []
    for m in MODULES:
        for name, obj in sorted(vars(importlib.import_module(m)).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)
                                            or inspect.isbuiltin(obj)):
                continue
            if inspect.getdoc(obj):
                docs.append(inspect.getdoc(obj).strip())
    return "\n\n".join(docs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--json", default="out/eval_docstrings.json")
    p.add_argument("--text", default="out/python_docstrings.txt")
    a = p.parse_args()
    torch.set_num_threads(1)
    Path(a.text).parent.mkdir(parents=True, exist_ok=True)
    Path(a.text).write_text(docstrings())
    out = {}
    for run in a.runs:
        res = run_eval(run, EvalConfig(text=a.text), progress=False)
        served = load_run(run)
        paras = [x for x in Path(a.text).read_text().split("\n\n") if x.strip()]
        encs = served.tokenizer.encode_batch(paras, add_special_tokens=False)
        whole = sum(bool((local_ids(np.asarray(e.ids), served.vocab) >= 0).all()) for e in encs)
        res["paragraphs_without_unseen_tokens"] = int(whole)
        out[run] = res
        print(f"{run}: loss {res['loss']:.4f} on {res['scored']:,} of {res['targets']:,} targets "
              f"({res['left_out_fraction']:.1%} left out, {res['unseen_ids']} unseen ids); "
              f"{whole} of {res['documents']} paragraphs have no unseen token")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
