#!/usr/bin/env bash
# Same losses before and after a change (issue 26's rule for refactors): fixed-seed runs of
# `engram train` (Engram, MoE, Engram-Nine), a 2-rank torchrun and a small Nine study, at REV (in a
# temporary git worktree) and in this working tree, compared record by record, bit for bit. Then
# the decode side, on each tree's own Engram and Nine runs (issue 48): `engram generate`'s tokens
# (memory tier; file tier behind the hot cache + prefetch; sampled), and, from the Python API,
# the logits of a full forward and of a cached decode (engram.open), the Generator's tokens, the
# export's logits and greedy tokens through transformers, the paged model's tokens under the
# mini engine (tests/serving/engine_sim.py: chunked prefill, prefix cache), and `engram
# analyze`'s analysis.json and `engram pool-budget`'s counts (rows each step reads: its hash ids);
# logits compared by the sha256 of their bytes.
#
#   benchmarks/bit_identity.sh [REV=main] [OUT=out/bit_identity]     (~8 min on 2 cores)
#
# The GEMM route is pinned (ENGRAM_GEMM, default onednn where oneDNN is in the torch build): under
# `auto` each side measures its own routes, and two routes agree to float32 rounding, not bits.
# `engram compare` at its defaults is the longer check: run it on both sides and compare
# results.json's "runs" (tests cannot: it takes 8-30 minutes).
set -euo pipefail
REV=${1:-main}
OUT=$(realpath -m "${2:-out/bit_identity}")
ROOT=$(git rev-parse --show-toplevel)
export ENGRAM_GEMM=${ENGRAM_GEMM:-onednn}
rm -rf "$OUT"; mkdir -p "$OUT"
BASE="$OUT/base-tree"
git -C "$ROOT" worktree add --detach "$BASE" "$REV" >/dev/null
trap 'git -C "$ROOT" worktree remove --force "$BASE"' EXIT

runs() {  # $1: source tree, $2: output folder
  local E="python3 -m engram"
  mkdir -p "$2"
  (cd "$1" && export PYTHONPATH="$1/src" &&
   $E train --out_dir="$2/train_engram" --steps=60 --eval_every=20 --log_every=10 --seed=3 &&
   $E train --out_dir="$2/train_moe" --steps=40 --eval_every=20 --engram=false --moe=true --seed=1 &&
   $E train --out_dir="$2/train_nine" --steps=40 --eval_every=20 --hot_rows=500 \
     --shared_tables=true --engram_layers=1,2 --seed=0 &&
   torchrun --nproc-per-node 2 -m engram train --out_dir="$2/train_dist" --steps=30 \
     --eval_every=10 --seed=0 &&
   $E study-nine --out_dir="$2/nine" --steps=40 --seeds=0 --eval_every=20 \
     --only=hash-10k,nine-2k/8k &&
   for run in train_engram train_nine; do
     prompts=(--prompt "And God said" --prompt "The kernel" --prompt "def main():")
     $E generate "$2/$run" "${prompts[@]}" --max-new-tokens=16 --no-stop --json="$2/$run.gen_memory.json" &&
     $E generate "$2/$run" "${prompts[@]}" --max-new-tokens=16 --no-stop --tier=file \
       --cache_fraction=0.1 --prefetch --json="$2/$run.gen_file.json" &&
     $E generate "$2/$run" "${prompts[@]}" --max-new-tokens=16 --no-stop --temperature=0.8 \
       --top_k=20 --seed=5 --json="$2/$run.gen_sampled.json" &&
     $E export-hf "$2/$run" "$2/$run.hf" &&
     python3 -c "$DECODE" "$2/$run" "$2/$run.hf" "$1/tests/serving" "$2/$run.decode.json" || exit 1
   done &&
   $E analyze "$2/train_engram" --out_dir="$2/analysis" --batches=4 --lens_batches=1 \
     --cka_tokens=512 --probes=32 &&
   $E pool-budget --run_dir="$2/train_engram" --out_dir="$2/pool" --tiers=memory,file --reps=3
  ) > "$2.log" 2>&1 || { echo "failed: see $2.log"; exit 1; }
}
# The Python side of the decode check: RUN HF ENGINE_SIM_DIR OUT (the APIs both trees have).
DECODE=$(cat <<'PY'
import hashlib, json, sys
import torch
import engram
from engram.serving.generate import GenerationConfig, Generator
from engram.serving.hf_export import open_export
from engram.serving.paged import PagedLM
run, hf, sim, out = sys.argv[1:5]
sys.path.insert(0, sim)
from engine_sim import MiniEngine
def digest(t):
    return {"shape": list(t.shape), "sha256": hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()}
rt = engram.open(run)
texts = ["In the beginning God created", "The kernel maps each page", "for i in range(10):"]
ps = [rt.encode(t) for t in texts]
n = min(map(len, ps))
ids = torch.tensor([p[:n] for p in ps])
res = {}
with torch.no_grad():
    res["full_logits"] = digest(rt.raw_logits(rt.forward(ids).hidden))
    group = rt.new_group(list(range(len(ps))))
    steps = [rt.raw_logits(rt.forward(ids[:, :1], group).hidden)]
    for k in range(1, n):  # one token at a time through the decode cache
        steps.append(rt.raw_logits(rt.forward(ids[:, k:k + 1], group).hidden))
    res["decode_logits"] = digest(torch.cat(steps, 1))
    res["generator"] = Generator(rt, config=GenerationConfig(max_new_tokens=12)).generate(ps).tokens
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(hf)
    res["transformers_logits"] = digest(m(ids).logits.float())
    res["transformers_greedy"] = [m.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist() for p in ps]
    eng = MiniEngine(PagedLM(open_export(hf, {})), block_size=4, chunk=3)
    for p in ps + [ps[0] + ps[1]]:  # the last shares the first's prefix blocks
        eng.add(p, 12)
    while eng.step():
        pass
    res["paged_tokens"] = [r["out"] for r in eng.reqs]
json.dump(res, open(out, "w"), indent=1)
PY
)
echo "runs at $REV ($(git -C "$ROOT" rev-parse --short "$REV")) ..."; runs "$BASE" "$OUT/before"
echo "runs in the working tree ..."; runs "$ROOT" "$OUT/after"

python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def records(p):  # every loss of every record, as written (floats compared by their bits)
    return [{k: v for k, v in json.loads(x).items() if "loss" in k or k == "step"} for x in open(p)]
def nine(root):
    if (root / "nine" / "runs.json").exists():  # before issue 26: one file
        rs = json.load(open(root / "nine" / "runs.json"))
    else:
        rs = [json.load(open(f))["result"] for f in (root / "nine" / "runs").rglob("result.json")]
    return {(r["name"], r["seed"]): json.dumps([r["history"], r["final"]], sort_keys=True)
            for r in rs}
ok = True
for run in ("train_engram", "train_moe", "train_nine", "train_dist"):
    a = records(out / "before" / run / "metrics.jsonl")
    b = records(out / "after" / run / "metrics.jsonl")
    same = a == b
    ok &= same
    print(f"{run:13s} {len(a)} records  {'identical' if same else 'DIFFERENT'}")
a, b = nine(out / "before"), nine(out / "after")
for k in sorted(a):
    same = a[k] == b.get(k)
    ok &= same
    print(f"study-nine {k[0]} seed {k[1]}: {'identical' if same else 'DIFFERENT'}")
def gen(p):  # the tokens of a generate --json (its speeds are timings)
    return json.load(open(p))["tokens"]
for run in ("train_engram", "train_nine"):
    for part in ("gen_memory", "gen_file", "gen_sampled"):
        same = gen(out / "before" / f"{run}.{part}.json") == gen(out / "after" / f"{run}.{part}.json")
        ok &= same
        print(f"{run} generate {part[4:]}: {'identical' if same else 'DIFFERENT'}")
    a, b = (json.load(open(out / side / f"{run}.decode.json")) for side in ("before", "after"))
    for k in a:
        same = a[k] == b.get(k)
        ok &= same
        print(f"{run} {k}: {'identical' if same else 'DIFFERENT'}")
def analysis(root):  # every number analyze wrote, less its timings
    d = json.load(open(root / "analysis" / "analysis.json"))
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if not k.endswith(("_s", "seconds", "time"))}
        return [strip(v) for v in x] if isinstance(x, list) else x
    return json.dumps(strip(d), sort_keys=True).replace(str(root), "SIDE")  # its run's path
same = analysis(out / "before") == analysis(out / "after")
ok &= same
print(f"analyze: {'identical' if same else 'DIFFERENT'}")
def budget(root):  # pool-budget's counts (rows read, distinct, cache hits); the rest are timings
    counts = ("tokens", "rows", "distinct", "misses", "hits", "table_rows")
    def keep(x):
        if isinstance(x, dict):
            return {k: keep(v) for k, v in x.items() if k in counts or isinstance(v, dict)
                    or isinstance(v, list) and any(isinstance(e, dict) for e in v)}
        return [keep(v) for v in x] if isinstance(x, list) else x
    return json.dumps(keep(json.load(open(root / "pool" / "budget.json"))), sort_keys=True)
same = budget(out / "before") == budget(out / "after")
ok &= same
print(f"pool-budget: {'identical' if same else 'DIFFERENT'}")
print("all identical" if ok else "differences found")
sys.exit(0 if ok else 1)
PY
