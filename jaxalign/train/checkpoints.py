"""Orbax checkpoints of a run: save (async, keep-N), restore the newest one that reads back; the run folder's lock;
and the SIGTERM / SIGINT handler (installed by the CLI) that makes the loop save and stop at the next step boundary.

A checkpoint holds the ``TrainState`` and a JSON meta record (step, data position, objective name), and once its
(async) save has completed, a manifest of its files' sizes and SHA-256 hashes. The state is written per layer
whatever ``model.scan_layers`` is: a scanned model's stacked layers are split on the host (views of the fetched
state; nothing is copied on the devices), so the files do not depend on how the run held its layers. A
multi-process run, whose state no one process holds whole, writes its own layout; restores read either. A
checkpoint whose files do not match its manifest (flipped bytes, truncation, a save that never completed) or that
does not restore is moved to ``broken-checkpoints/`` with a warning and the next older one restored; when none is
good the run stops.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxalign.models.llama import layer_plan, other_layer_layout
from jaxalign.train.step import TrainState

MANIFEST = "jaxalign-manifest.json"
BROKEN = "broken-checkpoints"
# The errno values of a save that failed for lack of room or a failing disk.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS}


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, quota, I/O error); the message names the folder, the bytes
    needed and free, and says the earlier checkpoints are intact."""


class NoGoodCheckpoint(RuntimeError):
    """A run folder has checkpoints but none passes verification; nothing is restored and nothing overwritten."""


def _digest(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def content_hashes(folder: Path) -> dict[str, list]:
    """``{relative path: [bytes, sha256]}`` of every file in a step folder (the manifest excluded)."""
    return {str(p.relative_to(folder)): [p.stat().st_size, _digest(p)]
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}


def seal(folder: Path) -> None:
    """Writes ``folder``'s manifest (written last, atomically: a folder without one was never completed)."""
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"format": 1, "files": content_hashes(folder)}, indent=0))
    with tmp.open("rb") as handle:
        os.fsync(handle.fileno())
    tmp.replace(folder / MANIFEST)


def verify(folder: Path) -> str | None:
    """None when every file of the step folder matches its manifest; else what is wrong, in words."""
    try:
        recorded = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return "it has no manifest (its save never completed)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"its manifest is unreadable ({type(err).__name__})"
    present = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST}
    if missing := sorted(set(recorded) - present):
        return f"{missing[0]} is missing"
    if extra := sorted(present - set(recorded)):
        return f"{extra[0]} is not in its manifest"
    for name, (size, digest) in recorded.items():
        path = folder / name
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
        if _digest(path) != digest:
            return f"{name} does not match its content hash"
    return None


def _write_failure(err: BaseException) -> str | None:
    """The reason in words when ``err`` (or an error it wraps) is a full disk or an I/O failure."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _WRITE_ERRNOS:
            return os.strerror(err.errno)
        text = str(err)
        for code in _WRITE_ERRNOS:
            if os.strerror(code) in text:
                return os.strerror(code)
        err = err.__cause__ or err.__context__
    return None


def state_bytes(state) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if hasattr(x, "dtype"))


class Checkpoints:
    """The run's ``checkpoints/`` folder: Orbax saves (async, keep-N), each sealed with a manifest of content
    hashes once written; restores verify the manifest first. A checkpoint that fails verification or does not
    restore is moved to ``broken-checkpoints/`` (never trusted again) and the next older one is used."""

    def __init__(self, workdir: Path, keep: int, model_config=None, *, per_layer: bool = True):
        self.workdir = Path(workdir)
        # model_config: the run's model (a LlamaConfig); with per_layer, a scanned one's saves are written per layer
        self.layout = None if model_config is None else other_layer_layout(model_config)
        self.stacked = model_config is not None and bool(layer_plan(model_config)[2])
        self.per_layer = per_layer
        self.folder = (self.workdir / "checkpoints").resolve()
        # cleanup_tmp_directories: the temporary folder of a save that was killed or failed is removed at start
        self.manager = ocp.CheckpointManager(self.folder, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True, cleanup_tmp_directories=True))
        self._unsealed: list[int] = []
        self._needed = 0

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, state: TrainState, step: int, meta: dict, *, wait: bool = False) -> None:
        """Saves ``state`` as ``step`` (nothing when that step is already saved); ``wait`` blocks until written
        and sealed. A failed write raises ``CheckpointWriteError`` with the temporary files removed."""
        self.finish()
        if step not in self.manager.all_steps():
            self._needed = state_bytes(state)
            free = shutil.disk_usage(self.workdir).free
            if free < self._needed:  # checked first: a save that cannot fit is not started
                raise CheckpointWriteError(self._explain(step, os.strerror(errno.ENOSPC), free))
            try:
                self.manager.save(step, args=ocp.args.Composite(
                    state=ocp.args.StandardSave(self.on_disk(state)),
                    meta=ocp.args.JsonSave({"step": step, **meta})), force=True)
            except Exception as err:
                self._failed(err, step)
                raise
            self._unsealed.append(step)
        if wait:
            self.finish()

    def on_disk(self, state: TrainState):
        """The tree a save writes: ``state`` itself, or, for a scanned model in one process with ``per_layer``,
        its per-layer form: slices (views) of the state fetched to the host (``jax.device_get``: a copy from an
        accelerator, the buffers themselves on the CPU), which Orbax copies as it does every host array it saves
        before the save returns (so the next step may reuse the buffers). Nothing extra is made on the devices; the
        host holds about one copy of the state more than a save of the stacked arrays (docs/training.md)."""
        whole = all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(state))
        if not (self.stacked and self.per_layer and whole):
            return state
        return self.layout[0](jax.device_get(state))

    def finish(self) -> None:
        """Waits for the save in flight and seals what this process saved."""
        try:
            self.manager.wait_until_finished()
        except Exception as err:
            self._failed(err, self._unsealed[-1] if self._unsealed else None)
            raise
        if jax.process_index() == 0:
            for step in self._unsealed:
                if (self.folder / str(step)).is_dir():
                    seal(self.folder / str(step))
        self._unsealed = []

    def _failed(self, err: BaseException, step: int | None) -> None:
        reason = _write_failure(err)
        if reason is None:
            return
        with contextlib.suppress(Exception):  # let the save's remaining writer threads end
            self.manager.wait_until_finished()
        quiet = 0
        for _ in range(30):  # writers still finishing may recreate a temporary folder: remove until it stays gone
            leftovers = list(self.folder.glob("*.orbax-checkpoint-tmp*"))
            for tmp in leftovers:
                shutil.rmtree(tmp, ignore_errors=True)
            quiet = 0 if leftovers else quiet + 1
            if quiet == 3:
                break
            time.sleep(0.1)
        self._unsealed = [s for s in self._unsealed if s != step]
        raise CheckpointWriteError(self._explain(step, reason, shutil.disk_usage(self.workdir).free)) from None

    def _explain(self, step: int | None, reason: str, free: int) -> str:
        good = [s for s in self.steps() if s != step]
        kept = (f"the earlier checkpoints are intact (latest: step {good[-1]})" if good else
                "there is no earlier checkpoint")
        return (f"could not save checkpoint {step} in {self.folder}: {reason}; it needs about "
                f"{self._needed / 2**20:.1f} MiB and {free / 2**20:.1f} MiB are free; {kept}. Free some space and "
                "rerun the same command: it resumes from the latest good checkpoint.")

    def restore_latest(self, state: TrainState) -> tuple[TrainState, dict] | None:
        """The newest checkpoint that verifies and restores into ``state``'s shapes and shardings; broken ones are
        moved aside with a warning. None for a folder without checkpoints; ``NoGoodCheckpoint`` when there are some
        but none is good (nothing is moved then). With the run's ``model_config``, a checkpoint that does not restore
        in one layer layout (per layer, or a scanned model's stacked layers) is tried in the other before it counts
        as broken: the per-layer one first for a scanned model, as its saves write."""
        target = abstract_of(state)
        problems = []
        for step in reversed(self.steps()):
            problem = verify(self.folder / str(step))
            if problem is None:
                try:
                    restored_state, restored_meta = restore_in_layout(self.manager, step, target, self.layout,
                                                                      meta=True,
                                                                      other_first=self.stacked and self.per_layer)
                except Exception as err:  # a readable manifest over unreadable Orbax metadata
                    problem = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
                else:
                    for bad in problems:
                        self._set_aside(bad[0])
                    if problems:
                        if jax.process_count() > 1:  # every process sees the folder after process 0 moved steps
                            from jax.experimental import multihost_utils

                            multihost_utils.sync_global_devices("jaxalign-checkpoints-set-aside")
                        self.manager.reload()
                    return TrainState(*restored_state), restored_meta
            warnings.warn(f"checkpoint {step} in {self.folder} is broken ({problem}); trying an older one",
                          stacklevel=2)
            problems.append((step, problem))
        if problems:
            listed = "; ".join(f"step {s}: {p}" for s, p in problems)
            raise NoGoodCheckpoint(
                f"{self.folder} has no good checkpoint ({listed}). Nothing was restored or changed; to start this "
                "run over, rerun with --config.train.resume=False (the broken run moves to a replaced-* folder).")
        return None

    def _set_aside(self, step: int) -> None:
        if jax.process_index() != 0:
            return
        target = self.workdir / BROKEN / f"{step}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
        target.parent.mkdir(exist_ok=True)
        (self.folder / str(step)).replace(target)
        warnings.warn(f"checkpoint {step} moved to {target}; it will not be used again", stacklevel=3)

    def close(self) -> None:
        self.manager.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:
            with contextlib.suppress(Exception):  # the error in flight is the one to report
                self.close()


def good_step(folder: Path, step: int | None = None) -> tuple[int, list[str]]:
    """The newest step folder under ``folder`` (a run's ``checkpoints/``) that verifies, or ``step`` itself when
    given and good; with the broken ones passed over, as ``step N: problem`` lines. Raises ``NoGoodCheckpoint``."""
    steps = sorted((int(p.name) for p in Path(folder).iterdir() if p.name.isdigit() and p.is_dir()),
                   reverse=True) if Path(folder).is_dir() else []
    if step is not None:
        steps = [step] if step in steps else []
        if not steps:
            raise FileNotFoundError(f"{folder}: no checkpoint {step}")
    skipped = []
    for candidate in steps:
        problem = verify(Path(folder) / str(candidate))
        if problem is None:
            return candidate, skipped
        skipped.append(f"step {candidate}: {problem}")
    if not steps:
        raise FileNotFoundError(f"{folder}: no checkpoint to restore")
    raise NoGoodCheckpoint(f"{folder} has no good checkpoint ({'; '.join(skipped)})")


def restore_in_layout(manager, step: int, target, other_layout=None, *, meta: bool = False,
                      other_first: bool = False) -> tuple[Any, Any]:
    """``(state, meta record or None)`` of checkpoint ``step`` restored into ``target`` (abstract arrays). With
    ``other_layout`` = ``(to_saved, to_live)`` (the model's ``other_layer_layout``), a checkpoint that does not
    restore into ``target``'s layer layout is restored in the other one, then converted to ``target``'s layout and
    shardings; ``other_first`` tries the other layout first. The first error is raised when neither restores."""
    def restore(state_target):
        args = {"state": ocp.args.StandardRestore(state_target)}
        if meta:
            args["meta"] = ocp.args.JsonRestore()
        restored = manager.restore(step, args=ocp.args.Composite(**args))
        return restored.state, restored.meta if meta else None

    def in_other_layout():
        to_saved, to_live = other_layout
        state, record = restore(to_saved(target))
        state = jax.tree.unflatten(jax.tree.structure(target), jax.tree.leaves(to_live(state)))
        return jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), state, target), record

    attempts = [lambda: restore(target)] if other_layout is None else (
        [in_other_layout, lambda: restore(target)] if other_first else [lambda: restore(target), in_other_layout])
    first = None
    for attempt in attempts:
        try:
            return attempt()
        except Exception as err:
            first = first or err
    raise first


def abstract_of(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class StopSignals:
    """SIGTERM / SIGINT set a flag; the loop saves and exits at the next step boundary (start-up stops at its next
    stage, before anything is half-made). A second Ctrl-C raises ``KeyboardInterrupt`` at once."""

    def __init__(self):
        self.requested, self._previous = None, {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame):
        if self.requested == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C does not wait for the step boundary
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
# Fields under SAME_RUN_FIELDS that change no result: a run may resume with them changed (the checkpoint's layer
# layout is converted on restore).
RESUME_MAY_CHANGE = ("model.scan_layers",)
RUN_FILES = ("checkpoints", BROKEN, "metrics.jsonl", "summary.json", "tensorboard", "curves.png", "config.json",
             "model_config.json", "tokenizer", "data")


def check_links(workdir: Path) -> None:
    """Refuses a run folder with a symbolic link (at its top level, or inside ``checkpoints/``, ``data/`` or
    ``tokenizer/``) that leads outside it: the run would write, and keep-N would delete, through it."""
    root = Path(workdir).resolve()
    if not root.is_dir():
        return
    entries = [*root.iterdir()]
    for sub in ("checkpoints", "data", "tokenizer", BROKEN):
        if (root / sub).is_dir() and not (root / sub).is_symlink():
            entries += (root / sub).iterdir()
    for entry in entries:
        if entry.is_symlink() and not entry.resolve().is_relative_to(root):
            raise RunFolderError(f"{entry} is a link to {entry.resolve()}, outside the run folder {root}; a run "
                                 "writes and deletes only inside its folder: remove the link or give another "
                                 "--config.workdir")


def has_checkpoints(workdir: Path) -> bool:
    folder = Path(workdir) / "checkpoints"
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def differences(saved: dict, new: dict) -> list[str]:
    """``field: saved -> new`` for the ``SAME_RUN_FIELDS`` two effective configs disagree on."""
    from jaxalign.train.fields import flatten

    old, now = dict(flatten(saved)), dict(flatten(new))
    fields = sorted(f for f in set(old) | set(now)
                    if (f.startswith(SAME_RUN_FIELDS) or f in SAME_RUN_FIELDS) and f not in RESUME_MAY_CHANGE)
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
