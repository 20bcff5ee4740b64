"""Every study in experiments/ runs end to end at --smoke size and writes its JSON, table and plots."""

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"
STUDIES = sorted(p.stem for p in EXPERIMENTS.glob("*.py") if p.stem not in ("common", "pretrained"))
# the options of a study's generic smoke run, where its default version has a test of its own
SMOKE_OPTIONS = {"grpo_toy": ("--bundled", "--baseline")}


@pytest.fixture(scope="module", autouse=True)
def experiments_on_path():
    sys.path.insert(0, str(EXPERIMENTS))
    yield
    sys.path.remove(str(EXPERIMENTS))


def one_device_env() -> dict[str, str]:
    """This environment with XLA's host device count and thread pool left at their defaults (one device): what a
    user running a study gets."""
    env = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    return env


def run_at_smoke_size(study: str, tmp_path: Path, *options: str) -> None:
    """Runs ``experiments/<study>.py --smoke`` as a user runs it (its own process, one CPU device), writing to
    ``tmp_path/out`` and ``tmp_path/runs``."""
    command = [sys.executable, str(EXPERIMENTS / f"{study}.py"), "--smoke", *options, "--out", str(tmp_path / "out"),
               "--workdir", str(tmp_path / "runs")]
    done = subprocess.run(command, cwd=EXPERIMENTS.parent, env=one_device_env(), capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("study", STUDIES)
def test_study_runs_at_smoke_size(study, tmp_path):
    # run as a user runs it: its own process, one CPU device, XLA's default thread pool (not this process's 8 fake
    # devices; with those and the default pool cpi_toy deadlocked: docs/reliability.md)
    module = importlib.import_module(study)
    for package in getattr(module, "REQUIRES", ()):
        pytest.importorskip(package)
    options = SMOKE_OPTIONS.get(study, ())
    run_at_smoke_size(study, tmp_path, *options)
    written = json.loads((tmp_path / "out" / f"{study}.json").read_text())
    assert written["results"]
    assert written["meta"]["command"].startswith(" ".join([f"python experiments/{study}.py --smoke", *options]))
    assert (tmp_path / "out" / f"{study}.md").read_text().startswith("Command: `python experiments/")
    assert list((tmp_path / "out").glob(f"{study}*.png")), "each study draws at least one figure"


def test_every_study_has_a_docstring_and_main():
    for study in STUDIES:
        text = (EXPERIMENTS / f"{study}.py").read_text()
        assert text.startswith('"""') and "def main(argv" in text and 'if __name__ == "__main__"' in text


@pytest.mark.slow
@pytest.mark.parametrize("study", ["frozen_lake", "sft_vs_ift"])
def test_rerunning_a_study_with_the_same_seed_reproduces_its_numbers(study, tmp_path):
    module = importlib.import_module(study)
    runs = []
    for attempt in range(2):  # separate run folders: a study reuses a finished run's result.json in its folder
        out, runs_dir = tmp_path / f"out{attempt}", tmp_path / f"runs{attempt}"
        module.main(["--smoke", "--out", str(out), "--workdir", str(runs_dir)])
        results = json.loads((tmp_path / f"out{attempt}" / f"{study}.json").read_text())["results"]
        runs.append(json.dumps(_without_timings(results), sort_keys=True))
    assert runs[0] == runs[1]


def _without_timings(value):
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if "seconds" not in k}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


@pytest.mark.slow
def test_smollm2_study_resumes_from_its_records_after_the_run_folders_are_gone(tmp_path):
    # the records (start, validation and test scores) are kept apart from the checkpoints; a second invocation with
    # the run folders deleted reuses every record and trains the exported DPO run again, which must end at the
    # recorded loss (else it stops), and writes the same results
    pytest.importorskip("torch")
    module = importlib.import_module("smollm2_real")
    outputs = []
    for attempt in range(2):
        runs_dir = tmp_path / "runs"
        shutil.rmtree(runs_dir, ignore_errors=True)
        module.main(["--smoke", "--out", str(tmp_path / f"out{attempt}"), "--workdir", str(runs_dir),
                     "--records", str(tmp_path / "records")])
        results = json.loads((tmp_path / f"out{attempt}" / "smollm2_real.json").read_text())["results"]
        outputs.append(json.dumps(_without_timings(results), sort_keys=True))
    assert outputs[0] == outputs[1]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir() if p.name.startswith("dpo_lr")) == \
        [f"dpo_lr{json.loads(outputs[0])['chosen']['dpo']}_s0"]  # only the exported run was trained again
    # another seed set reads the published sweep (seed 0) back from the records and trains only its own seed
    shutil.rmtree(runs_dir)
    module.main(["--smoke", "--seeds", "1", "--out", str(tmp_path / "out2"), "--workdir", str(runs_dir),
                 "--records", str(tmp_path / "records")])
    again = json.loads((tmp_path / "out2" / "smollm2_real.json").read_text())["results"]
    first = json.loads(outputs[0])
    assert again["seeds"] == [1] and again["sweep_seeds"] == [0] and again["sweep"] == first["sweep"]
    assert again["chosen"] == first["chosen"]
    assert sorted(p.name for p in runs_dir.iterdir() if "_lr" in p.name) == \
        sorted(f"{arm}_lr{lr}_s1" for arm, lr in first["chosen"].items())
    assert "Learning-rate sweep on seed 0 " in (tmp_path / "out2" / "smollm2_real.md").read_text()


@pytest.mark.slow
def test_grpo_tuned_runs_every_arm_from_one_sft_start(tmp_path):
    run_at_smoke_size("grpo_toy", tmp_path)  # the fair-test version is the default
    results = json.loads((tmp_path / "out" / "grpo_toy_tuned.json").read_text())["results"]
    assert set(results["chosen"]) == {"grpo", "sft", "sft_short"} and results["sweep_seeds"] == [0, 1]
    assert list(results["verdicts"]) == ["GRPO − matched SFT", "GRPO − SFT on short answers (the style ablation)",
                                         "GRPO − the SFT start"]
    start = tmp_path / "runs" / "sft_start" / "hf"
    configs = sorted((tmp_path / "runs").glob("seed*/*/lr*/config.json"))
    assert len(configs) == 12  # 3 arms x 2 rates x 2 sweep seeds
    for path in configs:
        config = json.loads(path.read_text())
        assert config["model"]["path"] == str(start), path
        style = "short" if path.parts[-3] == "sft_short" else "mixed"
        assert config["data"]["train"].endswith(f"train_{style}_seed{path.parts[-4].removeprefix('seed')}.jsonl")
    for arm in ("sft", "sft_short"):  # the SFT arms see as many sequences per step as GRPO has completions
        config = json.loads(next((tmp_path / "runs").glob(f"seed0/{arm}/lr*/config.json")).read_text())
        assert config["train"]["batch_size"] == 4 * 8 and config["optim"]["schedule"] == "constant"
    assert (tmp_path / "out" / "grpo_toy_tuned.png").exists()
    # the published records hold no model: one more seed trains the SFT start again, which must score as recorded
    shutil.rmtree(start.parent / "hf")
    shutil.rmtree(start.parent / "run")
    run_at_smoke_size("grpo_toy", tmp_path, "--tuned", "--seeds", "0,1,2")
    again = json.loads((tmp_path / "out" / "grpo_toy_tuned.json").read_text())["results"]
    assert again["start"] == results["start"] and (start / "config.json").exists()
    assert [r["test"] for r in again["runs"]["grpo"][:2]] == [r["test"] for r in results["runs"]["grpo"]]


def test_sater_stage_one_only_tests_the_stage_one_claims_alone(tmp_path):
    run_at_smoke_size("sater_toy", tmp_path, "--stage-one-only")
    results = json.loads((tmp_path / "out" / "sater_toy.json").read_text())["results"]
    assert results["stage_one_only"] and not results["routing_summary"]
    assert list(results["verdicts"]) == ["stage I: correct-answer length, SFT − stage I (tokens)",
                                         "stage I: accuracy, stage I − SFT"]
    assert all(run["stage2"] is None for run in results["per_seed"])
    assert not list((tmp_path / "runs").glob("seed*/stage2_*")), "stage II was not trained"
    text = (tmp_path / "out" / "sater_toy.md").read_text()
    assert "Stage II on the test pool" not in text and "--stage-one-only" in text
    assert (tmp_path / "out" / "sater_toy_stage1.png").exists()


@pytest.mark.slow
def test_distill_kd_temperature_is_its_own_arm(tmp_path):
    run_at_smoke_size("distill_toy", tmp_path, "--arms", "kd", "--kd-temperature", "2")
    results = json.loads((tmp_path / "out" / "distill_toy.json").read_text())["results"]
    assert results["labels"] == {"sft": "SFT", "kd": "KD (off-policy, β = 0, T = 2)"}
    assert list(results["verdicts"]) == ["KD (off-policy, β = 0, T = 2) − SFT"]
    runs = tmp_path / "runs"
    assert not list(runs.glob("seed*/kd/")), "runs at T = 1 and T = 2 share no folder"
    (config,) = runs.glob("seed0/kd_t2/*/run/config.json")
    params = json.loads(config.read_text())["objective"]["params"]
    assert params["temperature"] == 2.0 and params["beta"] == 0.0 and params["lmbda"] == 0.0
    assert "T = 2" in (tmp_path / "out" / "distill_toy.md").read_text()


@pytest.mark.slow
def test_distill_student_records_share_the_teacher(tmp_path):
    run_at_smoke_size("distill_toy", tmp_path, "--arms", "kd", "--train-records", "40")
    runs = tmp_path / "runs"
    student_data = (runs / "n40" / "train.jsonl").read_text().splitlines()
    assert student_data == (runs / "train.jsonl").read_text().splitlines()[:40]
    assert not (runs / "n40" / "teacher").exists() and (runs / "teacher" / "hf").is_dir()
    for config in [*runs.glob("n40/seed*/*/*/run/config.json"), runs / "n40" / "student_start" / "run" / "config.json"]:
        assert json.loads(config.read_text())["data"]["train"] == str(runs / "n40" / "train.jsonl")
    assert json.loads((runs / "teacher" / "run" / "config.json").read_text())["data"]["train"] == str(
        runs / "train.jsonl")
    assert not list(runs.glob("seed*")), "the student's runs are all under n40"
    results = json.loads((tmp_path / "out" / "distill_toy.json").read_text())["results"]
    assert results["sizes"]["student_records"] == 40
    assert "both on 40 training records" in (tmp_path / "out" / "distill_toy.md").read_text()


@pytest.mark.parametrize("options, message", [
    (["--arms", "gkd", "--kd-temperature", "2"], "which --arms gkd leaves out"),
    (["--kd-temperature", "0"], "must be > 0"),
    (["--train-records", "201"], "need 1 to 200 (the teacher's records)"),
    (["--train-records", "-1"], "need 1 to 200"),
])
def test_distill_kd_temperature_is_checked_before_anything_runs(options, message, capsys, tmp_path):
    distill_toy = importlib.import_module("distill_toy")
    with pytest.raises(SystemExit):
        distill_toy.main(["--smoke", *options, "--workdir", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    assert message in capsys.readouterr().err and not (tmp_path / "runs").exists()


def test_cpi_tunes_each_arm_on_validation_and_runs_only_the_parts_each_rate_serves(monkeypatch, tmp_path):
    cpi_toy = importlib.import_module("cpi_toy")
    tasks = ["add", "sub", "reverse", "copy"]
    best = {"cpi_ft": 1e-3, "cpi_ft_no_fusion": 1e-3, "cpi_ft_no_freezing": 3e-4, "multi_task_sft": 3e-3,
            "sequential_sft": 3e-3}
    calls = []

    def fake_pipeline(config):  # scores that peak at each arm's `best` rate on validation and say where they came from
        cpi, lr = config.cpi, config.optim.lr
        calls.append((config.seed, lr, cpi.eval_pool, cpi.ablations, cpi.baselines, cpi.forgetting))
        score = lambda arm: {t: (1.0 if lr == best[arm] else 0.5) if cpi.eval_pool == "validation" else lr
                             for t in tasks}
        arms = ["cpi_ft"] + (["cpi_ft_no_fusion", "cpi_ft_no_freezing"] if cpi.ablations else []) + (
            ["multi_task_sft", "sequential_sft"] if cpi.baselines else [])
        report = {"tasks": tasks, "settings": cpi.to_dict(), "groups": [[t] for t in tasks],
                  "scores": {"base": score("cpi_ft"), "fused": score("cpi_ft"), **{a: score(a) for a in arms},
                             **{f"probe_{t}": score("cpi_ft") for t in tasks}}}
        if cpi.forgetting:
            report["forgetting_test"] = {key: score("cpi_ft") for key in ("after_a", "after_b_plain",
                                                                         "after_b_core_frozen")}
        return report

    monkeypatch.setattr(cpi_toy, "run_cpi", fake_pipeline)
    monkeypatch.setattr(cpi_toy, "pretrained_start", lambda shape: tmp_path / "start")
    options = ["--lrs", "3e-4,1e-3,3e-3", "--seeds", "0,1", "--sweep-seeds", "7", "--workdir", str(tmp_path / "runs"),
               "--out", str(tmp_path / "out")]
    results = cpi_toy.main(options)
    assert results["chosen"] == best
    assert sorted(calls) == sorted(
        [(7, lr, "validation", True, True, "") for lr in (3e-4, 1e-3, 3e-3)]
        + [(seed, 3e-4, "test", True, False, "") for seed in (0, 1)]  # no freezing's rate: the ablations only
        + [(seed, 1e-3, "test", True, False, "add,reverse") for seed in (0, 1)]  # CPI-FT's: also the forgetting test
        + [(seed, 3e-3, "test", False, True, "") for seed in (0, 1)])  # the baselines'
    for run in results["per_seed"]:  # each arm's test score comes from the run at its own rate
        assert {arm: run["scores"][arm]["add"] for arm in best} == best
    assert "| multi-task SFT | 50.0 | 50.0 | 100.0 | 0.003 |" in (tmp_path / "out" / "cpi_toy.md").read_text()
    calls.clear()
    cpi_toy.main(options)  # started again: every run is reused
    assert calls == []
    calls.clear()
    cpi_toy.main(["--lrs", "1e-3", *options[2:]])  # one rate: no sweep, one run per seed with every part
    assert calls == [(seed, 1e-3, "test", True, True, "add,reverse") for seed in (0, 1)]
    for folder in (tmp_path / "runs" / "test-lr0.001").glob("seed*-ablations+forgetting"):
        shutil.rmtree(folder)
    calls.clear()
    cpi_toy.main(options)  # a finished run with more parts at the same seed, rate and pool serves
    assert calls == []


@pytest.mark.parametrize("lrs, message", [("1e-3,fast", "expected comma-separated numbers"), ("0,1e-3", "must be > 0")])
def test_cpi_learning_rates_are_checked_before_anything_runs(lrs, message, capsys, tmp_path):
    cpi_toy = importlib.import_module("cpi_toy")
    with pytest.raises(SystemExit):
        cpi_toy.main(["--smoke", "--lrs", lrs, "--workdir", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    assert message in capsys.readouterr().err and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("options, message", [(["--bundled", "--tuned"], "two different studies"),
                                              (["--baseline"], "has it already")])
def test_grpo_study_options_that_do_not_fit_together_are_refused(options, message):
    module = importlib.import_module("grpo_toy")
    with pytest.raises(SystemExit, match=message):
        module.main(options)
