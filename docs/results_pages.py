"""The results pages of the docs site (docs/hooks.py builds the site with them):
``benchmarks/results`` as recorded, one page per folder, each titled with what was measured and
on which machine (read from the records), led by its notes and reports with their figures; the
JSON and other files are linked, not shown."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
RESULTS_SEARCH_BOOST = 0.5  # a results page's sections weigh half a reference page's (search)

# A folder of benchmarks/results -> (nav title, what it measured). A folder missing here still gets
# its page: its first report's heading, else its name, is the title.
RESULTS_TITLES = {
    "top": ("Single-file benchmarks",
            "Single-file benchmarks: hashing, module, training, tiers, serving and start-up speed"),
    "compare": ("Dense vs Engram vs MoE", "Dense vs Engram vs MoE at equal active parameters "
                "(engram compare)"),
    "sweeps": ("Allocation sweep", "How to split a parameter budget between experts and memory "
               "(engram sweep-allocation)"),
    "ablate": ("Ablations", "Ablations of the Engram module (engram ablate)"),
    "analysis": ("LogitLens, CKA, gates", "What the memory does: LogitLens, CKA, suppression "
                 "and gates (engram analyze)"),
    "nine": ("Engram-Nine training", "Engram-Nine, a collision-free hot tier, trained "
             "(engram study-nine)"),
    "nine_serving": ("Engram-Nine serving", "Engram-Nine's hot tier, served: lookup speed"),
    "data": ("Prepare, and compare on all sources", "Preparing text (engram prepare) and "
             "compare on all four built-in sources"),
    "eval": ("Held-out text (engram eval)", "Next-token loss on unseen text (engram eval)"),
    "lm_eval": ("lm-evaluation-harness", "lm-evaluation-harness against engram eval on "
                "held-out documents"),
    "pool": ("Pool budget", "Pool budget: do the rows arrive within the prefetch window?"),
    "vision": ("Vision: trigger tables", "Trigger tables vs LoRA vs textual inversion in a "
               "diffusion model"),
    "vllm": ("vLLM serving", "Serving through vLLM on each table tier"),
    "gpu": ("GPU checks", "The CUDA checks and GPU tests"),
    "train_grad_weight": ("Weight-gradient products", "The weight gradient's matrix product in "
                          "training, old and new operand order"),
}
# CPU model numbers in the records -> the name readers know
CPU_NAMES = {("23", "49"): "AMD EPYC Zen 2", ("25", "17"): "AMD EPYC Zen 4",
             ("26", "2"): "AMD EPYC Zen 5"}
MACHINE_KEYS = ("cpu", "cpu_model", "device")


def results_groups() -> dict[str, list[Path]]:
    """A results page's key -> its files: one page per top folder, "top" for the loose files."""
    groups: dict[str, list[Path]] = {}
    for f in sorted(RESULTS.rglob("*")):
        if f.is_file() and f != RESULTS / "README.md":
            rel = f.relative_to(RESULTS)
            key = rel.parts[0] if len(rel.parts) > 1 else "top"
            groups.setdefault(key, []).append(f)
    return groups


def results_title(key: str, members: list[Path] | None = None) -> tuple[str, str]:
    """(nav title, page title): what was measured and, when ``members`` are given, where."""
    if key in RESULTS_TITLES:
        short, what = RESULTS_TITLES[key]
    else:
        heads = [re.search(r"^# (.+)$", f.read_text(), re.M) for f in (members or [])
                 if f.suffix == ".md"]
        heads = [h.group(1).strip() for h in heads if h]
        short = what = heads[0] if heads else key.replace("_", " ").capitalize()
    if members is None:
        return short, what
    where = machines(key, members)
    return short, f"{what}, on {where}"


def machines(key: str, members: list[Path]) -> str:
    """The machines the records of a page name (CPU models, GPUs), as readers know them."""
    found: list[str] = []
    texts = [_notes(key)]
    for f in members:
        if f.suffix == ".json":
            try:
                texts += [str(v) for v in _values(json.loads(f.read_text()), MACHINE_KEYS)]
            except ValueError:
                pass
        elif f.suffix == ".md":
            texts.append(f.read_text())
    for text in texts:
        for fam, model in re.findall(r"family (\d+),? model (\d+)", text):
            name = CPU_NAMES.get((fam, model), f"CPU family {fam} model {model}")
            if "Intel" in text and (fam, model) not in CPU_NAMES:
                name = f"Intel Xeon (family {fam} model {model})"
            found.append(name)
        found += [f"AMD EPYC Zen {z}" for z in re.findall(r"\bZen (\d)\b", text)]
        found += re.findall(r"NVIDIA [A-Z]\d+", text)
    unique = sorted(set(found))
    if not unique:
        return "the 2-core AMD EPYC development machine"
    zens = [u for u in unique if u.startswith("AMD EPYC Zen")]
    if len(zens) > 1:  # "AMD EPYC Zen 2, Zen 4 and Zen 5"
        rest = [z[len("AMD EPYC "):] for z in zens]
        joined = "AMD EPYC " + ", ".join(rest[:-1]) + " and " + rest[-1]
        unique = [joined] + [u for u in unique if u not in zens]
    return ", ".join(unique)


def _values(data: Any, keys: tuple[str, ...]) -> list[Any]:
    if isinstance(data, dict):
        out = []
        for k, v in data.items():
            out += [v] if k in keys and isinstance(v, str) else _values(v, keys)
        return out
    if isinstance(data, list):
        return [x for v in data for x in _values(v, keys)]
    return []


def _notes(key: str) -> str:
    """benchmarks/results/README.md's bullets about a page's files: those whose first backticked
    name is in the page's folder (a loose file for "top"), verbatim."""
    out: list[str] = []
    bullet = None
    for line in (RESULTS / "README.md").read_text().splitlines() + [""]:
        if bullet is not None and line.startswith("  ") and line.strip():
            bullet.append(line)
            continue
        if bullet is not None:
            out.append("\n".join(bullet))
            bullet = None
        m = re.match(r"- `([^`]+)`", line)
        if m and ("/" not in m.group(1) if key == "top" else m.group(1).startswith(f"{key}/")):
            bullet = [line]
    return "\n".join(out)


def results_pages() -> dict[str, str]:
    groups = results_groups()
    pages: dict[str, str] = {}
    readme = (RESULTS / "README.md").read_text()
    intro = readme.split("\n- ", 1)[0].split("\n", 1)[1].strip()  # before the first bullet
    index = ["# Recorded results", "",
             "Generated at build time from `benchmarks/results/`: one page per folder, each led "
             "by its notes (`benchmarks/results/README.md`), then its reports with their figures "
             "and links to the recorded files. What each finding means, with its command and "
             "verdict: [Reproducing the paper's findings](../guides/reproduce.md).", "",
             intro, "", "| page | measured on |", "|---|---|"]
    for key in sorted(groups):
        short, what = results_title(key)
        index.append(f"| [{what}]({key}.md) | {machines(key, groups[key])} |")
    pages["results/index.md"] = "\n".join(index) + "\n"
    for key, members in groups.items():
        pages[f"results/{key}.md"] = _results_page(key, members)
    return pages


def _results_page(key: str, members: list[Path]) -> str:
    """Notes, then each folder's reports and figures, then links to its files (folder by folder,
    the page's own folder first)."""
    _, title = results_title(key, members)
    out = ["---", "search:", f"  boost: {RESULTS_SEARCH_BOOST}", "---", "", f"# {title}", ""]
    notes = _notes(key)
    if notes:
        out += ["## Notes", "", _include_text(notes, RESULTS, demote=0), ""]
    folders: dict[Path, list[Path]] = {}
    for f in members:
        folders.setdefault(f.parent, []).append(f)
    for folder in sorted(folders, key=lambda d: (d != RESULTS / key, str(d))):
        files = folders[folder]
        rel = folder.relative_to(RESULTS).as_posix()
        heading = "The files" if key == "top" else f"{rel}/"
        out += [f"## {heading}", ""]
        shown: set[Path] = set()
        for f in files:
            if f.suffix == ".md":
                text = _include(f, demote=1)
                shown |= {folder / m for m in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)",
                                                        f.read_text())}
                if len([g for g in files if g.suffix == ".md"]) > 1:
                    out += [f"**{f.name}**", ""]
                out += [text, ""]
        for f in files:
            if f.suffix == ".png" and f not in shown:
                out += [f"![{f.name}]({_link(f)})", ""]
        linked = [f for f in files if f.suffix != ".md"]
        if linked:
            out += ["Recorded files: " + ", ".join(
                f"[`{f.name}`]({_link(f)}) ({_size(f)})" for f in linked) + ".", ""]
    return "\n".join(out)


def _link(f: Path) -> str:
    """A recorded file's link from its results page (files are copied under results/)."""
    return f.relative_to(RESULTS).as_posix()


def _size(f: Path) -> str:
    n = f.stat().st_size
    if n < 1024:
        return f"{n} B"
    return f"{n / 1024:.0f} KiB" if n < 1 << 20 else f"{n / 2**20:.1f} MiB"


def _include(report: Path, demote: int) -> str:
    """A recorded Markdown file inside a page: its title line dropped (the page's heading says it),
    other headings demoted, its relative links rewritten to the page's place."""
    text = report.read_text()
    text = re.sub(r"\A# [^\n]*\n+", "", text)
    return _include_text(text, report.parent, demote)


def _include_text(text: str, base_dir: Path, demote: int) -> str:
    """Recorded Markdown (relative to ``base_dir``) as part of a page under results/: headings
    demoted, links to recorded files pointed at their copies under results/, links to anything
    else kept as text."""
    lines, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        if not fence and line.startswith("#"):
            line = "#" * demote + line
        lines.append(line)
    base = base_dir.relative_to(RESULTS)

    def link(m: re.Match) -> str:
        bang, label, target = m.group(1), m.group(2), m.group(3)
        if re.match(r"[a-z]+://", target):
            return m.group(0)
        rel = (base / target).as_posix()
        if (RESULTS / rel).is_file() and (RESULTS / rel).suffix != ".md":
            return f"{bang}[{label}]({rel})"
        return f"{label} (`{target}`)" if not bang else f"`{target}`"

    return re.sub(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)", link, "\n".join(lines))
