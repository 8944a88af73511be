"""`engram ablate`: each variant changes exactly what its name says (parameter counts), and the study
runs end to end in a small mode."""

import json

import pytest

from engram.cli.registry import STUDY_SKIP
from engram.studies.ablate import AblateConfig, ablation_configs, run_ablate
from engram.studies.ablate_report import claims, verdict
from engram.studies.compare import counts
from engram.training.train import TrainConfig

V = 38_304


@pytest.fixture(scope="module")
def c():
    cfgs = ablation_configs(TrainConfig(), V)
    return cfgs, {k: counts(v, V) for k, v in cfgs.items()}


def test_parameter_counts_are_what_the_names_say(c):
    cfgs, n = c
    ref = n["reference"]
    d, dm = 128, 2 * 128  # model width, memory width (2 orders x 128)
    key, norm, conv = dm * d + d, d, d * 4  # key projection (+bias), one RMSNorm, conv weight
    for name in ("layer0", "layer2", "layer3", "no-compress"):
        assert n[name] == ref, name  # same parameters, only placement / hashing differ
    assert [cfgs[f"layer{i}"].engram_layers for i in (0, 2, 3)] == [(0,), (2,), (3,)]
    assert ref["total"] - n["no-conv"]["total"] == conv + norm  # the conv and its input norm
    assert ref["total"] - n["gate1"]["total"] == key + 2 * norm  # key proj + key and hidden norms
    assert n["gate1"]["table"] == ref["table"]
    # One shared key: hc2 minus one key projection and one key norm.
    assert n["hc2"]["total"] - n["hc2-shared-key"]["total"] == key + norm
    # Same table budget, within prime rounding of the row counts.
    for name in ("split12", "orders234"):
        assert abs(n[name]["table"] - ref["table"]) / ref["table"] < 0.01, name
    assert cfgs["split12"].engram_layers == (1, 2) and cfgs["orders234"].max_ngram_size == 4
    # Split over two layers: a second module's projections, norms and conv are extra compute.
    value = dm * d + d
    assert n["split12"]["active"] - ref["active"] == value + key + 2 * norm + conv + norm
    assert not cfgs["no-compress"].compress and cfgs["reference"].compress


def test_verdict_words():
    assert verdict(0.01, 0.02, True).startswith("not resolved")
    assert verdict(0.1, 0.02, True) == "holds"
    assert verdict(-0.1, 0.02, True).startswith("does not hold")
    assert verdict(0.1, None, True).startswith("no seed spread")


def test_controls_are_judged_by_their_own_arms_spreads():
    """A control's verdict uses its two arms' spreads: a noisy variant run beside it (orders234,
    spread 0.2) moves the other claims' verdicts, not the controls'."""
    def v(losses, ref=None):
        return {"val_loss": sum(losses) / 3, "val_loss_per_seed": losses,
                "seed_spread": max(losses) - min(losses), "compared_with": "reference",
                "delta_per_seed": [a - b for a, b in zip(losses, ref)] if ref else [],
                "delta": sum(a - b for a, b in zip(losses, ref)) / 3 if ref else None}

    ref = [5.77, 5.75, 5.79]
    vs = {"reference": v(ref), "pathway": v([5.86, 5.87, 5.88], ref),
          "bigram-hash": v([5.76, 5.75, 5.78], ref), "orders234": v([5.6, 5.8, 5.7], ref)}
    rows = {c.split(" (")[0]: (m, verdict_, i) for c, m, verdict_, i in
            claims({"variants": vs, "max_seed_spread": 0.2})}
    pathway = rows["The memory's rows carry a gain"]
    assert pathway[0].startswith("pathway - reference: +0.1000 nats")
    assert pathway[1] == "holds"  # 0.1 > 2 x 0.04 (its arms' spread), not 2 x 0.2
    bigram = rows["Engram beats one hashed bigram table at the input"]
    assert bigram[1].startswith("not resolved") and "its arms' spread 0.0400" in bigram[1]
    assert rows["{2,3,4}-grams are slightly worse than {2,3} at equal rows"][1].startswith(
        "not resolved")  # judged by the largest spread, as before


@pytest.mark.slow  # ~70 s: spawns workers, trains 10 tiny runs
def test_ablate_end_to_end_small(tmp_path):
    tiny = TrainConfig(max_chars=30_000, n_layer=2, d_model=32, n_head=2, table_size=997,
                       n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,))
    ac = AblateConfig(out_dir=str(tmp_path), steps=2, batch_size=2, seq_len=16, eval_every=2,
                      eval_batches=1, seeds=(0, 1), workers=2,
                      variants=("gate1", "hc2-shared-key", "no-compress"))
    summary = run_ablate(ac, tiny)
    res = json.loads((tmp_path / "ablate.json").read_text())
    assert set(res["variants"]) == {"reference", "gate1", "hc2-shared-key", "hc2", "no-compress"}
    for v in res["variants"].values():
        assert len(v["val_loss_per_seed"]) == 2 and v["val_loss"] > 0
    assert res["variants"]["hc2-shared-key"]["compared_with"] == "hc2"
    assert (tmp_path / "ablate.png").stat().st_size > 1000
    report = (tmp_path / "report.md").read_text()
    assert "context-aware gate" in report and "gate1" in report
    assert "| paired 95% interval |" in report
    assert summary["max_seed_spread"] is not None
    with pytest.raises(ValueError, match="unknown variants"):
        run_ablate(AblateConfig(out_dir=str(tmp_path), variants=("nope",)), tiny)


def test_help_lists_every_field(capsys):
    import dataclasses

    from engram.cli import main
    with pytest.raises(SystemExit):
        main(["ablate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for cls in (AblateConfig, TrainConfig):
        for f in dataclasses.fields(cls):
            if cls is TrainConfig and f.name in STUDY_SKIP:  # not a study's (tiers, its budget's)
                continue
            assert f"--{f.name}" in text
    assert "--engram_fixed_gate" in text and "--compress" in text
