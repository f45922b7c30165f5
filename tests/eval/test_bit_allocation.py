"""eval.bit_allocation: the paired comparisons between two caches' perplexity changes."""

import math

import numpy as np
import pytest

from eval import bit_allocation as ba
from eval.perplexity import paired_change_se


def test_compare_ratio_and_difference_with_delta_method_errors():
    rng = np.random.default_rng(0)
    fp = rng.normal(-3.0, 0.1, (8, 50))
    a = fp - 0.01 - rng.normal(0, 0.002, (8, 1))  # ~1% worse per window
    b = fp - 0.04 - rng.normal(0, 0.004, (8, 1))  # ~4% worse
    c = ba.compare(a, b, fp)
    da, db = (-x.mean(1) + fp.mean(1) for x in (a, b))
    assert c["ratio"] == pytest.approx(math.expm1(da.mean()) / math.expm1(db.mean()))
    assert c["diff_points"] == pytest.approx(100 * (math.expm1(da.mean()) - math.expm1(db.mean())))
    assert 0 < c["ratio_se"] < 0.1 and 0 < c["diff_points_se"] < 0.5
    # the difference of a change with itself is exactly zero, with zero error
    same = ba.compare(a, a, fp)
    assert same["ratio"] == pytest.approx(1.0) and same["diff_points_se"] == pytest.approx(0.0)
    # one cache against full precision reduces to the paired SE of eval.perplexity
    se = ba._delta_se(lambda x, y: math.expm1(x), da, db)
    assert se == pytest.approx(paired_change_se(a, fp), rel=1e-4)


def test_options_are_checked():
    with pytest.raises(ValueError, match="--budgets -2"):
        ba.BitAllocationConfig(budgets=(-2.0,))
    with pytest.raises(ValueError, match="BITSb/META"):
        ba.BitAllocationConfig(uniform=("two bits",))
