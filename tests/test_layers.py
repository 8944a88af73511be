"""The package's folders are layers: a module may import its own layer or lower ones, never higher,
and no two modules import each other, even through others or inside functions."""

import ast
from pathlib import Path

import pytest

import engram

SRC = Path(engram.__file__).parent
# Lowest first. errors, ranges, schema, files, outputs, interrupts, configfile, options, command,
# machine, jit, gemm_decisions and gemm are the foundation every layer may use; the root re-exports.
LAYERS = ["errors", "ranges", "schema", "files", "outputs", "interrupts", "configfile", "options",
          "command", "machine", "jit", "gemm_decisions", "gemm",
          "retrieval", "tables", "module", "models", "training", "serving", "studies", "cli",
          "__main__", "__init__"]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return LAYERS.index("__init__")
    return LAYERS.index(parts[1])


def imports_of(path: Path) -> set[str]:
    """Every engram module this file imports, at the top or inside functions."""
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "engram"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "engram":
                continue
            # "from . import x" names a submodule when x is one.
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.add(sub if _is_module(sub) else target)
    return found - {own}


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (SRC / rel).with_suffix(".py").exists() or (SRC / rel / "__init__.py").exists()


GRAPH = {module_name(p): imports_of(p) for p in sorted(SRC.rglob("*.py"))}


def test_every_module_is_in_a_layer():
    for mod in GRAPH:
        assert layer_of(mod) >= 0, mod


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_only_downward(module):
    upward = [m for m in GRAPH[module] if layer_of(m) > layer_of(module)]
    assert not upward, f"{module} (layer {LAYERS[layer_of(module)]}) imports higher layers: {upward}"


def test_no_import_cycles():
    # A subpackage's __init__ re-exports its own modules; importing it is importing them.
    def edges(m):
        return {n for n in GRAPH.get(m, ()) if n in GRAPH and not m.startswith(n + ".")}

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in edges(m):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in GRAPH:
        if m not in state:
            visit(m)


def test_the_checker_catches_an_upward_import(tmp_path):
    bad = SRC / "tables" / "_upward_probe.py"
    assert not bad.exists()
    bad.write_text("from ..training.train import TrainConfig\n")
    try:
        found = imports_of(bad)
        assert "engram.training.train" in found
        assert layer_of("engram.training.train") > layer_of(module_name(bad))
    finally:
        bad.unlink()
