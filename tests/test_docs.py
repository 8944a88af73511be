"""The documentation: guides whose code runs, a site that builds, a declared public API, a short README.

- Every ``bash`` and ``python`` block of every guide (docs/guides/*.md) runs, in page order, in one
  empty folder per guide holding docs/guides/tiny.yaml (the tiny sizes the guides pass with
  ``--config tiny.yaml``). Other fences (``console``, ``text``, ``yaml``) are shown, never run. A
  guide whose first line is ``<!-- docs-test: slow -->`` runs only with ``-m slow``.
- The site builds with CI's own docs command (``.ci/run``'s ``mkdocs build --strict``: no broken
  link, no missing reference), and that command fails on a warning (one planted in a copy); every
  page of the built site has its title and no image whose file is missing.
- The built site, served over HTTP: every page answers 200, every internal link and anchor
  resolves, nothing loads from another host (Google Fonts); search's index, scored as the theme
  scores it, puts a guide first for what a newcomer types; no JSON file is a search entry. Where
  Chromium is installed, a few pages load in it too (that check alone may skip).
- Every name of ``engram.__all__`` has a docstring and a section of the API page; the guides import
  only those names; docstrings are the renderer's Markdown (no Sphinx roles, no ``Args:``
  sections, no bare ``*`` between characters outside code spans).
- The README fits in ~200 lines, and the test command it gives is the one CI runs; docs/index.md
  takes the README's headline section, whose numbers are recorded under benchmarks/results.
"""

from __future__ import annotations

import ast
import functools
import html.parser
import http.server
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

import pytest

import engram

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GUIDES = sorted((DOCS / "guides").glob("*.md"))
SLOW_MARK = "<!-- docs-test: slow -->"
RUNNABLE = ("bash", "python")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)


def blocks(page: Path) -> list[tuple[str, str]]:
    """(language, code) of every fenced block of a page, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(page.read_text())]


def _guide_param(page: Path):
    slow = page.read_text().startswith(SLOW_MARK)
    return pytest.param(page, id=page.stem, marks=[pytest.mark.slow] if slow else [])


def _env(bin_dir: Path) -> dict[str, str]:
    """This checkout's code first; ``engram`` on PATH runs it with this interpreter."""
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "engram"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m engram "$@"\n')
    shim.chmod(0o755)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env["PATH"]])
    env["PYTHON"] = sys.executable
    return env


@pytest.mark.parametrize("page", [_guide_param(p) for p in GUIDES])
def test_guide_code_runs(page, tmp_path):
    code = [(lang, text) for lang, text in blocks(page) if lang in RUNNABLE]
    assert code, f"{page.name} has no runnable block"
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(DOCS / "guides" / "tiny.yaml", work / "tiny.yaml")
    env = _env(tmp_path / "bin")
    for i, (lang, text) in enumerate(code):
        if lang == "bash":
            cmd = ["bash", "-euo", "pipefail", "-c", text]
        else:
            script = tmp_path / f"block{i}.py"
            script.write_text(text)
            cmd = [sys.executable, str(script)]
        r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, (f"{page.name}, block {i + 1} ({lang}) exited {r.returncode}:\n"
                                   f"{text}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n"
                                   f"{r.stderr[-3000:]}")


def test_fences_are_runnable_or_shown():
    """A guide's block in another language would silently never run: only the known ones."""
    for page in GUIDES:
        for lang, _ in blocks(page):
            assert lang in (*RUNNABLE, "console", "text", "yaml"), f"{page.name}: ```{lang}"


# -- the public API --------------------------------------------------------------------------------

def test_public_names_have_docstrings():
    griffe = pytest.importorskip("griffe")
    sys.path.insert(0, str(DOCS))
    try:
        from hooks import _home
    finally:
        sys.path.remove(str(DOCS))
    loader = griffe.GriffeLoader(search_paths=[str(ROOT / "src")])
    package = loader.load("engram")
    missing = []
    for name in engram.__all__:
        path = _home(engram, name)
        obj = package[path[len("engram."):]]
        if obj.is_alias:
            obj = obj.final_target
        if not (obj.docstring and obj.docstring.value.strip()):
            missing.append(path)
    assert not missing, f"public names without a docstring: {missing}"


# -- the built site --------------------------------------------------------------------------------

def ci_docs_command(site_dir: Path) -> list[str]:
    """.ci/run's docs build, as CI runs it, writing the site to ``site_dir`` (its ``-d`` argument
    replaced; ``python3`` is this interpreter)."""
    ci = (ROOT / ".ci" / "run").read_text()
    (line,) = re.findall(r"^python3 -m mkdocs build .*$", ci, re.M)
    args = shlex.split(line.replace('"$(mktemp -d)/site"', "SITE"))
    assert "-q" not in args and "--quiet" not in args, (
        "-q silences the warnings --strict counts: the build could not fail")
    assert "--strict" in args, line
    return [sys.executable, *args[1:args.index("-d")], "-d", str(site_dir),
            *args[args.index("-d") + 2:]]


def _build(root: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(ci_docs_command(out), cwd=root, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    r = _build(ROOT, out)
    assert r.returncode == 0, r.stderr[-5000:]
    return out


def test_ci_docs_build_fails_on_a_warning(site, tmp_path):
    """The command CI runs fails on a warning: here a nav entry to a missing page, planted in a
    copy of mkdocs.yml and docs/ (the code and the records are linked in, as the hook reads them).
    The unplanted build of the same command is the ``site`` fixture, which passed."""
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(ROOT / "README.md", copy / "README.md")
    for linked in ("src", "benchmarks"):
        (copy / linked).symlink_to(ROOT / linked)
    config = (ROOT / "mkdocs.yml").read_text()
    planted = config.replace("\nnav:\n", "\nnav:\n  - Planted: no-such-page.md\n", 1)
    assert planted != config
    (copy / "mkdocs.yml").write_text(planted)
    r = _build(copy, tmp_path / "site")
    assert r.returncode != 0, "a broken nav entry did not fail CI's docs build"
    assert "no-such-page.md" in r.stderr, r.stderr[-3000:]


class _Page(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.title, self.images, self.ids, self._in_title = "", [], set(), False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "title":
            self._in_title = True
        if tag == "img" and a.get("src"):
            self.images.append(a["src"])
        if a.get("id"):
            self.ids.add(a["id"])

    def handle_endtag(self, tag):
        if tag == "title":
            self._in_title = False

    def handle_data(self, data):
        if self._in_title:
            self.title += data


def _parse(page: Path) -> _Page:
    p = _Page()
    p.feed(page.read_text())
    return p


def test_every_page_has_its_title_and_its_images(site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 20
    images = 0
    for page in pages:
        if page.name == "404.html":
            continue
        p = _parse(page)
        assert p.title.strip() and p.title.strip() != "engram" or page == site / "index.html", (
            f"{page.relative_to(site)}: no page title ({p.title!r})")
        for src in p.images:
            url = urlparse(src)
            if url.scheme or src.startswith("data:"):
                continue
            target = (page.parent / unquote(url.path)).resolve()
            assert target.is_file(), f"{page.relative_to(site)}: broken image {src}"
            images += 1
    recorded = list((ROOT / "benchmarks" / "results").rglob("*.png"))
    assert images >= len(recorded), "every recorded figure appears on a page"


def test_site_shows_guides_api_cli_and_results(site):
    for guide in GUIDES:
        assert (site / "guides" / guide.stem / "index.html").is_file(), guide.name
    api = _parse(site / "reference" / "api" / "index.html")
    sys.path.insert(0, str(DOCS))
    try:
        from hooks import _home
    finally:
        sys.path.remove(str(DOCS))
    lost = [n for n in engram.__all__ if _home(engram, n) not in api.ids]
    assert not lost, f"public names without a section on the API page: {lost}"
    from engram.cli import COMMANDS

    cli = (site / "reference" / "cli" / "index.html").read_text()
    for name, cmd in COMMANDS.items():
        assert f"engram {name}" in cli
        for a in cmd.parser()._actions:
            if a.option_strings and a.help != "==SUPPRESS==":
                assert a.option_strings[0] in cli, (name, a.option_strings[0])


# -- the site as a reader gets it ------------------------------------------------------------------

class _Links(html.parser.HTMLParser):
    """Every URL a page loads or links to, and its element ids (anchors)."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("href", "src"):
            if a.get(key) and not (tag == "a" and key == "src"):
                self.urls.append(a[key])
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])


@pytest.fixture(scope="module")
def served(site):
    """The built site over HTTP on 127.0.0.1 (as ``mkdocs serve`` or any static server gives it)."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def test_every_page_serves_and_every_link_and_anchor_resolves(site, served):
    pages = [p.relative_to(site).as_posix() for p in sorted(site.rglob("*.html"))]
    pages = [p for p in pages if p != "404.html" and not _recorded_file(p)]
    status: dict[str, int] = {}
    ids: dict[str, set[str]] = {}
    broken, foreign = [], []

    def fetch(url: str) -> int:
        if url not in status:
            code, body = _get(url)
            status[url] = code
            if code == 200 and (url.endswith("/") or url.endswith(".html")):
                parser = _Links()
                parser.feed(body.decode("utf-8", "replace"))
                ids[url] = parser.ids
        return status[url]

    for page in pages:
        url = served + (page[:-len("index.html")] if page.endswith("index.html") else page)
        assert fetch(url) == 200, f"{url}: {status[url]}"
        parser = _Links()
        parser.feed(_get(url)[1].decode("utf-8", "replace"))
        for link in parser.urls:
            target = urljoin(url, link)
            parsed = urlparse(target)
            if parsed.scheme in ("mailto", "data", "javascript"):
                continue
            if parsed.netloc != urlparse(served).netloc:
                if parsed.scheme in ("http", "https") and not link.startswith(("http:", "https:")):
                    foreign.append((page, link))  # protocol-relative: loads from elsewhere
                elif any(h in parsed.netloc for h in ("fonts.googleapis", "fonts.gstatic")):
                    foreign.append((page, link))
                continue
            base = target.split("#", 1)[0]
            if fetch(base) != 200:
                broken.append((page, link, status[base]))
            elif parsed.fragment and base in ids and unquote(parsed.fragment) not in ids[base]:
                broken.append((page, link, "no such anchor"))
    assert not broken, f"{len(broken)} broken links, e.g. {broken[:10]}"
    assert not foreign, f"pages load from other hosts (offline they fail): {foreign[:5]}"
    assert fetch(served) == 200 and fetch(served + "search/search_index.json") == 200


def _recorded_file(page: str) -> bool:
    """A recorded HTML file under results/ (a gate heatmap), copied as it is, not a site page."""
    return page.startswith("results/") and not page.endswith("/index.html") and \
        page != "results/index.html"


# Material's search (lunr with its own tokenizer, ``b(0)``, a trailing wildcard on every query term,
# then its boost of whole pages and of queries whose every term matched), for the ranking check.

def search(index: dict, query: str) -> list[tuple[float, str]]:
    """(score, location) of every entry ``query`` finds, best first, as the theme's search worker
    ranks them (material/.../integrations/search/_/index.ts over lunr 2.3.9)."""
    sep = re.compile(index["config"]["separator"])
    fields = index["config"].get("fields") or {"title": {"boost": 1e3}, "text": {"boost": 1.0},
                                               "tags": {"boost": 1e6}}
    boosts = {k: v["boost"] for k, v in fields.items()}
    docs = index["docs"]
    tf: dict[tuple[str, str], dict[str, int]] = {}
    postings: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    for d in docs:
        for field in boosts:
            value = d.get(field)
            if value is None:
                continue
            value = " ".join(value) if isinstance(value, list) else value
            counts: dict[str, int] = defaultdict(int)
            for block in re.split(r"<[^>]*>", value):  # markup splits tokens, as its tokenizer
                for token in filter(None, sep.split(block)):
                    counts[token.lower()] += 1
                    postings[token.lower()][field].add(d["location"])
            tf[field, d["location"]] = counts
    n = len(docs)
    clauses = [t.lower() for part in query.split() for t in sep.split(part) if t]
    qvec: dict[str, float] = defaultdict(float)
    for c in clauses:
        for term in postings:
            if term.startswith(c):
                qvec[term] += 1
    norm = math.sqrt(sum(v * v for v in qvec.values())) or 1.0
    df = {t: sum(map(len, postings[t].values())) for t in qvec}  # per field, as lunr.idf counts
    idf = {t: math.log(1 + abs((n - df[t] + 0.5) / (df[t] + 0.5))) for t in qvec}
    first: dict[str, str] = {}
    for d in docs:
        first.setdefault(d["location"].split("#")[0], d["location"])
    out = []
    for d in docs:
        loc, score, matched = d["location"], 0.0, set()
        for field, boost in boosts.items():
            counts = tf.get((field, loc), {})
            dot = 0.0
            for t, q in qvec.items():
                if counts.get(t):
                    w = idf[t] * 2.2 * counts[t] / (1.2 + counts[t]) * boost * (d.get("boost") or 1)
                    dot += q * round(w * 1000) / 1000
                    matched.add(t)
            score += dot / norm
        if matched:
            found = sum(any(t.startswith(c) for t in matched) for c in clauses) / len(clauses)
            extra = (first[loc.split("#")[0]] == loc) + found
            out.append((score * (1 + extra ** 2), loc))
    return sorted(out, key=lambda r: -r[0])


def test_search_puts_a_guide_first(site):
    index = json.loads((site / "search" / "search_index.json").read_text())
    for query in ("finetune", "tier", "export-hf"):
        hits = search(index, query)
        assert hits and hits[0][1].startswith("guides/"), (query, hits[:5])
    # recorded JSON is linked from the results pages, never an entry (or a page) of its own
    assert not [d["location"] for d in index["docs"]
                if ".json" in d["location"] or d["title"].endswith(".json")]


def test_results_pages_say_what_and_where(site):
    """Each results page is titled with what was measured and the machine (not a folder path), and
    sits in the nav by itself (the hook: a new folder needs no mkdocs.yml entry)."""
    folders = {p.name for p in (ROOT / "benchmarks" / "results").iterdir() if p.is_dir()}
    nav = (site / "index.html").read_text()
    for key in sorted(folders) + ["top"]:
        page = site / "results" / key / "index.html"
        h1 = html.unescape(re.sub(r"<[^>]+>", "", re.search(r"<h1[^>]*>(.*?)</h1>",
                                                            page.read_text(), re.S).group(1)))
        assert ", on " in h1 and "benchmarks/results" not in h1, (key, h1)
        assert f'href="results/{key}/"' in nav, f"results/{key} is not in the nav"


def test_pages_load_in_chromium(site, served):
    """Optional beside the checks above: a few pages in headless Chromium, where it is installed
    (``apt-get install chromium``): each renders its article."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    for page in ("", "guides/quickstart/", "reference/api/", "results/", "results/compare/"):
        r = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                            "--dump-dom", served + page], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and "<article" in r.stdout, (page, r.stderr[-2000:])


# -- docstrings are what the renderer reads -------------------------------------------------------

ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|mod|obj|data|exc|ref|const|term):`")
SECTION = re.compile(r"^\s*(?:Args|Arguments|Parameters|Keyword Args|Returns|Raises|Yields):\s*$",
                     re.M)
CODE_SPAN = re.compile(r"``.*?``|`[^`\n]*`", re.S)
BARE_STAR = re.compile(r"(?<=[\w)\]])\*(?=[\w(\[])")  # a*b: Markdown's emphasis, not a product


def _docstrings(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                yield body[0].value.lineno, body[0].value.value


def test_docstrings_are_the_sites_markdown():
    """mkdocs.yml renders docstrings as Markdown prose (``docstring_style: null``): a Sphinx role
    would show as typed, a Google ``Args:`` list as one run-on block, and
    ``alpha*v + conv(alpha*v)`` in italics. Code and formulas go in code spans; parameters as
    ``name``: meaning."""
    bad = []
    for f in sorted((ROOT / "src").rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        for line, doc in _docstrings(f):
            def at(offset: int) -> str:
                return f"{rel}:{line + doc[:offset].count(chr(10))}"
            bad += [f"{at(m.start())}: Sphinx role" for m in ROLE.finditer(doc)]
            bad += [f"{at(m.start())}: {m.group(0).strip()} section" for m in SECTION.finditer(doc)]
            plain = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), doc)
            bad += [f"{at(m.start())}: bare * (use a code span)" for m in BARE_STAR.finditer(plain)]
    assert not bad, f"{len(bad)} docstring spots the site renders wrongly:\n" + "\n".join(bad)


def test_guides_import_only_public_names():
    """The guides are what users copy: they use ``engram.__all__`` only (the API page's policy)."""
    public = set(engram.__all__) | {"__version__"}
    bad = []
    for page in GUIDES:
        for lang, code in blocks(page):
            if lang != "python":
                continue
            for node in ast.walk(ast.parse(code)):
                if isinstance(node, ast.Import):
                    bad += [f"{page.name}: import {a.name}" for a in node.names
                            if a.name.startswith("engram.")]
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engram"):
                    if node.module != "engram":
                        bad.append(f"{page.name}: from {node.module} import ...")
                    else:
                        bad += [f"{page.name}: from engram import {a.name}" for a in node.names
                                if a.name not in public]
                elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                        and node.value.id == "engram" and node.attr not in public:
                    bad.append(f"{page.name}: engram.{node.attr}")
    assert not bad, bad


# -- the README ------------------------------------------------------------------------------------

def test_readme_is_short_and_its_test_command_is_what_ci_runs():
    """The README's test command (its "Run the tests" block) is what .ci/run runs: the same pytest
    line, with the extras it installs among CI's."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 210
    section = readme.split("## Run the tests", 1)[1].split("\n## ", 1)[0]
    (block,) = [code for lang, code in FENCE.findall(section) if lang == "bash"]
    ci = (ROOT / ".ci" / "run").read_text()
    steps = [s.strip() for s in block.strip().split("&&")]
    pytest_steps = [s for s in steps if s.startswith("python -m pytest")]
    assert pytest_steps, block
    for step in pytest_steps:
        assert re.search(rf"^python3? {re.escape(step[len('python '):])}$", ci, re.M), step
    # A file the main run leaves out (to keep CI in its budget) runs in the newcomer leg instead.
    for left_out in re.findall(r"--ignore=(\S+?)\"?$", ci, re.M):
        leg = ci.split("newcomer_leg() {", 1)[1].split("\n}", 1)[0]
        assert re.search(rf"python -m pytest .*{re.escape(left_out)}", leg), left_out
    ci_extras = set(re.search(r'pip install -q -e "\.\[([^\]]*)\]"', ci).group(1).split(","))
    for extras in re.findall(r'pip install -e "\.\[([^\]]*)\]"', block):
        assert set(extras.split(",")) <= ci_extras, extras
    for link in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", readme):
        assert (ROOT / link).exists(), f"README links to a missing {link}"


def test_index_takes_its_headline_from_the_readme(site):
    """One headline: docs/index.md includes the README's "## Headline results" section (the hook's
    ``{{ readme: ... }}``), and every number of that section is a value recorded under
    benchmarks/results (losses and ratios to 3-4 decimals; parameter counts in millions)."""
    assert "{{ readme: Headline results }}" in (DOCS / "index.md").read_text()
    sys.path.insert(0, str(DOCS))
    try:
        from hooks import readme_section
    finally:
        sys.path.remove(str(DOCS))
    section = readme_section("Headline results")
    index = (site / "index.html").read_text()
    text = html.unescape(re.sub(r"<[^>]+>", "", index))
    for row in re.findall(r"^\| ([^|]+) \| ([^|]+) \|", section, re.M)[2:]:  # its table's rows
        assert row[1].strip() in text, f"index.html lacks the README's {row}"
    recorded: set[str] = set()

    def walk(v):
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            for x in (v, abs(v), v / 1e6):
                recorded.update(f"{x:.{d}f}" for d in (3, 4))

    for f in (ROOT / "benchmarks" / "results").rglob("*.json"):
        try:
            walk(json.loads(f.read_text()))
        except ValueError:
            pass
    numbers = re.findall(r"(?<![\d.])(\d+\.\d{3,4})(?![\d.])", section)
    assert numbers, "the headline gives no numbers"
    unrecorded = [x for x in numbers if x not in recorded]
    assert not unrecorded, f"README headline numbers not in any recorded JSON: {unrecorded}"
