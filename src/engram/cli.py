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
    from .train import TrainConfig, parse_overrides, train

    cfg = parse_overrides(TrainConfig, args.overrides)
    run = train(cfg, resume=not args.no_resume)
    last = run.history[-1] if run.history else {}
    print(json.dumps({"out_dir": cfg.out_dir, "step": run.step, **last}))
    return 0


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
    return p


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    if args.command == "train":
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
