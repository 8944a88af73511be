"""A command's options in a file: ``--config FILE`` reads one, ``--print_config`` writes one.

A config file is a flat mapping of option name to value, the command line's options as a file
(``steps: 300``, ``sources: [kjv, peoples-daily]``), so a run's own ``config.json`` (TrainConfig's
fields, written by `engram train`) is one. ``.json`` files are read as JSON, any other as YAML
(PyYAML's safe loader; JSON is YAML too). ``engram.commandline.options`` maps the keys to the command's
options and types the values; this module only reads and writes the mapping, and says in one line
(UserError) what is wrong with a file: missing, a folder, not text, bad syntax (line and column), or
not a mapping.

The foundation layer: imports nothing else of engram but errors and outputs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from ..errors import UserError
from ..outputs import read_text

FORMATS = ("yaml", "json")  # what --print_config writes


def read(path: str | Path, label: str = "--config") -> dict[str, Any]:
    """The mapping in config file ``path`` (``{}`` for an empty YAML file)."""
    path = Path(path)
    if path.is_dir():
        hint = f" (a run's options: {path / 'config.json'})" if (path / "config.json").is_file() \
            else ""
        raise UserError(f"{label} {path} is a folder; name a YAML or JSON file{hint}")
    text = read_text(path, label)
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{label} {path} is not valid JSON (line {e.lineno}, column "
                            f"{e.colno}: {e.msg})") from None
    else:
        import yaml  # here, not at the top: `engram --help` stays as fast as it is

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise UserError(f"{label} {path} is not valid YAML ({where}{what})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{label} {path} holds a {type(data).__name__}, not a mapping of option "
                        "names to values (e.g. `steps: 300`)")
    return data


def dump(groups: Sequence[tuple[str, dict[str, Any]]], fmt: str, header: str = "") -> str:
    """``[(title, {option: value})]`` as one flat mapping that ``read`` takes back: YAML with
    each group's title and ``header`` as comments, or JSON (which has no comments)."""
    plain = [(title, {k: _plain(v) for k, v in values.items()}) for title, values in groups]
    if fmt == "json":
        return json.dumps({k: v for _, values in plain for k, v in values.items()}, indent=2)
    if fmt != "yaml":
        raise ValueError(f"format is one of {FORMATS}, got {fmt!r}")
    import yaml

    parts = [f"# {header}"] if header else []
    for title, values in plain:
        parts.append(f"# {title}")
        # One key at a time: a list on its line (`sources: [kjv, peoples-daily]`), the mapping in
        # block style (PyYAML writes a mapping of scalars alone as `{a: 1}`).
        parts += [yaml.safe_dump({k: v}, default_flow_style=None if isinstance(v, list) else False,
                                 allow_unicode=True, width=1 << 16).rstrip("\n")
                  for k, v in values.items()]
    return "\n".join(parts)


def _plain(value: Any) -> Any:
    """Tuples as lists: what JSON and YAML's safe dumper write."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


__all__ = ["FORMATS", "dump", "read"]
