"""The package's folders are layers: a module may import its own layer or lower ones, never higher,
and no two modules import each other, even through others or inside functions."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import engram

SRC = Path(engram.__file__).parent
# Lowest first. The root's modules (errors, ranges, files, outputs, interrupts), commandline/ (the
# command-line machinery) and compute/ (GEMM routes, machine identity, jit) are the foundation every
# layer may use; the root's __init__ re-exports.
LAYERS = ["errors", "ranges", "files", "outputs", "interrupts", "commandline", "compute",
          "retrieval", "tables", "module", "models", "artifacts", "training", "serving", "studies",
          "cli", "__main__", "__init__"]
ROOT_MODULES_AT_MOST = 8  # issue 48: the root holds only foundations (__init__, __main__ counted)


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


def test_the_root_holds_only_foundations():
    root = sorted(p.name for p in SRC.glob("*.py"))
    assert len(root) <= ROOT_MODULES_AT_MOST, root


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


def test_serving_never_imports_training():
    """Issue 48: what a folder holds is read in artifacts/, below both; serving opens a run
    without the training code (inside functions too)."""
    found = {m: sorted(n for n in GRAPH[m] if n.startswith("engram.training"))
             for m in GRAPH if m.startswith("engram.serving")}
    assert not {m: ns for m, ns in found.items() if ns}


def test_opening_a_run_and_generating_loads_no_training_module(tmp_path):
    """The same at run time, in a fresh process: an import moved into a function or made through
    importlib is still an import."""
    from engram.training.train import TrainConfig, train

    run = tmp_path / "run"
    train(TrainConfig(out_dir=str(run), steps=1, max_chars=20_000, n_layer=2, d_model=32,
                      n_head=2, seq_len=32, batch_size=4, table_size=997, n_embed_per_ngram=32,
                      n_head_per_ngram=2, engram_layers=(0,), warmup=1, eval_batches=1,
                      log_every=1, eval_every=1, ckpt_every=1), progress=False)
    code = (f"import sys, engram; rt = engram.open({str(run)!r}); "
            "engram.Generator(rt, config=engram.GenerationConfig(max_new_tokens=2))"
            ".generate([rt.encode('hello')]); "
            "print(sorted(m for m in sys.modules if m.startswith('engram.training')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


# The names of the files and folders of the folders artifacts/ owns (run, checkpoints, adapter):
# a module elsewhere names them through artifacts' constants, never spelled out (issue 48).
FOLDER_NAMES = ('"checkpoints"', '"latest.json"', '"model.json"', '"maps.safetensors"',
                '"engram.safetensors"', '"engram_config.json"', '"finetune.json"',
                '"settings.json"')


def test_folder_file_names_are_spelled_only_in_artifacts():
    found = [f"{p.relative_to(SRC)}: {name}" for p in sorted(SRC.rglob("*.py"))
             if p.relative_to(SRC).parts[0] != "artifacts"
             for name in FOLDER_NAMES if name in p.read_text()]
    assert not found, found


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
