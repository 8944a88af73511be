"""The command registry: ``@command`` declares a function as ``engram NAME`` (the package docstring
says what a declaration holds), and what several commands' declarations share."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..commandline.command import Arg, Command, Config, In, Out

TRAIN = "engram.training.config:TrainConfig"

from ..artifacts import RUN_RECORDS  # noqa: F401  (torchrun's records in a run's config.json)


GENERATION = "engram.serving.generate:GenerationConfig"


COMMANDS: dict[str, Command] = {}  # name -> declaration, in `engram --help` order


def command(name: str, help: str, *, args: Sequence[Arg] = (),
            configs: Sequence[Config | type | str] = (), about: str = "",
            reads: Sequence[In | str] = (), writes: Sequence[Out] = (), interrupted: str = "",
            passthrough: bool = False, presets: dict[str, dict[str, Any]] | None = None):
    """Declare the decorated function as ``engram NAME`` (see the module docstring);
    ``interrupted``: what a Ctrl-C leaves, when the command does not say it itself;
    ``passthrough``: the function takes the raw argv (a command that hands over to another
    program's own command line, e.g. lm-eval's); ``presets``: named option sets (``--preset``)."""
    def declare(run: Callable[..., int | None]) -> Callable[..., int | None]:
        assert name not in COMMANDS, f"command {name!r} declared twice"
        COMMANDS[name] = Command(name, help, run, tuple(args),
                                 tuple(c if isinstance(c, Config) else Config(c) for c in configs),
                                 about, tuple(r if isinstance(r, In) else In(r) for r in reads),
                                 tuple(writes), passthrough=passthrough, presets=dict(presets or {}),
                                 **({"interrupted": interrupted} if interrupted else {}))
        return run
    return declare


RUN_DIR = Arg("run_dir", "a folder written by `engram train --out_dir`")


# Training from the file tier is one run's choice (`engram train --table_tier file`), not a study's:
# a study's runs keep their tables in memory.
TIER_OPTIONS = ("table_tier", "table_dir", "table_budget_mb")
# Set for every run of a study from its own options (studies.compare.budget: warmup from
# --warmup_fraction of --steps): offered, they would be silently overridden.
BUDGET_SET = ("warmup", "log_every", "final_eval_full")
STUDY_SKIP = TIER_OPTIONS + BUDGET_SET  # TrainConfig options a study's runs do not take
STUDY_BASE = Config(TRAIN, "TrainConfig options (the base of every run; the study's options "
                    "above set each run's token budget)", records=RUN_RECORDS, skip=STUDY_SKIP)


RUNS_KEPT = ("finished runs are kept; a run in progress resumes from its checkpoint when the same "
             "command runs again")


def _on_this_machine(base) -> None:
    """A study's --device, --precision and --compile, checked before its first run (UserError)."""
    from ..models.precision import resolve

    resolve(base.device, base.precision, base.compile)
