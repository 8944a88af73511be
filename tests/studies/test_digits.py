"""The digit data, styles and judge of the vision study (real scikit-learn digits)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("sklearn")

from engram.studies import digits as D  # noqa: E402


def test_bold_style_adds_ink_and_keeps_the_digit():
    base, _ = D.load_digits()
    x = base.images[:20]
    bold = D.style(x, "bold")
    assert bold.shape == x.shape and bool((bold >= x).all()) and bold.sum() > x.sum()
    assert torch.equal(D.style(x, "bold", 3), F.max_pool2d(x, 3, stride=1, padding=1))
    with pytest.raises(ValueError, match="unknown style"):
        D.style(x, "italic")


def test_judge_reads_real_digits_and_style():
    base, judge_data = D.load_digits()
    assert len(base.labels) + len(judge_data.labels) == 1797
    assert set(base.labels.tolist()) == set(range(10))
    judge = D.Judge(judge_data)
    acc = judge.accuracy(D.Digits(base.images[:300], base.labels[:300]))  # digits it never saw
    assert acc["digit_plain"] > 0.85 and acc["bold_bold"] > 0.9 and acc["bold_plain"] > 0.9
