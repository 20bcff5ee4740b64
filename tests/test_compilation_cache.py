"""The persistent compilation cache the CLI turns on: entries are read back in a new process, a damaged entry is
found by its digest, removed and compiled again, and the settings (off, a folder, JAX's own variable) are obeyed."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from test_train import SMALL

from jaxalign import compilation_cache
from jaxalign.compilation_cache import seal, unseal

PROGRAM = """
import json, sys, warnings
from jaxalign import compilation_cache
folder = compilation_cache.enable(sys.argv[1])
import jax, jax.numpy as jnp
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    x = jnp.linspace(0.0, 1.0, 96 * 96).reshape(96, 96)
    y = jax.jit(lambda x: jnp.tanh(x @ x.T) * 3.0 + jnp.cumsum(x, axis=1))(x)
    value = [float(y.sum()), float(y[3, 5])]
print(json.dumps({"folder": str(folder), "value": value, "warnings": [str(w.message) for w in caught],
                  **compilation_cache.stats()}))
"""


def clean_env(**extra) -> dict:
    """The test process's environment without JAX's own cache variable (the suite sets it), so the CLI's default
    rule applies; every program is cached, however fast it compiles."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "JAXALIGN_COMPILATION_CACHE")}
    return {**env, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "PYTHONUNBUFFERED": "1", **extra}


def run_program(folder: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(folder)], capture_output=True, text=True, timeout=240,
                          env=clean_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*-cache"))


def test_seal_and_unseal():
    value = bytes(range(256)) * 7
    stored = seal(value)
    assert unseal(stored) == value and unseal(seal(b"")) == b""
    assert unseal(stored[:-1]) is None and unseal(stored[:100]) is None and unseal(b"") is None
    assert unseal(value) is None  # written without the digest (by JAX alone, or an older jaxalign)
    flipped = bytearray(stored)
    flipped[500] ^= 0x01
    assert unseal(bytes(flipped)) is None


def test_entries_are_read_back_and_damaged_ones_recompiled(tmp_path):
    folder = tmp_path / "cache"
    first = run_program(folder)
    assert first["folder"] == str(folder) and first["read"] == 0 and first["written"] >= 1, first
    written = entries(folder)
    assert len(written) == first["written"] and all(unseal(p.read_bytes()) is not None for p in written)

    second = run_program(folder)
    assert second["read"] == first["written"] and second["written"] == 0, second
    assert second["value"] == first["value"] and not second["warnings"]

    # a run killed while writing leaves a truncated entry; a disk or a person may alter one in place
    truncated, altered = written[0], written[-1]
    truncated.write_bytes(truncated.read_bytes()[:57])
    if altered != truncated:
        data = bytearray(altered.read_bytes())
        data[len(data) // 3] ^= 0x40
        altered.write_bytes(bytes(data))
    damaged = {truncated, altered}
    third = run_program(folder)
    assert third["value"] == first["value"], third
    assert third["written"] == len(damaged) and third["read"] == first["written"] - len(damaged), third
    named = [w for w in third["warnings"] if "failed its SHA-256 check" in w]
    assert sorted(named) == sorted(w for w in named if any(str(p) in w for p in damaged)) and len(named) == len(damaged)
    assert all(unseal(p.read_bytes()) is not None for p in entries(folder))  # replaced by good entries

    fourth = run_program(folder)
    assert fourth["read"] == first["written"] and fourth["written"] == 0 and not fourth["warnings"], fourth


def test_settings(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("JAXALIGN_COMPILATION_CACHE", "off")
    assert compilation_cache.enable() is None
    assert compilation_cache.summary(None).startswith("off")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.warns(UserWarning, match=r"compilation cache off: cannot use .*a-file/cache"):
        assert compilation_cache.enable(blocker / "cache") is None
    monkeypatch.setenv("JAXALIGN_COMPILATION_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("JAXALIGN_COMPILATION_CACHE_GB", "lots")
    with pytest.raises(ValueError, match="JAXALIGN_COMPILATION_CACHE_GB='lots' is not a number"):
        compilation_cache.enable()
    monkeypatch.setenv("JAXALIGN_COMPILATION_CACHE_GB", "0")
    with pytest.raises(ValueError, match="must be above 0"):
        compilation_cache.enable()
    # JAX's own variable is left as it is (a fresh process: this one has the suite's folder set already)
    said = subprocess.run([sys.executable, "-c", "from jaxalign import compilation_cache as c; import jax; "
                           "print(c.enable(), jax.config.jax_compilation_cache_dir)"], capture_output=True, text=True,
                          timeout=120, env=clean_env(JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax-own")))
    assert said.stdout.split() == [str(tmp_path / "jax-own")] * 2, said.stderr[-2000:]
    # a bucket URL goes to JAX as it is (no local folder made of it)
    monkeypatch.delenv("JAXALIGN_COMPILATION_CACHE_GB")
    calls = []
    monkeypatch.setattr(compilation_cache, "_install_checks", lambda: calls.append("checks"))
    monkeypatch.setattr(jax.config, "update", lambda name, value: calls.append((name, value)))
    assert compilation_cache.enable("gs://bucket/cache") == "gs://bucket/cache"
    assert calls == ["checks", ("jax_compilation_cache_dir", "gs://bucket/cache"),
                     ("jax_compilation_cache_max_size", int(compilation_cache.DEFAULT_GB * 2**30))]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compilation_cache.default_dir() == tmp_path / "xdg" / "jaxalign" / "compilation"


@pytest.mark.slow
def test_cli_train_reads_its_programs_back(tmp_path):
    """`jaxalign train` twice on one job: the second run reads its programs back and trains to the same loss."""
    cache = tmp_path / "cache"
    outputs = []
    for run in ("a", "b"):
        command = [sys.executable, "-m", "jaxalign.cli", "train", "--config", "sft", *SMALL,
                   "--config.train.steps=6", "--config.eval.generate=0", f"--config.workdir={tmp_path / run}"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                              env=clean_env(JAXALIGN_COMPILATION_CACHE=str(cache)))
        assert done.returncode == 0, done.stderr[-3000:]
        line = next(x for x in done.stdout.splitlines() if x.startswith("compile cache"))
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        outputs.append((line, [r["loss"] for r in rows if r["split"] == "train"]))
    (first, loss_a), (second, loss_b) = outputs
    # clean_env caches every program however fast it compiles: a threshold above 0 made this depend on the machine's
    # load (a program compiled in 0.19 s by the first run and in 0.21 s by the second was written only by the second)
    counts = [re.search(r": (\d+) program\(s\) read back .*, (\d+) written$", x) for x in (first, second)]
    assert str(cache) in first and all(counts), outputs
    (read_a, written_a), (read_b, written_b) = [tuple(int(g) for g in m.groups()) for m in counts]
    assert read_a == 0 and written_a >= 1 and read_b == written_a and written_b == 0, outputs
    assert loss_a == loss_b and len(loss_a) >= 2
