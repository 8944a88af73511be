"""`engram analyze` on two tiny trained runs (Engram and dense): every output is written, the
suppression conditions relate as they must, token kinds and probes come from the corpus."""

import json

import numpy as np
import pytest

from engram.cli import main
from engram.studies.probes import NgramCounts, copy_probes, memorised_probes, token_kinds
from engram.training.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(max_chars=30_000, n_layer=2, d_model=32, n_head=2, seq_len=32, batch_size=4,
            table_size=997, n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,),
            warmup=1, eval_batches=1, log_every=1, eval_every=3, ckpt_every=3)


def test_token_kinds_and_probes_follow_the_counts():
    train = np.array([5, 6, 7, 8] * 30 + [1, 2, 3, 9] * 3 + [1, 2, 4, 9] * 3)
    ng = NgramCounts.build(train, 10)
    assert ng.count(3, np.array([(5 * 10 + 6) * 10 + 7]))[0] == 30
    kinds = token_kinds(np.array([5, 6, 7, 1, 2, 3]), ng, min_count=20, n_function=1)
    # 7 completes the fixed trigram 5 6 7; 3 completes 1 2 3, seen only 3 times: not a phrase
    assert kinds.tolist()[1] == 0 and kinds.tolist()[4] != 0
    val = np.array([0, 0, 5, 6, 7, 8, 0, 1, 2, 3, 9])
    w = memorised_probes(val, ng, context=2, n=4, min_count=20)
    assert w.shape == (1, 6) and w[0, -4:].tolist() == [5, 6, 7, 8]
    c = copy_probes(ng.unigram, span=5, n=3)
    assert c.shape == (3, 10) and (c[:, :5] == c[:, 5:]).all()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("analyze")
    train(TrainConfig(out_dir=str(root / "engram"), steps=3, **TINY), progress=False)
    train(TrainConfig(out_dir=str(root / "dense"), steps=3, **{**TINY, "engram": False}),
          progress=False)
    return root


def test_analyze_end_to_end(runs, tmp_path):
    out = tmp_path / "a"
    assert main(["analyze", str(runs / "engram"), "--baseline", str(runs / "dense"),
                 "--out_dir", str(out), "--batches=4", "--lens_batches=2", "--cka_tokens=256",
                 "--probes=16", "--context=8", "--copy_span=6", "--min_count=3"]) == 0
    res = json.loads((out / "analysis.json").read_text())
    for f in ("lens.png", "cka.png", "retention.png", "gates_examples.png", "gates.html",
              "report.md"):
        assert (out / f).stat().st_size > 100, f
    assert len(res["lens"]["engram"]) == len(res["lens"]["baseline"]) == 3
    assert res["lens"]["engram"][-1] == pytest.approx(0, abs=1e-4)
    assert np.asarray(res["cka"]).shape == (3, 3)
    k = res["kinds"]["all"]
    assert k["all"]["n"] == 4 * 4 * 32 == sum(k[x]["n"] for x in ("phrase", "function", "other"))
    # forcing the gate to 0 is zeroing the output: the same scores
    assert k["all"]["gate0"]["nll"] == pytest.approx(k["all"]["zeroed"]["nll"], abs=1e-5)
    assert res["probes"]["memorised"]["n"] > 0 and res["probes"]["copy"]["n"] == 16
    assert "baseline" in res["probes"]["copy"]
    assert 0 < res["gates"]["en"]["mean_gate"] < 1
    report = (out / "report.md").read_text()
    assert "LogitLens" in report and "verdict" in report and "TriviaQA" in report
    assert main(["analyze", str(runs / "dense")]) == 2  # no Engram: a clear error


def test_help_lists_every_field(capsys):
    import dataclasses

    from engram.studies.analyze import AnalyzeConfig
    from engram.studies.evaluate import EvalConfig
    for command, cls in (("analyze", AnalyzeConfig), ("eval", EvalConfig)):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert all(f"--{f.name}" in text for f in dataclasses.fields(cls)) and "RUN_DIR" in text


SMALL = ["--batches=4", "--lens_batches=2", "--cka_tokens=256", "--probes=16", "--context=8",
         "--copy_span=6", "--min_count=3"]


def test_analyze_several_seeds_combines_them(runs, tmp_path, capsys):
    from engram.studies.analysis_seeds import combine
    from engram.studies.buckets import BUCKETS
    from engram.studies.evidence import paired_interval

    for s in (0, 1):  # pathway: compare's capacity-1 control of each Engram run
        for name, extra in (("engram", {}), ("dense", {"engram": False}),
                            ("pathway", {"engram_lookup": "constant"})):
            if s == 0 and name != "pathway":
                continue  # the module's runs
            train(TrainConfig(out_dir=str(runs / f"{name}{s or ''}"), steps=3, seed=s,
                              **{**TINY, **extra}), progress=False)
    out = tmp_path / "seeds"
    assert main(["analyze", str(runs / "engram"), str(runs / "engram1"), "--baseline",
                 f"{runs / 'dense'},{runs / 'dense1'}", "--pathway",
                 f"{runs / 'pathway'},{runs / 'pathway1'}", f"--out_dir={out}", *SMALL]) == 0
    c = json.loads((out / "analysis.json").read_text())
    assert c["n_seeds"] == 2 and (out / "seeds.png").stat().st_size > 100
    one = [json.loads((out / n / "analysis.json").read_text()) for n in ("engram", "engram1")]
    # where the gain lands: per seed, the buckets share out the held-out tokens; combined, the
    # per-seed differences with their paired interval
    b = c["buckets"]
    assert b["compared"] == ["dense", "pathway"] and list(b["orders"]) == ["2", "3"]
    for r in one:
        assert r["buckets"]["tokens"] == 4 * 4 * 32 and r["buckets"]["training_windows"] == 3 * 4
        for rows in r["buckets"]["orders"].values():
            assert sum(x["share"] for x in rows.values()) == pytest.approx(1.0)
        kinds = r["kinds"]["all"]["all"]  # the buckets' losses are the suppression table's
        assert r["buckets"]["all"]["nll"]["engram"] == pytest.approx(kinds["full"]["nll"])
    for n in ("2", "3"):
        for bucket in BUCKETS:
            v = b["orders"][n][bucket]["vs"]["pathway"]
            per = [r["buckets"]["orders"][n][bucket]["diff"]["pathway"] for r in one]
            assert v["per_seed"] == per
            if None not in per:
                assert v["interval"] == pytest.approx(paired_interval(per))
    report = (out / "report.md").read_text()
    assert "Where the gain lands" in report and "### Engram - pathway" in report
    assert "| 3 | 100+ |" in (out / "engram" / "report.md").read_text()
    # a pathway run of another seed, or one that is not the capacity-1 control: one clear line
    capsys.readouterr()
    for pathway, says in ((f"{runs / 'pathway1'},{runs / 'pathway'}", "differs in seed: 1 vs 0"),
                          (f"{runs / 'engram'},{runs / 'engram1'}",
                           "engram_lookup: 'ngram', not 'constant'")):
        assert main(["analyze", str(runs / "engram"), str(runs / "engram1"), "--baseline",
                     f"{runs / 'dense'},{runs / 'dense1'}", "--pathway", pathway,
                     f"--out_dir={tmp_path / 'bad'}", *SMALL]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and "is not the capacity-1 control" in err and "\n" not in err, err
    # the combined numbers are the per-seed numbers' mean and spread
    row = "held-out phrase (all)"
    per = [r["retention"][row]["zeroed"] for r in one]
    assert c["retention_zeroed"][row]["mean"] == pytest.approx(np.mean(per))
    assert c["retention_zeroed"][row]["sd"] == pytest.approx(np.std(per, ddof=1))
    report = (out / "report.md").read_text()
    assert "across seeds" in report and "engram1" in report
    # a seed twice: no spread, every stat positive or none; a sign flip in one copy: mixed
    same = combine([one[0], one[0]])
    assert all(s["sd"] == 0 for s in same["lens_gap"])
    flipped = json.loads(json.dumps(one[0]))
    flipped["lens"]["engram"], flipped["lens"]["baseline"] = (flipped["lens"]["baseline"],
                                                             flipped["lens"]["engram"])
    verdict = combine([one[0], flipped])["verdicts"][0][2]
    assert verdict.startswith("mixed") or "not resolved" in verdict or "any seed" in verdict
    gaps = [s["per_seed"] for s in combine([one[0], flipped])["lens_gap"]]
    assert all(a == pytest.approx(-b) for a, b in gaps if a)
    # one baseline per run, or none
    assert main(["analyze", str(runs / "engram"), str(runs / "engram1"), "--baseline",
                 str(runs / "dense"), f"--out_dir={tmp_path / 'bad'}", *SMALL]) == 2
