"""The studies' statistics (experiments/common.py): the paired difference, its interval, p-value and verdict."""

import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"


@pytest.fixture(scope="module")
def common():
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        import common

        yield common
    finally:
        sys.path.remove(str(EXPERIMENTS))


def test_paired_difference_is_the_t_interval_and_paired_t_test(common):
    method, baseline = [0.31, 0.42, 0.28, 0.35, 0.40], [0.30, 0.33, 0.29, 0.27, 0.31]
    d = common.paired_difference(method, baseline)
    diff = np.subtract(method, baseline)
    half = stats.t.ppf(0.975, 4) * diff.std(ddof=1) / np.sqrt(5)
    assert d["mean"] == pytest.approx(diff.mean())
    assert (d["low"], d["high"]) == pytest.approx((diff.mean() - half, diff.mean() + half))
    assert d["p"] == pytest.approx(stats.ttest_rel(method, baseline).pvalue)
    assert d["n"] == 5 and d["per_seed"] == pytest.approx(diff.tolist())
    assert common.verdict(d) == "inconclusive"  # -0.01 on one seed: the interval contains 0 here
    assert d["low"] < 0 < d["high"]


@pytest.mark.parametrize("diffs, expected", [([0.1, 0.12, 0.09], "reproduced"),
                                             ([-0.1, -0.12, -0.09], "not reproduced"),
                                             ([0.1, -0.12, 0.02], "inconclusive")])
def test_verdict_follows_the_interval(common, diffs, expected):
    assert common.verdict(common.paired_difference(diffs, [0.0] * len(diffs))) == expected


def test_one_seed_gives_no_interval_no_p_value_and_no_verdict(common):
    d = common.paired_difference([0.0], [0.061])
    assert d["low"] == d["high"] == d["mean"] == pytest.approx(-0.061)
    assert np.isnan(d["p"])
    assert common.verdict(d) == "no verdict (one seed)"


def test_equal_differences_on_every_seed(common):
    d = common.paired_difference([0.0, 0.0, 0.0], [0.061] * 3)  # e.g. an arm that fails every problem every time
    assert (d["low"], d["high"], d["p"]) == pytest.approx((-0.061, -0.061, 0.0))
    assert common.verdict(d) == "not reproduced"
    same = common.paired_difference([0.2, 0.3], [0.2, 0.3])
    assert same["p"] == 1.0 and common.verdict(same) == "inconclusive"
