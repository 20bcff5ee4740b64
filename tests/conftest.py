"""Test setup: 8 fake CPU devices, offline hub, persistent compilation cache, shared fixtures."""

import os

# XLA's backend optimisation level 0: the same HLO, compiled with fewer LLVM passes; half the suite's time is
# compilation of tiny models, and the results agree with the default level to float rounding. The collective
# timeout: the 8 fake devices' all-reduces meet in a rendezvous that XLA:CPU aborts the process on (LOG(FATAL) in
# AwaitAndLogIfStuck) when a participant is late past the timeout.
# PJRT_NPROC: XLA:CPU runs every device's part of a program, and the dispatch of the next program, on one thread
# pool of max(cores, devices) threads, 8 here; with programs queued behind a collective, 7 of its 8 participants
# waited at the rendezvous and the 8th never got a thread (a deadlock, then the abort above: the CPI-FT study every
# time, the training loop now and then, a 25-line loop of jitted steps on a 2-core AMD EPYC); with 24 threads that
# loop finishes (tests/test_parallel.py). jaxalign.parallel.make_mesh warns where the pool is too small
os.environ.setdefault("PJRT_NPROC", "24")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                      "--xla_cpu_collective_call_terminate_timeout_seconds=300 "
                      "--xla_cpu_collective_timeout_seconds=300")
# glibc writes its fatal messages (heap corruption and the like) to /dev/tty unless this is set, so a worker that
# aborts would leave only Python's "Fatal Python error: Aborted" in the log
os.environ.setdefault("LIBC_FATAL_STDERR_", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/jaxalign/jax-compilation-cache"))
if os.environ.get("PYTEST_XDIST_WORKER"):  # one cache per xdist worker: JAX writes cache files in place, unlocked
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"],
                                                           os.environ["PYTEST_XDIST_WORKER"])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from pathlib import Path

import jax
import pytest

from jaxalign.models import LlamaConfig
from jaxalign.parallel import make_mesh

TINY = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                   num_kv_heads=2)


@pytest.fixture(scope="session")
def mesh8():
    """A (2, 2, 2) mesh over ('data', 'fsdp', 'tensor') on 8 fake CPU devices."""
    assert jax.device_count() == 8, "tests expect 8 fake CPU devices (XLA_FLAGS set before jax import)"
    return make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


@pytest.fixture(scope="session")
def tiny_config():
    return TINY


def smollm2_gguf_path() -> Path | None:
    from jaxalign.models import bundled_smollm2

    return bundled_smollm2()
