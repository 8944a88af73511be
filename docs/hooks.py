"""MkDocs hook: the pages generated from the code at build time, so they change when it does.

- ``reference/cli.md``: every command of the registry (``engram.cli.COMMANDS``): its help, usage,
  arguments, options with their types, choices and defaults, what it reads and writes, exit status.
- ``reference/api.md``: the public API, ``engram.__all__``, one mkdocstrings block per name.
- ``results/*.md`` and the PNGs: ``benchmarks/results`` as recorded (reports, figures, JSON as
  tables), one page per folder.

The source tree's ``src/`` goes first on ``sys.path``: the pages describe this checkout, installed
or not. Reading the registry imports no torch (configs are read from their source).
"""

from __future__ import annotations

import argparse
import html
import json
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "src"))

MAX_ROWS = 80  # values shown per JSON file; the file itself has the rest
MAX_CELL = 140  # characters of one value


def on_files(files: Files, config: Any) -> Files:
    for uri, text in generated_pages().items():
        files.append(File.generated(config, uri, content=text))
    for png in sorted(RESULTS.rglob("*.png")):
        uri = f"results/{png.relative_to(RESULTS).as_posix()}"
        files.append(File.generated(config, uri, abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """``{{ tiers }}`` in a page: the tier registry as a table (tables/registry.py)."""
    if "{{ tiers }}" in markdown:
        markdown = markdown.replace("{{ tiers }}", tiers_table())
    return markdown


def tiers_table() -> str:
    from engram.tables.registry import REGISTRY

    rows = ["| tier | where the rows are |", "|---|---|"]
    rows += [f"| `{name}` | {_cell(t.help, None, True)} |" for name, t in REGISTRY.items()]
    return "\n".join(rows)


def generated_pages() -> dict[str, str]:
    pages = {"reference/cli.md": cli_page(), "reference/api.md": api_page()}
    pages.update(results_pages())
    return pages


# -- the command line --------------------------------------------------------------------------

EXIT = ("`0` done; `2` bad input (one line on stderr: `engram CMD: error: ...`); `1` a bug "
        "(the traceback); `130` interrupted by Ctrl-C or SIGTERM (one line saying what was kept)")


def _cell(text: Any, limit: int | None = MAX_CELL, code: bool = False) -> str:
    """Text as one table cell: no Markdown of its own; ``code``: `spans` stay code spans (help
    texts from our source, where backticks pair)."""
    s = str(text).replace("\n", " ")
    if limit is not None and len(s) > limit:
        s = s[:limit - 1] + "…"
    s = html.escape(s, quote=False)
    for ch, ent in (("|", "&#124;"), ("*", "&#42;"), ("[", "&#91;"), ("_", "&#95;")):
        s = s.replace(ch, ent)
    if not code or s.count("`") % 2:
        s = s.replace("`", "&#96;")
    else:  # inside a code span an entity shows as typed: put the underscores back there
        s = re.sub(r"`[^`]*`", lambda m: m.group(0).replace("&#95;", "_").replace("&#42;", "*")
                   .replace("&#91;", "["), s)
    return s


def cli_page() -> str:
    from engram import options, outputs
    from engram.cli import COMMANDS, top_parser
    from engram.schema import fields_of

    out = ["# Command-line reference", "",
           "Generated at build time from the command registry (`src/engram/cli/registry.py`, "
           "`@command`): what is here is what `engram COMMAND --help` prints. Every command with "
           "options also takes `--config FILE` (YAML or JSON: the same options as a mapping; the "
           "command line overrides it) and `--print_config` (the effective options as such a "
           "file); a command with named presets takes `--preset NAME` too (`engram compare --preset "
           "thorough`): a set of options that `--config` and the command line override. Options "
           "are spelled `--name value`, `--name=value` or `--name-with-dashes`; "
           "booleans also take bare `--flag` / `--no-flag`; tuples `a,b,c`; list options repeat.",
           "", f"**Exit status** (every command): {EXIT}.", "",
           "```text", top_parser().format_help().rstrip(), "```", ""]
    for name, cmd in COMMANDS.items():
        out += [f"## engram {name}", "", cmd.help[0].upper() + cmd.help[1:] + "."]
        if cmd.about:
            out += ["", cmd.about]
        out += [""]
        if cmd.passthrough:
            out += ["Its options are the other program's own (passed through unchanged); "
                    f"`engram {name} --help` prints them.", ""]
        p = cmd.parser()
        out += ["```text", p.format_usage().strip(), "```", ""]
        fields = {i: {f.name: f for f in fields_of(c.ref)} for i, c in enumerate(cmd.configs)}
        if cmd.args:
            out += ["| argument | meaning |", "|---|---|"]
            out += [f"| `{a.name.upper()}`{' (one or more)' if a.nargs == '+' else ''} | "
                    f"{_cell(a.help, None, True)} |" for a in cmd.args]
            out += [""]
        for group in p._action_groups:
            rows = []
            for a in group._group_actions:
                if not a.option_strings or a.help == argparse.SUPPRESS or a.dest == "help":
                    continue
                spell = ", ".join(f"`{o}`" for o in a.option_strings)
                if a.dest.startswith(options.SET_PREFIX):
                    i, fname = a.dest[len(options.SET_PREFIX):].split(".", 1)
                    f = fields[int(i)][fname]
                    kind = f.type + (f" ({' / '.join(map(str, f.choices))})" if f.choices else "")
                    default = "required" if f.required else options._show(f.default)
                    rows.append(f"| {spell} | {_cell(kind)} | {_cell(default)} | "
                                f"{_cell(f.comment, None, True)} |")
                else:
                    rows.append(f"| {spell} | | | {_cell(a.help, None, True)} |")
            if rows:
                out += [f"**{group.title}**", "", "| option | type | default | meaning |",
                        "|---|---|---|---|", *rows, ""]
        places = []
        for r in cmd.reads:
            places.append(f"reads `{_label(cmd, r.name)}`" + (" (a text file)" if r.text else ""))
        for w in cmd.writes:
            what = ("a file (new, or this command's own earlier output)" if w.kind == outputs.FILE
                    else f"a folder of kind `{w.kind}` (new, empty, or one this kind of command "
                    "wrote: its `.engram` marker says so)")
            places.append(f"writes `{_label(cmd, w.name)}`: {what}")
        if places:
            out += ["Places: " + "; ".join(places) + ".", ""]
        out += [f"Interrupted (exit 130): {cmd.interrupted}.", ""]
    return "\n".join(out)


def _label(cmd: Any, name: str) -> str:
    try:
        return cmd._where(name)[1]
    except KeyError:
        return name


# -- the Python API ----------------------------------------------------------------------------

def api_page() -> str:
    import engram

    names = sorted(engram.__all__)
    out = ["# Python API", "",
           "**Public and stable:** the names in `engram.__all__`, listed here; generated at build "
           "time from that list and the docstrings (`tests/test_docs.py` fails when one of them "
           "loses its docstring or its section). Import them from `engram` "
           "(`from engram import Generator`); they load on first use, so `import engram` imports "
           "no torch. Everything else (the modules under `engram.*`) is internal: it may change "
           "between versions without notice, even where this site describes it.", "",
           "| name | defined in |", "|---|---|"]
    where = {n: _home(engram, n) for n in names}
    out += [f"| [`{n}`](#{where[n]}) | `{where[n]}` |" for n in names]
    out += [""]
    for n in names:
        alias = f" (`engram.{n}`)" if n in engram._ALIASES else ""
        out += [f"## {n}{alias}", "", f"::: {where[n]}", "    options:",
                "      show_root_heading: false", "      heading_level: 3", ""]
    return "\n".join(out)


def _home(engram: Any, name: str) -> str:
    """The dotted path of the object ``engram.NAME`` stands for (its defining module, statically)."""
    if name in engram._ALIASES:
        module, attr = engram._ALIASES[name]
    else:
        module, attr = engram._EXPORTS[name], name
    path = ROOT / "src" / "engram" / Path(*module.split("."))
    if path.is_dir():  # a package re-exporting the name: find the file that defines it
        pattern = re.compile(rf"^(class|def) {attr}\b|^{attr} = ", re.M)
        for f in sorted(path.glob("*.py")):
            if pattern.search(f.read_text()):
                return f"engram.{module}.{f.stem}.{attr}"
    return f"engram.{module}.{attr}"


# -- benchmarks/results ------------------------------------------------------------------------

def results_pages() -> dict[str, str]:
    groups: dict[str, list[Path]] = {}
    for f in sorted(RESULTS.rglob("*")):
        if f.is_file():
            rel = f.relative_to(RESULTS)
            key = rel.parts[0] if len(rel.parts) > 1 else "top"
            groups.setdefault(key, []).append(f)
    pages: dict[str, str] = {}
    index = ["# Recorded results", "",
             "Generated at build time from `benchmarks/results/`: every report, figure and JSON "
             "file recorded there, one page per folder. What each finding means, with its command "
             "and verdict: [Reproducing the paper's findings](../guides/reproduce.md). "
             "The notes below are `benchmarks/results/README.md`.", "", "## Pages", ""]
    for key in sorted(groups):
        title = "Single-file benchmarks" if key == "top" else f"{key}/"
        index.append(f"- [{title}]({key}.md)")
    index += ["", _include(RESULTS / "README.md", page_dir="", demote=1)]
    pages["results/index.md"] = "\n".join(index)
    for key, members in groups.items():
        pages[f"results/{key}.md"] = _results_page(key, members)
    return pages


def _results_page(key: str, members: list[Path]) -> str:
    title = "Single-file benchmarks" if key == "top" else f"benchmarks/results/{key}/"
    out = [f"# {title}", "", "Recorded files, as committed (generated at build time).", ""]
    for f in members:
        if f.name == "report.md":
            rel = f.relative_to(RESULTS).as_posix()
            out += [f"## {rel}", "", _include(f, page_dir=key, demote=2), ""]
    pngs = [f for f in members if f.suffix == ".png"]
    if pngs:
        out += ["## Figures", ""]
        for f in pngs:
            rel = f.relative_to(RESULTS).as_posix()
            out += [f"**{rel}**", "", f"![{rel}]({rel})", ""]
    for f in members:
        if f.suffix == ".json":
            out += _json_table(f)
    others = [f.relative_to(RESULTS).as_posix() for f in members
              if f.suffix not in (".json", ".png") and f.name not in ("report.md", "README.md")]
    if others:
        out += ["## Other files", "", *[f"- `benchmarks/results/{o}`" for o in others], ""]
    return "\n".join(out)


def _include(report: Path, page_dir: str, demote: int) -> str:
    """A recorded Markdown file inside a page: headings demoted, its relative links rewritten to
    the page's place (figures are copied under results/), links to anything else kept as text."""
    base = report.parent.relative_to(RESULTS)
    lines = []
    fence = False
    for line in report.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        if not fence and line.startswith("#"):
            line = "#" * demote + line
        lines.append(line)
    text = "\n".join(lines)

    def link(m: re.Match) -> str:
        bang, label, target = m.group(1), m.group(2), m.group(3)
        if re.match(r"[a-z]+://", target):
            return m.group(0)
        rel = (base / target).as_posix()
        if (RESULTS / rel).suffix == ".png" and (RESULTS / rel).is_file():
            return f"{bang}[{label}]({rel})"
        return f"{label} (`{target}`)" if not bang else f"`{target}`"

    return re.sub(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)", link, text)


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        rows = []
        for k, v in value.items():
            rows += _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return rows
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value) \
            and len(value) <= 12:
        return [(prefix, ", ".join(_num(v) for v in value))]
    if isinstance(value, list):
        rows = []
        for i, v in enumerate(value):
            rows += _flatten(v, f"{prefix}[{i}]")
        return rows
    return [(prefix, _num(value))]


def _num(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _key(k: str) -> str:
    return f"`{k}`" if "`" not in k and "|" not in k and len(k) < MAX_CELL else _cell(k)


def _json_table(f: Path) -> list[str]:
    rel = f.relative_to(RESULTS).as_posix()
    try:
        data = json.loads(f.read_text())
    except ValueError:
        return [f"## {rel}", "", "(not JSON)", ""]
    rows = _flatten(data)
    out = [f"## {rel}", "", f"{len(rows)} values" + (f"; the first {MAX_ROWS} shown, the file "
                                                       "has the rest" if len(rows) > MAX_ROWS
                                                       else "") + ".", "",
           "| key | value |", "|---|---|"]
    out += [f"| {_key(k)} | {_cell(v)} |" for k, v in rows[:MAX_ROWS]]
    return out + [""]
