"""Orbax checkpoints of a run: save (async, keep-N), restore the newest one that reads back; the run folder's lock;
and the SIGTERM / SIGINT handler (installed by the CLI) that makes the loop save and stop at the next step boundary.

A checkpoint holds the ``TrainState`` and a JSON meta record (step, data position, objective name). A broken
checkpoint (half-written, corrupt) is skipped with a warning and the next older one restored.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import warnings
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxalign.train.step import TrainState


def manager(workdir: Path, keep: int) -> ocp.CheckpointManager:
    return ocp.CheckpointManager((Path(workdir) / "checkpoints").resolve(),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=keep,
                                                                      enable_async_checkpointing=True))


def save(manager: ocp.CheckpointManager, state: TrainState, step: int, meta: dict, *, wait: bool = False) -> None:
    """Saves ``state`` as ``step`` (nothing when that step is already saved); ``wait`` blocks until written."""
    if manager.latest_step() != step:
        manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                   meta=ocp.args.JsonSave({"step": step, **meta})), force=True)
    if wait:
        manager.wait_until_finished()


def abstract_of(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def restore_latest(manager: ocp.CheckpointManager, state: TrainState) -> tuple[TrainState, dict] | None:
    """The newest checkpoint that restores into ``state``'s shapes and shardings; broken ones are skipped with a
    warning."""
    target = abstract_of(state)
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                     meta=ocp.args.JsonRestore()))
            return TrainState(*restored.state), restored.meta
        except Exception as err:  # a half-written or corrupt checkpoint must not stop the run
            warnings.warn(f"checkpoint {step} could not be restored ({type(err).__name__}: {err}); trying an "
                          "older one", stacklevel=2)
    return None


class StopSignals:
    """SIGTERM / SIGINT set a flag; the loop saves and exits at the next step boundary."""

    def __init__(self):
        self.requested, self._previous = None, {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame):
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class NoSignals:
    """What the loop sees when the caller keeps its own signal handling (library calls, tests): never a request, so
    Ctrl-C raises ``KeyboardInterrupt`` as usual."""

    requested = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class RunFolderBusy(RuntimeError):
    """Another process is training into the same run folder."""


class RunLock:
    """An exclusive ``flock`` on ``workdir/.lock`` (holding the owner's PID) for the life of a run: a second run into
    the same folder fails at once with the first one's PID; the kernel drops the lock when its process dies, so a
    lock left by a killed run never blocks the next one."""

    def __init__(self, workdir: Path):
        self.path = Path(workdir) / ".lock"
        self._handle = None

    def __enter__(self):
        handle = self.path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip() or "unknown"
            handle.close()
            raise RunFolderBusy(f"{self.path.parent} is in use by another jaxalign run (PID {owner}); wait for it to "
                                "finish, stop it (it saves on SIGTERM), or give another --config.workdir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._handle = handle
        return self

    def __exit__(self, *exc):
        if self._handle is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None
