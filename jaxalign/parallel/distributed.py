"""Multi-process (multi-host) start-up: ``jax.distributed.initialize`` from the config or the environment.

JAX is multi-controller: every host runs the same program, and each process feeds its own slice of the global
batch. ``initialize`` must run before anything touches a JAX backend (``jax.devices()``, the first array).

``distributed.mode``:

* ``auto`` (default): initialise when the environment says this is one process of several: an explicit
  coordinator (config or ``JAX_COORDINATOR_ADDRESS``), a SLURM job step with several tasks, an Open MPI job with
  several ranks, or a multi-host Cloud TPU slice. A single process on one machine is left alone.
* ``on``: always initialise (JAX's own cluster auto-detection fills what the config leaves empty).
* ``off``: never (one process, all its local devices).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

MODES = ("auto", "on", "off")


def detect_cluster(environ: Mapping[str, str] | None = None) -> str | None:
    """The kind of multi-process launch the environment describes, or None for a single process."""
    env = os.environ if environ is None else environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "explicit"
    if env.get("SLURM_JOB_ID") and _int_from(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") > 1:
        return "slurm"
    if _int_from(env, "OMPI_COMM_WORLD_SIZE") > 1:
        return "openmpi"
    hosts = env.get("TPU_WORKER_HOSTNAMES", "")
    if "," in hosts or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "tpu"
    return None


def _int_from(env: Mapping[str, str], *names: str) -> int:
    for name in names:
        try:
            return int(env[name])
        except (KeyError, ValueError):
            continue
    return 0


def initialize(config: Any = None) -> bool:
    """Joins the distributed job described by ``config`` (the ``distributed`` section, a dict or None) and the
    environment. Returns True when this process is part of a multi-process job. Safe to call twice."""
    cfg = dict(config or {})
    mode = cfg.get("mode", "auto")
    if mode not in MODES:
        raise ValueError(f"distributed.mode={mode!r}; choose one of {', '.join(MODES)}")
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    coordinator = cfg.get("coordinator_address") or None
    if mode == "off" or (mode == "auto" and not coordinator and detect_cluster() is None):
        return False
    num_processes = int(cfg.get("num_processes") or 0) or None
    process_id = cfg.get("process_id", -1)
    process_id = None if process_id is None or int(process_id) < 0 else int(process_id)
    local_ids = cfg.get("local_device_ids") or None
    if isinstance(local_ids, str):
        local_ids = [int(i) for i in local_ids.split(",") if i.strip()]
    if coordinator and (num_processes is None or process_id is None) and detect_cluster() in (None, "explicit"):
        raise ValueError("distributed.coordinator_address is set, so distributed.num_processes and "
                         "distributed.process_id are needed too (or launch under SLURM / Open MPI / a TPU pod, "
                         "which provide them)")
    # Cross-process collectives between CPU devices (tests over loopback, CPU clusters) need gloo.
    jax.config.update("jax_cpu_collectives_implementation", cfg.get("cpu_collectives", "gloo"))
    timeout = cfg.get("initialization_timeout", 300)
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, local_device_ids=local_ids,
                                   initialization_timeout=int(timeout))
    except RuntimeError as err:
        if "before" not in str(err):
            raise
        reason = str(err).rstrip(".")
        raise ValueError(f"distributed: {reason}. Joining a multi-process job must happen first in a fresh process "
                         "(jaxalign train does it before anything else; in Python, call train() before any other "
                         "JAX work)") from None
    return jax.process_count() > 1



def to_host(x) -> np.ndarray:
    """The whole value of ``x`` on this host as numpy: a plain read when this process holds all of it (one process,
    or a replicated array), else gathered from every process (``multihost_utils.process_allgather``; every
    process must call it)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def gather_rows(local: np.ndarray) -> np.ndarray:
    """Every process's ``local`` rows, concatenated in process order (the identity in one process)."""
    if jax.process_count() == 1:
        return np.asarray(local)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(local), tiled=True))
