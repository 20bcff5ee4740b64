"""Nothing is lost when things go wrong: kill -9 at random steps, SIGTERM, broken checkpoints, NaN batches,
invalid configs, hostile files. Fuzzing of the record validators lives in test_fuzz_records.py."""

import os
import pickle
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from test_train import SMALL, small_config

from jaxalign.cli import main
from jaxalign.data import DataError, TokenizeConfig, Tokenizer, load_sources
from jaxalign.data.pipeline import DataPipeline
from jaxalign.data.toy import toy_tokenizer, write_jsonl
from jaxalign.models import CheckpointError, create_model, load_pretrained, save_hf
from jaxalign.train import ConfigError, TrainingHalted, checkpoints, load_config, train, validate, writers
from jaxalign.train.export import restore_model

STEPS = 40
KILLS = 10
RUN = [*SMALL, f"--config.train.steps={STEPS}", "--config.train.save_every=1", "--config.train.keep_checkpoints=2",
       "--config.train.log_every=10", "--config.eval.generate=0", "--config.data.eval="]


def start(workdir: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "jaxalign.cli", "train", "--config", "sft", *RUN, f"--config.workdir={workdir}"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_for_checkpoint(process: subprocess.Popen, workdir: Path, step: int, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (workdir / "checkpoints" / str(step)).exists():
            return
        if process.poll() is not None:
            raise AssertionError(f"training ended before step {step}:\n{process.stdout.read()}")
        time.sleep(0.01)
    process.kill()
    raise AssertionError(f"no checkpoint {step} within {timeout} s")


def final_params(workdir: Path):
    model, _, step = restore_model(workdir)
    return step, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


def assert_same_params(workdir_a: Path, workdir_b: Path) -> None:
    step_a, a = final_params(workdir_a)
    step_b, b = final_params(workdir_b)
    assert step_a == step_b == STEPS
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: the same run, never interrupted (started in the background)."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    process = start(workdir)
    yield process, workdir
    if process.poll() is None:
        process.kill()


def finished(reference) -> Path:
    process, workdir = reference
    output = process.communicate(timeout=600)[0] if process.returncode is None else ""
    assert process.returncode == 0, output
    return workdir


@pytest.mark.slow
def test_kill9_at_ten_random_steps_then_identical_parameters(uninterrupted, tmp_path):
    kill_steps = sorted(random.Random(2026).sample(range(2, STEPS - 2, 3), KILLS))  # at least 3 steps apart
    workdir = tmp_path / "killed"
    for i, step in enumerate(kill_steps):
        process = start(workdir)
        wait_for_checkpoint(process, workdir, step)
        process.send_signal(signal.SIGKILL)  # no handler runs: possibly mid-step or mid-save
        output = process.communicate()[0]
        assert process.returncode == -signal.SIGKILL
        if i:
            assert "resumed from" in output, output[-2000:]
    process = start(workdir)
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0, output[-3000:]
    assert "resumed from" in output
    assert_same_params(workdir, finished(uninterrupted))


@pytest.mark.slow
def test_sigterm_checkpoints_exits_and_resumes_at_the_next_step(uninterrupted, tmp_path):
    workdir = tmp_path / "preempted"
    process = start(workdir)
    wait_for_checkpoint(process, workdir, 12)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 0, output
    assert "SIGTERM: saved a checkpoint at step" in output
    saved = int(output.split("SIGTERM: saved a checkpoint at step ")[1].split()[0])
    assert 12 <= saved < STEPS
    process = start(workdir)
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0 and f"at step {saved}" in output, output[-3000:]
    # the data position was restored too: the parameters equal the uninterrupted run's bit for bit
    assert_same_params(workdir, finished(uninterrupted))


CKPT = ["--config.train.save_every=4", "--config.train.keep_checkpoints=3", "--config.eval.generate=0"]


@pytest.mark.slow
def test_sigterm_during_start_up_exits_0_with_nothing_half_made(tmp_path):
    workdir = tmp_path / "starting"
    process = start(workdir)
    for line in process.stdout:  # the model is being built and compiled now
        if line.startswith("mesh "):
            break
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 0, output
    assert "SIGTERM during start-up: stopped before training; no checkpoint was written" in output
    assert not checkpoints.has_checkpoints(workdir) and "Traceback" not in output
    assert not list(workdir.rglob("*.tmp"))
    process = start(workdir)  # and the same command then trains normally
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0 and "done" in output, output[-2000:]


def test_half_written_final_checkpoint_is_replaced_and_export_uses_a_good_one(tmp_path, capsys):
    train(small_config("sft", tmp_path / "run", "--config.train.steps=8", *CKPT))
    for file in (tmp_path / "run" / "checkpoints" / "8").rglob("*"):
        if file.is_file() and file.stat().st_size > 1:
            file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])  # the write stopped halfway
    with pytest.warns(UserWarning, match="checkpoint 8 in .* is broken"):
        summary = train(small_config("sft", tmp_path / "run", "--config.train.steps=8", *CKPT))  # the same command
    assert summary["step"] == 8
    assert [p.name.split("-")[0] for p in (tmp_path / "run" / "broken-checkpoints").iterdir()] == ["8"]
    assert checkpoints.good_step(tmp_path / "run" / "checkpoints") == (8, [])  # retrained and saved again
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    assert f"using checkpoint 8 of {tmp_path / 'run'}" in capsys.readouterr().err


def flip(file: Path, at: float) -> None:
    data = bytearray(file.read_bytes())
    i = int(len(data) * at)
    data[i:i + 8] = bytes(b ^ 0x5A for b in data[i:i + 8])  # same size, different content
    file.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def reference8(tmp_path_factory):
    """The parameters after 8 uninterrupted steps of the CKPT run."""
    workdir = tmp_path_factory.mktemp("reference8")
    train(small_config("sft", workdir, "--config.train.steps=8", *CKPT))
    return final_params(workdir)[1]


def assert_params_equal(workdir: Path, reference) -> None:
    _, params = final_params(workdir)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True):
        np.testing.assert_array_equal(x, y)


def test_flipped_bytes_anywhere_in_the_latest_checkpoint_fall_back_and_train_identically(tmp_path, reference8):
    run = tmp_path / "run"
    train(small_config("sft", run, "--config.train.steps=8", *CKPT))
    step8 = run / "checkpoints" / "8"
    # the array data (middle, end), the JSON meta record, a middle-sized Orbax file (names change with each save)
    targets = [(-1, 0.5), (-1, 0.97), ("meta/metadata", 0.5), (0.5, 0.3)]
    for which, at in targets:
        files = sorted((p for p in step8.rglob("*") if p.is_file() and p.name != checkpoints.MANIFEST),
                       key=lambda p: p.stat().st_size)
        flip(step8 / which if isinstance(which, str) else files[int(which * (len(files) - 1)) if which > 0
                                                                else which], at)
        with pytest.warns(UserWarning, match=r"checkpoint 8 in .* is broken \(.* does not match its content hash"):
            train(small_config("sft", run, "--config.train.steps=8", *CKPT))
        assert_params_equal(run, reference8)
    assert len(list((run / "broken-checkpoints").iterdir())) == len(targets)


def disk_trouble(monkeypatch, at_step: int, how: str):
    """From checkpoint ``at_step`` on: the disk reports almost no free space (``full``), or writes past 16 KiB fail in
    the kernel (``io``: RLIMIT_FSIZE, so Orbax's background writes get EFBIG)."""
    original = checkpoints.Checkpoints.save

    def save(self, state, step, meta, *, wait=False):
        if step >= at_step:
            self.finish()  # the earlier save completes first
            if how == "full":
                monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(
                    10**9, 10**9 - 4096, 4096))
            else:
                resource.setrlimit(resource.RLIMIT_FSIZE, (16384, resource.RLIM_INFINITY))
        return original(self, state, step, meta, wait=wait)

    monkeypatch.setattr(checkpoints.Checkpoints, "save", save)


@pytest.mark.parametrize("how", ["full", "io"])
def test_disk_full_or_io_error_is_one_line_and_the_rerun_finishes_identically(monkeypatch, tmp_path, capsys,
                                                                               reference8, how):
    run = tmp_path / "run"
    command = ["train", "--config", "sft", *SMALL, f"--config.workdir={run}", "--config.train.steps=8", *CKPT]
    disk_trouble(monkeypatch, 8, how)
    try:
        assert main(command) == 2
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    err = capsys.readouterr().err
    reason = "No space left on device" if how == "full" else "File too large"
    assert err.strip().splitlines()[-1].startswith(f"jaxalign train: error: could not save checkpoint 8 in {run}"
                                                    f"/checkpoints: {reason}; it needs about 0.3 MiB and "), err
    assert "the earlier checkpoints are intact (latest: step 4)" in err and "Traceback" not in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["4"]  # no temporary folder left
    monkeypatch.undo()  # space freed
    assert main(command) == 0
    assert_params_equal(run, reference8)


def test_no_good_checkpoint_stops_the_run_and_moves_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    train(small_config("sft", run, "--config.train.steps=8", *CKPT))
    for step in ("4", "8"):
        flip(max((run / "checkpoints" / step).rglob("*"), key=lambda p: p.stat().st_size), 0.5)
    with pytest.raises(checkpoints.NoGoodCheckpoint, match=r"no good checkpoint \(step 8: .*; step 4: .*"
                                                           r"train.resume=False"):
        train(small_config("sft", run, "--config.train.steps=8", *CKPT))
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["4", "8"]
    assert not (run / "broken-checkpoints").exists()
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "no good checkpoint" in err and "Traceback" not in err


def test_a_bad_metrics_line_before_the_last_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "split": "eval"}\n{"step": 2, "split": "train"}\n'
                                            'garbage\n{"step": 4, "split": "train"}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 3: not a metrics row"):
        writers.read_metrics(tmp_path / "metrics.jsonl")
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "split": "eval"}\n{"step": 2, "spl')
    assert writers.read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "split": "eval"}]


def test_torn_metrics_and_rows_after_the_checkpoint_are_repaired_on_resume(tmp_path):
    run = tmp_path / "run"
    extra = ["--config.train.log_every=2", "--config.logging.plot=True", *CKPT]
    train(small_config("sft", run, "--config.train.steps=8", *extra))
    flip(max((run / "checkpoints" / "8").rglob("*"), key=lambda p: p.stat().st_size), 0.5)  # resume from 4
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 9, "split": "train", "lo')  # what kill -9 mid-write leaves
    with pytest.warns(UserWarning, match="is broken"):
        summary = train(small_config("sft", run, "--config.train.steps=8", *extra))
    rows = writers.read_metrics(run / "metrics.jsonl")
    keys = [(r["step"], r["split"]) for r in rows]
    assert len(keys) == len(set(keys)), keys  # no step twice
    assert [s for s, split in keys if split == "train"] == [2, 4, 6, 8]
    assert [s for s, split in keys if split == "eval"] == [0, 8]
    assert (run / "curves.png").stat().st_size > 0
    assert summary["initial_eval_step"] == 0 and np.isfinite(summary["initial_eval"]["loss"])


def poison_batch(monkeypatch, at):
    """Makes the ``at``-th training batch (or every one in ``at``, a container) carry a NaN example weight (so its
    loss and gradients are NaN)."""
    original = DataPipeline.__next__
    calls = {"n": 0}

    def poisoned(self):
        batch = original(self)
        if self.config.shuffle:  # the training pipeline (evaluation does not shuffle)
            calls["n"] += 1
            if calls["n"] == at or (not isinstance(at, int) and calls["n"] in at):
                batch = {**batch, "example_weight": np.full_like(batch["example_weight"], np.nan)}
        return batch

    monkeypatch.setattr(DataPipeline, "__next__", poisoned)


def test_nan_batch_is_skipped_counted_and_training_continues(monkeypatch, tmp_path, capsys):
    poison_batch(monkeypatch, at=3)
    summary = train(small_config("sft", tmp_path / "run", "--config.train.steps=10", "--config.eval.generate=0"))
    assert summary["step"] == 10 and summary["skipped_updates"] == 1  # 10 %: at the limit, not over it
    assert "step 3: the loss or the gradients are not finite; the update was skipped (1 skipped so far)" in (
        capsys.readouterr().out)
    _, params = final_params(tmp_path / "run")
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params))


def test_nan_batch_halts_when_configured(monkeypatch, tmp_path):
    poison_batch(monkeypatch, at=3)
    with pytest.raises(TrainingHalted, match=r"step 3: .*not finite.*train.nan_policy='halt'"):
        train(small_config("sft", tmp_path / "run", "--config.train.steps=6", "--config.train.nan_policy=halt",
                           "--config.eval.generate=0"))
    step, params = final_params(tmp_path / "run")
    assert step == 3 and all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params))


def test_a_streak_of_skipped_updates_halts_with_a_checkpoint(monkeypatch, tmp_path):
    poison_batch(monkeypatch, at=range(3, 100))
    with pytest.raises(TrainingHalted, match=r"3 updates in a row were skipped \(train.max_skip_streak=3\).*"
                                             r"checkpoint at step 5"):
        train(small_config("sft", tmp_path / "run", "--config.train.steps=20", "--config.train.max_skip_streak=3",
                           "--config.eval.generate=0"))
    step, params = final_params(tmp_path / "run")
    assert step == 5 and all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params))


def test_too_many_skipped_updates_is_a_failed_run_not_done(monkeypatch, tmp_path, capsys):
    poison_batch(monkeypatch, at={2, 4})
    workdir = tmp_path / "run"
    assert main(["train", "--config", "sft", *SMALL, f"--config.workdir={workdir}", "--config.train.steps=10",
                 "--config.eval.generate=0"]) == 2
    out, err = capsys.readouterr()
    assert "2 of 10 updates (20.0 %) were skipped" in err and "max_skip_fraction=0.1" in err
    assert "done" not in out and "Traceback" not in err
    assert (workdir / "summary.json").exists() and checkpoints.good_step(workdir / "checkpoints")[0] == 10


# ------------------------------------------------------------------------------------------ bad configs
@pytest.mark.parametrize(("overrides", "messages"), [
    (["--config.train.batch_size=6", "--config.mesh.fsdp=3"], ["mesh=", "needs 3 devices"]),
    (["--config.train.grad_accum=3"], ["train.batch_size=32 must be a multiple of train.grad_accum=3"]),
    (["--config.train.nan_policy=ignore"], ["train.nan_policy='ignore'"]),
    (["--config.train.checkpoint_layout=stacked"], ["train.checkpoint_layout='stacked'"]),
    (["--config.train.nan_policy=halt", "--config.train.nan_guard=False"], ["needs train.nan_guard=True"]),
    (["--config.distributed.mode=always"], ["distributed.mode='always'"]),
    (["--config.distributed.coordinator_address=localhost"], ["needs HOST:PORT"]),
    (["--config.distributed.num_processes=2", "--config.distributed.process_id=2"], ["distributed.process_id=2"]),
    (["--config.reference.cache_dir=../../elsewhere"], ["reference.cache_dir='../../elsewhere' leaves the run"]),
    (["--config.objective.name=mpo", "--config.data.packing=True", "--config.data.row_length=128"],
     ["data.packing is supported for sft, ift, dpo, simpo, orpo, cpo and distill, not mpo"]),
    (["--config.data.packing=True", "--config.data.row_length=100"],
     ["data.packing needs data.row_length >= 128 (a whole pair: 2 x data.max_length)"]),
    (["--config.objective.name=sft", "--config.data.shared_prefix=True"],
     ["data.shared_prefix writes each preference pair's prompt once: it needs a pair objective", "not sft"]),
    (["--config.data.bucket_step=-1"], ["data.bucket_step=-1 must be >= 0"]),
    (["--config.optim.schedule=warmup_stable"], ["optim.schedule='warmup_stable'"]),
    (["--config.train.steps=0", "--config.data.on_invalid=ignore"], ["train.steps=0", "data.on_invalid='ignore'"]),
])
def test_each_bad_config_names_its_fields(overrides, messages):
    with pytest.raises(ConfigError) as info:
        validate(load_config("dpo", overrides), num_devices=8)
    for message in messages:
        assert message in str(info.value)


def test_cli_reports_a_bad_config_before_any_work(tmp_path, capsys):
    workdir = tmp_path / "never"
    assert main(["train", "--config", "dpo", f"--config.workdir={workdir}", "--config.train.batch_size=6",
                 "--config.optim.name=lion"]) == 2
    err = capsys.readouterr().err
    assert "train.batch_size / train.grad_accum = 6 rows" in err and "optim.name='lion'" in err
    assert "Traceback" not in err
    assert not workdir.exists()  # nothing written, nothing compiled


# ------------------------------------------------------------------------------------------ security
class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickled_weights_are_refused_unopened(tmp_path, tiny_config):
    save_hf(create_model(tiny_config), tmp_path / "model")
    (tmp_path / "model" / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    (tmp_path / "model" / "pytorch_model.bin").write_bytes(pickle.dumps({"weights": _Payload(marker)}))
    with pytest.raises(CheckpointError, match="pickle"):
        load_pretrained(tmp_path / "model")
    assert not marker.exists()


def test_chat_templates_cannot_reach_python(tmp_path):
    marker = tmp_path / "pwned"
    hostile = [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}",
        "{% for m in messages %}{{ m.content.__class__.__base__ }}{% endfor %}",
        "{{ lipsum.__globals__['os'].popen('touch " + str(marker) + "').read() }}",
    ]
    path = write_jsonl([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
                       tmp_path / "chat.jsonl")
    for template in hostile:
        tok = Tokenizer(toy_tokenizer(), TokenizeConfig(max_length=64, chat_template=template))
        with pytest.raises(DataError, match=r"record 0, field '<record>': the chat template failed \(Security"):
            load_sources([path], tok, kind="sft")
    assert not marker.exists()


def test_config_paths_cannot_escape_the_run_folder(tmp_path):
    config = small_config("dpo", tmp_path / "run", "--config.reference.kind=precomputed",
                          "--config.reference.cache_dir=../../../tmp/escaped")
    with pytest.raises(ConfigError, match="leaves the run folder"):
        train(config)
    assert not (tmp_path / "run" / "checkpoints").exists()
    config = small_config("sft", tmp_path / "run2", "--config.data.train=toy:../../../etc/passwd")
    with pytest.raises(ConfigError, match=r"toy:../../../etc/passwd is unknown"):
        train(config)
    assert not (tmp_path / "run2").exists()  # refused before anything was written
    assert not list(tmp_path.rglob("*passwd*"))
    inside = small_config("dpo", tmp_path / "run3", "--config.train.steps=2", "--config.eval.generate=0",
                          "--config.reference.kind=precomputed", "--config.reference.cache_dir=cache/ref")
    train(inside)
    assert list((tmp_path / "run3" / "cache" / "ref").glob("*.npz"))


@pytest.mark.parametrize("link", ["checkpoints", "data", "metrics.jsonl", "checkpoints/4"])
def test_a_link_out_of_the_run_folder_is_refused_before_anything_is_written(tmp_path, link):
    outside = tmp_path / "outside"
    outside.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    if "/" in link:
        (run / "checkpoints").mkdir()
    (run / link).symlink_to(outside)
    with pytest.raises(checkpoints.RunFolderError, match=rf"{link} is a link to {outside}, outside the run folder"):
        train(small_config("sft", run, "--config.train.steps=2"))
    assert [p.name for p in run.iterdir()] == [link.split("/")[0]]
    assert not list(outside.iterdir())


def test_load_sources_reports_unreadable_files(tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(b'{"messages": [}\n\xff\xfe\n')
    tok = Tokenizer(toy_tokenizer(), TokenizeConfig(max_length=64))
    with pytest.raises(DataError, match=r"bad.jsonl"):
        load_sources([tmp_path / "bad.jsonl"], tok, kind="sft")


# ------------------------------------------------------------------------------------------ bounded records
HUGE_RECORD = """
import json, sys, time
from jaxalign.data import DataError, TokenizeConfig, Tokenizer, load_sources
from jaxalign.data.toy import toy_tokenizer


def status(field):  # this process's own RSS figures in bytes (ru_maxrss would include the forked parent's)
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1]) * 1024


tok = Tokenizer(toy_tokenizer(), TokenizeConfig(max_length=64))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM restarts from the current RSS
start = time.perf_counter()
try:
    load_sources([sys.argv[1]], tok, kind="sft")
    message = ""
except DataError as err:
    message = str(err)
print(json.dumps({"seconds": time.perf_counter() - start, "message": message, "peak": status("VmHWM")}))
"""


def test_a_50_mb_record_is_rejected_fast_and_small(tmp_path):
    import json

    path = tmp_path / "huge.jsonl"
    good = json.dumps({"prompt": "1+1=", "completion": "2"})
    with path.open("w") as handle:
        handle.write(good + "\n")
        handle.write(json.dumps({"prompt": "x" * 50_000_000, "completion": "y"}) + "\n")  # one valid 50 MB record
        handle.write(json.dumps({"prompt": "z" * 1_500_000, "completion": "y"}) + "\n")  # 1.5 M characters
        handle.write(good + "\n")
    done = subprocess.run([sys.executable, "-c", HUGE_RECORD, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert "2 invalid record(s)" in result["message"], result
    assert "record 1, field '<record>': line 2 has 50000034 bytes, over data.max_record_chars=1000000" in (
        result["message"])
    assert "record 2, field '<record>': at least 1500" in result["message"]
    assert result["seconds"] < 5 and result["peak"] < 2**30, result


def test_hanging_and_hostile_templates_are_per_record_errors_within_the_time_limit(tmp_path):
    records = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 2
    path = write_jsonl(records, tmp_path / "chat.jsonl")
    cases = {
        "{{ 'a' * 10**9 }}": "SecurityError: repeating 1 items 1000000000 times exceeds",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}":
            "did not finish within data.template_timeout=0.5 s",
        "{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}": "RecursionError",
        "{% include 'other.jinja' %}": "include / import / extends",
        "{% import 'macros.jinja' as m %}{{ m.x() }}": "include / import / extends",
    }
    for template, expected in cases.items():
        tok = Tokenizer(toy_tokenizer(), TokenizeConfig(max_length=64, chat_template=template, template_timeout=0.5))
        start = time.perf_counter()
        with pytest.raises(DataError) as info:
            load_sources([path], tok, kind="sft")
        assert time.perf_counter() - start < 3 * 0.5 + 1, template  # two records, each stopped at its limit
        for index in (0, 1):
            assert f"record {index}, field '<record>': the chat template" in str(info.value), str(info.value)
        assert expected in str(info.value), (template, str(info.value))
