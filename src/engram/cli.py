"""The `engram` command line: every command declared once, in this file, by ``@command``.

A command is a function decorated with ``@command(name, help, args=..., configs=..., reads=...,
writes=...)``. The declaration says everything the command line needs: the one-line help, the
positional arguments (:class:`Arg`), the config dataclasses whose fields are its options, in order
(an earlier config owns an option name a later one also has; :class:`Config` adds a group title,
fields to skip, a prefix), and which arguments and options are places it reads (``reads``: a name,
or :class:`In` for a text file) and writes (``writes``: :class:`Out`, a file or a folder of a
kind). The function receives the positional values, then one instance per config, and prints its
result. Adding a command:

    @command("eval", "loss of a trained run on any text", args=(RUN_DIR,),
             configs=("engram.studies.evaluate:EvalConfig",),
             reads=("run_dir", In("text", text=True)), writes=(Out("json"),))
    def _eval(run_dir: str, ec) -> None:
        from .studies.evaluate import run_eval

        print(json.dumps(run_eval(run_dir, ec)))

Before the function runs, every command follows one rule for its places (engram/outputs.py,
applied by ``options.Command``): inputs exist (text inputs decode as text); outputs are checked
before any work: a folder output is new, empty or marked as this kind of folder (``.engram``),
never a file or a folder of something else; a file output is new or this command's own earlier
output. A command that fails leaves no folder it created behind.

A config whose module imports torch is named ``"module:Class"``; every config is read from its
source (:mod:`engram.schema`), so ``engram --help`` and ``engram CMD --help`` import no torch, and a
command's modules are imported only when it runs (import them inside the function). Options that
exist only on the command line (the prompts, resume, where tables live) are dataclasses here, next
to the commands that take them.

Errors: :class:`engram.errors.UserError` (bad input) and argparse errors print one line,
``engram CMD: error: MESSAGE``, and exit 2; SIGINT / SIGTERM print one line saying what was kept
(training saves a checkpoint first) and exit 130; any other exception is a bug and keeps its
traceback (exit 1).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from .errors import Interrupted, NonFinite, UserError
from .options import Arg, Command, Config, ConfigParser, In, Out, new_parser
from .ranges import AT_LEAST_1, POSITIVE, Range, check_ranges

TRAIN = "engram.training.train:TrainConfig"
GENERATION = "engram.serving.generate:GenerationConfig"


# -- declarations ----------------------------------------------------------------------------------

COMMANDS: dict[str, Command] = {}  # name -> declaration, in `engram --help` order


def command(name: str, help: str, *, args: Sequence[Arg] = (),
            configs: Sequence[Config | type | str] = (), about: str = "",
            reads: Sequence[In | str] = (), writes: Sequence[Out] = (), interrupted: str = "",
            passthrough: bool = False):
    """Declare the decorated function as ``engram NAME`` (see the module docstring);
    ``interrupted``: what a Ctrl-C leaves, when the command does not say it itself;
    ``passthrough``: the function takes the raw argv (a command that hands over to another
    program's own command line, e.g. lm-eval's)."""
    def declare(run: Callable[..., int | None]) -> Callable[..., int | None]:
        assert name not in COMMANDS, f"command {name!r} declared twice"
        COMMANDS[name] = Command(name, help, run, tuple(args),
                                 tuple(c if isinstance(c, Config) else Config(c) for c in configs),
                                 about, tuple(r if isinstance(r, In) else In(r) for r in reads),
                                 tuple(writes), passthrough=passthrough,
                                 **({"interrupted": interrupted} if interrupted else {}))
        return run
    return declare


RUN_DIR = Arg("run_dir", "a folder written by `engram train --out_dir`")
STUDY_BASE = Config(TRAIN, "TrainConfig options (the base of every run; the study's options "
                    "above set each run's token budget)")
RUNS_KEPT = ("finished runs are kept; a run in progress resumes from its checkpoint when the same "
             "command runs again")


def _on_this_machine(base) -> None:
    """A study's --device, --precision and --compile, checked before its first run (UserError)."""
    from .training.precision import resolve

    resolve(base.device, base.precision, base.compile)


# -- options only the command line has -------------------------------------------------------------

@dataclass
class DemoOptions:
    text: str | None = None  # sentence to hash; None: a built-in one
    table_size: int = 50_000  # table size per n-gram order; the official demo uses 646400
    hidden_size: int = 256  # model width the module runs at
    json: str | None = None  # also write ids, hashes and gates here

    def __post_init__(self) -> None:
        if self.text is not None and not self.text.strip():
            raise UserError("text must hold at least one character that is not a space")
        check_ranges(self, table_size=Range(2), hidden_size=AT_LEAST_1)


@dataclass
class Launch:
    resume: bool = True  # continue from the newest checkpoint in out_dir (--no-resume refuses to)
    # Under torchrun only: init every table row on every rank, or each rank only its own rows
    # (tables larger than one machine).
    table_init: str = field(default="replicated", metadata={"choices": ("replicated", "sharded")})
    timeout: float = 300.0  # under torchrun only: seconds a collective waits for a dead/hung peer

    def __post_init__(self) -> None:
        if self.timeout <= 0:
            raise UserError(f"timeout must be > 0 seconds, got {self.timeout}")
        check_ranges(self, timeout=POSITIVE)


@dataclass
class Tables:
    # Where table rows are read from.
    tier: str = field(default="memory", metadata={"choices": "engram.tables.registry:TIERS"})
    # Row type of the table files.
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


@dataclass
class Baselines:
    # The dense run(s) on the same corpus, for LogitLens and CKA: one per RUN_DIR, same order.
    baseline: tuple[str, ...] = ()


# -- the commands ----------------------------------------------------------------------------------

@command("demo", "compress the DeepSeek tokenizer, hash a sentence, run the module (~3 s)",
         configs=(DemoOptions,), writes=(Out("json"),))
def _demo(o: DemoOptions) -> None:
    from .outputs import write_json
    from .studies.demo import DEFAULT_TEXT, run_demo

    out = run_demo(text=o.text or DEFAULT_TEXT, table_size=o.table_size, hidden_size=o.hidden_size)
    if o.json:
        write_json(o.json, out, "engram demo")


@command("train", "train one LM (dense, MoE or Engram) on the package corpus or --data; "
         "torchrun for several",
         configs=(TRAIN, Config(Launch, "run options")), writes=(Out("out_dir", "run"),),
         about="Under torchrun (WORLD_SIZE > 1): DDP and row-sharded tables. Ctrl-C or SIGTERM "
         "saves a checkpoint of the step reached; the same command resumes from it.",
         interrupted="stopped at once (before training began, or a second Ctrl-C): the run "
         "folder's newest checkpoint, if any, is intact and the same command resumes from it")
def _train(cfg, launch: Launch) -> None:
    from .training.checkpoint import saved_step

    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        if world > 1:  # launched by torchrun: sharded tables + DDP
            from .training.distributed import train_distributed

            run = train_distributed(cfg, resume=launch.resume, table_init=launch.table_init,
                                    timeout_s=launch.timeout)
        else:
            from .training.train import train

            run = train(cfg, resume=launch.resume)
    except (NonFinite, Interrupted) as e:  # say what the run folder keeps
        step = saved_step(cfg.out_dir)
        kept = (f"the newest checkpoint is step {step} in {cfg.out_dir}/checkpoints; the same "
                "command resumes from it" if step is not None else
                f"no checkpoint yet in {cfg.out_dir}: nothing to resume from")
        raise type(e)(f"{e}; {kept}") from None
    if int(os.environ.get("RANK", "0")) != 0 and world > 1:
        return
    last = run.history[-1] if run.history else {}
    print(json.dumps({"out_dir": cfg.out_dir, "step": run.step,
                      **({"world_size": world} if world > 1 else {}), **last}))


@command("prepare", "your own text (files, folders, globs, .jsonl/.parquet/.csv) as token "
         "shards for `train --data`", configs=("engram.training.prepare:PrepareConfig",),
         reads=(In("input", check=False), In("tokenizer", check=False)),
         writes=(Out("out", "corpus"),),
         about="Rerunning the same command resumes: finished shards are kept, changed ones redone.")
def _prepare(cfg) -> None:
    from .training.prepare import prepare, summary_lines

    print("\n".join(summary_lines(prepare(cfg), cfg.out)))


@command("compare", "the main job: dense vs Engram vs MoE at matched parameters, seeds, report",
         configs=("engram.studies.compare:CompareConfig", STUDY_BASE),
         writes=(Out("out_dir", "compare"),), interrupted=RUNS_KEPT)
def _compare(cc, base) -> None:
    _on_this_machine(base)
    from .studies.compare import run_compare

    s = run_compare(cc, base)
    print(" ".join(f"{k}: {v['val_loss']:.4f}" for k, v in s["runs"].items())
          + f" | engram gain vs dense {s['engram_gain_vs_dense']:.4f} nats; "
          f"wrote {cc.out_dir}/results.json, loss.png, report.md, gates.html")


def _sweep(kind: str, sc, base) -> None:
    _on_this_machine(base)
    from .studies.sweep import run_sweep

    s = run_sweep(kind, sc, base)
    print(" ".join(f"{p['name']}: {p['val_loss']:.4f}" for p in s["points"])
          + f" | best {s['best']['name']}; wrote {sc.out_dir}")


SWEEP = ("engram.studies.sweep:SweepConfig", STUDY_BASE)
command("sweep-allocation", "fixed total/active parameters; the sparse budget moves experts <-> "
        "tables", configs=SWEEP, writes=(Out("out_dir", "sweep"),),
        interrupted=RUNS_KEPT)(
    lambda sc, base: _sweep("allocation", sc, base))
command("sweep-slots", "fixed backbone, Engram tables of growing size", configs=SWEEP,
        writes=(Out("out_dir", "sweep"),), interrupted=RUNS_KEPT)(
    lambda sc, base: _sweep("slots", sc, base))


@command("generate", "continue prompts with a trained run, tables on any tier",
         args=(Arg("run_dir", RUN_DIR.help, deprecated="--run"),),
         configs=(Prompts, Tables, GENERATION),
         reads=("run_dir", "table_dir"), writes=(Out("json"),),
         about="GenerationConfig's prefetch (announce rows before each forward) stays on; "
         "--prefetch is the tables' background gather.")
def _generate(run_dir: str, o: Prompts, t: Tables, gen) -> None:
    import dataclasses

    import torch

    from .serving.generate import Generator
    from .serving.loader import load_run
    from .training.corpus import EOS_TOKEN

    from .training.precision import resolve

    resolve(gen.device or "cpu", gen.precision)  # the machine can run it: before loading
    if o.threads:
        torch.set_num_threads(o.threads)
    served = load_run(run_dir, tier=t.tier, table_dir=t.table_dir, table_dtype=t.table_dtype,
                      cache_fraction=t.cache_fraction, prefetch=t.prefetch,
                      engram_layers=t.engram_layers)
    tok = served.tokenizer
    eos = tok.token_to_id(EOS_TOKEN)
    if o.stop and eos is not None:
        gen = dataclasses.replace(gen, stop_ids=(*gen.stop_ids, eos))
    room = served.model.config.max_seq_len - max(0, gen.max_new_tokens - 1)
    prompts, known = [], set(served.vocab.tolist())
    for text in o.prompt:
        ids = tok.encode(text, add_special_tokens=False).ids
        unknown = sorted({tok.decode([i]) for i in ids if i not in known})
        if unknown:
            raise UserError(f"prompt {text!r} has tokens the model never saw in training: "
                            f"{unknown[:10]}")
        if len(ids) > room:
            print(f"engram generate: keeping the last {room} of {len(ids)} prompt tokens "
                  f"(max_seq_len={served.model.config.max_seq_len})", file=sys.stderr)
            ids = ids[-room:]
        prompts.append(ids)
    out = Generator(served.model, served.hasher, served.vocab, gen).generate(prompts)
    texts = [tok.decode(t, skip_special_tokens=True) for t in out.tokens]
    for i, text in enumerate(texts):
        print(text if len(texts) == 1 else f"[{i}] {text}")
    print(f"engram generate: {t.tier} tables; prefill {out.prefill_tok_s:.0f} tok/s, decode "
          f"{out.decode_tok_s:.0f} tok/s ({served.checkpoint.name})", file=sys.stderr)
    if o.json:
        from .outputs import write_json

        write_json(o.json, {
            "prompts": o.prompt, "continuations": texts, "tokens": out.tokens,
            "prefill_tok_s": out.prefill_tok_s, "decode_tok_s": out.decode_tok_s,
            "checkpoint": str(served.checkpoint), "tier": t.tier}, "engram generate")


@command("finetune", "memory-only training of Engram injected into SmolLM2 vs LoRA",
         configs=("engram.studies.finetune:FinetuneConfig",), reads=(In("model", check=False),),
         writes=(Out("out_dir", "finetune"),),
         about="Train only Engram injected into a frozen pretrained model (SmolLM2-135M) and LoRA "
         "at the same trainable parameters; report fit and forgetting.")
def _finetune(cfg) -> None:
    from .studies.finetune import format_summary, run_finetune

    summary = run_finetune(cfg)
    print(format_summary(summary))
    print(f"wrote {cfg.out_dir}/results.json and finetune.png "
          f"({summary['wall_seconds']:.0f}s in all)")


@command("export-hf", "a trained run as a directory vLLM serves (`vllm serve OUT` with the plugin)",
         args=(RUN_DIR, Arg("out_dir", "where to write config.json, weights, tables and "
                            "tokenizer")),
         configs=(Config(Tables, skip=("table_dir",)),),
         reads=("run_dir",), writes=(Out("out_dir", "export", of="run_dir"),),
         about="The tier is a default: vLLM's --hf-overrides "
         "'{\"engram_serving\": {\"tier\": \"file\"}}' changes it.")
def _export_hf(run_dir: str, out_dir: str, t: Tables) -> None:
    from .serving.hf_export import export_hf

    out = export_hf(run_dir, out_dir, tier=t.tier, table_dtype=t.table_dtype,
                    cache_fraction=t.cache_fraction, prefetch=t.prefetch,
                    engram_layers=t.engram_layers)
    print(f"wrote {out}; serve with: vllm serve {out} --dtype float32")


@command("study-nine", "Engram-Nine: collision-free hot tier vs hashed tables at equal parameters",
         configs=("engram.studies.nine:NineStudyConfig", STUDY_BASE),
         writes=(Out("out_dir", "study-nine"),), interrupted=RUNS_KEPT)
def _study_nine(sc, base) -> None:
    _on_this_machine(base)
    from .studies.nine import run_nine_study

    s = run_nine_study(sc, base)
    print(" ".join(f"{k}: {v['val_loss_mean_sd'][0]:.4f}" for k, v in s["configs"].items())
          + f"; wrote {sc.out_dir}/nine.json, report.md and plots")


@command("study-vision", "trigger tables vs LoRA binding a word to a digit in a small "
         "text-to-image model", configs=("engram.studies.vision:VisionConfig",),
         writes=(Out("out_dir", "study-vision"),),
         interrupted="a base model already trained is kept and reused by a rerun; the binding "
         "runs start over")
def _study_vision(cfg) -> None:
    from .studies.vision import run_vision

    res = run_vision(cfg)
    for name, c in res["concepts"].items():
        print(name, " ".join(f"{m}: bind {v['summary']['binding']['mean']:.2f}"
                             for m, v in c["methods"].items()))
    print(f"wrote {cfg.out_dir}/vision.json, report.md, grid_*.png in {res['total_s']:.0f} s")


@command("eval", "loss of a trained run on any text; unseen tokens kept as context, counted",
         args=(RUN_DIR,), configs=("engram.studies.evaluate:EvalConfig",),
         reads=("run_dir", In("text", text=True)), writes=(Out("json"),))
def _eval(run_dir: str, ec) -> None:
    from .studies.evaluate import run_eval

    print(json.dumps(run_eval(run_dir, ec)))


@command("ablate", "which parts of Engram matter: placement, compression, gate, conv, keys, orders",
         configs=("engram.studies.ablate:AblateConfig", STUDY_BASE),
         writes=(Out("out_dir", "ablate"),), interrupted=RUNS_KEPT)
def _ablate(ac, base) -> None:
    _on_this_machine(base)
    from .studies.ablate import run_ablate

    s = run_ablate(ac, base)
    print(" ".join(f"{k}: {v['val_loss']:.4f}" for k, v in s["variants"].items())
          + f"; wrote {ac.out_dir}/ablate.json, ablate.png, report.md")


def analysis_dir(run_dirs: list[str]) -> str:
    """analyze's output when --out_dir is not given: RUN_DIR/analysis; with several runs,
    ``analysis`` beside the first (each run's own analysis goes in a folder inside it)."""
    first = Path(run_dirs[0])
    return str(first / "analysis" if len(run_dirs) == 1 else first.parent / "analysis")


@command("analyze", "what the memory does: LogitLens, CKA, suppression, probes, gate statistics",
         args=(Arg("run_dir", "an Engram run (`engram train --out_dir`); several runs (seeds of "
                   "one configuration) are each analysed and then combined: mean +- sd per claim "
                   "and in how many seeds it holds", nargs="+"),),
         configs=("engram.studies.analyze:AnalyzeConfig", Baselines),
         reads=("run_dir", "baseline"),
         writes=(Out("out_dir", "analysis", default=lambda get: analysis_dir(get("run_dir"))),))
def _analyze(run_dirs: list[str], ac, b: Baselines) -> None:
    if len(run_dirs) > 1:
        from .studies.analysis_seeds import run_seeds

        c = run_seeds(run_dirs, list(b.baseline) or None, ac)
        print(json.dumps({"n_seeds": c["n_seeds"], "verdicts": [v for _, _, v in c["verdicts"]]}))
        return
    if len(b.baseline) > 1:
        raise UserError("one RUN_DIR takes at most one --baseline")
    from .studies.analyze import run_analyze

    res = run_analyze(run_dirs[0], b.baseline[0] if b.baseline else None, ac)
    print(json.dumps({"lens": res["lens"], "retention": res["retention"]}))


@command("pool-budget", "will each Engram layer's rows arrive within its prefetch window, per tier",
         args=(Arg("run_dir", "a trained run (`engram train --out_dir`); none: the model of the "
                   "TrainConfig options with random weights", nargs="?", deprecated="--run_dir"),),
         configs=(Config("engram.studies.pool_budget:PoolBudgetConfig", skip=("run_dir",)),
                  Config(TRAIN, "TrainConfig options (the model with random weights when RUN_DIR "
                         "is not given)")),
         reads=("run_dir", In("pool_path", check=False)),
         writes=(Out("out_dir", "pool-budget"), Out("table_dir", "tables", of="run_dir")),
         about="Measures t_exec per layer, the read latency per tier, the break-even injected "
         "latency and the bandwidth bound.")
def _pool_budget(run_dir: str | None, pc, tc) -> None:
    import dataclasses

    from .studies.pool_budget import run_pool_budget, v41_lines
    from .studies.pool_report import verdict

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

        from .schema import constant

        print("engram lm-eval: lm-eval's own options below; --model is engram unless given.\n"
              "model_args of engram: pretrained=OUT (an `engram export-hf` directory), tier ("
              + "|".join(constant("engram.tables.registry:TIERS"))
              + "; default: the export's), cache_fraction, prefetch, batch_size "
              "[16], max_length [the model's], max_gen_toks [256], device [cpu]\n", flush=True)
        raise SystemExit(subprocess.call([sys.executable, "-m", "lm_eval", "run", "--help"]))
    from .studies.harness import cli_lm_eval

    return cli_lm_eval(argv)


V41_ABOUT = "OUT appears whole or not at all; an existing non-empty OUT is refused."


@command("import-v41", "a DeepSeek-V4.1 checkpoint's Engram layers as our module weights + table "
         "files", args=(Arg("src", "checkpoint folder (config.json, safetensors shards)"),
                        Arg("out", "folder to write")),
         reads=("src",), writes=(Out("out", "v41-layers", whole=True),), about=V41_ABOUT)
def _import_v41(src: str, out: str) -> None:
    from .models.v41_layers import import_v41

    print(f"wrote {import_v41(src, out, progress=True)}")


@command("export-v41", "a layer set (or a v4.1 run's Engram layers) as a DeepSeek-V4.1 checkpoint",
         args=(Arg("src", "layer set folder (`engram import-v41` OUT) or v4.1 run folder"),
               Arg("out", "folder to write")),
         reads=("src",), writes=(Out("out", "v41-checkpoint", whole=True),), about=V41_ABOUT)
def _export_v41(src: str, out: str) -> None:
    from .serving.v41 import export_v41_checkpoint

    print(f"wrote {export_v41_checkpoint(src, out, progress=True)}")


# -- main ------------------------------------------------------------------------------------------

def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch-engram")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


def top_parser() -> ConfigParser:
    p = new_parser("engram", "Engram conditional memory for language models. "
                   "`engram COMMAND --help` lists a command's options.\n\ncommands:\n"
                   + "\n".join(f"  {k:<17} {c.help}" for k, c in COMMANDS.items())
                   + "\n\nenvironment:\n  ENGRAM_GEMM       float32 CPU matrix products: auto "
                   "(default: the faster of the two, timed per shape on first use, cached), "
                   "torch, onednn\n\nexit status: 0 done, 2 bad input (one line on stderr), 1 a bug "
                   "(traceback), 130 interrupted (Ctrl-C / SIGTERM; what was kept is said)")
    p.add_argument("--version", action="version", version=f"engram {_version()}")
    p.add_argument("command", nargs="?", choices=list(COMMANDS), metavar="COMMAND")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command. Bad input (UserError, a bad option): one line on stderr, 2. A bug: the
    exception propagates with its traceback (exit status 1)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        top_parser().parse_args(argv)  # --help / --version exit here
        top_parser().print_help()
        return 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(f"engram: error: unknown command {name!r}{hint} (commands: "
              f"{', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    cmd = COMMANDS[name]
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    try:
        with _sigterm_as_ctrl_c():
            return cmd(rest)
    except UserError as e:
        rank = f" (rank {os.environ['RANK']})" if distributed else ""
        code, line = 2, f"engram {name}{rank}: error: {e}"
    except (Interrupted, KeyboardInterrupt) as e:  # 128 + SIGINT, the shell's convention
        said = str(e) if isinstance(e, Interrupted) else cmd.interrupted
        code, line = 130, f"engram {name}: interrupted; {said}"
        if distributed and os.environ["RANK"] != "0":
            line = ""
    # Printed once the exception is gone: what it held (a progress bar) has closed by now, so the
    # line stands on its own, last.
    if line:
        print(line, file=sys.stderr)
    return code


@contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM (a scheduler, `kill`, torchrun stopping its workers) takes Ctrl-C's path: a clean
    stop saying what was kept, not a silent death. Training loops catch both to save first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


if __name__ == "__main__":
    raise SystemExit(main())
