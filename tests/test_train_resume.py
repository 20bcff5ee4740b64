"""Interrupted training: SIGKILL then resume ends with the parameters of an uninterrupted run; SIGTERM saves."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
from test_train import SMALL

from jaxalign.train.export import restore_model

STEPS = 160


def start(workdir):
    command = [sys.executable, "-m", "jaxalign.cli", "train", "--config", "sft", *SMALL,
               f"--config.workdir={workdir}", f"--config.train.steps={STEPS}", "--config.train.save_every=10",
               "--config.train.log_every=10", "--config.eval.generate=0", "--config.data.eval="]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_for_checkpoint(process, workdir, step, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (workdir / "checkpoints" / str(step)).exists():
            return
        if process.poll() is not None:
            raise AssertionError(f"training ended early:\n{process.stdout.read()}")
        time.sleep(0.02)
    raise AssertionError("no checkpoint in time")


def params_of(workdir):
    model, _, step = restore_model(workdir)
    from flax import nnx

    return step, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    reference = start(tmp_path / "reference")
    interrupted = start(tmp_path / "interrupted")
    wait_for_checkpoint(interrupted, tmp_path / "interrupted", 30)
    interrupted.send_signal(signal.SIGKILL)
    interrupted.wait()
    assert reference.wait(timeout=600) == 0, reference.stdout.read()
    resumed = start(tmp_path / "interrupted")
    output = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, output
    assert "resumed from" in output
    step_a, expected = params_of(tmp_path / "reference")
    step_b, got = params_of(tmp_path / "interrupted")
    assert step_a == step_b == STEPS
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    process = start(tmp_path / "run")
    wait_for_checkpoint(process, tmp_path / "run", 20)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 0, output
    assert "SIGTERM: saved a checkpoint at step" in output
    saved = max(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert 20 <= saved < STEPS
    step, _ = params_of(tmp_path / "run")
    assert step == saved
