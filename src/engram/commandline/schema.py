"""A config dataclass's fields, read from its source file without importing its module.

`engram --help` must not import torch, yet most configs live beside the torch code they configure
(``TrainConfig`` in training/train.py). So the command line names a config by ``"module:Class"`` and
reads it from the source: each field's name, annotation (as text), default, the comment beside or
above it (the --help text), and its valid values from ``field(metadata={"choices": ...})``. A
default is a literal expression, evaluated here; a name in it is followed to the module-level
constant it names, across ``from .x import NAME`` (``tiers: tuple[str, ...] = TIERS``). What cannot
be evaluated (a call into torch) is shown as its source text. The module is imported only when the
command runs (``resolve``), and the dataclass then applies its own defaults; tests/test_cli.py
checks, for every command's configs, that what the source says equals the imported class.

Choices are a tuple, a dict (its keys), or a ``"module:NAME"`` string naming such a constant (for a
config that may not import the module that owns the list, e.g. one in the command line).

The foundation layer: imports nothing else of engram, so every layer may use it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import operator
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

MISSING = dataclasses.MISSING  # a field without a default: the option is required


@dataclass(frozen=True)
class Field:
    """One config field as the command line sees it."""
    name: str
    type: str  # the annotation's source text, e.g. "tuple[int, ...]" or "str | None"
    default: Any  # the evaluated default; MISSING when required; Source when not evaluable
    comment: str  # the comment beside the field, else the comment lines right above it
    choices: tuple | None = None  # valid values (of each element, for tuples and lists)

    @property
    def required(self) -> bool:
        return self.default is MISSING


@dataclass(frozen=True)
class Source:
    """A default that is not a literal: shown as the expression that computes it."""
    text: str

    def __str__(self) -> str:
        return self.text


class _Unknown(Exception):
    """An expression this reader does not evaluate."""


def split_ref(config: type | str) -> tuple[str, str]:
    """``"pkg.mod:Class"`` or a class -> (module name, class name)."""
    if isinstance(config, str):
        module, sep, name = config.partition(":")
        if not sep or not name:
            raise ValueError(f"a config reference is 'module:Class', got {config!r}")
        return module, name
    return config.__module__, config.__qualname__


def resolve(config: type | str) -> Any:
    """The class (or constant) itself: imports its module. For running a command, not for --help."""
    if not isinstance(config, str):
        return config
    module, name = split_ref(config)
    return getattr(importlib.import_module(module), name)


def fields_of(config: type | str) -> tuple[Field, ...]:
    """The init fields of a dataclass, in the order the dataclass has them, from its source."""
    module, name = split_ref(config)
    return _Module.named(module).fields(name)


def constant(ref: str) -> Any:
    """The value of a module-level constant, ``"module:NAME"``, from the source."""
    module, name = split_ref(ref)
    try:
        return _Module.named(module).value(name)
    except _Unknown as e:
        raise ValueError(f"{ref} is not a constant this reader evaluates ({e})") from None


# -- reading a module ------------------------------------------------------------------------------

_CALLS = {"tuple": tuple, "list": list, "sorted": sorted, "set": set, "frozenset": frozenset,
          "dict": dict, "int": int, "float": float, "str": str, "len": len, "min": min, "max": max}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow, ast.LShift: operator.lshift, ast.RShift: operator.rshift,
           ast.BitOr: operator.or_, ast.BitAnd: operator.and_}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_,
          ast.Invert: operator.invert}


class _Module:
    """One module's source: its top-level names, classes and ``from`` imports."""

    def __init__(self, name: str, path: str):
        self.name = name
        with open(path, encoding="utf-8") as f:
            self.source = f.read()
        self.lines = self.source.splitlines()
        self.package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        self.bindings: dict[str, Any] = {}  # name -> value expression, ClassDef or (module, name)
        for node in ast.parse(self.source).body:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.bindings[target.id] = node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None \
                    and isinstance(node.target, ast.Name):
                self.bindings[node.target.id] = node.value
            elif isinstance(node, ast.ClassDef):
                self.bindings[node.name] = node
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(node)
                for a in node.names:
                    self.bindings[a.asname or a.name] = (base, a.name)
        self._values: dict[str, Any] = {}

    @staticmethod
    @lru_cache(maxsize=None)
    def named(name: str) -> "_Module":
        loaded = sys.modules.get(name)
        path = getattr(loaded, "__file__", None)
        if path is None:  # a module of a loaded top package: its file, without importing parents
            top = sys.modules.get(name.split(".")[0])  # (engram.module's __init__ imports torch)
            for root in getattr(top, "__path__", []) if "." in name else []:
                rel = Path(root, *name.split(".")[1:])
                found = [f for f in (rel.with_suffix(".py"), rel / "__init__.py") if f.is_file()]
                if found:
                    path = str(found[0])
                    break
        if path is None:
            spec = importlib.util.find_spec(name)  # imports the parent packages, not the module
            if spec is None or not spec.origin or not spec.origin.endswith(".py"):
                raise ValueError(f"no Python source for module {name!r}")
            path = spec.origin
        return _Module(name, path)

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = self.package.split(".")
        parts = parts[:len(parts) - node.level + 1]
        return ".".join(parts + ([node.module] if node.module else []))

    # -- values ------------------------------------------------------------------------------------
    def value(self, name: str) -> Any:
        if name in self._values:
            return self._values[name]
        bound = self.bindings.get(name)
        if bound is None:
            raise _Unknown(f"{self.name} has no top-level {name}")
        if isinstance(bound, tuple):
            module, attr = bound
            result = _Module.named(module).value(attr)
        elif isinstance(bound, ast.ClassDef):
            raise _Unknown(f"{name} is a class")
        else:
            result = self.evaluate(bound)
        self._values[name] = result
        return result

    def evaluate(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = [self.evaluate(e) for e in node.elts]
            return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](items)
        if isinstance(node, ast.Dict):  # keys must evaluate; values may be anything (torch dtypes)
            out = {}
            for k, v in zip(node.keys, node.values):
                if k is None:
                    raise _Unknown("dict unpacking")
                try:
                    out[self.evaluate(k)] = self.evaluate(v)
                except _Unknown:
                    out[self.evaluate(k)] = Source(ast.unparse(v))
            return out
        if isinstance(node, ast.Name):
            return self.value(node.id)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self.evaluate(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](self.evaluate(node.left), self.evaluate(node.right))
        if isinstance(node, ast.Subscript):
            return self.evaluate(node.value)[self.evaluate(node.slice)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords \
                and node.func.id in _CALLS and node.func.id not in self.bindings:
            return _CALLS[node.func.id](*(self.evaluate(a) for a in node.args))
        raise _Unknown(ast.unparse(node))

    # -- dataclass fields --------------------------------------------------------------------------
    @lru_cache(maxsize=None)
    def fields(self, name: str) -> tuple[Field, ...]:
        bound = self.bindings.get(name)
        if isinstance(bound, tuple):
            return _Module.named(bound[0]).fields(bound[1])
        if not isinstance(bound, ast.ClassDef):
            raise ValueError(f"{self.name} defines no class {name!r}")
        out: dict[str, Field] = {}
        for base in bound.bases:  # a dataclass's inherited fields come first, in the base's order
            if isinstance(base, ast.Name) and base.id in self.bindings:
                try:
                    for f in self.fields(base.id):
                        out[f.name] = f
                except ValueError:  # not a class of this reader's (Generic, Protocol, ...)
                    pass
        for node in bound.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            annotation = ast.get_source_segment(self.source, node.annotation) or \
                ast.unparse(node.annotation)
            if annotation.split("[")[0].split(".")[-1] in ("ClassVar", "InitVar"):
                continue
            default, choices, init = self._default(node.value)
            if not init:
                out.pop(node.target.id, None)
                continue
            comment = self._comment(node)
            old = out.get(node.target.id)
            if old is not None and not comment:  # an override without a comment keeps the base's
                comment = old.comment
            if old is not None and choices is None:
                choices = old.choices
            out[node.target.id] = Field(node.target.id, annotation, default, comment, choices)
        return tuple(out.values())

    def _default(self, node: ast.AST | None) -> tuple[Any, tuple | None, bool]:
        """(default, choices, init) of a field's right-hand side."""
        if node is None:
            return MISSING, None, True
        if not (isinstance(node, ast.Call) and ast.unparse(node.func) in
                ("field", "dataclasses.field")):
            return self._shown(node), None, True
        kw = {k.arg: k.value for k in node.keywords}
        init = not (isinstance(kw.get("init"), ast.Constant) and kw["init"].value is False)
        default: Any = MISSING
        if "default" in kw:
            default = self._shown(kw["default"])
        elif "default_factory" in kw:
            factory = kw["default_factory"]
            if isinstance(factory, ast.Lambda):
                default = self._shown(factory.body)
            elif isinstance(factory, ast.Name) and factory.id in _CALLS:
                default = _CALLS[factory.id]()
            else:
                default = Source(f"{ast.unparse(factory)}()")
        choices = None
        if "metadata" in kw:
            try:
                meta = self.evaluate(kw["metadata"])
            except _Unknown as e:
                raise ValueError(f"{self.name}: field metadata must be a literal dict "
                                 f"({e})") from None
            if "choices" in meta:
                choices = meta["choices"]
                if isinstance(choices, str):
                    choices = constant(choices)
                choices = tuple(choices)
        return default, choices, init

    def _shown(self, node: ast.AST) -> Any:
        try:
            return self.evaluate(node)
        except (_Unknown, LookupError, TypeError, ValueError, ArithmeticError):
            return Source(ast.unparse(node))

    def _comment(self, node: ast.AnnAssign) -> str:
        """The comment on the field's line, else the comment lines right above it (not counting a
        "-- section --" rule)."""
        comment = _trailing_comment(self.lines[node.lineno - 1])
        if comment:
            return comment
        above, i = [], node.lineno - 2
        while i >= 0 and self.lines[i].strip().startswith("#"):
            text = self.lines[i].strip().lstrip("#").strip()
            if text.startswith("--"):
                break
            above.insert(0, text)
            i -= 1
        return " ".join(above)


def _trailing_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[i + 1:].strip()
    return ""


__all__ = ["MISSING", "Field", "Source", "constant", "fields_of", "resolve", "split_ref"]
