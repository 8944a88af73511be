"""Commands that serve or move a trained model: generate, export-hf, pool-budget, lm-eval,
import-v41, export-v41."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputNotFound, UserError
from ..interrupts import stderr_line
from ..commandline.command import Arg, Config, In, Out
from ..ranges import AT_LEAST_1, check_ranges
from .registry import GENERATION, RUN_DIR, RUN_RECORDS, TIER_OPTIONS, TRAIN, command

@dataclass
class Tables:
    # Where table rows are read from.
    tier: str = field(default="memory", metadata={"choices": "engram.tables.registry:TIERS"})
    # Row type of the table files (only fp32 is exact; int8 / int4: GGUF Q8_0 / Q4_0 blocks).
    table_dtype: str = field(default="fp32", metadata={"choices": "engram.tables.tablefile:DTYPES"})
    cache_fraction: float = 0.0  # hot cache of this fraction of each table's rows (file tiers)
    prefetch: bool = False  # gather each step's rows in background threads
    table_dir: str | None = None  # table files of the file tiers; None: RUN_DIR/tables
    # A DeepSeek-V4.1 layer set (`engram import-v41` OUT) replacing the run's Engram layers.
    engram_layers: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.cache_fraction < 1:
            raise UserError(f"cache_fraction must be in [0, 1), got {self.cache_fraction}")


@dataclass
class Gate:
    # Keep a lossy --table_dtype whose measured loss rise is above the gate's 0.01 nats a token,
    # up to this many nats (docs/guides/tables.md: the quality gate).
    accept_loss: float | None = None
    # Measure a lossy format's cost on this UTF-8 text (paragraphs are documents) instead of the
    # run's held-out split; refused where it overlaps the training stream.
    text: str | None = None
    quality_tokens: int = 32_768  # at most this many tokens scored to measure a lossy format

    def __post_init__(self) -> None:
        check_ranges(self, quality_tokens=AT_LEAST_1)


@dataclass
class Prompts:
    prompt: list[str]  # text to continue; repeat the option for a batch
    stop: bool = True  # end a row at the end-of-text token (--no-stop: always max_new_tokens)
    json: str | None = None  # also write tokens and speeds here
    threads: int | None = None  # torch threads; None: torch's default

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise UserError(f"threads must be >= 1 or None, got {self.threads}")
        if not all(p.strip() for p in self.prompt):
            raise UserError("every --prompt must hold text (an empty prompt has nothing to "
                            "continue)")


def _sayer(command: str) -> Callable[[str], None]:
    """A command's progress line on stderr, named by the command (one write: stderr_line)."""
    return lambda line: stderr_line(f"engram {command}: {line}")


@command("generate", "continue prompts with a trained run, tables on any tier",
         args=(Arg("run_dir", RUN_DIR.help, deprecated="--run"),),
         configs=(Prompts, Tables, Config(Gate, skip=("text", "quality_tokens")), GENERATION),
         reads=("run_dir", "table_dir"), writes=(Out("json"),),
         about="GenerationConfig's prefetch (announce rows before each forward) stays on; "
         "--prefetch is the tables' background gather. Lossy table files are written and "
         "measured as `engram export-tables` does (the quality gate).")
def _generate(run_dir: str, o: Prompts, t: Tables, g: Gate, gen) -> None:
    import dataclasses

    import torch

    from ..serving.generate import Generator
    from ..serving.loader import open_model
    from ..studies.table_cost import cost_line, export_gated, table_folder, writes_tables

    say = _sayer("generate")
    if o.threads:
        torch.set_num_threads(o.threads)
    if t.tier != "memory" and t.engram_layers is None and writes_tables(run_dir):
        # a run's (an adapter's) file tiers read table files written from its checkpoint (its
        # tensors); an export's are its own
        export_gated(run_dir, t.table_dir, t.table_dtype, accept_loss=g.accept_loss,
                     command="engram generate", say=say)
    if t.engram_layers is None:  # a V4.1 layer set's files are its own (fp8 + E8M0, as V4.1's)
        line = cost_line(table_folder(run_dir, t.tier, t.table_dir))
        if line:
            say(line)
    rt = open_model(run_dir, tier=t.tier, table_dir=t.table_dir, table_dtype=t.table_dtype,
                    cache_fraction=t.cache_fraction, prefetch=t.prefetch,
                    engram_layers=t.engram_layers, device=gen.device,
                    precision=gen.precision or "fp32")
    rt.on_unseen = say
    if o.stop and rt.eos_id is not None:
        gen = dataclasses.replace(gen, stop_ids=(*gen.stop_ids, rt.eos_id))
    prompts = rt.fit_prompts([rt.encode(text) for text in o.prompt], gen.max_new_tokens,
                             cut=True, say=say)
    out = Generator(rt, config=gen).generate(prompts)
    texts = [rt.decode(ids) for ids in out.tokens]
    for i, text in enumerate(texts):
        print(text if len(texts) == 1 else f"[{i}] {text}")
    stats = rt.cache_stats()
    cache = "" if stats is None else f", cache hit rate {stats['hit_rate']:.1%}"
    say(f"{t.tier} tables{cache}; prefill {out.prefill_tok_s:.0f} tok/s, decode "
        f"{out.decode_tok_s:.0f} tok/s ({rt.checkpoint})")
    if o.json:
        from ..outputs import write_json

        write_json(o.json, {
            "prompts": o.prompt, "continuations": texts, "tokens": out.tokens,
            "prefill_tok_s": out.prefill_tok_s, "decode_tok_s": out.decode_tok_s,
            "checkpoint": rt.checkpoint, "tier": t.tier, "cache": stats}, "engram generate")


@command("export-tables", "a run's or an adapter's tables as table files, for the file tiers "
         "(generate, eval, pool-budget read them)",
         args=(Arg("run_dir", "a folder written by `engram train --out_dir` or by `engram "
                   "finetune --out_dir` (an adapter)"),),
         configs=(Config(Tables, skip=("tier", "cache_fraction", "prefetch", "engram_layers")),
                  Gate),
         reads=("run_dir", In("text", text=True)),
         writes=(Out("table_dir", "tables", of="run_dir"),),
         about="Writes nothing when the files of the newest checkpoint are there already. A lossy "
         "--table_dtype (all but fp32) is measured against the fp32 tables (TABLE_DIR/"
         "quality.json, one line on stderr) and refused, its files removed, when the loss rises "
         "more than 0.01 nats a token (--accept_loss).")
def _export_tables(run_dir: str, t: Tables, g: Gate) -> None:
    from ..studies.table_cost import write_tables

    say = _sayer("export-tables")
    folder = write_tables(run_dir, t.table_dir, t.table_dtype, accept_loss=g.accept_loss,
                          text=g.text, max_tokens=g.quality_tokens, say=say)
    print(f"table files in {folder}")


@command("export-hf", "a trained run as a directory vLLM serves (`vllm serve OUT` with the plugin)",
         args=(RUN_DIR, Arg("out_dir", "where to write config.json, weights, tables and "
                            "tokenizer")),
         configs=(Config(Tables, skip=("table_dir",)), Gate),
         reads=("run_dir", In("text", text=True)),
         writes=(Out("out_dir", "export", of="run_dir"),),
         about="The tier is a default: vLLM's --hf-overrides "
         "'{\"engram_serving\": {\"tier\": \"file\"}}' changes it. A rerun keeps the files "
         "already written that hold what it would write, and writes the rest. A lossy "
         "--table_dtype (all but fp32) is measured as `engram export-tables` measures it "
         "(OUT/tables/quality.json, one line on stderr) before it replaces any table file, and "
         "refused, OUT left as it was, when the loss rises more than 0.01 nats a token "
         "(--accept_loss).",
         interrupted="the files written whole so far are kept; the same command writes the rest")
def _export_hf(run_dir: str, out_dir: str, t: Tables, g: Gate) -> None:
    from ..studies.table_cost import export_hf

    say = _sayer("export-hf")
    kept: list[Path] = []
    out = export_hf(run_dir, out_dir, tier=t.tier, table_dtype=t.table_dtype,
                    cache_fraction=t.cache_fraction, prefetch=t.prefetch,
                    engram_layers=t.engram_layers, accept_loss=g.accept_loss, text=g.text,
                    max_tokens=g.quality_tokens, say=say, kept=kept)
    if kept:
        names = ", ".join(str(p.relative_to(out)) for p in kept)
        files = "file" if len(kept) == 1 else "files"
        say(f"kept {len(kept)} {files} already written: {names}")
    print(f"wrote {out}; serve with: vllm serve {out} --dtype float32")


@command("pool-budget", "will each Engram layer's rows arrive within its prefetch window, per tier",
         args=(Arg("run_dir", "a trained run (`engram train --out_dir`); none: the model of the "
                   "TrainConfig options with random weights", nargs="?", deprecated="--run_dir"),),
         configs=(Config("engram.studies.pool_budget:PoolBudgetConfig", skip=("run_dir",)),
                  Config(TRAIN, "TrainConfig options (the model with random weights when RUN_DIR "
                         "is not given)", records=RUN_RECORDS, skip=TIER_OPTIONS)),
         reads=("run_dir", In("pool_path", check=False)),
         writes=(Out("out_dir", "pool-budget"), Out("table_dir", "tables", of="run_dir")),
         about="Measures t_exec per layer, the read latency per tier, the break-even injected "
         "latency and the bandwidth bound.")
def _pool_budget(run_dir: str | None, pc, tc) -> None:
    import dataclasses

    import torch

    from ..studies.pool_budget import run_pool_budget, v41_lines
    from ..studies.pool_report import verdict

    torch.set_num_threads(pc.threads)  # process-wide: set here, not inside the study
    summary = run_pool_budget(dataclasses.replace(pc, run_dir=run_dir), tc)
    print("\n".join(verdict(summary) + v41_lines(summary["v41_tables"])))
    print(f"wrote {pc.out_dir}/budget.json, budget.png, report.md ({summary['wall_s']:.0f} s)")


@command("lm-eval", "lm-evaluation-harness on an export-hf directory: lm-eval's options, model "
         "`engram`", passthrough=True,
         about="Every option is lm-eval's own (`lm-eval run --help`); --model is engram unless "
         "given, e.g. engram lm-eval --model_args pretrained=OUT,tier=file --tasks TASK.")
def _lm_eval(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):  # lm-eval's own help, from a process of its own:
        import subprocess  # this one stays free of torch (lm-eval imports it)

        from ..commandline.schema import constant

        print("engram lm-eval: lm-eval's own options below; --model is engram unless given.\n"
              "model_args of engram: pretrained=OUT (an `engram export-hf` directory), tier ("
              + "|".join(constant("engram.tables.registry:TIERS"))
              + "; default: the export's), cache_fraction, prefetch, batch_size "
              "[16], max_length [the model's], max_gen_toks [256], device [cpu]\n", flush=True)
        raise SystemExit(subprocess.call([sys.executable, "-m", "lm_eval", "run", "--help"]))
    return _run_lm_eval(argv)


def _run_lm_eval(argv: list[str]) -> int:
    """lm-eval's own command line with the ``engram`` model type (registered on import)."""
    from lm_eval.__main__ import cli_evaluate

    from ..studies import harness  # noqa: F401  (@register_model("engram"))

    argv = list(argv)
    if not argv or argv[0] not in ("run", "ls", "validate"):
        argv = ["run", *argv]
    if argv[0] == "run" and not any(a in ("-M", "--model") or a.startswith("--model=")
                                    for a in argv):
        argv = ["run", "--model", "engram", *argv[1:]]
    if argv[0] == "run" and _named_model(argv) == "engram":
        _check_model_args(_model_args(argv))
    saved = sys.argv
    sys.argv = ["engram lm-eval", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0


def _named_model(argv: list[str]) -> str:
    for i, a in enumerate(argv):
        if a in ("-M", "--model") and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--model="):
            return a.split("=", 1)[1]
    return "engram"


def _model_args(argv: list[str]) -> dict[str, str]:
    """``--model_args`` as lm-eval reads it (``k=v,k2=v2`` or several ``k=v`` words)."""
    words: list[str] = []
    for i, a in enumerate(argv):
        if a.startswith("--model_args="):
            words.append(a.split("=", 1)[1])
        elif a in ("-a", "--model_args"):
            for b in argv[i + 1:]:
                if b.startswith("-"):
                    break
                words.append(b)
    pairs = [p for w in words for p in w.split(",") if p]
    return {k.strip(): v.strip() for k, _, v in (p.partition("=") for p in pairs)}


def _check_model_args(args: dict[str, str]) -> None:
    """What the user can fix, refused in one line before lm-eval starts (it logs and builds its
    task list first, and reports a model's error as a traceback)."""
    from ..artifacts.export import check_serving

    if "pretrained" not in args:
        raise UserError("--model_args needs pretrained=DIR (an `engram export-hf` directory)")
    root = Path(args["pretrained"])
    from ..artifacts import adapter, export

    if adapter.detect(root):  # `engram finetune`'s folder
        if args.get("tier", "memory") != "memory" and not (root / adapter.TABLES).is_dir():
            raise UserError(f"pretrained={root} is a finetuned adapter without table files for "
                            f"tier={args['tier']}: write them with `engram export-tables {root}`")
        return
    if not (root / export.CONFIG).is_file():
        raise InputNotFound(f"pretrained={root}: no config.json there (an `engram export-hf` "
                            "directory is expected)")
    if "tier" in args:
        check_serving({"tier": args["tier"]})


V41_ABOUT = "OUT appears whole or not at all; an existing non-empty OUT is refused."


@command("import-v41", "a DeepSeek-V4.1 checkpoint's Engram layers as our module weights + table "
         "files", args=(Arg("src", "checkpoint folder (config.json, safetensors shards)"),
                        Arg("out", "folder to write")),
         reads=("src",), writes=(Out("out", "v41-layers", whole=True),), about=V41_ABOUT)
def _import_v41(src: str, out: str) -> None:
    from ..artifacts.layer_set import import_v41

    print(f"wrote {import_v41(src, out, progress=True)}")


@command("export-v41", "a layer set (or a v4.1 run's Engram layers) as a DeepSeek-V4.1 checkpoint",
         args=(Arg("src", "layer set folder (`engram import-v41` OUT) or v4.1 run folder"),
               Arg("out", "folder to write")),
         reads=("src",), writes=(Out("out", "v41-checkpoint", whole=True),), about=V41_ABOUT)
def _export_v41(src: str, out: str) -> None:
    from ..serving.v41 import export_v41_checkpoint

    print(f"wrote {export_v41_checkpoint(src, out, progress=True)}")
