"""`engram lm-eval` run the way the tests run it: lm-evaluation-harness's own command line on the
local task files (tests/data/lm_eval, whose data_files are relative: run from there), datasets and
the hub offline, the logged samples read back."""

import glob
import json
from pathlib import Path

from engram.cli import main

TASKS = Path(__file__).parent / "data" / "lm_eval"


def lm_eval_samples(model_args, tmp_path, monkeypatch, tasks, *extra):
    """Run `engram lm-eval --model_args MODEL_ARGS --tasks TASKS`; the logged samples of each task,
    in document order, and the results JSON."""
    monkeypatch.chdir(TASKS)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc = main(["lm-eval", "--model_args", model_args, "--tasks", tasks,
               "--include_path", str(TASKS), "--output_path", str(tmp_path / "res"),
               "--log_samples", "--batch_size", "4", *extra])
    assert rc == 0
    found = {}
    for task in tasks.split(","):
        (path,) = glob.glob(str(tmp_path / "res" / "**" / f"samples_{task}_*.jsonl"),
                            recursive=True)
        rows = [json.loads(line) for line in open(path)]
        found[task] = sorted(rows, key=lambda r: r["doc_id"])
    (results,) = glob.glob(str(tmp_path / "res" / "**" / "results_*.json"), recursive=True)
    return found, json.load(open(results))
