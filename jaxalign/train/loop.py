"""The training loop: set-up from a config, the step loop, evaluation, checkpoints, signals, the final report.

Everything with side effects lives here (files, devices, signals); the math is in ``objectives`` / ``losses``
and the step in ``step.py``.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxalign.data import (
    OBJECTIVE_KINDS,
    DataPipeline,
    PipelineConfig,
    TokenizeConfig,
    Tokenizer,
    load_sources,
)
from jaxalign.data.sources import read_records
from jaxalign.data.toy import GENERATORS, toy_tokenizer, write_jsonl
from jaxalign.models import LlamaConfig, abstract_model, create_model, load_pretrained, lora, param_shardings
from jaxalign.objectives import get_objective, make_params
from jaxalign.parallel import distributed, make_mesh
from jaxalign.train import reference_cache
from jaxalign.train.config import path_inside, validate
from jaxalign.train.evaluate import exact_match, make_eval_step
from jaxalign.train.step import (
    ModelParts,
    TrainState,
    full_parts,
    init_state,
    lora_parts,
    make_optimizer,
    make_train_step,
    state_shardings,
)
from jaxalign.train.writers import MetricWriter, plot_curves


def log(message: str) -> None:
    if jax.process_index() == 0:
        print(message, flush=True)


# ------------------------------------------------------------------------------------------------ set-up
def materialise_data(config, workdir: Path) -> tuple[list[str], list[str]]:
    """Paths of the training and eval files; ``toy:NAME`` sources are generated into ``workdir/data`` with the
    eval questions held out of the training file."""
    data = config.data

    def toy_records(name: str, n: int, seed: int) -> list[dict]:
        if name not in GENERATORS:
            raise ValueError(f"data source toy:{name} is unknown; choose one of {', '.join(GENERATORS)}")
        kwargs = {"style": data.toy_style} if name == "arithmetic" else {}
        return GENERATORS[name](n, seed, **kwargs)

    def question(record: dict) -> str:
        return json.dumps(record.get("messages", record.get("prompt", record.get("source_conversations")))[:1])

    eval_paths, held_out = [], set()
    for spec in filter(None, data.eval.split(",")):
        if spec.startswith("toy:"):
            records = toy_records(spec[4:], data.toy_eval_size, config.seed + 1000)
            held_out |= {question(r) for r in records}
            spec = str(write_jsonl(records, workdir / "data" / f"eval_{spec[4:]}.jsonl"))
        eval_paths.append(spec)
    train_paths = []
    for spec in filter(None, data.train.split(",")):
        if spec.startswith("toy:"):
            records = [r for r in toy_records(spec[4:], data.toy_size, config.seed) if question(r) not in held_out]
            spec = str(write_jsonl(records, workdir / "data" / f"train_{spec[4:]}.jsonl"))
        train_paths.append(spec)
    if not train_paths:
        raise ValueError("data.train is empty: give one or more files (comma-separated) or toy:NAME")
    return train_paths, eval_paths


def build_model(config, mesh):
    """(policy model, HF tokenizer) from ``model.path`` or the random ``tiny`` preset."""
    overrides = {"attention_impl": config.model.attention_impl, "remat": config.model.remat,
                 "remat_policy": config.model.get("remat_policy", "nothing")}
    if config.model.path:
        model, tokenizer = load_pretrained(config.model.path, dtype=config.model.dtype, mesh=mesh,
                                           config_overrides=overrides)
        if config.model.param_dtype != config.model.dtype:
            warnings.warn("model.param_dtype differs from model.dtype: loaded weights keep model.dtype", stacklevel=2)
    else:
        shape = config.model.shape.to_dict()
        model_config = LlamaConfig(**shape, dtype=config.model.dtype, param_dtype=config.model.param_dtype,
                                   **overrides)
        model, tokenizer = create_model(model_config, seed=config.seed, mesh=mesh), None
    if config.tokenizer == "toy":
        tokenizer = toy_tokenizer()
    elif config.tokenizer:
        from jaxalign.models import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer)
    if tokenizer is None:
        raise ValueError("no tokenizer: the model folder has none; set tokenizer='toy' or a tokenizer folder")
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
                         f"{model.config.vocab_size}")
    return model, tokenizer


def lora_trainables(config, model, graphdef, params, tx, mesh, reference_model: bool):
    """LoRA's (parts, fresh adapters, frozen base, state shardings, base shardings): only the adapters are
    trained, held in the optimizer and checkpointed; the base weights are the step's frozen argument."""
    lora_config = lora.LoRAConfig.from_config(config.lora)
    counts = lora.count_params(model.config, lora_config)
    log(f"LoRA r={lora_config.rank} on {','.join(lora_config.targets)}: {counts['adapter']:,} adapter parameters "
        f"train ({100 * counts['adapter'] / counts['base']:.2f}% of the {counts['base']:,} frozen base parameters)")
    parts = lora_parts(lora.lora_graphdef(model.config, lora_config), graphdef, with_reference=reference_model)
    shardings = state_shardings(lora.abstract_lora_model(model.config, lora_config), tx, mesh,
                                trained=nnx.LoRAParam)
    with jax.set_mesh(mesh):
        adapters = lora.init_adapters(model.config, lora_config, seed=config.seed, mesh=mesh)
    return parts, adapters, params, shardings, nnx.to_pure_dict(param_shardings(abstract_model(model.config), mesh))


@dataclasses.dataclass
class Run:
    """Everything the loop needs, built once by ``setup``."""

    config: ml_collections.ConfigDict
    workdir: Path
    mesh: Any
    graphdef: Any
    tokenizer: Any
    pipeline: DataPipeline
    eval_pipeline: DataPipeline | None
    eval_records: list[dict]
    objective: Any
    hparams: Any
    parts: ModelParts
    state: TrainState
    frozen: Any  # the step's frozen tree: the reference's weights, LoRA's base weights, or None
    step_fn: Any
    eval_fn: Any
    batch_sharding: Any
    manager: ocp.CheckpointManager
    writer: MetricWriter
    schedule: Any


def setup(config: ml_collections.ConfigDict) -> Run:
    validate(config)
    workdir = Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    mesh = make_mesh(dict(config.mesh))
    log(f"mesh {dict(mesh.shape)} over {jax.device_count()} devices in {jax.process_count()} process"
        f"{'es' if jax.process_count() > 1 else ''}")
    with jax.set_mesh(mesh):
        model, hf_tokenizer = build_model(config, mesh)
    if jax.process_index() == 0:
        hf_tokenizer.save_pretrained(str(workdir / "tokenizer"))
        (workdir / "model_config.json").write_text(json.dumps(dataclasses.asdict(model.config), indent=2))
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    name = config.objective.name
    kind = OBJECTIVE_KINDS[name]
    data = config.data
    tok = Tokenizer(hf_tokenizer, TokenizeConfig(max_length=data.max_length, max_prompt_length=data.max_prompt_length,
                                                 truncation=data.truncation, chat_template=data.chat_template or None))
    train_paths, eval_paths = materialise_data(config, workdir)
    sources, reports = load_sources(train_paths, tok, kind=kind, on_invalid=data.on_invalid)
    for report in reports:
        log(f"data: {report.summary()}")
    objective = get_objective(name)
    hparams = make_params(name, config.objective.params.to_dict())

    eval_sources = load_sources(eval_paths, tok, kind=kind, on_invalid="skip")[0] if eval_paths else []
    reference_params, reference_model = None, False
    if objective.uses_reference and not getattr(hparams, "reference_free", False):
        if config.reference.kind == "precomputed":
            cache_dir = path_inside(workdir, config.reference.cache_dir or "reference_cache", "reference.cache_dir")

            def attach(sources, paths):
                return reference_cache.attach(sources, graphdef, params, hf_tokenizer, kind, hparams, cache_dir,
                                              key_parts={"paths": paths, "max_length": data.max_length,
                                                         "max_prompt_length": data.max_prompt_length})

            if eval_sources:
                eval_sources = attach(eval_sources, eval_paths)
            sources = attach(sources, train_paths)
        elif config.lora.enabled:
            reference_model = True  # the initial LoRA policy is its base: the reference is the base, adapters off
        else:
            reference_params = jax.tree.map(jnp.copy, params)  # frozen: the initial policy, held once
            reference_model = True

    pipeline_config = PipelineConfig(
        batch_size=config.train.batch_size, seed=config.seed, shuffle=data.shuffle,
        weights=tuple(float(w) for w in data.weights.split(",")) if data.weights else None, packing=data.packing,
        row_length=data.row_length, max_pairs_per_row=data.max_pairs_per_row,
        pad_id=hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else 0)
    pipeline = DataPipeline(sources, kind, pipeline_config, num_hosts=jax.process_count(),
                            host_index=jax.process_index())
    eval_pipeline, eval_records = None, []
    if eval_sources:
        eval_pipeline = DataPipeline(eval_sources, kind, PipelineConfig(batch_size=config.train.batch_size,
                                                                        shuffle=False, pad_id=pipeline_config.pad_id),
                                     num_hosts=jax.process_count(), host_index=jax.process_index())
        eval_records = [r for path in eval_paths for _, r in read_records(path) if isinstance(r, dict)]

    tx, schedule = make_optimizer(config.optim, config.train.steps)
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    if config.lora.enabled:
        parts, trained, frozen, shardings, frozen_shardings = lora_trainables(config, model, graphdef, params, tx,
                                                                              mesh, reference_model)
    else:
        parts, trained, frozen = full_parts(graphdef), params, reference_params
        shardings = state_shardings(abstract_model(model.config), tx, mesh)
        frozen_shardings = shardings.params if frozen is not None else None
    with jax.set_mesh(mesh):
        state = init_state(trained, tx, config.seed, shardings)
    step_fn = make_train_step(parts, objective.fn, hparams, tx, grad_accum=config.train.grad_accum,
                              nan_guard=config.train.nan_guard, schedule=schedule, shardings=shardings,
                              batch_sharding=batch_sharding, frozen_shardings=frozen_shardings)
    manager = ocp.CheckpointManager(
        (workdir / "checkpoints").resolve(),
        options=ocp.CheckpointManagerOptions(max_to_keep=config.train.keep_checkpoints,
                                             enable_async_checkpointing=True))
    writer = MetricWriter(workdir, tensorboard=config.logging.tensorboard, wandb=config.logging.wandb,
                          wandb_project=config.logging.wandb_project, config=config.to_dict())
    return Run(config=config, workdir=workdir, mesh=mesh, graphdef=graphdef, tokenizer=hf_tokenizer,
               pipeline=pipeline, eval_pipeline=eval_pipeline, eval_records=eval_records, objective=objective,
               hparams=hparams, parts=parts, state=state, frozen=frozen, step_fn=step_fn,
               eval_fn=make_eval_step(parts, objective.fn, hparams), batch_sharding=batch_sharding,
               manager=manager, writer=writer, schedule=schedule)


# ------------------------------------------------------------------------------------------------ checkpoints
def save(run: Run, *, wait: bool = False) -> None:
    step = int(run.state.step)
    if run.manager.latest_step() == step:  # already saved at this step
        if wait:
            run.manager.wait_until_finished()
        return
    meta = {"step": step, "data": run.pipeline.state(), "objective": run.config.objective.name}
    run.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(run.state),
                                                   meta=ocp.args.JsonSave(meta)), force=True)
    if wait:
        run.manager.wait_until_finished()


def abstract_of(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def restore_latest(manager: ocp.CheckpointManager, state: TrainState) -> tuple[TrainState, dict] | None:
    """The newest checkpoint that restores; broken ones are skipped with a warning."""
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


# ------------------------------------------------------------------------------------------------ loop
def device_batch(run: Run, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {k: jax.make_array_from_process_local_data(run.batch_sharding, v) for k, v in batch.items()}


def reduce(metrics: dict) -> dict[str, float]:
    return {name: float(m.total) / max(float(m.count), 1e-9) for name, m in metrics.items()}


def evaluate(run: Run) -> dict[str, float]:
    out: dict[str, float] = {}
    if run.eval_pipeline is not None:
        totals: dict = {}
        run.eval_pipeline.restore({**run.eval_pipeline.state(), "epoch": 0, "step": 0})
        for _ in range(min(run.config.eval.batches, run.eval_pipeline.steps_per_epoch)):
            metrics = run.eval_fn(run.state.params, device_batch(run, next(run.eval_pipeline)), run.frozen,
                                  run.state.step)
            totals = metrics if not totals else jax.tree.map(jnp.add, totals, metrics)
        out.update(reduce(totals))
    if run.eval_records and run.config.eval.generate > 0:
        model = run.parts.policy(run.state.params, run.frozen, None)
        out["accuracy"] = exact_match(model, run.tokenizer, run.eval_records[: run.config.eval.generate],
                                      max_new_tokens=run.config.eval.max_new_tokens)
    return out


class TrainingHalted(RuntimeError):
    """Training stopped on purpose (``train.nan_policy='halt'``); the message says where the checkpoint is."""


class _Stop:
    """SIGTERM / SIGINT set a flag; the loop saves and exits at the next step boundary."""

    def __init__(self):
        self.requested = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame):
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def train(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """Runs (or resumes) training; returns a summary with the paths written."""
    start_time = time.time()
    distributed.initialize(config.get("distributed"))
    run = setup(config)
    cfg = config.train
    if cfg.resume:
        restored = restore_latest(run.manager, run.state)
        if restored is not None:
            run.state, meta = restored
            run.pipeline.restore(meta["data"])
            log(f"resumed from {run.workdir / 'checkpoints'} at step {int(run.state.step)}")
    first_step = int(run.state.step)
    initial_eval = None
    if first_step == 0 and (run.eval_pipeline is not None or run.eval_records):
        initial_eval = evaluate(run)
        run.writer.write(0, initial_eval, "eval")
        log("step 0 eval: " + ", ".join(f"{k} {v:.4f}" for k, v in initial_eval.items()))
    progress = None
    if config.logging.progress and sys.stderr.isatty() and jax.process_index() == 0:
        from tqdm import tqdm

        progress = tqdm(total=cfg.steps, initial=first_step, dynamic_ncols=True)
    window: dict = {}
    tokens_seen, window_start, stop_reason = 0, time.time(), None
    skipped = int(run.state.skipped)
    last_eval = initial_eval or {}
    with _Stop() as stop, jax.set_mesh(run.mesh):
        while int(run.state.step) < cfg.steps:
            batch = next(run.pipeline)
            tokens_seen += int(sum(v.sum() for k, v in batch.items() if k.endswith("attention_mask")))
            args = (run.state, device_batch(run, batch)) + ((run.frozen,) if run.frozen is not None else ())
            run.state, metrics = run.step_fn(*args)
            window = metrics if not window else jax.tree.map(jnp.add, window, metrics)
            step = int(run.state.step)
            if int(run.state.skipped) > skipped:
                skipped = int(run.state.skipped)
                message = (f"step {step}: the loss or the gradients are not finite; the update was skipped "
                           f"({skipped} skipped so far)")
                if cfg.nan_policy == "halt":
                    save(run, wait=True)
                    raise TrainingHalted(f"{message}. Halting because train.nan_policy='halt'; a checkpoint at step "
                                         f"{step} (parameters of step {step - 1}) is in {run.workdir / 'checkpoints'}")
                log(message)
            if step % cfg.log_every == 0 or step == cfg.steps:
                values = reduce(window)
                elapsed = time.time() - window_start
                values["tokens_per_s"] = tokens_seen / max(elapsed, 1e-9) * jax.process_count()
                run.writer.write(step, values, "train")
                eta = (cfg.steps - step) * elapsed / max(cfg.log_every, 1)
                line = (f"step {step}/{cfg.steps} loss {values['loss']:.4f} tokens/s {values['tokens_per_s']:.0f} "
                        f"ETA {eta:.0f}s")
                if progress is not None:
                    progress.set_postfix_str(line.split(" ", 2)[2])
                else:
                    log(line)
                window, tokens_seen, window_start = {}, 0, time.time()
            if progress is not None:
                progress.update(1)
            if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps:
                last_eval = evaluate(run)
                run.writer.write(step, last_eval, "eval")
                log(f"step {step} eval: " + ", ".join(f"{k} {v:.4f}" for k, v in last_eval.items()))
            if cfg.save_every and step % cfg.save_every == 0:
                save(run)
            if stop.requested:
                stop_reason = stop.requested
                break
    if progress is not None:
        progress.close()
    final_step = int(run.state.step)
    save(run, wait=True)
    if stop_reason:
        log(f"{stop_reason}: saved a checkpoint at step {final_step} in {run.workdir / 'checkpoints'}; rerun the same "
            "command to resume")
        run.writer.close()
        return {"stopped": stop_reason, "step": final_step, "workdir": str(run.workdir)}
    final_eval = evaluate(run) if (run.eval_pipeline is not None or run.eval_records) else {}
    if final_eval:
        run.writer.write(final_step, final_eval, "eval")
    run.writer.close()
    plot = None
    if config.logging.plot and jax.process_index() == 0:
        plot = plot_curves(run.workdir / "metrics.jsonl", run.workdir / "curves.png",
                           title=f"{config.objective.name} — {run.workdir.name}")
    summary = {"step": final_step, "workdir": str(run.workdir), "metrics": str(run.workdir / "metrics.jsonl"),
               "checkpoints": str(run.workdir / "checkpoints"), "plot": str(plot) if plot else None,
               "tensorboard": str(run.workdir / "tensorboard") if config.logging.tensorboard else None,
               "initial_eval": initial_eval, "final_eval": final_eval, "skipped_updates": int(run.state.skipped),
               "seconds": round(time.time() - start_time, 1)}
    if jax.process_index() == 0:
        (run.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
