"""Run an ``engram export-hf`` directory through vLLM's offline engine and write what it generated:
the check behind tests/serving/test_vllm.py and benchmarks/vllm_serve.py, in its own process (vLLM
may live in another environment: ``ENGRAM_VLLM_PYTHON``). A tool of the tests and benchmarks, not
of the library (it lived in engram/serving before).

    python benchmarks/vllm_run.py OUT --requests req.json --result res.json \
        [--hf_overrides '{"engram_serving": {"tier": "file"}}'] [--max_num_batched_tokens 64]
        [--in_process]

req.json: {"prompts": [[token ids], ...], "max_tokens": 8}; prompts are token ids, so nothing
depends on how a chat template or BOS handling would tokenise text. Greedy decoding, stop at
max_tokens only (``ignore_eos``), as ``Generator`` with no stop ids.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import time

# vLLM's engine processes talk over ZMQ IPC sockets at VLLM_RPC_BASE_PATH/<uuid4> (default: the temp
# dir), and a unix socket's path holds at most 107 bytes: under a deep TMPDIR (a pytest-xdist
# worker's test folder) the engine cannot start. Past this length, a short folder of its own.
RPC_DIR_MAX = 64


@contextlib.contextmanager
def short_rpc_dir():
    """Sets VLLM_RPC_BASE_PATH (in this process, for vLLM's processes) to a short folder under
    /tmp, removed after, where the temp dir's path is too long for vLLM's sockets; else nothing."""
    if "VLLM_RPC_BASE_PATH" in os.environ or len(tempfile.gettempdir()) <= RPC_DIR_MAX:
        yield
        return
    path = tempfile.mkdtemp(prefix="vllm-rpc-", dir="/tmp")
    os.environ["VLLM_RPC_BASE_PATH"] = path
    try:
        yield
    finally:
        os.environ.pop("VLLM_RPC_BASE_PATH", None)
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/vllm_run.py",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", help="directory written by `engram export-hf`")
    p.add_argument("--requests", required=True, help="JSON with prompts (token ids), max_tokens")
    p.add_argument("--result", required=True, help="JSON to write tokens and timings to")
    p.add_argument("--hf_overrides", default="{}", help="JSON merged into config.json by vLLM")
    p.add_argument("--max_num_batched_tokens", type=int, default=64,
                   help="tokens per engine step: smaller than a prompt forces chunked prefill")
    p.add_argument("--max_num_seqs", type=int, default=64, help="requests in flight at once")
    p.add_argument("--block_size", type=int, default=32, help="KV block size (CPU: multiple of 32)")
    p.add_argument("--prefix_caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--in_process", action="store_true",
                   help="the engine core and its one worker in this process (vLLM's "
                   "VLLM_ENABLE_V1_MULTIPROCESSING=0 and the 'uni' executor), where a server runs "
                   "three: each imports vLLM and torch again (~20 s), so a test's engine starts "
                   "in ~half the time; the same model code, the same tokens")
    p.add_argument("--kv_blocks", type=int, default=None,
                   help="KV cache blocks (None: sized from VLLM_CPU_KVCACHE_SPACE); few blocks "
                   "force preemption")
    a = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if a.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with short_rpc_dir():
        return run(a)


def run(a: argparse.Namespace) -> int:
    from vllm import LLM, SamplingParams

    req = json.load(open(a.requests))
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    t0 = time.perf_counter()
    llm = LLM(model=a.model, dtype="float32", enforce_eager=True, seed=0,
              max_model_len=cfg["max_position_embeddings"], max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, block_size=a.block_size,
              enable_prefix_caching=a.prefix_caching, hf_overrides=json.loads(a.hf_overrides),
              disable_log_stats=False, num_gpu_blocks_override=a.kv_blocks,
              distributed_executor_backend="uni" if a.in_process else None)
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in req["prompts"]]
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up outside the timing
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t1
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    counters = {}
    try:  # the engine's own counters: prefix-cache queries and hits, preemptions
        for m in llm.get_metrics():
            if any(k in m.name for k in ("prefix_cache", "preemption")) and hasattr(m, "value"):
                counters[m.name] = m.value
    except Exception as e:  # metrics are informative; their API moves between versions
        counters["error"] = repr(e)
    json.dump({"tokens": tokens, "startup_s": startup, "generate_s": wall,
               "tokens_per_s": sum(map(len, tokens)) / wall, "hf_overrides": a.hf_overrides,
               "counters": counters},
              open(a.result, "w"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
