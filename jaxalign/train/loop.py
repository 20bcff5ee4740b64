"""The training loop: config -> spec (``spec.py``) -> engine (``build.py``) -> inputs (``inputs.py``) -> steps.

Everything with side effects lives here (files, devices, signals); the math is in ``objectives`` / ``losses`` and
the step in ``step.py``. The loop keeps the step count on the host and reads device values only when it logs,
evaluates or saves (and every step with ``train.nan_policy='halt'``), so the next batch, prepared by the
``Prefetcher`` thread, overlaps the running step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jaxalign.parallel import distributed
from jaxalign.train import checkpoints, writers
from jaxalign.train.build import Engine, build, run_mesh
from jaxalign.train.evaluate import evaluate, reduce
from jaxalign.train.inputs import Inputs, Prefetcher, load_inputs
from jaxalign.train.spec import RunSpec, effective_config, validate
from jaxalign.train.writers import MetricWriter


def log(message: str) -> None:
    if jax.process_index() == 0:
        print(message, flush=True)


class TrainingHalted(RuntimeError):
    """Training stopped on purpose (``train.nan_policy='halt'``); the message says where the checkpoint is."""


@dataclasses.dataclass
class Run:
    """One training run: its spec and folder, the engine, the inputs, and where it stands."""

    spec: RunSpec
    workdir: Path
    engine: Engine
    inputs: Inputs
    manager: Any
    writer: MetricWriter
    step: int = 0  # host copy of state.step
    data_state: dict | None = None  # the pipeline's position after the last batch a step consumed
    eval_seconds: float = 0.0

    def save(self, *, wait: bool = False) -> None:
        meta = {"data": self.data_state or self.inputs.pipeline.state(), "objective": self.spec.objective.name}
        checkpoints.save(self.manager, self.engine.state, self.step, meta, wait=wait)

    def evaluate(self, step: int) -> dict[str, float]:
        started = time.time()
        values = evaluate(self.engine, self.inputs, self.engine.eval_step)
        self.eval_seconds += time.time() - started
        if values:
            self.writer.write(step, values, "eval")
            log(f"step {step} eval: " + ", ".join(f"{k} {v:.4f}" for k, v in values.items()))
        return values


def setup(config: ml_collections.ConfigDict, spec: RunSpec) -> Run:
    """Engine and inputs first: config.json, tokenizer/ and model_config.json are written once both loaded."""
    workdir = Path(spec.workdir)
    mesh = run_mesh(spec)
    log(f"mesh {dict(mesh.shape)} over {jax.device_count()} devices in {jax.process_count()} process"
        f"{'es' if jax.process_count() > 1 else ''}")
    engine = build(spec, mesh, log=log)
    inputs = load_inputs(spec, engine, workdir, log)
    effective = effective_config(config, spec)
    if jax.process_index() == 0 and not spec.train.resume and (old := checkpoints.retire(workdir)):
        log(f"train.resume=False: the previous run in {workdir} moved to {old}")
    writers.write_run_files(workdir, effective, engine.hf_tokenizer, engine.model_config)
    writer = MetricWriter(workdir, tensorboard=spec.logging.tensorboard, wandb=spec.logging.wandb,
                          wandb_project=spec.logging.wandb_project, config=effective)
    return Run(spec, workdir, engine, inputs, checkpoints.manager(workdir, spec.train.keep_checkpoints), writer)


def resume(run: Run) -> None:
    restored = checkpoints.restore_latest(run.manager, run.engine.state) if run.spec.train.resume else None
    if restored is not None:
        run.engine.state, meta = restored
        run.inputs.pipeline.restore(meta["data"])
        log(f"resumed from {run.workdir / 'checkpoints'} at step {int(run.engine.state.step)}")
    run.step = int(run.engine.state.step)


def report_skips(run: Run, counts: list, seen: int) -> int:
    """Logs each step whose update the NaN guard skipped (``counts``: the running count after each step of the
    window, read in one transfer); halts with ``nan_policy='halt'``. Returns the count after the window."""
    first = run.step - len(counts) + 1
    for step, count in enumerate(map(int, jax.device_get(counts)), first):
        if count > seen:
            seen = count
            message = (f"step {step}: the loss or the gradients are not finite; the update was skipped "
                       f"({count} skipped so far)")
            if run.spec.train.nan_policy == "halt":
                run.save(wait=True)
                raise TrainingHalted(f"{message}. Halting because train.nan_policy='halt'; a checkpoint at step "
                                     f"{step} (parameters of step {step - 1}) is in {run.workdir / 'checkpoints'}")
            log(message)
    return seen


def log_window(run: Run, window: dict, tokens: int, started: float, progress) -> None:
    values = reduce(window)
    elapsed = time.time() - started
    values["tokens_per_s"] = tokens / max(elapsed, 1e-9) * jax.process_count()
    run.writer.write(run.step, values, "train")
    eta = (run.spec.train.steps - run.step) * elapsed / max(run.spec.train.log_every, 1)
    line = writers.console_line(run.step, run.spec.train.steps, values, run.engine.objective.console, eta)
    writers.show(line, progress, log)


def run_steps(run: Run, stop) -> str | None:
    """Trains from ``run.step`` to ``train.steps``; returns the signal's name if one stopped it."""
    cfg, engine = run.spec.train, run.engine
    progress = writers.progress_bar(cfg.steps, run.step) if run.spec.logging.progress else None
    step_fn, frozen = engine.train_step, (() if engine.frozen is None else (engine.frozen,))
    skipped = int(engine.state.skipped)
    window, counts, tokens, started = {}, [], 0, time.time()
    prefetch = Prefetcher(run.inputs.pipeline, engine.batch_sharding)
    try:
        while run.step < cfg.steps:
            batch, batch_tokens, run.data_state = next(prefetch)
            engine.state, metrics = step_fn(engine.state, batch, *frozen)
            run.step += 1
            window = metrics if not window else jax.tree.map(jnp.add, window, metrics)
            counts.append(metrics["skipped_updates"].total)  # the state is donated: read the output
            tokens += batch_tokens
            if cfg.nan_policy == "halt" or run.step % cfg.log_every == 0 or run.step == cfg.steps:
                skipped, counts = report_skips(run, counts, skipped), []
            if run.step % cfg.log_every == 0 or run.step == cfg.steps:
                log_window(run, window, tokens, started, progress)
                window, tokens, started = {}, 0, time.time()
            if progress is not None:
                progress.update(1)
            if cfg.eval_every and run.step % cfg.eval_every == 0 and run.step != cfg.steps:
                run.evaluate(run.step)
            if cfg.save_every and run.step % cfg.save_every == 0:
                run.save()
            if stop.requested:
                report_skips(run, counts, skipped)
                return stop.requested
        return None
    finally:
        prefetch.close()
        if progress is not None:
            progress.close()


def summarise(run: Run, initial_eval: dict | None, start_time: float) -> dict[str, Any]:
    final_eval = run.evaluate(run.step)
    run.writer.close()
    plot = None
    if run.spec.logging.plot and jax.process_index() == 0:
        title = f"{run.spec.objective.name} — {run.workdir.name}"
        plot = writers.plot_curves(run.workdir / "metrics.jsonl", run.workdir / "curves.png", title,
                                   metrics=run.engine.objective.console)
    return writers.write_summary(run.workdir, {
        "step": run.step, "workdir": str(run.workdir), "metrics": str(run.workdir / "metrics.jsonl"),
        "checkpoints": str(run.workdir / "checkpoints"), "plot": str(plot) if plot else None,
        "tensorboard": str(run.workdir / "tensorboard") if run.spec.logging.tensorboard else None,
        "initial_eval": initial_eval, "final_eval": final_eval, "skipped_updates": int(run.engine.state.skipped),
        "reference_cache": run.inputs.reference_cache, "seconds": round(time.time() - start_time, 1),
        "eval_seconds": round(run.eval_seconds, 1)})


def train(config: ml_collections.ConfigDict, *, stop_on_signals: bool = False) -> dict[str, Any]:
    """Runs (or resumes) training; returns a summary with the paths written. ``stop_on_signals`` (the CLI's
    choice): SIGTERM / SIGINT save a checkpoint and stop at the next step; otherwise the caller's handlers stay."""
    start_time = time.time()
    distributed.initialize(config.get("distributed"))
    spec = validate(config)
    Path(spec.workdir).mkdir(parents=True, exist_ok=True)
    lock = checkpoints.RunLock(Path(spec.workdir)) if jax.process_index() == 0 else contextlib.nullcontext()
    signals = checkpoints.StopSignals() if stop_on_signals else checkpoints.NoSignals()
    with lock:
        if spec.train.resume:
            checkpoints.check_resumable(Path(spec.workdir), effective_config(config, spec))
        return _train(setup(config, spec), signals, start_time)


def _train(run: Run, signals, start_time: float) -> dict[str, Any]:
    resume(run)
    with signals as stop, jax.set_mesh(run.engine.mesh), run.engine.rules_scope():
        initial_eval = (run.evaluate(0) or None) if run.step == 0 else None
        stop_reason = run_steps(run, stop)
        run.save(wait=True)
        if stop_reason:
            log(f"{stop_reason}: saved a checkpoint at step {run.step} in {run.workdir / 'checkpoints'}; rerun the "
                "same command to resume")
            run.writer.close()
            return {"stopped": stop_reason, "step": run.step, "workdir": str(run.workdir)}
        return summarise(run, initial_eval, start_time)
