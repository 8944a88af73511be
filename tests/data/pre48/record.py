"""Greedy tokens of the fixtures, as the code that wrote them gives them: tokens.json.

Run with that commit's code on the path (README.txt): python record.py FIXTURE_DIR OUT_JSON.
Each folder is read from a copy (opening must not need to write, and a record must not change it).
"""
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

PROMPT = "In the beginning God created"
NEW = 12


def main(fixtures: Path, out: Path) -> None:
    import engram
    from engram.cli import main as cli

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp())
    for name in ("run", "export", "adapter"):
        shutil.copytree(fixtures / name, work / name)
    got: dict = {"prompt": PROMPT, "max_new_tokens": NEW, "engram_generate": {}}
    for name in ("run", "export", "adapter"):
        js = work / f"{name}.json"
        assert cli(["generate", str(work / name), "--prompt", PROMPT, "--max_new_tokens", str(NEW),
                    "--no-stop", "--threads", "1", "--json", str(js)]) == 0
        rec = json.loads(js.read_text())
        got["engram_generate"][name] = {"tokens": rec["tokens"][0],
                                        "text": rec["continuations"][0]}
    rt = engram.open(work / "run")
    got["prompt_ids"] = list(rt.encode(PROMPT))

    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(work / "export").eval()
    ids = torch.tensor([got["prompt_ids"]])
    res = m.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    got["transformers_export"] = {"class": type(m).__name__,
                                  "tokens": res[0, ids.shape[1]:].tolist()}
    hf, hf_tok = engram.load_adapter(work / "adapter")
    aid = hf_tok(PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
    res = hf.generate(aid, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    got["transformers_adapter"] = {"class": type(hf).__name__,
                                   "tokens": res[0, aid.shape[1]:].tolist()}
    out.write_text(json.dumps(got, indent=1) + "\n")
    shutil.rmtree(work)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
