"""The documentation: guides whose code runs, a site that builds, a declared public API, a short README.

- Every ``bash`` and ``python`` block of every guide (docs/guides/*.md) runs, in page order, in one
  empty folder per guide holding docs/guides/tiny.yaml (the tiny sizes the guides pass with
  ``--config tiny.yaml``). Other fences (``console``, ``text``, ``yaml``) are shown, never run. A
  guide whose first line is ``<!-- docs-test: slow -->`` runs only with ``-m slow``.
- The site builds with ``mkdocs build --strict`` (no broken link, no missing reference), and every
  page of the built site has its title and no image whose file is missing.
- Every name of ``engram.__all__`` has a docstring and a section of the API page.
- The README fits in ~200 lines, and the test command it gives is the one CI runs.
"""

from __future__ import annotations

import html.parser
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

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

@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f",
                        str(ROOT / "mkdocs.yml"), "-d", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-5000:]
    return out


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
    ci_extras = set(re.search(r'pip install -q -e "\.\[([^\]]*)\]"', ci).group(1).split(","))
    for extras in re.findall(r'pip install -e "\.\[([^\]]*)\]"', block):
        assert set(extras.split(",")) <= ci_extras, extras
    for link in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", readme):
        assert (ROOT / link).exists(), f"README links to a missing {link}"
