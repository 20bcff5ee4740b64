"""The training loop: config -> spec (``spec.py``) -> engine (``build.py``) -> inputs (``inputs.py``) -> steps.

Everything with side effects lives here (files, devices, signals); the math is in ``objectives`` / ``losses`` and
the step in ``step.py``. The loop keeps the step count on the host and reads device values only when it logs,
evaluates or saves (and every step with ``train.nan_policy='halt'``), so the next batch, prepared by the
``Prefetcher`` thread, overlaps the running step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jaxalign.parallel import distributed
from jaxalign.train import checkpoints, onpolicy, writers
from jaxalign.train.build import Engine, build, run_mesh
from jaxalign.train.evaluate import evaluate, reduce
from jaxalign.train.inputs import Inputs, Prefetcher, device_batch, load_inputs, real_tokens
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
    checkpoints: checkpoints.Checkpoints
    writer: MetricWriter
    step: int = 0  # host copy of state.step
    data_state: dict | None = None  # the pipeline's position after the last batch a step consumed
    eval_seconds: float = 0.0

    def save(self, *, wait: bool = False) -> None:
        meta = {"data": self.data_state or self.inputs.pipeline.state(), "objective": self.spec.objective.name}
        self.checkpoints.save(self.engine.state, self.step, meta, wait=wait)

    def evaluate(self, step: int) -> dict[str, float]:
        started = time.time()
        values = evaluate(self.engine, self.inputs, self.engine.eval_step)
        self.eval_seconds += time.time() - started
        if values:
            self.writer.write(step, values, "eval")
            log(f"step {step} eval: " + ", ".join(f"{k} {v:.4f}" for k, v in values.items()))
        return values


def describe_mesh(mesh) -> str:
    return (f"mesh {dict(mesh.shape)} over {jax.device_count()} devices in {jax.process_count()} process"
            f"{'es' if jax.process_count() > 1 else ''}")


def setup(config: ml_collections.ConfigDict, spec: RunSpec, stage=lambda: None) -> Run:
    """Engine and inputs first: config.json, tokenizer/ and model_config.json are written once both loaded.
    ``stage()`` is called between the stages (it raises to stop start-up on a signal)."""
    workdir = Path(spec.workdir)
    mesh = run_mesh(spec)
    log(describe_mesh(mesh))
    engine = build(spec, mesh, log=log)
    stage()
    inputs = load_inputs(spec, engine, workdir, log)
    stage()
    effective = effective_config(config, spec)
    if jax.process_index() == 0 and not spec.train.resume and (old := checkpoints.retire(workdir)):
        log(f"train.resume=False: the previous run in {workdir} moved to {old}")
    writers.write_run_files(workdir, effective, engine.hf_tokenizer, engine.model_config)
    writer = MetricWriter(workdir, tensorboard=spec.logging.tensorboard, wandb=spec.logging.wandb,
                          wandb_project=spec.logging.wandb_project, config=effective)
    saves = checkpoints.Checkpoints(workdir, spec.train.keep_checkpoints, engine.model_config,
                                    per_layer=spec.train.checkpoint_layout == "per_layer")
    return Run(spec, workdir, engine, inputs, saves, writer)


def resume(run: Run) -> None:
    restored = run.checkpoints.restore_latest(run.engine.state) if run.spec.train.resume else None
    if restored is not None:
        run.engine.state, meta = restored
        run.inputs.pipeline.restore(meta["data"])
        log(f"resumed from {run.workdir / 'checkpoints'} at step {int(run.engine.state.step)}")
    run.step = int(run.engine.state.step)
    if jax.process_index() == 0:  # rows a killed run wrote after its checkpoint would repeat: drop them
        writers.rewind_metrics(run.workdir / "metrics.jsonl", run.step,
                               final=run.step == 0 or run.step >= run.spec.train.steps)


class Skips:
    """Counts the updates the NaN guard skipped (``counts``: the running total after each step of a window, read
    in one transfer), logs each, and stops the run when ``train.nan_policy='halt'`` or when
    ``train.max_skip_streak`` updates in a row were skipped."""

    def __init__(self, run: Run):
        self.run, self.seen, self.streak = run, int(run.engine.state.skipped), 0

    def report(self, counts: list) -> None:
        run, cfg = self.run, self.run.spec.train
        first = run.step - len(counts) + 1
        for step, count in enumerate(map(int, jax.device_get(counts)), first):
            if count <= self.seen:
                self.streak = 0
                continue
            self.seen, self.streak = count, self.streak + 1
            message = (f"step {step}: the loss or the gradients are not finite; the update was skipped "
                       f"({count} skipped so far)")
            if cfg.nan_policy == "halt" or (cfg.max_skip_streak and self.streak >= cfg.max_skip_streak):
                run.save(wait=True)
                why = ("train.nan_policy='halt'" if cfg.nan_policy == "halt" else
                       f"{self.streak} updates in a row were skipped (train.max_skip_streak={cfg.max_skip_streak})")
                raise TrainingHalted(f"{message}. Halting because {why}; a checkpoint at step {run.step} (parameters "
                                     f"of the last good update) is in {run.workdir / 'checkpoints'}")
            log(message)

    def check_share(self) -> None:
        """At the end of a run: more than ``train.max_skip_fraction`` of all updates skipped is a failed run."""
        limit, steps = self.run.spec.train.max_skip_fraction, max(self.run.step, 1)
        if limit and self.seen > limit * steps:
            raise TrainingHalted(
                f"{self.seen} of {steps} updates ({100 * self.seen / steps:.1f} %) were skipped because the loss or "
                f"the gradients were not finite, more than train.max_skip_fraction={limit}; the run is not trusted "
                f"as trained (checkpoint and metrics in {self.run.workdir}). Lower optim.lr or check the data.")


def log_window(run: Run, window: dict, tokens: int, started: float, progress, extra: dict | None = None) -> None:
    values = {**reduce(window), **(extra or {})}
    elapsed = time.time() - started
    values["tokens_per_s"] = tokens / max(elapsed, 1e-9) * jax.process_count()
    run.writer.write(run.step, values, "train")
    eta = (run.spec.train.steps - run.step) * elapsed / max(run.spec.train.log_every, 1)
    line = writers.console_line(run.step, run.spec.train.steps, values, run.engine.objective.console, eta)
    writers.show(line, progress, log)


def run_steps(run: Run, stop, skips: Skips) -> str | None:
    """Trains from ``run.step`` to ``train.steps``; returns the signal's name if one stopped it."""
    cfg, engine = run.spec.train, run.engine
    progress = writers.progress_bar(cfg.steps, run.step) if run.spec.logging.progress else None
    step_fn, frozen = engine.train_step, (() if engine.frozen is None else (engine.frozen,))
    window, counts, tokens, started = {}, [], 0, time.time()
    sampled = onpolicy.GKDBatches(engine, run.spec) if onpolicy.enabled(engine.hparams) else None
    prefetch = Prefetcher(run.inputs.pipeline, engine.batch_sharding if sampled is None else None)
    every_step = cfg.nan_policy == "halt" or cfg.max_skip_streak == 1
    if sampled is not None:
        log(sampled.describe())
    try:
        while run.step < cfg.steps:
            batch, batch_tokens, run.data_state = next(prefetch)
            if sampled is not None:  # GKD: completions drawn by the current student or the teacher
                batch = sampled(batch, run.step)
                batch, batch_tokens = device_batch(engine.batch_sharding, batch), real_tokens(batch)
            engine.state, metrics = step_fn(engine.state, batch, *frozen)
            run.step += 1
            window = metrics if not window else jax.tree.map(jnp.add, window, metrics)
            counts.append(metrics["skipped_updates"].total)  # the state is donated: read the output
            tokens += batch_tokens
            if every_step or run.step % cfg.log_every == 0 or run.step == cfg.steps:
                skips.report(counts)
                counts = []
            if run.step % cfg.log_every == 0 or run.step == cfg.steps:
                log_window(run, window, tokens, started, progress, sampled.stats() if sampled else None)
                window, tokens, started = {}, 0, time.time()
            if progress is not None:
                progress.update(1)
            if cfg.eval_every and run.step % cfg.eval_every == 0 and run.step != cfg.steps:
                run.evaluate(run.step)
            if cfg.save_every and run.step % cfg.save_every == 0:
                run.save()
            if stop.requested:
                skips.report(counts)
                return stop.requested
        return None
    finally:
        prefetch.close()
        if progress is not None:
            progress.close()


def summarise(run: Run, initial_eval: dict | None, start_time: float) -> dict[str, Any]:
    """The closing evaluation, the plot and ``summary.json``. A resumed run's first evaluation comes from
    ``metrics.jsonl`` (the one it knows), with its step."""
    final_eval = run.evaluate(run.step)
    run.writer.close()
    initial_step = 0 if initial_eval else None
    if not initial_eval and jax.process_index() == 0:
        first, _ = writers.known_evaluations(run.workdir / "metrics.jsonl")
        if first is not None and first["step"] < run.step:
            initial_step = first.pop("step")
            initial_eval = first
    plot = None
    if run.spec.logging.plot and jax.process_index() == 0:
        title = f"{run.spec.objective.name} — {run.workdir.name}"
        plot = writers.plot_curves(run.workdir / "metrics.jsonl", run.workdir / "curves.png", title,
                                   metrics=run.engine.objective.console)
    return writers.write_summary(run.workdir, {
        "step": run.step, "workdir": str(run.workdir), "metrics": str(run.workdir / "metrics.jsonl"),
        "checkpoints": str(run.workdir / "checkpoints"), "plot": str(plot) if plot else None,
        "tensorboard": str(run.workdir / "tensorboard") if run.spec.logging.tensorboard else None,
        "initial_eval": initial_eval or None, "initial_eval_step": initial_step, "final_eval": final_eval,
        "skipped_updates": int(run.engine.state.skipped), "reference_cache": run.inputs.reference_cache,
        "seconds": round(time.time() - start_time, 1), "eval_seconds": round(run.eval_seconds, 1)})


class StoppedEarly(Exception):
    """A signal arrived during start-up: the run stops at the next stage boundary, before training."""


def train(config: ml_collections.ConfigDict, *, stop_on_signals: bool = False) -> dict[str, Any]:
    """Runs (or resumes) training; returns a summary with the paths written. ``stop_on_signals`` (the CLI's
    choice): SIGTERM / SIGINT, from the first moment on, save a checkpoint and stop at the next step (during start-up:
    stop at the next stage, nothing half-written); otherwise the caller's handlers stay."""
    start_time = time.time()
    signals = checkpoints.StopSignals() if stop_on_signals else checkpoints.NoSignals()
    with signals as stop:
        try:
            return _train(config, stop, start_time)
        except StoppedEarly:
            log(f"{stop.requested} during start-up: stopped before training; no checkpoint was written (rerun the "
                "same command to start)")
            return {"stopped": stop.requested, "step": 0, "workdir": str(config.get("workdir", ""))}


def _train(config: ml_collections.ConfigDict, stop, start_time: float) -> dict[str, Any]:
    def stage() -> None:
        if stop.requested:
            raise StoppedEarly

    distributed.initialize(config.get("distributed"))
    spec = validate(config)
    stage()
    workdir = Path(spec.workdir)
    checkpoints.check_links(workdir)
    created = not workdir.exists()
    workdir.mkdir(parents=True, exist_ok=True)
    lock = checkpoints.RunLock(workdir) if jax.process_index() == 0 else contextlib.nullcontext()
    with lock:
        try:
            if spec.train.resume:
                checkpoints.check_resumable(workdir, effective_config(config, spec))
            if spec.objective.name == "grpo":
                from jaxalign.rl.trainer import train_grpo

                return train_grpo(config, spec, workdir, stop, stage, start_time, log)
            run = setup(config, spec, stage)
        except BaseException:
            started = (workdir / "config.json").exists() or (workdir / "sft").exists()
            if created and not started and jax.process_index() == 0:  # failed during start-up: leave nothing
                shutil.rmtree(workdir, ignore_errors=True)
            raise
        with run.checkpoints:
            return _run(run, stop, start_time)


def _run(run: Run, stop, start_time: float) -> dict[str, Any]:
    resume(run)
    skips = Skips(run)
    with jax.set_mesh(run.engine.mesh), run.engine.rules_scope():
        initial_eval = (run.evaluate(0) or None) if run.step == 0 else None
        stop_reason = run_steps(run, stop, skips)
        run.save(wait=True)
        if stop_reason:
            log(f"{stop_reason}: saved a checkpoint at step {run.step} in {run.workdir / 'checkpoints'}; rerun the "
                "same command to resume")
            run.writer.close()
            return {"stopped": stop_reason, "step": run.step, "workdir": str(run.workdir)}
        summary = summarise(run, initial_eval, start_time)
        skips.check_share()
        return summary
