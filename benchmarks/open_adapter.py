"""Opening an ``engram finetune`` adapter on the file tier: its tables injected as table-file stores
(issue 48: nothing built in memory only to be replaced) against the path it replaced, which read
engram.safetensors whole (tables too), built every table in memory from N(0, std), copied the
file's rows in, and only then put the file tier in their place.

    python benchmarks/open_adapter.py [--table_size 500000] [--rounds 3] [--before SRC]
        [--json benchmarks/results/open_adapter.json]

The adapter: a tiny random Llama (2 layers, width 32, DeepSeek's tokenizer) with one Engram layer
of ``table_size`` rows a head (2 orders x 4 heads, 32 wide: 500,000 gives 4M rows, 512 MB in
float32), random rows, saved with save_engram; its table files written by ``engram
export-tables``. Each open is a fresh process (imports done before the clock starts):
``engram.open(ADAPTER, tier="file")`` with this tree's code ("new") and, with ``--before SRC``
(the ``src`` folder of a checkout of the commit before, e.g. a ``git worktree``), with that
code ("old"), alternating round by round. Reported: the median wall time of the open, the peak
resident memory (VmHWM) and the peak above the process just before opening, the ratios new / old,
and whether both give the same logits on one batch (a digest of their bytes). The CPU and the
load average go with them: the machines are shared.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from record import open_line, open_summary, run_child, write_json  # noqa: E402

HERE = Path(__file__).resolve().parent.parent / "src"  # this checkout's code

# One open in a fresh process, with the code on PYTHONPATH: its time, memory and logits.
CHILD = r"""
import hashlib, json, sys, time
import torch
import engram
import engram.serving.loader, engram.models.injected, transformers  # imports before the clock
adapter = sys.argv[1]
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])  # kB
before = status("VmRSS:")
t0 = time.perf_counter()
rt = engram.open(adapter, tier="file")
took = time.perf_counter() - t0
peak = status("VmHWM:")
ids = torch.arange(1000, 1000 + 2 * 24).reshape(2, 24)
with torch.no_grad():
    logits = rt.raw_logits(rt.forward(ids).hidden)
digest = hashlib.sha256(logits.contiguous().numpy().tobytes()).hexdigest()
print(json.dumps({"open_s": took, "rss_before_kb": before, "peak_kb": peak, "digest": digest}))
"""


def make_adapter(root: Path, table_size: int) -> dict:
    """root/base (a tiny random Llama) and root/adapter (random Engram on layer 0, its table files
    written); the table's shape."""
    import torch
    import transformers as t

    from engram import EngramConfig
    from engram.artifacts.adapter import save_engram
    from engram.models.hf import engram_runtime, inject
    from engram.retrieval.compress import build_compression, default_tokenizer
    from engram.serving.loader import write_tables

    tok = default_tokenizer()
    torch.manual_seed(0)
    base = t.LlamaForCausalLM(t.LlamaConfig(
        vocab_size=tok.get_vocab_size(with_added_tokens=True), hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        pad_token_id=0, eos_token_id=1, bos_token_id=1)).eval()
    base.save_pretrained(root / "base")
    cfg = EngramConfig(engram_vocab_size=[table_size, table_size], max_ngram_size=3,
                       n_embed_per_ngram=128, n_head_per_ngram=4, layer_ids=[0], pad_id=0)
    inject(base, cfg, compression=build_compression(tok))
    with torch.no_grad():
        for p in engram_runtime(base).engram_parameters():
            p.normal_(0, 0.5)
    save_engram(base, root / "adapter", base_model=str(root / "base"), tokenizer=tok, eos_id=1)
    w = engram_runtime(base).engrams[0].table.weight
    write_tables(root / "adapter")
    return {"rows": w.shape[0], "dim": w.shape[1], "mb": w.numel() * w.element_size() / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table_size", type=int, default=500_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", default=None, help="src folder of the code to compare against")
    p.add_argument("--json", default="benchmarks/results/open_adapter.json")
    p.add_argument("--smoke", action="store_true", help="a 997-row-a-head table, 1 round (CI)")
    a = p.parse_args()
    if a.smoke:
        a.table_size, a.rounds = 997, 1
    try:
        import transformers  # noqa: F401  (the [test] extra: an adapter's base model's library)
    except ImportError:
        print("skipped: transformers is not installed (pip install engram[test])")
        write_json(a.json, {"skipped": "transformers is not installed"})
        return
    import torch

    from engram.compute import machine

    trees = {"new": HERE, **({"old": Path(a.before).resolve()} if a.before else {})}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="open-adapter-") as tmp:
        table = make_adapter(Path(tmp), a.table_size)
        got: dict[str, list[dict]] = {m: [] for m in trees}
        for r in range(a.rounds):
            for mode in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                got[mode].append(run_child(CHILD, [str(Path(tmp) / "adapter")], trees[mode]))
    load_after = os.getloadavg()

    summary = {m: open_summary(got[m]) for m in got}
    same = len({x["digest"] for m in got for x in got[m]}) == 1
    result = {"cpu": machine.cpu_id(), "threads": os.cpu_count(), "torch": torch.__version__,
              "load_average_before": load_before, "load_average_after": load_after,
              "note": "shared machine: the load average is that of everything running beside it",
              "table": table, "table_size": a.table_size, "rounds": a.rounds,
              "before": a.before, "median": summary, "same_logits": same, "runs": got}
    for m, s in summary.items():
        print(open_line(m, s))
    if "old" in summary:
        result["new_over_old"] = {k: summary["new"][k] / summary["old"][k] for k in summary["new"]}
        r = result["new_over_old"]
        print(f"new / old: time {r['open_s']:.3f}x, peak {r['peak_mb']:.3f}x, above start "
              f"{r['peak_over_start_mb']:.3f}x")
    print(f"table {table['rows']:,} x {table['dim']} ({table['mb']:.0f} MB); same logits: {same}; "
          f"{result['cpu']}, load {load_before[0]:.1f} -> {load_after[0]:.1f}")
    if not same:
        raise SystemExit("the two trees opened the adapter to different logits")
    write_json(a.json, result)


if __name__ == "__main__":
    main()
