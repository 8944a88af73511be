"""Config fields read from the source: names, types, defaults (literal, followed across modules, or
shown as source), comments and choices, without importing the config's module."""

import dataclasses
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import engram
from engram.commandline.schema import MISSING, Source, constant, fields_of, resolve

LETTERS = ("a", "b")


@dataclass
class Sample:
    need: int  # no default: required
    # Picks one letter.
    letter: str = field(default="a", metadata={"choices": LETTERS})
    many: tuple[str, ...] = tuple(LETTERS) + ("c",)  # a computed default
    made: list[int] = field(default_factory=lambda: [1, 2])
    size: int = 4 << 10
    opaque: float = math.pi  # not a literal: shown as its source
    hidden: int = field(default=0, init=False)


@dataclass
class Child(Sample):
    size: int = 8  # an override keeps the field's place
    extra: bool = False


def test_fields_defaults_comments_and_choices():
    f = {x.name: x for x in fields_of(Sample)}
    assert list(f) == ["need", "letter", "many", "made", "size", "opaque"]  # init=False left out
    assert f["need"].required and f["need"].default is MISSING
    assert f["need"].comment == "no default: required"
    assert f["letter"].choices == ("a", "b") and f["letter"].comment == "Picks one letter."
    assert f["many"].default == ("a", "b", "c") and f["made"].default == [1, 2]
    assert f["size"].default == 4096 and f["size"].type == "int"
    assert f["opaque"].default == Source("math.pi")
    c = {x.name: x for x in fields_of(Child)}
    assert list(c) == ["need", "letter", "many", "made", "size", "opaque", "extra"]
    assert c["size"].default == 8 and c["size"].comment == "an override keeps the field's place"
    assert c["letter"].choices == ("a", "b")  # inherited


def test_the_source_agrees_with_the_class():
    for cls in (Sample, Child):
        real = [f for f in dataclasses.fields(cls) if f.init]
        assert [f.name for f in real] == [f.name for f in fields_of(cls)]


def test_names_are_followed_across_modules_without_importing_them():
    code = ("import sys; from engram.commandline.schema import fields_of, constant;"
            "f = {x.name: x for x in fields_of('engram.studies.pool_budget:PoolBudgetConfig')};"
            "assert f['tiers'].default == constant('engram.studies.pool_budget:DEFAULT_TIERS');"
            "assert constant('engram.tables.tablefile:DTYPES')['fp32'].text.startswith('(torch');"
            "assert 'torch' not in sys.modules and 'engram.studies.pool_budget' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, "PYTHONPATH": str(Path(engram.__file__).parents[1])})
    assert constant("engram.artifacts.export:TIERS") == resolve("engram.artifacts.export:TIERS")


def test_bad_references_are_clear():
    with pytest.raises(ValueError, match="module:Class"):
        fields_of("engram.training.train")
    with pytest.raises(ValueError, match="no class 'Nope'"):
        fields_of("engram.training.train:Nope")
