"""What a user meets first: config help and typo hints, a locked run folder, a failed start that changes nothing,
and library calls that leave Ctrl-C alone."""

import json
import signal

import pytest

from jaxalign.cli import main
from jaxalign.configs import base
from jaxalign.data import DataError
from jaxalign.train import load_config, train
from jaxalign.train import writers as writers_module
from jaxalign.train.checkpoints import RunFolderBusy, RunFolderError, RunLock
from jaxalign.train.fields import HELP, describe

SMALL = ["--config.model.shape.hidden_size=32", "--config.model.shape.intermediate_size=64",
         "--config.model.shape.num_layers=1", "--config.model.shape.num_heads=2", "--config.model.shape.num_kv_heads=1",
         "--config.data.toy_size=100", "--config.data.toy_eval_size=8", "--config.data.max_length=48",
         "--config.train.batch_size=8", "--config.train.log_every=2", "--config.train.eval_every=0",
         "--config.eval.batches=1", "--config.eval.generate=0", "--config.logging.tensorboard=False",
         "--config.logging.plot=False", "--config.train.steps=2"]


def test_every_field_has_a_line_of_help_and_config_show_prints_them(capsys):
    rows = describe(base.get_config())
    assert {path for path, _, _ in rows if not path.startswith("objective.params.")} == set(HELP)
    assert main(["config", "show", "dpo", "--config.train.steps=7"]) == 0
    out = capsys.readouterr().out
    assert any(line.startswith("train.steps") and " 7 " in line and "optimizer steps" in line
               for line in out.splitlines())
    assert "objective.params.label_smoothing" in out  # hyper-parameters with their defaults
    assert main(["config", "show", "sft", "--json"]) == 0
    values = json.loads(capsys.readouterr().out)
    assert values["objective.params.normalization"] == "token" and values["train.steps"] == 600
    assert main(["config", "show", "sft", "--config.optim.lrr=1"]) == 2
    assert "did you mean 'lr'?" in capsys.readouterr().err


def test_a_second_run_into_a_busy_folder_is_refused_with_the_owner(tmp_path, capsys):
    workdir = tmp_path / "run"
    workdir.mkdir()
    with RunLock(workdir):
        with pytest.raises(RunFolderBusy, match=r"in use by another jaxalign run \(PID \d+\)"):
            train(load_config("sft", [*SMALL, f"--config.workdir={workdir}"]))
        assert main(["train", "--config", "sft", *SMALL, f"--config.workdir={workdir}"]) == 2
        assert "in use by another jaxalign run" in capsys.readouterr().err
        assert not (workdir / "config.json").exists()
    train(load_config("sft", [*SMALL, f"--config.workdir={workdir}"]))  # released: the folder is usable again


def test_a_failed_start_leaves_an_existing_run_folder_byte_identical(tmp_path):
    workdir = tmp_path / "run"
    train(load_config("sft", [*SMALL, f"--config.workdir={workdir}"]))
    before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl"):  # a fresh start (resume=False) that fails on its data
        train(load_config("dpo", [*SMALL, f"--config.workdir={workdir}", f"--config.data.train={bad}",
                                  "--config.train.resume=False"]))
    after = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    assert after == before


def test_library_training_leaves_the_callers_signal_handlers(tmp_path, monkeypatch):
    seen, callers = [], signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN under nohup / `&`
    write = writers_module.MetricWriter.write

    def spy(self, *args, **kwargs):
        seen.append(signal.getsignal(signal.SIGINT))
        return write(self, *args, **kwargs)

    monkeypatch.setattr(writers_module.MetricWriter, "write", spy)
    train(load_config("sft", [*SMALL, f"--config.workdir={tmp_path / 'run'}"]))
    assert seen and all(handler is callers for handler in seen)


def test_a_different_run_in_a_used_folder_is_refused_and_resume_false_starts_fresh(tmp_path):
    workdir = tmp_path / "run"
    train(load_config("sft", [*SMALL, f"--config.workdir={workdir}"]))
    before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    with pytest.raises(RunFolderError, match=r"(?s)different config:.*objective.name: 'sft' -> 'dpo'.*"
                                             r"--config.train.resume=False"):
        train(load_config("dpo", [*SMALL, f"--config.workdir={workdir}"]))
    assert {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()} == before
    summary = train(load_config("dpo", [*SMALL, f"--config.workdir={workdir}", "--config.train.resume=False"]))
    [old] = workdir.glob("replaced-*")
    assert (old / "checkpoints").is_dir()
    assert json.loads((old / "config.json").read_text())["objective"]["name"] == "sft"
    assert summary["step"] == 2 and json.loads((workdir / "config.json").read_text())["objective"]["name"] == "dpo"
    train(load_config("dpo", [*SMALL, f"--config.workdir={workdir}", "--config.train.steps=4"]))  # steps may grow


def test_evaluation_follows_the_users_data(tmp_path, capsys):
    records = [{"prompt": f"Say {i}.", "completion": f"{i}"} for i in range(40)]
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = load_config("sft", [*SMALL, f"--config.workdir={tmp_path / 'run'}", f"--config.data.train={data}",
                                 "--config.eval.generate=4"])
    assert config.data.eval == "" and "5% of each training file (at least one batch) is held out" in (
        capsys.readouterr().out)
    summary = train(config)
    out = capsys.readouterr().out
    assert "32 of 40 records usable, 8 held out for evaluation" in out  # 5 %, but at least one eval batch
    held = [json.loads(line) for line in (tmp_path / "run" / "data" / "eval_heldout_0.jsonl").read_text().splitlines()]
    assert len(held) == 8 and all(r in records for r in held)
    assert "loss" in summary["final_eval"] and "accuracy" not in summary["final_eval"]  # no answers: no exact match
    assert "nll/token" in out.split("step 2/2")[1].splitlines()[0]  # the objective's headline metric
    toy = load_config("sft", [*SMALL, f"--config.workdir={tmp_path / 'toy'}"])
    assert toy.data.eval == "toy:arithmetic"


def test_curves_draw_each_headline_metric_even_from_one_point(tmp_path):
    from jaxalign.train.writers import plot_curves

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "split": "train", "loss": 0.69, "rewards/margins": 0.1}) + "\n"
                       + json.dumps({"step": 1, "split": "eval", "loss": 0.7, "rewards/accuracies": 0.5}) + "\n")
    out = plot_curves(metrics, tmp_path / "curves.png", "dpo", metrics=("loss", "rewards/margins",
                                                                          "rewards/accuracies"))
    assert out.stat().st_size > 10_000
