"""The `engram` command line: one subcommand per job, each a thin wrapper over the library.

Only the chosen subcommand's modules are imported. Options come from the dataclass configs (:mod:`engram.options`): ``--help`` lists every
field with its type, default and comment; ``--key value``, ``--key=value`` and ``--flag/--no-flag``
all work; an unknown option names the closest known one.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from typing import Callable

from .options import add_config, build, new_parser

# name -> one-line help, shown by `engram --help` without importing anything heavy.
COMMANDS = {
    "demo": "compress the DeepSeek tokenizer, hash a sentence, run the module (2 s)",
    "train": "train one LM (dense, MoE or Engram) on the package corpus; torchrun for several",
    "compare": "the main job: dense vs Engram vs MoE at matched parameters, seeds, report",
    "sweep-allocation": "fixed total/active parameters; the sparse budget moves experts <-> tables",
    "sweep-slots": "fixed backbone, Engram tables of growing size",
    "generate": "continue prompts with a trained run, tables on any tier",
    "finetune": "memory-only training of Engram injected into SmolLM2 vs LoRA",
    "export-hf": "a trained run as a directory vLLM serves (`vllm serve OUT` with the plugin)",
    "study-nine": "Engram-Nine: collision-free hot tier vs hashed tables at equal parameters",
    "study-vision": "trigger tables vs LoRA binding a word to a digit in a small text-to-image model",
    "eval": "loss of a trained run on any text; unseen tokens kept as context, counted",
    "ablate": "which parts of Engram matter: placement, compression, gate, conv, keys, orders",
    "analyze": "what the memory does: LogitLens, CKA, suppression, probes, gate statistics",
    "pool-budget": "will each Engram layer's rows arrive within its prefetch window, per tier",
    "lm-eval": "lm-evaluation-harness on an export-hf directory: lm-eval's options, model `engram`",
}


def _demo(argv: list[str]) -> int:
    from .studies.demo import DEFAULT_TEXT, run_demo

    p = new_parser("engram demo", COMMANDS["demo"])
    p.add_argument("--text", default=DEFAULT_TEXT, help="sentence to hash [default: a built-in one]")
    p.add_argument("--table_size", "--table-size", type=int, default=50_000,
                   help="table size per n-gram order; the official demo uses 646400 "
                   "[default: %(default)s]")
    p.add_argument("--hidden_size", "--hidden-size", type=int, default=256,
                   help="model width the module runs at [default: %(default)s]")
    p.add_argument("--json", default=None, help="also write ids, hashes and gates here "
                   "[default: none]")
    a = p.parse_args(argv)
    out = run_demo(text=a.text, table_size=a.table_size, hidden_size=a.hidden_size)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)
    return 0


def _train(argv: list[str]) -> int:
    import os

    from .training.distributed import cli_train_distributed, train_parser
    from .training.train import TrainConfig, train

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # launched by torchrun: sharded tables + DDP
        return cli_train_distributed(argv)
    ns = train_parser().parse_args(argv)
    cfg = build(TrainConfig, ns, 0)
    run = train(cfg, resume=ns.resume)
    last = run.history[-1] if run.history else {}
    print(json.dumps({"out_dir": cfg.out_dir, "step": run.step, **last}))
    return 0


def _study_parser(command: str, study_cls: type) -> argparse.ArgumentParser:
    """A study's own options first; TrainConfig's for the fields the study does not set itself."""
    import dataclasses

    from .training.train import TrainConfig

    p = new_parser(f"engram {command}", COMMANDS[command] + ". The study's options set the token "
                   "budget of every run; TrainConfig options set the rest of each run's config.")
    add_config(p, study_cls, 0, f"{study_cls.__name__} options")
    add_config(p, TrainConfig, 1, "TrainConfig options (the base of every run)",
               skip=[f.name for f in dataclasses.fields(study_cls)])
    return p


def _run_study(argv: list[str], command: str, study_cls: type, run: Callable,
               describe: Callable) -> int:
    """Parse a study's and TrainConfig's options, run it, print a one-line summary."""
    from .training.train import TrainConfig

    ns = _study_parser(command, study_cls).parse_args(argv)
    cfg = build(study_cls, ns, 0)
    summary = run(cfg, build(TrainConfig, ns, 1))
    print(describe(summary, cfg))
    return 0


def _compare(argv: list[str]) -> int:
    from .studies.compare import CompareConfig, run_compare

    return _run_study(argv, "compare", CompareConfig, run_compare, lambda s, cc: (
        " ".join(f"{k}: {v['val_loss']:.4f}" for k, v in s["runs"].items())
        + f" | engram gain vs dense {s['engram_gain_vs_dense']:.4f} nats; "
        f"wrote {cc.out_dir}/results.json, loss.png, report.md, gates.html"))


def _sweep(command: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        from .studies.sweep import SweepConfig, run_sweep

        kind = command.split("-", 1)[1]
        return _run_study(argv, command, SweepConfig, lambda sc, base: run_sweep(kind, sc, base),
                          lambda s, sc: " ".join(f"{p['name']}: {p['val_loss']:.4f}"
                                                 for p in s["points"])
                          + f" | best {s['best']['name']}; wrote {sc.out_dir}")
    return run


def _generate(argv: list[str]) -> int:
    from .serving.generate import cli_generate

    return cli_generate(argv)


def _finetune(argv: list[str]) -> int:
    from .studies.finetune import cli_finetune

    return cli_finetune(argv)


def _export_hf(argv: list[str]) -> int:
    from .serving.hf_export import SERVING_DEFAULTS, export_hf
    from .serving.loader import TIERS
    from .tables.tablefile import DTYPES

    p = new_parser("engram export-hf", COMMANDS["export-hf"] + ". The tier is a default: "
                   "vLLM's --hf-overrides '{\"engram_serving\": {\"tier\": \"file\"}}' changes it.")
    p.add_argument("run_dir", help="folder written by `engram train --out_dir`")
    p.add_argument("out_dir", help="where to write config.json, weights, tables and tokenizer")
    p.add_argument("--tier", choices=TIERS, default=SERVING_DEFAULTS["tier"],
                   help="where the server reads table rows from [default: %(default)s]")
    p.add_argument("--table_dtype", "--table-dtype", default="fp32", choices=sorted(DTYPES),
                   help="row type of the table files [default: %(default)s]")
    p.add_argument("--cache_fraction", "--cache-fraction", type=float, default=0.0,
                   help="hot cache of this fraction of each table's rows, file tiers "
                   "[default: %(default)s]")
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=False,
                   help="gather each step's rows in background threads [default: %(default)s]")
    a = p.parse_args(argv)
    out = export_hf(a.run_dir, a.out_dir, tier=a.tier, table_dtype=a.table_dtype,
                    cache_fraction=a.cache_fraction, prefetch=a.prefetch)
    print(f"wrote {out}; serve with: vllm serve {out} --dtype float32")
    return 0


def _study_nine(argv: list[str]) -> int:
    from .studies.nine import NineStudyConfig, run_nine_study

    return _run_study(argv, "study-nine", NineStudyConfig, run_nine_study, lambda s, sc: (
        " ".join(f"{k}: {v['val_loss_mean_sd'][0]:.4f}" for k, v in s["configs"].items())
        + f"; wrote {sc.out_dir}/nine.json, report.md and plots"))


def _study_vision(argv: list[str]) -> int:
    from .studies.vision import cli_vision

    return cli_vision(argv)


def _eval(argv: list[str]) -> int:
    from .studies.evaluate import EvalConfig, run_eval

    p = new_parser("engram eval", COMMANDS["eval"])
    p.add_argument("run_dir", metavar="RUN_DIR", help="an `engram train --out_dir` folder")
    add_config(p, EvalConfig, 0)
    ns = p.parse_args(argv)
    res = run_eval(ns.run_dir, build(EvalConfig, ns, 0))
    print(json.dumps(res))
    return 0


def _ablate(argv: list[str]) -> int:
    from .studies.ablate import AblateConfig, run_ablate

    return _run_study(argv, "ablate", AblateConfig, run_ablate, lambda s, ac: (
        " ".join(f"{k}: {v['val_loss']:.4f}" for k, v in s["variants"].items())
        + f"; wrote {ac.out_dir}/ablate.json, ablate.png, report.md"))


def _analyze(argv: list[str]) -> int:
    from .studies.analyze import AnalyzeConfig, run_analyze

    p = new_parser("engram analyze", COMMANDS["analyze"])
    p.add_argument("run_dir", metavar="RUN_DIR", nargs="+", help="an Engram run (`engram train "
                   "--out_dir`); several runs (seeds of one configuration) are each analysed and "
                   "then combined: mean +- sd per claim and in how many seeds it holds")
    p.add_argument("--baseline", nargs="*", default=None, metavar="RUN_DIR",
                   help="the dense run(s) on the same corpus, for LogitLens and CKA: one per "
                   "RUN_DIR, same order [default: none]")
    add_config(p, AnalyzeConfig, 0)
    ns = p.parse_args(argv)
    ac = build(AnalyzeConfig, ns, 0)
    if len(ns.run_dir) > 1:
        from .studies.analysis_seeds import run_seeds

        c = run_seeds(ns.run_dir, ns.baseline, ac)
        print(json.dumps({"n_seeds": c["n_seeds"], "verdicts": [v for _, _, v in c["verdicts"]]}))
        return 0
    if ns.baseline is not None and len(ns.baseline) > 1:
        p.error("one RUN_DIR takes at most one --baseline")
    res = run_analyze(ns.run_dir[0], ns.baseline[0] if ns.baseline else None, ac)
    print(json.dumps({"lens": res["lens"], "retention": res["retention"]}))
    return 0


def _lm_eval(argv: list[str]) -> int:
    from .studies.harness import cli_lm_eval

    return cli_lm_eval(argv)


def _pool_budget(argv: list[str]) -> int:
    from .studies.pool_budget import cli_pool_budget

    return cli_pool_budget(argv)


RUNNERS: dict[str, Callable[[list[str]], int]] = {
    "demo": _demo, "train": _train, "compare": _compare,
    "sweep-allocation": _sweep("sweep-allocation"), "sweep-slots": _sweep("sweep-slots"),
    "generate": _generate, "finetune": _finetune, "export-hf": _export_hf,
    "study-nine": _study_nine, "study-vision": _study_vision, "eval": _eval,
    "ablate": _ablate, "analyze": _analyze, "pool-budget": _pool_budget, "lm-eval": _lm_eval,
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch-engram")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


def top_parser() -> argparse.ArgumentParser:
    p = new_parser("engram", "Engram conditional memory for language models. "
                   "`engram COMMAND --help` lists a command's options.\n\ncommands:\n"
                   + "\n".join(f"  {k:<17} {v}" for k, v in COMMANDS.items())
                   + "\n\nenvironment:\n  ENGRAM_GEMM       float32 CPU matrix products: auto "
                   "(default; oneDNN on AMD x86, torch's MKL elsewhere), torch, onednn")
    p.add_argument("--version", action="version", version=f"engram {_version()}")
    p.add_argument("command", nargs="?", choices=list(COMMANDS), metavar="COMMAND")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        top_parser().parse_args(argv)  # --help / --version exit here
        top_parser().print_help()
        return 2
    command, rest = argv[0], argv[1:]
    if command not in RUNNERS:
        close = difflib.get_close_matches(command, list(RUNNERS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(f"engram: error: unknown command {command!r}{hint} (commands: "
              f"{', '.join(RUNNERS)})", file=sys.stderr)
        return 2
    try:
        return RUNNERS[command](rest)
    except (ValueError, TypeError, KeyError, FileNotFoundError, RuntimeError) as e:
        print(f"engram {command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
