"""Multi-process training: 2 processes x 4 fake CPU devices joined by ``jax.distributed`` over loopback train with
FSDP across the processes, checkpoint, resume, and end with the parameters of a one-process, 8-device run."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from test_train import SMALL

from jaxalign.parallel.distributed import detect_cluster, initialize
from jaxalign.train import load_config, train
from jaxalign.train.export import restore_model

# Constant learning rate: 6 steps then 6 more (a resume) equal 12 uninterrupted steps.
COMMON = [*SMALL, "--config.optim.schedule=constant", "--config.optim.warmup_steps=0", "--config.train.save_every=3",
          "--config.eval.generate=0", "--config.data.eval=", "--config.mesh.data=1", "--config.mesh.fsdp=-1"]


def free_port() -> int:
    """A free port in 61440-65535 (the range JAX's SLURM support derives ports in)."""
    for port in np.random.default_rng().permutation(np.arange(61440, 65536)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", int(port)))
            except OSError:
                continue
            return int(port)
    raise RuntimeError("no free port")


def launch(workdir, steps: int, name: str = "dpo", processes: int = 2, timeout: int = 300, slurm: bool = False,
           extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """``processes`` local processes of one job: coordinator given in the config, or found from SLURM variables
    (as ``srun`` sets them) by ``distributed.mode=auto``."""
    port = free_port()
    flags = os.environ["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=8",
                                            f"--xla_force_host_platform_device_count={8 // processes}")
    env = {**os.environ, "XLA_FLAGS": flags,
           "PYTHONUNBUFFERED": "1"}
    procs = []
    for i in range(processes):
        command = [sys.executable, "-m", "jaxalign.cli", "train", "--config", name, *COMMON,
                   f"--config.workdir={workdir}", f"--config.train.steps={steps}", *extra]
        if slurm:  # JAX derives the coordinator port from the job id: 61440 + id % 4096
            task_env = {**env, "SLURM_JOB_ID": str(port - 61440 + 4096 * 7), "SLURM_STEP_NODELIST": "localhost",
                        "SLURM_NTASKS": str(processes), "SLURM_STEP_NUM_TASKS": str(processes),
                        "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i), "SLURM_STEP_NUM_NODES": "1"}
        else:
            task_env = env
            command += [f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                        f"--config.distributed.num_processes={processes}", f"--config.distributed.process_id={i}"]
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=task_env))
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outputs


def params_of_hf(folder):
    from jaxalign.models import load_hf

    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(load_hf(folder))))


def params_of(workdir):
    model, _, step = restore_model(workdir)
    return step, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "reference"), [("sft", "model"), ("dpo", "model"), ("dpo", "precomputed")])
def test_two_processes_with_resume_equal_one_process(name, reference, tmp_path):
    extra = [f"--config.reference.kind={reference}"]
    outputs = launch(tmp_path / "multi", 6, name, extra=extra)
    assert "step 6/6" in outputs[0] and "step 6/6" not in outputs[1]  # process 0 logs, process 1 stays quiet
    outputs = launch(tmp_path / "multi", 12, name, extra=extra)
    assert "resumed from" in outputs[0] and "at step 6" in outputs[0]
    train(load_config(name, [*COMMON, *extra, f"--config.workdir={tmp_path / 'single'}", "--config.train.steps=12"]))
    step_a, multi = params_of(tmp_path / "multi")
    step_b, single = params_of(tmp_path / "single")
    assert step_a == step_b == 12
    worst = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(multi), jax.tree.leaves(single),
                                                          strict=True))
    print(f"{name} ({reference} reference): largest parameter difference, 2 processes vs 1: {worst:.2e}")
    assert worst <= 1e-5, worst
    steps = [json.loads(line)["step"] for line in (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [5, 6, 10, 12]  # each row written once (by process 0), the resume continues at step 7


def test_cluster_detection():
    assert detect_cluster({}) is None
    assert detect_cluster({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
    assert detect_cluster({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}) == "slurm"
    assert detect_cluster({"OMPI_COMM_WORLD_SIZE": "2"}) == "openmpi"
    assert detect_cluster({"TPU_WORKER_HOSTNAMES": "w0,w1"}) == "tpu"
    assert detect_cluster({"TPU_WORKER_HOSTNAMES": "localhost"}) is None
    assert detect_cluster({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}) == "explicit"
    assert initialize({"mode": "auto"}) is False  # one process here: nothing to join
    with pytest.raises(ValueError, match=r"distributed.mode='sometimes'"):
        initialize({"mode": "sometimes"})
    jax.devices()  # the backend is up: joining now is refused with a message, not a bare RuntimeError
    with pytest.raises(ValueError, match="must happen first in a fresh process"):
        initialize({"mode": "on", "coordinator_address": "127.0.0.1:1", "num_processes": 2, "process_id": 0})


@pytest.mark.slow
def test_slurm_environment_is_detected(tmp_path):
    """What ``srun`` gives each task is enough: no coordinator in the config."""
    outputs = launch(tmp_path / "slurm", 2, "sft", slurm=True)
    assert "over 8 devices in 2 processes" in outputs[0]
    assert (tmp_path / "slurm" / "checkpoints" / "2").exists()


def test_launchers_dry_run():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "DRY_RUN": "1", "RUN": "r1"}

    def dry(*command):
        result = subprocess.run(["bash", *command], cwd=root, env=env, capture_output=True, text=True, check=True)
        return result.stdout

    out = dry("launch/tpu_pod.sh", "run", "pod", "us-east5-a", "--", "--config", "dpo", "--config.optim.lr=1e-6")
    assert "tpu-vm ssh pod --zone us-east5-a --worker=all" in out and "jaxalign.cli\\ train" in out
    assert "r1-" in out and "--config.optim.lr=1e-6" in out
    assert "--worker=all" in dry("launch/tpu_pod.sh", "stop", "pod", "us-east5-a")
    assert "jaxalign.cli train --config x.py --config.distributed.mode=off" in dry("launch/gpu_single_host.sh",
                                                                                  "--config", "x.py")
    assert dry("launch/slurm.sbatch", "--config", "y.py").startswith("srun --kill-on-bad-exit=1 python3 -m")


@pytest.mark.slow
def test_grpo_in_two_processes_equals_one_process(tmp_path, monkeypatch):
    """Every process samples the whole generation batch, scores its own rows and trains on them; the update, the
    samples and the held-out evaluation equal a one-process, 8-device run."""
    from test_grpo_train import GRPO

    # a reward with signal from the first step (the 10-step SFT start answers nothing right): completion length
    (tmp_path / "length_reward.py").write_text(
        "def length(prompts, completions, completion_lengths, **_):\n"
        "    return [float(n) for n in completion_lengths]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))

    train(load_config("grpo", [*GRPO, f"--config.workdir={tmp_path / 'start'}", "--config.train.steps=1",
                               "--config.eval.generate=0"]))  # an SFT start, exported to start/sft/hf
    flags = [*GRPO, f"--config.model.path={tmp_path / 'start' / 'sft' / 'hf'}", "--config.tokenizer=",
             "--config.optim.lr=1e-3", "--config.objective.params.max_completion_length=4",
             "--config.data.eval=toy:arithmetic", "--config.data.max_length=64", "--config.train.steps=4",
             "--config.objective.params.rewards=length_reward:length"]
    outputs = launch(tmp_path / "multi", 4, "grpo", extra=flags)
    assert "step 4/4" in outputs[0]
    train(load_config("grpo", [*COMMON, *flags, f"--config.workdir={tmp_path / 'single'}"]))
    (step_a, multi), (step_b, single) = params_of(tmp_path / "multi"), params_of(tmp_path / "single")
    assert step_a == step_b == 4
    worst = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(multi), jax.tree.leaves(single),
                                                          strict=True))
    moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(
        params_of_hf(tmp_path / "start" / "sft" / "hf")), strict=True))
    print(f"GRPO: largest parameter difference, 2 processes vs 1: {worst:.2e} (moved {moved:.2e} from the start)")
    assert worst <= 1e-5 * max(moved, 1.0) and moved > 1e-4, (worst, moved)
    evals = [r for r in map(json.loads, (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines())
             if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4]  # held-out exact match, generated by both processes
    for name in ("samples.jsonl", "metrics.jsonl"):
        rows = [[json.loads(line) for line in (tmp_path / run / name).read_text().splitlines()]
                for run in ("multi", "single")]
        assert [r.get("completions", r.get("accuracy")) for r in rows[0]] == \
            [r.get("completions", r.get("accuracy")) for r in rows[1]], name
