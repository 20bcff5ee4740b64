"""The studies' statistics (experiments/common.py): the paired difference, its interval, p-value and verdict."""

import json
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


def test_tuned_arms_sweeps_each_arms_own_rates_and_reuses_the_chosen_run(common):
    calls = []
    score = {("a", 1): 0.5, ("a", 2): 0.7, ("b", 10): 0.4, ("b", 20): 0.4}
    nll = {("b", 10): 1.3, ("b", 20): 1.1}

    def run_one(arm, lr, seed):
        calls.append((arm, lr, seed))
        return {"validation": score[arm, lr], "nll": nll.get((arm, lr), 0.0), "key": (arm, lr, seed)}

    def rank(done):  # validation first, ties to the lower NLL
        return np.mean([r["validation"] for r in done]), -np.mean([r["nll"] for r in done])

    tuned = common.tuned_arms(["a", "b"], {"a": (1, 2), "b": (10, 20)}, [0, 1, 2], [0], run_one, rank=rank)
    assert tuned["chosen"] == {"a": 2, "b": 20}  # b's tie goes to the lower NLL
    assert [r["key"] for r in tuned["runs"]["b"]] == [("b", 20, 0), ("b", 20, 1), ("b", 20, 2)]
    assert len(calls) == len(set(calls)) == 4 + 4  # the sweep's seed-0 run at the chosen rate is not run again
    assert len(tuned["every"]) == 8
    plain = common.tuned_arms(["b"], (10, 20), [0], [0], run_one)  # one list for every arm, mean validation
    assert plain["chosen"] == {"b": 10}  # without a rank the first of equal rates stays


def test_sweep_seeds_outside_the_evaluated_seeds_tune_without_being_evaluated(common):
    p = common.parser('"""A study."""')
    args = p.parse_args(["--seeds", "21,22,23", "--sweep-seeds", "100,101"])
    seeds = common.seeds_of(args, (0, 1, 2))
    sweep_seeds = common.sweep_seeds_of(args, seeds)
    assert (seeds, sweep_seeds) == ([21, 22, 23], [100, 101])
    assert common.sweep_seeds_of(p.parse_args([]), [0, 1, 2]) == [0, 1]  # default: the first two seeds
    assert common.sweep_seeds_of(p.parse_args([]), [0, 1, 2], 1) == [0]

    def run_one(arm, lr, seed):
        return {"validation": {1: 0.2, 2: 0.6}[lr] + 0.01 * seed, "key": (arm, lr, seed)}

    tuned = common.tuned_arms(["a"], (1, 2), seeds, sweep_seeds, run_one)
    assert tuned["chosen"] == {"a": 2}
    assert [r["key"] for r in tuned["runs"]["a"]] == [("a", 2, 21), ("a", 2, 22), ("a", 2, 23)]
    assert len(tuned["every"]) == 4 + 3  # the sweep's runs are counted, none of them is an evaluated run


def test_recorded_rates_skip_the_sweep_unless_asked_to_tune(common):
    p = common.parser('"""A study."""')
    common.rate_options(p, {"a": 2, "b": 10}, "seeds 100-101")
    recorded = {"a": 2, "b": 10}
    assert common.recorded_rates(p.parse_args([]), recorded) == recorded
    for flags in (["--tune"], ["--sweep-seeds", "100,101"], ["--smoke"]):  # each of these sweeps
        assert common.recorded_rates(p.parse_args(flags), recorded) is None
    assert common.rates_or_sweep(p.parse_args([]), [21, 22], recorded) == (recorded, [])
    assert common.rates_or_sweep(p.parse_args(["--tune"]), [21, 22], recorded) == (None, [100, 101])
    assert common.rates_or_sweep(p.parse_args(["--tune"]), [21, 22], recorded, sweep_seeds=None) == (None, [21, 22])
    assert common.rates_or_sweep(p.parse_args([]), [21, 22], None) == (None, [100, 101])  # nothing recorded
    assert common.rates_or_sweep(p.parse_args(["--smoke"]), [0, 1], recorded) == (None, [0, 1])
    calls = []

    def run_one(arm, lr, seed):
        calls.append((arm, lr, seed))
        return {"validation": 0.5, "key": (arm, lr, seed)}

    tuned = common.tuned_arms(["a", "b"], (1, 2, 10), [21, 22], [100, 101], run_one, recorded=recorded)
    assert calls == [("a", 2, 21), ("a", 2, 22), ("b", 10, 21), ("b", 10, 22)]  # no sweep run, no sweep seed
    assert tuned["chosen"] == recorded and tuned["sweep"] == {"a": {}, "b": {}}
    results = {"sizes": {"lrs": (1, 2, 10)}, "sweep": common.sweep_summary(tuned), "chosen": tuned["chosen"]}
    assert common.sweep_section(results, {"a": "A", "b": "B"}).startswith("No sweep in this run")
    assert "A 2, B 10" in common.sweep_section(results, {"a": "A", "b": "B"})


def test_cached_run_skips_a_finished_run_and_never_trusts_a_broken_record(common, tmp_path):
    calls = []
    record = tmp_path / "seed0" / "result.json"
    assert common.cached_run(record, lambda: calls.append(1) or {"test": 0.5}) == {"test": 0.5}
    assert common.cached_run(record, lambda: calls.append(1) or {"test": 0.0}) == {"test": 0.5}
    assert calls == [1] and [p.name for p in record.parent.iterdir()] == ["result.json"]  # nothing left aside
    record.write_text('{"test": 0.')  # a record cut short
    with pytest.raises(SystemExit, match=r"result\.json: a finished run's record that is not valid JSON"):
        common.cached_run(record, lambda: calls.append(1) or {"test": 0.0})
    assert calls == [1]


def test_a_study_records_the_weights_of_the_pretrained_start_it_used(common, tmp_path, monkeypatch):
    import hashlib

    import pretrained  # experiments/, on the path through the common fixture

    start = tmp_path / "toy-tiny-0123456789abcdef"
    start.mkdir()
    (start / "model.safetensors").write_bytes(b"weights" * 1000)
    digest = pretrained.weights_digest(start)
    assert digest == hashlib.sha256(b"weights" * 1000).hexdigest()[:16]
    monkeypatch.setattr(pretrained, "USED", {start.name: digest})
    common.write(tmp_path / "out", "study", command="python experiments/study.py", results={"x": 1},
                 markdown="table", started=0.0)
    meta = json.loads((tmp_path / "out" / "study.json").read_text())["meta"]
    assert meta["pretrained_weights_sha256"] == {start.name: digest}
    assert f"start `{start.name}`, weights sha256 {digest}" in (tmp_path / "out" / "study.md").read_text()
