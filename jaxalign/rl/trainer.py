"""Online RL for the GRPO family: rollouts from the current weights on the training mesh, verifiable rewards, group
advantages, then ``num_iterations`` x ``steps_per_generation`` optimizer steps on each generation batch.

One generation batch: ``prompts_per_step`` prompts from a seeded, resumable order, ``num_generations`` completions
each from one prefill of the prompt (``jaxalign.sampling.sample``, temperature / top-p / top-k, EOS), decoded and
scored (``jaxalign.rl.rewards``), advantages by ``losses.group_advantages``, and the policy updated by the engine's
jitted step with the ``grpo`` objective. A checkpoint holds the train state and the prompt order's position; the
rollout key is a function of the seed and the step, so a resumed run samples exactly what the uninterrupted one did.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxalign.data.batching import group_rows, group_rows_cost
from jaxalign.data.sources import read_records
from jaxalign.data.tokenize import padding_id
from jaxalign.data.toy import write_jsonl
from jaxalign.losses import group_advantages
from jaxalign.objectives.grpo import completion_logps
from jaxalign.parallel.distributed import gather_rows, to_host
from jaxalign.rl.rewards import combine, resolve, score
from jaxalign.sampling.generate import left_pad, sample, stop_string_lengths
from jaxalign.train import checkpoints, writers
from jaxalign.train.build import build, run_mesh
from jaxalign.train.evaluate import exact_match, prompt_of, reduce
from jaxalign.train.export import export
from jaxalign.train.inputs import device_batch, materialise_data
from jaxalign.train.loop import Skips, describe_mesh, train
from jaxalign.train.spec import RunSpec, effective_config, whole_group_problems

SAMPLES_FILE = "samples.jsonl"


def prompt_records(paths: list[str], exclude: list[list[int]], max_record_chars: int) -> list[dict]:
    """The records of ``paths`` that hold a prompt (``messages`` minus the last turn, or ``prompt``), minus the
    held-out indices, each with ``_prompt`` and ``_index`` (its index in its file, for error messages) added."""
    out = []
    for path, skip in zip(paths, exclude, strict=True):
        skip = set(skip)
        for index, record in read_records(path, max_record_chars=max_record_chars):
            if index in skip or not isinstance(record, dict):
                continue
            prompt = prompt_of(record)
            if prompt is not None:
                out.append({**record, "_prompt": prompt, "_index": index, "_source": str(path)})
    if not out and paths:
        raise ValueError(f"{', '.join(paths)}: no record with a prompt ('messages' or 'prompt') to sample from")
    return out


def in_sft_share(record: dict, share: float) -> bool:
    """Whether a record's question belongs to the SFT start's share (a stable hash of its prompt)."""
    digest = hashlib.sha1(json.dumps(prompt_of(record), sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:4], "little") % 10_000 < share * 10_000


class PromptOrder:
    """A seeded permutation of the prompt records per epoch; ``take(n)`` the next ``n`` indices; ``state()`` /
    ``restore()`` for checkpoints."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.epoch, self.index = size, seed, 0, 0

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.size)

    def take(self, n: int) -> np.ndarray:
        out = []
        while len(out) < n:
            order = self._order()
            grab = order[self.index:self.index + n - len(out)]
            out += grab.tolist()
            self.index += len(grab)
            if self.index >= self.size:
                self.epoch, self.index = self.epoch + 1, 0
        return np.asarray(out)

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "size": self.size}

    def restore(self, state: dict) -> None:
        if state.get("size") != self.size or state.get("seed") != self.seed:
            raise ValueError(f"the checkpoint's prompt order ({state}) is not this run's (size {self.size}, seed "
                             f"{self.seed})")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


@dataclasses.dataclass
class Rollouts:
    """What one generation batch produced, on the host."""

    batch: dict[str, np.ndarray]
    texts: list[str]
    prompts: list[str]
    rewards: np.ndarray  # [N, R], NaN = None
    total: np.ndarray  # [N]
    advantages: np.ndarray  # [N]
    lengths: np.ndarray  # [N]
    entropy: np.ndarray  # [N], summed over each completion's tokens (the sampling distribution's)
    seconds: float


def rollout_seed(seed: int, step: int, refill: int = 0) -> int:
    return int(np.random.default_rng([seed, 7919, step, refill]).integers(2**31 - 1))


def select_groups(parts: list[Rollouts], groups: int, size: int) -> Rollouts:
    """``groups`` groups of ``size`` completions from ``parts`` (in order), those with unequal rewards first (DAPO's
    dynamic sampling); groups with equal rewards fill up only when too few others were found."""
    candidates = [(part, g) for part in parts for g in range(len(part.total) // size)]
    mixed = [np.nanstd(part.total[g * size:(g + 1) * size]) > 0 for part, g in candidates]
    order = [i for i, m in enumerate(mixed) if m] + [i for i, m in enumerate(mixed) if not m]
    rows = [(candidates[i][0], np.arange(candidates[i][1] * size, (candidates[i][1] + 1) * size))
            for i in order[:groups]]

    def cat(get):
        return np.concatenate([get(part)[index] for part, index in rows])

    def cat_list(get):
        return [get(part)[i] for part, index in rows for i in index]

    batch = {key: cat(lambda part, key=key: part.batch[key]) for key in parts[0].batch}
    return Rollouts(batch, cat_list(lambda p: p.texts), cat_list(lambda p: p.prompts), cat(lambda p: p.rewards),
                    cat(lambda p: p.total), cat(lambda p: p.advantages), cat(lambda p: p.lengths),
                    cat(lambda p: p.entropy), sum(p.seconds for p in parts))


class GRPORun:
    """The engine, the prompts, the rewards and where the run stands."""

    def __init__(self, config, spec: RunSpec, workdir: Path, stage, log):
        self.spec, self.workdir, self.log = spec, workdir, log
        self.hp = spec.objective.params
        self.processes, self.process = jax.process_count(), jax.process_index()
        if self.processes > 1:  # every process samples the whole generation batch and trains on its own rows
            rows = self.hp.prompts_per_step * self.hp.num_generations // self.hp.steps_per_generation
            if rows % self.processes:
                raise ValueError(f"{rows} completions per optimizer step do not split over {self.processes} "
                                 "processes: make prompts_per_step x num_generations / steps_per_generation a "
                                 "multiple of the process count")
            if self.hp.dynamic_sampling:
                raise ValueError("objective.params.dynamic_sampling runs in one process for now "
                                 f"({self.processes} processes joined)")
        mesh = run_mesh(spec)
        log(describe_mesh(mesh))
        self.engine = build(spec, mesh, log=log)
        stage()
        train_paths, eval_paths, exclude = materialise_data(spec, workdir)
        tok = self.engine.tokenizer
        self.records = prompt_records(train_paths, exclude, spec.data.max_record_chars)
        if self.hp.sft_share:  # the questions the SFT start saw are not sampled
            self.records = [r for r in self.records if not in_sft_share(r, self.hp.sft_share)]
        self.eval_records = prompt_records(eval_paths, [[]] * len(eval_paths), spec.data.max_record_chars)
        self.eval_records = [r for r in self.eval_records if "answer" in r][: spec.eval.generate]
        encoded = [tok.encode_prompt(r["_prompt"]) for r in self.records]
        limit = spec.data.max_length
        if too_long := [(r, len(e)) for r, e in zip(self.records, encoded, strict=True) if len(e) > limit]:
            record, length = too_long[0]
            raise ValueError(f"{record['_source']}, record {record['_index']}: the prompt takes {length} tokens, over "
                             f"data.max_length={limit} ({len(too_long)} prompts in all); raise data.max_length or "
                             "shorten them")
        self.pad = padding_id(tok.hf)
        self.prompt_ids, self.prompt_mask = left_pad(encoded, self.pad)
        log(f"data: {len(self.records)} prompts (up to {self.prompt_ids.shape[1]} tokens), "
            f"{len(self.eval_records)} held-out questions")
        self.grouped = self.group_layout(spec, log)
        self.order = PromptOrder(len(self.records), spec.seed)
        self.rewards = resolve(self.hp.rewards, self.hp.reward_weights or None)
        stage()
        effective = effective_config(config, spec)
        writers.write_run_files(workdir, effective, self.engine.hf_tokenizer, self.engine.model_config)
        self.writer = writers.MetricWriter(workdir, tensorboard=spec.logging.tensorboard, wandb=spec.logging.wandb,
                                           wandb_project=spec.logging.wandb_project, config=effective)
        self.checkpoints = checkpoints.Checkpoints(workdir, spec.train.keep_checkpoints, self.engine.model_config,
                                                   per_layer=spec.train.checkpoint_layout == "per_layer")
        self.step = 0
        self.skips = None  # a loop.Skips once the state is restored
        engine, hp = self.engine, self.hp

        @jax.jit
        def old_logps(params, frozen, batch):
            model = engine.parts.policy(params, frozen, None)
            return completion_logps(model, batch, chunk_size=hp.logps_chunk_size, temperature=hp.temperature)

        self._old_logps = old_logps

    # ------------------------------------------------------------------------------------------ one generation
    def generation_batch(self) -> tuple[Rollouts, int]:
        """The next generation batch and the number of refills it took (dynamic sampling)."""
        hp = self.hp
        parts = [self.rollout(self.order.take(hp.prompts_per_step))]
        refills = 0
        while hp.dynamic_sampling and refills < hp.max_refills and sum(
                np.nanstd(g) > 0 for p in parts for g in p.total.reshape(-1, hp.num_generations)) < hp.prompts_per_step:
            refills += 1
            parts.append(self.rollout(self.order.take(hp.prompts_per_step), refill=refills))
        if len(parts) == 1:
            return parts[0], 0
        return select_groups(parts, hp.prompts_per_step, hp.num_generations), refills

    def rollout(self, indices: np.ndarray, refill: int = 0) -> Rollouts:
        hp, tok, started = self.hp, self.engine.tokenizer, time.time()
        g = hp.num_generations
        ids, mask = self.prompt_ids[indices], self.prompt_mask[indices]
        gen = sample(self.engine.policy(), ids, prompt_mask=mask, max_new_tokens=hp.max_completion_length,
                     temperature=hp.temperature, top_k=hp.top_k, top_p=hp.top_p, eos_id=tok.eos_id, pad_id=self.pad,
                     seed=rollout_seed(self.spec.seed, self.step, refill), num_samples=g,
                     weights=hp.rollout_weights)
        completion, lengths = to_host(gen.tokens), to_host(gen.lengths)
        lengths = stop_string_lengths(completion, lengths, hp.stops,
                                      lambda row: tok.hf.decode(row, skip_special_tokens=True))
        seconds = time.time() - started
        valid = (np.arange(completion.shape[1])[None] < lengths[:, None]).astype(np.int32)
        completion = np.where(valid > 0, completion, self.pad)
        prompt_zeros = np.zeros((len(valid), ids.shape[1]), np.float32)
        batch = {"tokens": np.concatenate([np.repeat(ids, g, 0), completion], 1).astype(np.int32),
                 "attention_mask": np.concatenate([np.repeat(mask, g, 0), valid], 1).astype(np.int32),
                 "loss_mask": np.concatenate([np.zeros_like(prompt_zeros, np.int32), valid], 1)}
        if hp.sampling_correction != "none":  # the sampler's log-probs, aligned with the loss mask
            batch["sampling_logps"] = np.concatenate([prompt_zeros, to_host(gen.sampling_logps) * valid], 1)
        entropy = (to_host(gen.entropy) * valid).sum(axis=1)
        texts = [tok.hf.decode(row[:n], skip_special_tokens=True) for row, n in zip(completion, lengths, strict=True)]
        records = [self.records[i] for i in indices for _ in range(g)]
        prompts = [tok.prompt_text(r["_prompt"]) for r in records]
        columns = sorted({k for r in records for k in r if not k.startswith("_") and k not in ("messages", "prompt")})
        fields = {k: [r.get(k) for r in records] for k in columns}
        fields["completion_lengths"] = lengths.tolist()
        fields["raw_prompts"] = [r["_prompt"] for r in records]  # before the chat template (reward models)
        mine = self.local_rows(len(records))  # each process scores its share; the table is then shared
        table = gather_rows(score(self.rewards, prompts[mine], texts[mine], {k: v[mine] for k, v in fields.items()},
                                  record_index=[int(r["_index"]) for r in records[mine]]))
        total = combine(table, self.rewards)
        advantages = np.asarray(group_advantages(jnp.asarray(total), g, scale_rewards=hp.scale_rewards,
                                                 estimator=hp.estimator))
        batch["advantages"] = advantages.astype(np.float32)
        return Rollouts(batch, texts, prompts, table, total, advantages, lengths, entropy, seconds)

    def group_layout(self, spec: RunSpec, log) -> bool:
        """Whether the training passes take each group's prompt once (``objective.params.shared_prefix``; "auto":
        when whole groups fit the layout and ``group_rows_cost`` finds it cheaper at this run's prompt width)."""
        hp = self.hp
        blockers = whole_group_problems(spec, jax.device_count(), self.processes) if hp.shared_prefix else []
        if hp.shared_prefix is True and blockers:
            raise ValueError("; ".join(blockers))
        if hp.shared_prefix != "auto":
            return hp.shared_prefix
        if blockers:
            log(f"shared prefix: off ({'; '.join(blockers)})")
            return False
        separate, grouped = group_rows_cost(self.engine.model_config, hp.num_generations, self.prompt_ids.shape[1],
                                            hp.max_completion_length)
        log(f"shared prefix: {'on' if grouped < separate else 'off'} (a group trains in {grouped / 1e9:.3g} GFLOP "
            f"as one row of its prompt and completions, {separate / 1e9:.3g} as {hp.num_generations} rows)")
        return grouped < separate

    def local_rows(self, rows: int) -> slice:
        """This process's block of ``rows`` consecutive rows (all of them in one process)."""
        share = rows // self.processes
        return slice(self.process * share, (self.process + 1) * share)

    def device_rows(self, batch: dict, rows: np.ndarray, fields: tuple[str, ...] | None = None) -> dict:
        """This process's share of ``rows`` of a generation batch (``fields`` of it, default all), on the devices;
        in the shared-prefix layout also the rows of whole groups (``group_rows``)."""
        mine = rows[self.local_rows(len(rows))]
        local = {k: batch[k][mine] for k in (fields or batch)}
        if self.grouped:  # whole groups: steps and processes split at group boundaries (checked)
            local.update(group_rows(local["tokens"], local["attention_mask"], local["loss_mask"],
                                    self.hp.num_generations, self.hp.max_completion_length))
        return device_batch(self.engine.batch_sharding, local)

    def update(self, rollouts: Rollouts) -> dict:
        """``num_iterations`` passes of ``steps_per_generation`` optimizer steps over the generation batch."""
        hp, engine = self.hp, self.engine
        batch = dict(rollouts.batch)
        rows = len(batch["advantages"])
        frozen = () if engine.frozen is None else (engine.frozen,)
        if hp.recompute_old_logps:  # the sampling policy's log-probs by the trainer's forward, kept fixed
            placed = self.device_rows(batch, np.arange(rows), ("tokens", "attention_mask", "loss_mask"))
            batch["old_logps"] = to_host(self._old_logps(engine.state.params, engine.frozen, placed))
        if hp.steps_per_generation > 1:  # TRL: each step's share of the generation batch's tokens
            batch["loss_share"] = np.full(rows, batch["loss_mask"].sum() / hp.steps_per_generation
                                          / (rows // hp.steps_per_generation), np.float32)
        parts = np.array_split(np.arange(rows), hp.steps_per_generation)
        window, counts = {}, []
        for _ in range(hp.num_iterations):
            for part in parts:
                chunk = self.device_rows(batch, part)
                engine.state, metrics = engine.train_step(engine.state, chunk, *frozen)
                self.step += 1
                window = metrics if not window else jax.tree.map(jnp.add, window, metrics)
                counts.append(metrics["skipped_updates"].total)
        self.skips.report(counts)  # the NaN guard's skips: logged, and the run halts on a streak
        return window

    def rollout_metrics(self, r: Rollouts) -> dict[str, float]:
        g, c = self.hp.num_generations, self.hp.max_completion_length
        grouped = r.total.reshape(-1, g)
        out = {"reward": float(np.nanmean(r.total)), "reward_std": float(np.nanstd(r.total)),
               "frac_reward_zero_std": float(np.mean(np.nanstd(grouped, axis=1) == 0)),
               "completion/mean_length": float(r.lengths.mean()), "completion/min_length": float(r.lengths.min()),
               "completion/max_length": float(r.lengths.max()),
               "completion/clipped_ratio": float(np.mean(r.lengths >= c)),
               "entropy": float(r.entropy.sum() / max(r.lengths.sum(), 1)),
               "rollout_tokens_per_s": float(r.lengths.sum() / max(r.seconds, 1e-9))}
        for k, reward in enumerate(self.rewards):
            column = r.rewards[:, k]
            if not np.isnan(column).all():
                out[f"rewards/{reward.name}/mean"] = float(np.nanmean(column))
                out[f"rewards/{reward.name}/std"] = float(np.nanstd(column))
        return out

    def write_samples(self, r: Rollouts, count: int = 4) -> None:
        if jax.process_index() != 0:
            return
        g = self.hp.num_generations
        with (self.workdir / SAMPLES_FILE).open("a") as handle:
            for row in range(0, min(count * g, len(r.texts)), g):
                handle.write(json.dumps({
                    "step": self.step, "prompt": r.prompts[row], "completions": r.texts[row:row + g],
                    "rewards": [None if np.isnan(x) else float(x) for x in r.total[row:row + g]],
                    "advantages": [round(float(a), 4) for a in r.advantages[row:row + g]]}) + "\n")

    def evaluate(self) -> dict[str, float]:
        if not self.eval_records:
            return {}
        accuracy = exact_match(self.engine.policy(), self.engine.tokenizer, self.eval_records,
                               max_new_tokens=self.spec.eval.max_new_tokens)
        values = {"accuracy": accuracy}
        self.writer.write(self.step, values, "eval")
        self.log(f"step {self.step} eval: held-out exact match {100 * accuracy:.1f}%")
        return values

    def save(self, *, wait: bool = False) -> None:
        self.checkpoints.save(self.engine.state, self.step, {"data": self.order.state(), "objective": "grpo"},
                              wait=wait)


def _sft_start(config, spec: RunSpec, workdir: Path, log) -> RunSpec:
    """For a randomly initialised model with ``sft_steps``: SFT on the same data in ``workdir/sft`` (resumable like
    any run), exported once to ``workdir/sft/hf``; returns the spec that starts GRPO from it."""
    hp = spec.objective.params
    if spec.model.path or not hp.sft_steps:
        return spec
    folder = workdir / "sft"
    sft = copy.deepcopy(config)
    sft.workdir = str(folder)
    sft.objective.name = "sft"
    sft.objective.params = type(sft.objective.params)()
    sft.train.steps, sft.train.batch_size = hp.sft_steps, min(32, spec.train.batch_size)
    sft.train.save_every = hp.sft_steps
    sft.optim.lr, sft.optim.schedule, sft.optim.warmup_steps = 3e-3, "cosine", 50
    sft.eval.generate = 0
    sft.logging.plot = False
    hf = folder / "hf"
    if hp.sft_share and not (hf / "config.json").exists():  # SFT on its share of the training questions only
        train_paths, _, exclude = materialise_data(spec, workdir)
        records = prompt_records(train_paths, exclude, spec.data.max_record_chars)
        share = [{k: v for k, v in r.items() if not k.startswith("_")} for r in records
                 if in_sft_share(r, hp.sft_share)]
        sft.data.train = str(write_jsonl(share, workdir / "data" / "sft_share.jsonl").resolve())
        log(f"objective.params.sft_share={hp.sft_share}: the SFT start trains on {len(share)} of {len(records)} "
            "records; GRPO samples the others")
    if not (hf / "config.json").exists() and jax.process_count() > 1:
        raise ValueError(f"objective.params.sft_steps={hp.sft_steps}: the SFT start runs in one process; give "
                         "--config.model.path=YOUR_SFT_MODEL (for example the sft/hf folder one run of this command "
                         f"in one process leaves; {hf} does not exist yet)")
    if not (hf / "config.json").exists():
        log(f"objective.params.sft_steps={hp.sft_steps}: SFT first, in {folder}")
        train(sft)
        export(folder, hf)
    return dataclasses.replace(spec, model=dataclasses.replace(spec.model, path=str(hf), tokenizer=""))


def train_grpo(config, spec: RunSpec, workdir: Path, stop, stage, start_time: float, log) -> dict[str, Any]:
    """The GRPO-family run (called by ``jaxalign.train.loop`` for ``objective.name='grpo'``)."""
    build_spec = _sft_start(config, spec, workdir, log)
    stage()
    run = GRPORun(config, build_spec, workdir, stage, log)
    with run.checkpoints:
        return _loop(run, stop, start_time)


def _loop(run: GRPORun, stop, start_time: float) -> dict[str, Any]:
    spec, hp = run.spec, run.hp
    per_generation = hp.num_iterations * hp.steps_per_generation
    restored = run.checkpoints.restore_latest(run.engine.state) if spec.train.resume else None
    if restored is not None:
        run.engine.state, meta = restored
        run.order.restore(meta["data"])
        log_resume = f"resumed from {run.workdir / 'checkpoints'} at step {int(run.engine.state.step)}"
        run.log(log_resume)
    run.step = int(run.engine.state.step)
    run.skips = Skips(run)
    if jax.process_index() == 0:
        writers.rewind_metrics(run.workdir / "metrics.jsonl", run.step, final=run.step in (0, spec.train.steps))
    with jax.set_mesh(run.engine.mesh), run.engine.rules_scope():
        initial = run.evaluate() if run.step == 0 else None
        last_save = run.step
        while run.step < spec.train.steps:
            started = time.time()
            rollouts, refills = run.generation_batch()
            window = run.update(rollouts)
            values = {**reduce(window), **run.rollout_metrics(rollouts)}
            if hp.dynamic_sampling:
                values["dynamic_sampling/refills"] = float(refills)
            values["train_tokens_per_s"] = float(rollouts.batch["attention_mask"].sum() * per_generation
                                                 / max(time.time() - started - rollouts.seconds, 1e-9))
            every = spec.train.log_every
            if run.step % every < per_generation or run.step >= spec.train.steps:
                run.writer.write(run.step, values, "train")
                run.log(f"step {run.step}/{spec.train.steps} loss {values['loss']:.4f} reward "
                        f"{values['reward']:.3f} length {values['completion/mean_length']:.1f} zero-std groups "
                        f"{values['frac_reward_zero_std']:.2f} rollout {values['rollout_tokens_per_s']:.0f} tok/s")
            if hp.samples_every and run.step % hp.samples_every < per_generation:
                run.write_samples(rollouts)
            if spec.train.eval_every and run.step % spec.train.eval_every < per_generation \
                    and run.step < spec.train.steps:
                run.evaluate()
            if spec.train.save_every and run.step - last_save >= spec.train.save_every:
                run.save()
                last_save = run.step
            if stop.requested:
                run.save(wait=True)
                run.log(f"{stop.requested}: saved a checkpoint at step {run.step} in {run.workdir / 'checkpoints'}; "
                        "rerun the same command to resume")
                run.writer.close()
                return {"stopped": stop.requested, "step": run.step, "workdir": str(run.workdir)}
        run.save(wait=True)
        final = run.evaluate()
    run.writer.close()
    if initial is None and jax.process_index() == 0:
        first, _ = writers.known_evaluations(run.workdir / "metrics.jsonl")
        initial = {k: v for k, v in (first or {}).items() if k != "step"} or None
    plot = None
    if spec.logging.plot and jax.process_index() == 0:
        plot = writers.plot_curves(run.workdir / "metrics.jsonl", run.workdir / "curves.png",
                                   f"grpo ({hp.loss_type}) — {run.workdir.name}",
                                   metrics=("loss", "reward", "completion/mean_length"))
    summary = writers.write_summary(run.workdir, {
        "step": run.step, "workdir": str(run.workdir), "metrics": str(run.workdir / "metrics.jsonl"),
        "checkpoints": str(run.workdir / "checkpoints"), "plot": str(plot) if plot else None,
        "samples": str(run.workdir / SAMPLES_FILE), "tensorboard": None,
        "initial_eval": initial, "initial_eval_step": 0 if initial else None, "final_eval": final,
        "skipped_updates": int(run.engine.state.skipped), "seconds": round(time.time() - start_time, 1)})
    run.skips.check_share()
    return summary
