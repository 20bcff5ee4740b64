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


class RunFolderError(RuntimeError):
    """The run folder cannot take this run (in use, or holding a different run); the message says what to do."""


class RunFolderBusy(RunFolderError):
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


# What makes a checkpoint this run's: a resumed run must agree on these (train.steps, logging, eval, the mesh and
# the processes may change between a run and its resume).
SAME_RUN_FIELDS = ("seed", "tokenizer", "model.", "data.", "objective.", "reference.kind", "lora.", "optim.",
                   "train.batch_size", "train.grad_accum")
RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json", "tensorboard", "curves.png", "config.json",
             "model_config.json", "tokenizer", "data")


def has_checkpoints(workdir: Path) -> bool:
    folder = Path(workdir) / "checkpoints"
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def differences(saved: dict, new: dict) -> list[str]:
    """``field: saved -> new`` for the ``SAME_RUN_FIELDS`` two effective configs disagree on."""
    from jaxalign.train.fields import flatten

    old, now = dict(flatten(saved)), dict(flatten(new))
    fields = sorted(f for f in set(old) | set(now)
                    if f.startswith(SAME_RUN_FIELDS) or f in SAME_RUN_FIELDS)
    return [f"{f}: {old.get(f)!r} -> {now.get(f)!r}" for f in fields if old.get(f) != now.get(f)]


def check_resumable(workdir: Path, effective: dict) -> None:
    """Refuses to resume a run folder whose checkpoints were trained with a different config (``effective``: the
    new run's ``effective_config``)."""
    saved = Path(workdir) / "config.json"
    if not (has_checkpoints(workdir) and saved.exists()):
        return
    from jaxalign.train.config import load_config
    from jaxalign.train.spec import RunSpec, effective_config

    previous = load_config(str(saved))
    changed = differences(effective_config(previous, RunSpec.from_config(previous, check=False)), effective)
    if changed:
        shown = "\n  - ".join(changed[:10]) + (f"\n  - ... and {len(changed) - 10} more" if len(changed) > 10 else "")
        raise RunFolderError(
            f"{workdir} holds a run trained with a different config:\n  - {shown}\nTo resume that run, rerun it with "
            f"its own config (--config {saved}); to start fresh in this folder, add --config.train.resume=False "
            "(the old run moves to a replaced-* folder inside it); or give another --config.workdir.")


def retire(workdir: Path) -> Path | None:
    """Moves a previous run's files into ``workdir/replaced-<UTC time>/`` (train.resume=False in a used folder:
    nothing is deleted); returns that folder, or None when there was nothing to move."""
    import time

    present = [name for name in RUN_FILES if (Path(workdir) / name).exists()]
    if not present or not has_checkpoints(workdir):
        return None
    target = Path(workdir) / time.strftime("replaced-%Y%m%d-%H%M%S", time.gmtime())
    suffix = 0
    while target.exists():
        suffix += 1
        target = target.with_name(f"{target.name.split('.')[0]}.{suffix}")
    target.mkdir()
    for name in present:
        (Path(workdir) / name).replace(target / name)
    return target
