"""The CPI-FT pipeline and its baselines, end to end on one host.

probe fine-tunes per task → core masks → Jaccard groups → fusion → staged SFT with earlier groups' cores frozen →
exact-match evaluation per task, next to multi-task SFT and sequential SFT with the same number of task steps.
Writes ``report.json`` and ``report.md`` to the run folder.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxalign.cpi.fusion import fuse
from jaxalign.cpi.grouping import group_tasks, jaccard_matrix
from jaxalign.cpi.masks import core_mask, default_include, mask_size
from jaxalign.cpi.optimizer import freeze, union
from jaxalign.data import DataPipeline, PipelineConfig, Tokenizer, tokenize_record, validate_record
from jaxalign.data.toy import GENERATORS, multitask
from jaxalign.objectives import get_objective, make_params
from jaxalign.parallel import batch_sharding, use_rules
from jaxalign.train.build import load_model, optimizer, run_mesh
from jaxalign.train.evaluate import exact_match
from jaxalign.train.inputs import device_batch
from jaxalign.train.loop import log
from jaxalign.train.spec import RunSpec, validate
from jaxalign.train.step import init_state, make_train_step


class Trainer:
    """Short SFT runs from given parameters, optionally with frozen entries, through the public training API on the
    run's mesh: one compiled step per run length (the frozen entries are optimizer state, so every stage's mask
    shares it), batches placed as training places them."""

    def __init__(self, spec: RunSpec, graphdef, tokenizer, mesh, *, max_new_tokens: int = 8):
        self.spec, self.graphdef, self.mesh = spec, graphdef, mesh
        self.max_new_tokens = max_new_tokens
        self.rules = spec.mesh.rules_table
        self.tok = tokenizer
        self.pad_id = tokenizer.hf.pad_token_id or 0
        self.batch_sharding = batch_sharding(mesh, 1, self.rules)
        self._steps: dict[int, tuple] = {}

    def examples(self, records: list[dict]) -> list[dict]:
        return [tokenize_record(self.tok, validate_record(r, source="toy", index=i, kind="sft"))
                for i, r in enumerate(records)]

    def _step(self, steps: int, params, lr: float):
        """(optimizer, jitted step) for a run of ``steps`` steps (the schedule's length) at peak rate ``lr``, built
        once; the frozen entries live in the optimizer state, so every mask shares the step."""
        if (steps, lr) not in self._steps:
            tx, _ = optimizer(dataclasses.replace(self.spec.optim, lr=lr), steps)
            template = freeze(tx, jax.tree.map(lambda _: False, params))
            self._steps[steps, lr] = (tx, make_train_step(self.graphdef, get_objective("sft").fn, make_params("sft"),
                                                          template))
        return self._steps[steps, lr]

    def train(self, params, records: list[dict], steps: int, *, frozen=None, seed: int = 0, lr: float = 0.0):
        """``steps`` SFT steps from ``params`` on ``records`` (peak rate ``lr``, the run's own when 0), the
        entries set in ``frozen`` held fixed."""
        if steps <= 0:
            return params
        tx, step = self._step(steps, params, lr or self.spec.optim.lr)
        mask = jax.tree.map(lambda _: False, params) if frozen is None else frozen
        state = init_state(jax.tree.map(jnp.copy, params), freeze(tx, mask), seed, None)
        pipeline = DataPipeline([self.examples(records)], "sft",
                                PipelineConfig(batch_size=self.spec.train.batch_size, seed=seed, pad_id=self.pad_id))
        with jax.set_mesh(self.mesh), use_rules(self.rules):
            for _ in range(steps):
                state, _ = step(state, device_batch(self.batch_sharding, next(pipeline)))
        return state.params

    def accuracy(self, params, records: list[dict]) -> float:
        with jax.set_mesh(self.mesh), use_rules(self.rules):
            return exact_match(nnx.merge(self.graphdef, params), self.tok, records,
                               max_new_tokens=self.max_new_tokens)


def _task_data(cpi, seed: int) -> tuple[dict[str, list], dict[str, list]]:
    tasks = [t for t in cpi.tasks.split(",") if t]
    # arithmetic questions: evaluated on the fixed test (or validation) pool, trained on the train pool
    # (jaxalign.data.toy.pool_of); the words of reversal and copying are drawn apart for each pool
    offset = {"test": 1000, "validation": 2000}[cpi.eval_pool]
    evaluation = multitask(cpi.eval_per_task * len(tasks), seed + offset, tasks=tasks, pool=cpi.eval_pool)
    evaluation = {t: [r for r in evaluation if r["task"] == t][: cpi.eval_per_task] for t in tasks}
    held_out = {r["messages"][0]["content"] for records in evaluation.values() for r in records}
    pool = multitask(cpi.train_per_task * len(tasks), seed, tasks=tasks, pool="train")
    train = {t: [r for r in pool if r["task"] == t and r["messages"][0]["content"] not in held_out] for t in tasks}
    return train, evaluation


STAGE_DATA = ("mixed", "group")
EVAL_POOLS = ("test", "validation")


def _check(cpi, tasks: list[str]) -> None:
    if cpi.stage_data not in STAGE_DATA:
        raise ValueError(f"cpi.stage_data={cpi.stage_data!r}; expected one of {STAGE_DATA}")
    if cpi.eval_pool not in EVAL_POOLS:
        raise ValueError(f"cpi.eval_pool={cpi.eval_pool!r}; expected one of {EVAL_POOLS}")
    pair = [t for t in cpi.forgetting.split(",") if t]
    if cpi.forgetting and (len(pair) != 2 or pair[0] == pair[1] or not set(pair) <= set(tasks)):
        raise ValueError(f"cpi.forgetting={cpi.forgetting!r}; expected two different tasks of cpi.tasks "
                         f"({','.join(tasks)}), e.g. 'add,reverse'")


def run(config) -> dict:
    """Runs CPI-FT (and the baselines) from a config with a ``cpi`` section; returns the report."""
    start = time.time()
    cpi = config.cpi
    _check(cpi, [t for t in cpi.tasks.split(",") if t])  # before the model loads
    spec = validate(config)
    workdir = Path(spec.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    mesh = run_mesh(spec)
    with jax.set_mesh(mesh), use_rules(spec.mesh.rules_table):
        model, hf_tokenizer = load_model(spec.model, seed=spec.seed, mesh=mesh, rules=spec.mesh.rules_table)
    graphdef, params = nnx.split(model)
    base = nnx.to_pure_dict(params)
    tokenizer = Tokenizer(hf_tokenizer, spec.data.tokenize_config())
    trainer = Trainer(spec, graphdef, tokenizer, mesh, max_new_tokens=cpi.max_new_tokens)
    train_data, eval_data = _task_data(cpi, spec.seed)
    tasks = list(train_data)

    def scores(params) -> dict[str, float]:
        return {t: round(trainer.accuracy(params, eval_data[t]), 4) for t in tasks}

    if cpi.base_steps and cpi.base_data:
        name = cpi.base_data.removeprefix("toy:")
        base = trainer.train(base, GENERATORS[name](2000, spec.seed + 7), cpi.base_steps, seed=1)
    report: dict = {"tasks": tasks, "settings": cpi.to_dict(), "scores": {"base": scores(base)}}
    log(f"base: {report['scores']['base']}")

    # 1. probe fine-tunes and core masks
    include = lambda name: default_include(name, embeddings=cpi.include_embeddings, norms=cpi.include_norms)
    probes, masks = [], []
    for i, task in enumerate(tasks):
        probe = trainer.train(base, train_data[task], cpi.probe_steps, seed=10 + i, lr=cpi.probe_lr)
        probes.append(probe)
        masks.append(core_mask(base, probe, cpi.fraction, include=include))
        report["scores"][f"probe_{task}"] = scores(probe)
        log(f"probe {task}: {report['scores'][f'probe_{task}']}, core size {mask_size(masks[-1])}")

    # 2. groups, 3. fusion
    similarity = jaccard_matrix(masks)
    groups = group_tasks(similarity, cpi.tau)
    report["core_sizes"] = {t: mask_size(m) for t, m in zip(tasks, masks, strict=True)}
    report["jaccard"] = np.round(similarity, 4).tolist()
    report["groups"] = [[tasks[i] for i in g] for g in groups]
    log(f"groups at tau={cpi.tau}: {report['groups']}")
    fused = fuse(base, probes, masks, omega=cpi.omega or None)
    report["scores"]["fused"] = scores(fused)

    # 4. staged SFT on a small balanced sample (every task's, or the stage's group's), earlier groups' cores frozen
    def staged(start_params, freezing: bool):
        current, frozen_groups = start_params, []
        for k, group in enumerate(groups):
            members = range(len(tasks)) if cpi.stage_data == "mixed" else group
            sample = [r for i in members for r in train_data[tasks[i]][: cpi.sample_per_task]]
            frozen = union([masks[i] for g in frozen_groups for i in g]) if frozen_groups and freezing else None
            current = trainer.train(current, sample, cpi.stage_steps * len(group), frozen=frozen, seed=100 + k)
            frozen_groups.append(group)
        return current

    report["scores"]["cpi_ft"] = scores(staged(fused, True))
    log(f"CPI-FT: {report['scores']['cpi_ft']}")
    if cpi.ablations:
        report["scores"]["cpi_ft_no_fusion"] = scores(staged(base, True))  # the stages start from θ0
        report["scores"]["cpi_ft_no_freezing"] = scores(staged(fused, False))
        log(f"ablations: no fusion {report['scores']['cpi_ft_no_fusion']}, "
            f"no freezing {report['scores']['cpi_ft_no_freezing']}")

    if cpi.baselines:  # the same total steps as CPI-FT's probes and stages
        per_task = cpi.probe_steps + cpi.stage_steps
        mixture = [r for t in tasks for r in train_data[t]]
        report["scores"]["multi_task_sft"] = scores(trainer.train(base, mixture, per_task * len(tasks), seed=200))
        sequential = base
        report["sequential_after_each"] = {}
        for i, task in enumerate(tasks):
            sequential = trainer.train(sequential, train_data[task], per_task, seed=300 + i)
            report["sequential_after_each"][task] = scores(sequential)
        report["scores"]["sequential_sft"] = scores(sequential)
        methods = [m for m in ("sequential_sft", "multi_task_sft", "cpi_ft", "cpi_ft_no_fusion", "cpi_ft_no_freezing")
                   if m in report["scores"]]
        report["forgetting"] = {
            method: round(float(np.mean([report["scores"][f"probe_{t}"][t] - report["scores"][method][t]
                                         for t in tasks])), 4) for method in methods}
        log(f"multi-task SFT: {report['scores']['multi_task_sft']}")
        log(f"sequential SFT: {report['scores']['sequential_sft']}")

    if cpi.forgetting:  # task A's probe, then task B's data with and without A's core frozen
        a, b = (tasks.index(t) for t in cpi.forgetting.split(","))
        after_b = {"plain": trainer.train(probes[a], train_data[tasks[b]], cpi.probe_steps, seed=400,
                                          lr=cpi.probe_lr),
                   "core_frozen": trainer.train(probes[a], train_data[tasks[b]], cpi.probe_steps, frozen=masks[a],
                                                seed=400, lr=cpi.probe_lr)}
        report["forgetting_test"] = {"a": tasks[a], "b": tasks[b], "after_a": report["scores"][f"probe_{tasks[a]}"],
                                     **{f"after_b_{k}": scores(v) for k, v in after_b.items()}}
        log(f"forgetting test {tasks[a]} -> {tasks[b]}: {report['forgetting_test']}")
    report["seconds"] = round(time.time() - start, 1)
    (workdir / "report.json").write_text(json.dumps(report, indent=2))
    (workdir / "report.md").write_text(markdown(report))
    return report


def markdown(report: dict) -> str:
    tasks = report["tasks"]
    lines = ["| model | " + " | ".join(tasks) + " | mean |", "|---|" + "---|" * (len(tasks) + 1)]
    for name, row in report["scores"].items():
        values = [row[t] for t in tasks]
        cells = " | ".join(f"{100 * v:.1f}" for v in values)
        lines.append(f"| {name} | {cells} | {100 * np.mean(values):.1f} |")
    lines += ["", f"groups: {report['groups']}", f"core sizes: {report['core_sizes']}",
              f"Jaccard: {report['jaccard']}"]
    if "forgetting" in report:
        lines.append("mean drop from each task's own probe score (points x 100): " +
                     ", ".join(f"{k} {100 * v:.1f}" for k, v in report["forgetting"].items()))
    return "\n".join(lines) + "\n"
