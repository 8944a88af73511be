"""Commands that make a run: demo, train, prepare, finetune, finetune-study."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..commandline.command import Arg, Config, In, Out
from ..errors import Interrupted, NonFinite, UserError
from ..files import disk_error
from ..ranges import AT_LEAST_1, POSITIVE, Range, check_ranges
from .registry import RUN_RECORDS, TRAIN, command


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


@command("demo", "compress the DeepSeek tokenizer, hash a sentence, run the module (~3 s)",
         configs=(DemoOptions,), writes=(Out("json"),))
def _demo(o: DemoOptions) -> None:
    from ..outputs import write_json
    from ..studies.demo import DEFAULT_TEXT, run_demo

    out = run_demo(text=o.text or DEFAULT_TEXT, table_size=o.table_size, hidden_size=o.hidden_size)
    if o.json:
        write_json(o.json, out, "engram demo")


@command("train", "train one LM (dense, MoE or Engram) on the package corpus or --data; "
         "torchrun for several",
         configs=(Config(TRAIN, records=RUN_RECORDS), Config(Launch, "run options")),
         # the file tier's folder (training/tier_tables.py), claimed and locked like the run's
         writes=(Out("out_dir", "run"),
                 Out("table_dir", "tier", of="out_dir",
                     default=lambda get: str(Path(get("out_dir")) / "tier")
                     if get("table_tier") == "file" else None)),
         about="Under torchrun (WORLD_SIZE > 1): DDP and row-sharded tables. Ctrl-C or SIGTERM "
         "saves a checkpoint of the step reached; the same command resumes from it.",
         interrupted="stopped at once (before training began, or a second Ctrl-C): the run "
         "folder's newest checkpoint, if any, is intact and the same command resumes from it")
def _train(cfg, launch: Launch) -> None:
    from ..artifacts.checkpoint import saved_step

    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        if world > 1:  # launched by torchrun: sharded tables + DDP
            from ..training.distributed import train_distributed

            run = train_distributed(cfg, resume=launch.resume, table_init=launch.table_init,
                                    timeout_s=launch.timeout)
        else:
            from ..training.train import train

            run = train(cfg, resume=launch.resume)
    except (NonFinite, Interrupted, OSError) as e:  # say what the run folder keeps
        disk = disk_error(e, None) if isinstance(e, OSError) else None
        if isinstance(e, OSError) and disk is None:
            raise
        step = saved_step(cfg.out_dir)
        kept = (f"the newest checkpoint is step {step} in {cfg.out_dir}/checkpoints; the same "
                "command resumes from it" if step is not None else
                f"no checkpoint yet in {cfg.out_dir}: nothing to resume from")
        if disk is not None:
            disk.kept = kept
            raise disk from (None if disk is e else e)
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
         about="Rerunning the same command resumes: finished shards are kept, changed ones redone.",
         interrupted="the shards finished so far are kept; the same command resumes from them")
def _prepare(cfg) -> None:
    from ..training.prepare import (
        prepare,
        release_large_blocks,
        summary_lines,
        tokenizer_threads,
    )

    # Process-wide settings, here rather than inside prepare(): this process only prepares.
    if cfg.workers != 0:  # on worker threads
        release_large_blocks()
    with tokenizer_threads(cfg.workers):
        print("\n".join(summary_lines(prepare(cfg), cfg.out)))


@command("finetune", "Engram memory for your pretrained transformers model: train it on your "
         "prepared text (backbone frozen), save an adapter that generate, eval and lm-eval open",
         args=(Arg("model", "a transformers model folder (llama, mistral, qwen2, qwen3 or gpt2 "
                   "family), or smollm2 (the packaged SmolLM2-135M-Instruct)"),),
         configs=("engram.training.finetune:FinetuneConfig",),
         reads=(In("model", check=False), In("data")), writes=(Out("out_dir", "adapter"),),
         about="--data is a folder of `engram prepare --tokenizer MODEL`. Ctrl-C or SIGTERM saves "
         "a checkpoint of the step reached; the same command resumes from it exactly.",
         interrupted="stopped at once (before training began, or a second Ctrl-C): the newest "
         "checkpoint in OUT_DIR/checkpoints, if any, is intact and the same command resumes from it")
def _finetune(model: str, cfg) -> None:
    from ..artifacts.checkpoint import saved_step
    from ..training.finetune import finetune

    try:
        summary = finetune(model, cfg)
    except (NonFinite, Interrupted) as e:  # say what the folder keeps
        step = saved_step(cfg.out_dir)
        kept = (f"the newest checkpoint is step {step} in {cfg.out_dir}/checkpoints; the same "
                "command resumes from it" if step is not None else
                f"no checkpoint yet in {cfg.out_dir}: nothing to resume from")
        raise type(e)(f"{e}; {kept}") from None
    print(f"held-out loss {summary['base_val_loss']:.4f} -> {summary['val_loss']:.4f} "
          f"({summary['val_gain']:+.4f} nats) after {summary['steps']} steps; adapter in "
          f"{cfg.out_dir} (engram generate {cfg.out_dir} --prompt ...)")


SEEDS_KEPT = ("the seeds finished (OUT_DIR/seedN/results.json) are kept; the same command trains "
              "only the missing ones, the seed in progress from its start")


@command("finetune-study", "Engram memory vs LoRA at equal trainable parameters on a frozen "
         "pretrained model (SmolLM2), over seeds: gain, forgetting, tokens/s",
         configs=("engram.studies.finetune:FinetuneStudyConfig",),
         reads=(In("model", check=False), In("data")),
         writes=(Out("out_dir", "finetune"),),
         about="Both methods train on the same batches through the same loop as `engram finetune`; "
         "each seed's results are kept in OUT_DIR/seedN and a rerun trains only the missing ones.",
         interrupted=SEEDS_KEPT)
def _finetune_study(cfg) -> None:
    from ..studies.finetune import run_study
    from ..studies.finetune_report import format_study

    try:
        summary = run_study(cfg)
    except Interrupted as e:  # the loop's "stopped at step N of M", and what the folder keeps
        raise Interrupted(f"{e}; {SEEDS_KEPT}") from None
    print(format_study(summary))
    print(f"wrote {cfg.out_dir}/results.json and finetune.png "
          f"({summary['wall_seconds']:.0f}s in all)")
