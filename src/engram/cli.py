"""The `engram` command line: one subcommand per job, each a thin wrapper over the library."""

from __future__ import annotations

import argparse
import json
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    out = run_demo(text=args.text, table_size=args.table_size, hidden_size=args.hidden_size)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return 0


def _train(args: argparse.Namespace) -> int:
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # launched by torchrun: sharded tables + DDP
        from .distributed import cli_train_distributed
        return cli_train_distributed(args.overrides + (["--no-resume"] if args.no_resume else []))
    from .train import TrainConfig, parse_overrides, train

    cfg = parse_overrides(TrainConfig, args.overrides)
    run = train(cfg, resume=not args.no_resume)
    last = run.history[-1] if run.history else {}
    print(json.dumps({"out_dir": cfg.out_dir, "step": run.step, **last}))
    return 0


def _compare(args: argparse.Namespace) -> int:
    import dataclasses

    from .compare import CompareConfig, run_compare
    from .train import TrainConfig, parse_overrides

    own = {f.name for f in dataclasses.fields(CompareConfig)}
    mine = [a for a in args.overrides if a[2:].split("=", 1)[0].replace("-", "_") in own]
    rest = [a for a in args.overrides if a not in mine]
    cc = parse_overrides(CompareConfig, mine)
    summary = run_compare(cc, parse_overrides(TrainConfig, rest))
    runs = summary["runs"]
    print(" ".join(f"{k}: {v['val_loss']:.4f}" for k, v in runs.items())
          + f" | engram gain vs dense {summary['engram_gain_vs_dense']:.4f} nats; "
          f"wrote {cc.out_dir}/results.json, loss.png, report.md, gates.html")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    import dataclasses

    from .sweep import SweepConfig, run_sweep
    from .train import TrainConfig, parse_overrides

    own = {f.name for f in dataclasses.fields(SweepConfig)}
    mine = [a for a in args.overrides if a[2:].split("=", 1)[0].replace("-", "_") in own]
    sc = parse_overrides(SweepConfig, mine)
    base = parse_overrides(TrainConfig, [a for a in args.overrides if a not in mine])
    summary = run_sweep(args.command.split("-", 1)[1], sc, base)
    print(" ".join(f"{p['name']}: {p['val_loss']:.4f}" for p in summary["points"])
          + f" | best {summary['best']['name']}; wrote {sc.out_dir}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from .generate import cli_generate

    return cli_generate(args.overrides)


def _finetune(args: argparse.Namespace) -> int:
    from .finetune import cli_finetune

    return cli_finetune(args.overrides)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engram", description="Engram conditional memory for LMs")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="compress the DeepSeek tokenizer, hash a sentence, run the module")
    d.add_argument("--text", default=None, help="sentence to hash (default: a built-in one)")
    d.add_argument("--table-size", type=int, default=50_000,
                   help="table size per n-gram order (the official demo uses 646400)")
    d.add_argument("--hidden-size", type=int, default=256)
    d.add_argument("--json", default=None, help="also write ids, hashes and gates here")
    d.set_defaults(func=_demo)
    t = sub.add_parser("train", help="train an LM (--key=value overrides of TrainConfig)")
    t.add_argument("--no-resume", action="store_true",
                   help="refuse to continue from a checkpoint in out_dir")
    t.set_defaults(func=_train)
    c = sub.add_parser("compare", help="dense vs Engram vs MoE on the default corpus (the main job); "
                       "--key=value overrides of CompareConfig and TrainConfig")
    c.set_defaults(func=_compare)
    g = sub.add_parser("generate", help="greedy/sampled decoding from a trained run, tables on any "
                       "tier (see `engram generate --help`)", add_help=False)
    g.set_defaults(func=_generate)
    f = sub.add_parser("finetune", help="memory-only training of Engram injected into a pretrained "
                       "HF model (SmolLM2) vs LoRA; --key=value overrides", add_help=False)
    f.set_defaults(func=_finetune)
    for kind, what in (("allocation", "split a fixed sparse budget between experts and Engram (rhos)"),
                       ("slots", "fixed backbone, Engram tables of growing size")):
        sw = sub.add_parser(f"sweep-{kind}", help=f"{what}; --key=value overrides")
        sw.set_defaults(func=_sweep)
    return p


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    if args.command in ("train", "compare", "sweep-allocation", "sweep-slots", "generate",
                        "finetune"):
        args.overrides = rest
    elif rest:
        build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
    if getattr(args, "text", "") is None:
        from .demo import DEFAULT_TEXT
        args.text = DEFAULT_TEXT
    try:
        return args.func(args)
    except (ValueError, TypeError, KeyError, FileNotFoundError, RuntimeError) as e:
        print(f"engram {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
