#!/usr/bin/env bash
# Same losses before and after a change (issue 26's rule for refactors): fixed-seed runs of
# `engram train` (Engram, MoE, Engram-Nine), a 2-rank torchrun and a small Nine study, at REV (in a
# temporary git worktree) and in this working tree, compared record by record, bit for bit.
#
#   benchmarks/bit_identity.sh [REV=main] [OUT=out/bit_identity]     (~6 min on 2 cores)
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
     --only=hash-10k,nine-2k/8k) > "$2.log" 2>&1 || { echo "failed: see $2.log"; exit 1; }
}
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
print("all identical" if ok else "differences found")
sys.exit(0 if ok else 1)
PY
