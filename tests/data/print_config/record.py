"""Writes configs.json: every command's resolved options (`engram NAME --print_config=json`, with
only what it requires), as tests/test_configfile.py's test_resolved_defaults_keep_their_meaning
compares them. Rerun it only for an intended change of a default or an option (a new option, a
new command), and say so in the commit: a recorded run's config.json means what these say.

    python tests/data/print_config/record.py
"""

import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from test_configfile import POSITIONALS, REQUIRED  # noqa: E402

from engram.cli import COMMANDS, main  # noqa: E402


def resolved() -> dict:
    out = {}
    for name in sorted(n for n, c in COMMANDS.items() if c.configs):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main([name, *POSITIONALS.get(name, []), *REQUIRED.get(name, []),
                       "--print_config=json"])
        if rc != 0:
            raise SystemExit(f"engram {name} --print_config failed ({rc})")
        out[name] = json.loads(buf.getvalue())
    return out


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:  # printing does no work; relative defaults stay so
        os.chdir(tmp)
        data = resolved()
    (HERE / "configs.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {HERE / 'configs.json'}: {len(data)} commands")
