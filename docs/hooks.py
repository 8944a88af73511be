"""MkDocs hook: the pages generated from the code and the records at build time, so they change
when those do.

- ``reference/cli.md``: every command of the registry (``engram.cli.COMMANDS``): its help, usage,
  arguments, options with their types, choices and defaults, what it reads and writes, exit status.
- ``reference/api.md``: the public API, ``engram.__all__``, grouped by what a user does, one
  mkdocstrings block per name (signature, docstring) and, for a dataclass, its fields with the
  comments beside them in the source; then the policy that makes those names stable.
- ``results/*.md``: ``benchmarks/results`` as recorded, one page per folder, each titled with what
  was measured and on which machine (read from the records), led by its notes and reports with their
  figures; the JSON and other files are copied beside the page and linked, not shown (static files:
  search does not index them). The nav's "Recorded results" section lists these pages by itself
  (``on_config``), so a new results folder needs no edit here or in mkdocs.yml.
- ``{{ readme: HEADING }}`` in a page: that ``## HEADING`` section of the top README (up to the next
  ``## ``), so a page and the README cannot disagree (docs/index.md takes the headline from it).
- ``{{ tiers }}`` in a page: the tier registry as a table (tables/registry.py).

The source tree's ``src/`` goes first on ``sys.path``: the pages describe this checkout, installed
or not. Reading the registry imports no torch (configs are read from their source).
"""

from __future__ import annotations

import argparse
import ast
import functools
import html
import json
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_pages.py, beside this file
from results_pages import RESULTS, results_groups, results_pages, results_title  # noqa: E402

MAX_CELL = 140  # characters of one table cell
RESULTS_NAV = "Recorded results"  # the nav section the results pages go into
# Search: a guide's sections weigh twice a reference page's (the theme's ``search.boost``;
# tests/test_docs.py checks "finetune", "tier" and "export-hf" find a guide)
GUIDE_SEARCH_BOOST = 2


def on_config(config: Any) -> Any:
    """The results pages into the nav, in the section named ``RESULTS_NAV`` (made if missing)."""
    entries = ["results/index.md"] + [{results_title(k)[0]: f"results/{k}.md"}
                                      for k in sorted(results_groups())]
    nav = config.nav if config.nav is not None else []
    for item in nav:
        if isinstance(item, dict) and RESULTS_NAV in item:
            item[RESULTS_NAV] = entries
            break
    else:
        nav.append({RESULTS_NAV: entries})
    config.nav = nav
    return config


def on_files(files: Files, config: Any) -> Files:
    for uri, text in generated_pages().items():
        files.append(File.generated(config, uri, content=text))
    for f in sorted(RESULTS.rglob("*")):  # every recorded file but the Markdown (shown in pages)
        if f.is_file() and f.suffix != ".md":
            uri = f"results/{f.relative_to(RESULTS).as_posix()}"
            files.append(File.generated(config, uri, abs_src_path=str(f)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if page.file.src_uri.startswith("guides/"):  # a newcomer's search lands on a guide first
        page.meta.setdefault("search", {}).setdefault("boost", GUIDE_SEARCH_BOOST)
    if "{{ tiers }}" in markdown:
        markdown = markdown.replace("{{ tiers }}", tiers_table())
    page_dir = str(Path(page.file.src_uri).parent.as_posix()).strip(".")
    return re.sub(r"\{\{ readme: ([^}]+?) \}\}",
                  lambda m: readme_section(m.group(1), page_dir), markdown)


def tiers_table() -> str:
    from engram.tables.registry import REGISTRY

    rows = ["| tier | where the rows are |", "|---|---|"]
    rows += [f"| `{name}` | {_cell(t.help, None, True)} |" for name, t in REGISTRY.items()]
    return "\n".join(rows)


def generated_pages() -> dict[str, str]:
    pages = {"reference/cli.md": cli_page(), "reference/api.md": api_page()}
    pages.update(results_pages())
    return pages


# -- the top README's sections -----------------------------------------------------------------

def readme_section(heading: str, page_dir: str = "") -> str:
    """The README's ``## heading`` section without its heading line, its links rewritten for a page
    in ``page_dir`` (under docs/): a link into docs/ or to a recorded figure points at the site's
    copy; a link to anything else (source, scripts) becomes its path as code."""
    text = README.read_text()
    m = re.search(rf"^## {re.escape(heading)}[ \t]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    if m is None:
        raise ValueError(f"README.md has no '## {heading}' section")
    up = "../" * len([p for p in page_dir.split("/") if p])

    def link(m: re.Match) -> str:
        bang, label, target = m.group(1), m.group(2), m.group(3)
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            return m.group(0)
        path, _, anchor = target.partition("#")
        if path.startswith("docs/"):
            return f"{bang}[{label}]({up}{path[len('docs/'):]}{'#' + anchor if anchor else ''})"
        if path.startswith("benchmarks/results/") and (ROOT / path).is_file() \
                and not path.endswith(".md"):
            return f"{bang}[{label}]({up}results/{path[len('benchmarks/results/'):]})"
        return f"{label} (`{path}`)" if not bang else f"`{path}`"

    return re.sub(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)", link, m.group(1).strip("\n")) + "\n"


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
    from engram import outputs
    from engram.commandline import options
    from engram.cli import COMMANDS, top_parser
    from engram.commandline.schema import fields_of

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

# What a user does -> the public names for it, in reading order. A name of engram.__all__ missing
# here lands in "Other" (tests/test_docs.py checks every name has a section either way).
API_GROUPS = [
    ("Open, generate, score", ["open", "open_model", "Runtime", "Generator", "GenerationConfig"]),
    ("Hugging Face models", ["load_adapter", "EngramLMForCausalLM", "EngramLMConfig",
                             "export_hf"]),
    ("Tables and tiers", ["write_tables", "open_tier", "TableStore", "MemoryTable"]),
    ("Trigger tables (Tiny-Engram)", ["inject_triggers", "save_triggers", "load_triggers",
                                      "eject_triggers"]),
    ("The reference model and its training", ["EngramLM", "ModelConfig", "ModelOutput",
                                              "DecodeCache", "build_optimizers", "RowAdam"]),
    ("The Engram module", ["Engram", "build_engram", "EngramState", "ShortConv"]),
    ("Retrieval: tokenizer compression and hashing", [
        "EngramConfig", "NgramHasher", "HashStream", "Compression", "build_compression",
        "default_tokenizer", "DEAD", "prime_table_sizes", "rows_per_layer"]),
]

API_POLICY = """## What "public and stable" means

- **Public**: the names in `engram.__all__`, imported from `engram` itself (`from engram import
  Generator`, `engram.open(...)`). Their documented behaviour, the parameters and fields shown
  here (names, order of the positional ones, defaults' meaning) and their return values are the
  package's API. The modules under `engram.*` are internal: they may move or change in any release,
  even where a guide or this site describes them; the guides import only public names
  (`tests/test_docs.py` checks it).
- **Additions** come in any release: a new name, a new keyword parameter with a default, a new
  dataclass field with a default, a new tier or command.
- **Removals and incompatible changes** are deprecated first: the old name or parameter keeps
  working for at least one minor release (`0.x` to `0.x+1`), warns with a `DeprecationWarning`
  that names its replacement, and is listed on this page as deprecated until it goes. A name is
  added to `__all__` (in `src/engram/__init__.py`, which loads each on first use) only with a
  docstring; this page is generated from that list.
- **Command-line commands and options** follow the same rule ([command line](cli.md)); the
  folders they write (runs, exports, adapters, table files) are read by the names here.
"""


def api_page() -> str:
    import engram

    names = set(engram.__all__)
    groups = [(title, [n for n in members if n in names]) for title, members in API_GROUPS]
    grouped = {n for _, members in groups for n in members}
    if names - grouped:
        groups.append(("Other", sorted(names - grouped)))
    where = {n: _home(engram, n) for n in names}
    out = ["# Python API", "",
           "**Public and stable:** the names in `engram.__all__`, listed here by what they are "
           "for ([what that promises](#what-public-and-stable-means)); generated at build time "
           "from that list and the docstrings (`tests/test_docs.py` fails when one of them loses "
           "its docstring or its section). Import them from `engram` (`from engram import "
           "Generator`); they load on first use, so `import engram` imports no torch. Everything "
           "else (the modules under `engram.*`) is internal.", ""]
    for title, members in groups:
        out += [f"**{title}:** " + ", ".join(f"[`{n}`](#{_slug(n, engram)})" for n in members)
                + ".", ""]
    out += [API_POLICY, ""]
    for title, members in groups:
        out += [f"## {title}", ""]
        for n in members:
            alias = f" (`engram.{n}`)" if n in engram._ALIASES else ""
            use = f"`engram.{n}`" if n in engram._ALIASES else f"`from engram import {n}`"
            out += [f"### {n}{alias}", "", f"{use} (defined as `{where[n]}`)", "",
                    *_signature(where[n], f"engram.{n}" if alias else n),
                    f"::: {where[n]}", "    options:",
                    "      show_root_heading: false", "      heading_level: 4", ""]
            out += _fields_table(where[n])
    return "\n".join(out)


def _slug(name: str, engram: Any) -> str:
    """The anchor of a name's section (its heading's slug, as the toc extension makes it)."""
    text = f"{name} engram.{name}" if name in engram._ALIASES else name
    return re.sub(r"[^\w\s-]", "", text).strip().lower().replace(" ", "-")


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


@functools.lru_cache(maxsize=1)
def _package() -> Any:
    import griffe

    return griffe.GriffeLoader(search_paths=[str(ROOT / "src")]).load("engram")


def _signature(dotted: str, shown: str) -> list[str]:
    """How to call it, as a code block: a function's or a class's constructor's parameters (a
    dataclass's fields), annotations and defaults, read statically (griffe); a constant's value.
    (mkdocstrings shows a signature only in the heading this page does not use.)"""
    obj = _package()[dotted[len("engram."):]]
    if obj.is_alias:
        obj = obj.final_target
    if obj.is_attribute:
        return ["```python", f"{shown} = {obj.value}", "```", ""]
    function = obj.all_members.get("__init__") if obj.is_class else obj
    params = list(function.parameters) if function is not None else []
    if obj.is_class and params and params[0].name == "self":
        params = params[1:]
    parts, star = [], False
    for i, prm in enumerate(params):
        kind = prm.kind.value
        if kind == "keyword-only" and not star:
            parts.append("*")
            star = True
        text = {"variadic positional": "*", "variadic keyword": "**"}.get(kind, "") + prm.name
        star = star or kind == "variadic positional"
        if prm.annotation is not None:
            text += f": {prm.annotation}"
        if prm.default is not None and not kind.startswith("variadic"):
            text += f" = {prm.default}" if prm.annotation is not None else f"={prm.default}"
        parts.append(text)
        if kind == "positional-only" and (i + 1 == len(params)
                                          or params[i + 1].kind.value != "positional-only"):
            parts.append("/")
    returns = f" -> {function.returns}" if not obj.is_class and function.returns else ""
    one_line = f"{shown}({', '.join(parts)}){returns}"
    if len(one_line) <= 96:
        return ["```python", one_line, "```", ""]
    return ["```python", f"{shown}(", *[f"    {p}," for p in parts], f"){returns}", "```", ""]


def _fields_table(dotted: str) -> list[str]:
    """A dataclass's fields as a table (name, type, default, the comment beside it in the source);
    nothing for anything else. Read from the source, as the command line reads its configs."""
    from engram.commandline.schema import fields_of

    module, _, name = dotted.rpartition(".")
    source = ROOT / "src" / Path(*module.split("."))
    source = source / "__init__.py" if source.is_dir() else source.with_suffix(".py")
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            names = {ast.unparse(d.func if isinstance(d, ast.Call) else d)
                     for d in node.decorator_list}
            if not names & {"dataclass", "dataclasses.dataclass"}:
                return []
            break
    else:
        return []
    rows = []
    for f in fields_of(f"{module}:{name}"):
        default = "required" if f.required else f"`{f.default!r}`"
        kind = f"`{f.type}`"
        rows.append(f"| `{f.name}` | {kind} | {default} | {_cell(f.comment, None, True)} |")
    if not rows:
        return []
    return ["**Fields** (the constructor's keyword arguments, in order):", "",
            "| field | type | default | meaning |", "|---|---|---|---|", *rows, ""]
