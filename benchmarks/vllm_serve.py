"""vLLM serving an Engram model: decode tokens/s per table tier (vs in memory, same run) and a load
test of the OpenAI server (200 concurrent requests, each checked against `engram generate`).

    python benchmarks/vllm_serve.py --json benchmarks/results/vllm/serve.json [--smoke]

``--smoke`` (CI): the export and the reference decode, then one vLLM engine run of two short
prompts on the memory tier (no other tiers, no load test); without vLLM only the first two.

vLLM runs in its own processes (``--vllm_python``, default ``$ENGRAM_VLLM_PYTHON`` or this Python).
The model is an export of ``--run`` (a trained run) or, by default, a random-weight model on
DeepSeek's tokenizer whose greedy tokens depend on the context (so a mixed-up request shows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from engram import EngramConfig, EngramLM, ModelConfig, NgramHasher, build_compression
from engram.serving.generate import GenerationConfig, Generator
from engram.artifacts.export import write as export_model
from engram.serving.loader import export_hf
from engram.training.process_group import free_port
from record import write_json  # benchmarks/record.py: the script's folder is on sys.path
from vllm_run import short_rpc_dir  # vLLM's sockets in a short folder (a deep TMPDIR breaks them)

TIERS = {"memory": {}, "file+cache+prefetch": {"tier": "file", "cache_fraction": 0.05,
                                               "prefetch": True},
         "shared": {"tier": "shared"}}


def random_export(out: Path, seed: int = 0):
    g = np.random.default_rng(seed)
    vocab = np.sort(g.choice(np.arange(1000, 60000), 2000, replace=False))
    ecfg = EngramConfig(engram_vocab_size=[20011, 20021], max_ngram_size=3, n_embed_per_ngram=128,
                        n_head_per_ngram=4, layer_ids=[1, 2], pad_id=2)
    mc = ModelConfig(vocab_size=len(vocab), n_layer=4, d_model=128, n_head=2, engram=ecfg,
                     max_seq_len=160, init_std=0.2, table_init_std=1.0)
    torch.manual_seed(seed)
    model = EngramLM(mc).eval()
    for e in model.engrams().values():
        torch.nn.init.normal_(e.short_conv.conv.weight, std=0.3)
    hasher = NgramHasher(ecfg, build_compression())
    counts = hasher.count_reads(torch.as_tensor(g.choice(vocab, 50_000)))
    export_model(model, hasher, vocab, out, counts=counts, tag="random")
    return model, hasher, vocab


def has_vllm(python: str) -> bool:
    """Whether ``python`` can import vllm (asked without importing it: that takes seconds)."""
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([python, "-c", code], capture_output=True).returncode == 0


def prompts(vocab, n, seed, lo, hi):
    g = np.random.default_rng(seed)
    return [[int(x) for x in g.choice(vocab, int(g.integers(lo, hi)))] for _ in range(n)]


def engine_run(python, model_dir, ps, max_tokens, overrides, work):
    req, res = work / "req.json", work / "res.json"
    req.write_text(json.dumps({"prompts": ps, "max_tokens": max_tokens}))
    cmd = [python, str(Path(__file__).with_name("vllm_run.py")), str(model_dir), "--requests", str(req),
           "--result", str(res), "--hf_overrides", json.dumps({"engram_serving": overrides})]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:  # the engine's own words, not only its exit status
        raise RuntimeError(f"vllm_run.py exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(res.read_text())


def load_test(python, model_dir, ps, want, max_tokens, concurrency):
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = subprocess.Popen(
        [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
         "--max-num-seqs", "64", "--max-num-batched-tokens", "256", "--block-size", "32",
         "--served-model-name", "engram"], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # start-up: at most 5 minutes
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError("vllm serve exited:\n" + server.stderr.read()[-3000:])
                time.sleep(0.5)

        def one(i):
            body = json.dumps({"model": "engram", "prompt": ps[i], "max_tokens": max_tokens,
                               "temperature": 0, "ignore_eos": True,
                               "return_token_ids": True}).encode()
            t0 = time.perf_counter()
            r = urllib.request.urlopen(urllib.request.Request(
                base + "/v1/completions", body, {"Content-Type": "application/json"}), timeout=600)
            choice = json.loads(r.read())["choices"][0]
            return i, time.perf_counter() - t0, choice.get("token_ids"), choice["text"]

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, range(len(ps))))
        wall = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(timeout=60)
    lat = sorted(r[1] for r in results)
    wrong = [i for i, _, ids, _ in results if ids is not None and list(ids) != want[i]]
    return {"requests": len(ps), "answered": len(results), "concurrency": concurrency,
            "wrong_tokens": len(wrong), "token_ids_returned": all(r[2] is not None for r in results),
            "p50_s": statistics.median(lat), "p99_s": lat[int(0.99 * (len(lat) - 1))],
            "wall_s": wall, "requests_per_s": len(ps) / wall}


def main() -> None:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--json", default="out/bench_vllm.json")
    p.add_argument("--run", default=None, help="export this trained run instead of a random model")
    p.add_argument("--vllm_python", default=os.environ.get("ENGRAM_VLLM_PYTHON", sys.executable))
    p.add_argument("--decode_requests", type=int, default=32)
    p.add_argument("--decode_tokens", type=int, default=64)
    p.add_argument("--load_requests", type=int, default=200)
    p.add_argument("--load_tokens", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="see the module docstring (CI)")
    a = p.parse_args()
    if a.smoke:
        a.decode_requests, a.decode_tokens, a.load_requests, a.load_tokens = 2, 2, 2, 2
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="engram-vllm-"))
    out = work / "model"
    if a.run:
        from engram.serving.loader import open_model
        export_hf(a.run, out, cache_fraction=0.0)
        served = open_model(a.run)
        model, hasher, vocab = served.model, served.hasher, served.vocab
    else:
        model, hasher, vocab = random_export(out)
    gen = Generator(model, hasher, vocab, GenerationConfig(max_new_tokens=a.load_tokens))
    result = {"model": a.run or "random (4 layers, d=128, Engram at 1 and 2, 2x20k rows x 4 heads)"}
    decode_ps = prompts(vocab, a.decode_requests, seed=1, lo=4, hi=32)
    if a.smoke:
        result["reference_tokens"] = gen.generate(decode_ps).tokens
        if has_vllm(a.vllm_python):
            r = engine_run(a.vllm_python, out, decode_ps, a.decode_tokens, TIERS["memory"], work)
            result["decode_tokens_per_s"] = {"memory": [r["tokens_per_s"]]}
        else:
            result["vllm"] = f"not installed for {a.vllm_python}: skipped"
        print(json.dumps(result))
        write_json(a.json, result, indent=1)
        return
    tiers = {}
    for name in ["memory", "file+cache+prefetch", "shared", "memory"]:  # memory twice: drift
        r = engine_run(a.vllm_python, out, decode_ps, a.decode_tokens, TIERS[name], work)
        tiers.setdefault(name, []).append(r["tokens_per_s"])
        print(f"{name}: {r['tokens_per_s']:.0f} tok/s (startup {r['startup_s']:.0f}s)", flush=True)
    base = statistics.mean(tiers["memory"])
    result["decode_tokens_per_s"] = tiers
    result["vs_memory"] = {k: statistics.mean(v) / base for k, v in tiers.items()}
    load_ps = prompts(vocab, a.load_requests, seed=2, lo=1, hi=100)
    want = [gen.generate([q]).tokens[0] for q in load_ps]
    result["load_test"] = load_test(a.vllm_python, out, load_ps, want, a.load_tokens,
                                     concurrency=a.load_requests)
    print(json.dumps(result, indent=1))
    write_json(a.json, result, indent=1)


if __name__ == "__main__":
    with short_rpc_dir():  # for every vLLM process it starts: engine runs and the server
        main()
