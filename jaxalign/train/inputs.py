"""A run's inputs: toy data written out, files loaded and tokenised with the run's tokenizer, precomputed
references attached, the train and eval pipelines, and a prefetcher that prepares the next batch on the host
(and places it on the devices) while the current step runs."""

from __future__ import annotations

import dataclasses
import json
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxalign.data import DataPipeline, PipelineConfig, load_sources
from jaxalign.data.sources import read_records
from jaxalign.data.tokenize import padding_id
from jaxalign.data.toy import GENERATORS, write_jsonl
from jaxalign.hub import resolve_dataset
from jaxalign.train import reference_cache
from jaxalign.train.spec import RunSpec, path_inside

HELD_OUT_MAX = 500


def held_out_indices(path: str, fraction: float, seed: int, batch_size: int,
                     max_record_chars: int | None = None) -> list[int]:
    """Record indices of ``path`` set aside for evaluation: ``fraction`` of them, at least one batch (the eval
    pipeline's) and at most ``HELD_OUT_MAX``, drawn from ``seed``; none when fewer than two batches would be left
    for training."""
    indices = [index for index, _ in read_records(path, max_record_chars=max_record_chars)]
    count = min(max(round(fraction * len(indices)), batch_size), HELD_OUT_MAX)
    if fraction <= 0 or len(indices) - count < batch_size:
        return []
    return sorted(np.random.default_rng(seed).choice(indices, count, replace=False).tolist())


def materialise_data(spec: RunSpec, workdir: Path) -> tuple[list[str], list[str], list[list[int]]]:
    """(training files, eval files, held-out record indices per training file). ``toy:NAME`` sources are
    generated into ``workdir/data`` (``workdir``: the run folder or a staging folder) with the eval questions held
    out of the training file; with ``data.eval`` empty, ``data.eval_fraction`` of each training file is held out
    (``held_out_indices``) and written as ``data/eval_heldout_<i>.jsonl``."""
    data = spec.data

    def toy_records(name: str, n: int, seed: int) -> list[dict]:
        if name not in GENERATORS:
            raise ValueError(f"data source toy:{name} is unknown; choose one of {', '.join(GENERATORS)}")
        kwargs = {"style": data.toy_style} if name == "arithmetic" else {}
        return GENERATORS[name](n, seed, **kwargs)

    def question(record: dict) -> str:
        return json.dumps(record.get("messages", record.get("prompt", record.get("source_conversations")))[:1])

    eval_paths, held_out = [], set()
    for source in filter(None, data.eval.split(",")):
        if source.startswith("hf:"):
            continue  # resolved below
        if source.startswith("toy:"):
            records = toy_records(source[4:], data.toy_eval_size, spec.seed + 1000)
            held_out |= {question(r) for r in records}
            source = str(write_jsonl(records, workdir / "data" / f"eval_{source[4:]}.jsonl"))
        eval_paths.append(source)
    train_sources = [str(path) if source.startswith("hf:") else source
                     for source in filter(None, data.train.split(","))
                     for path in (resolve_dataset(source) if source.startswith("hf:") else [source])]
    if data.weights and len(train_sources) != len([s for s in data.train.split(",") if s]):
        raise ValueError(f"data.weights={data.weights!r}: an hf: source of data.train has several data files "
                         f"({len(train_sources)} files in all); give one weight per file or drop data.weights")
    eval_paths += [str(path) for source in filter(None, data.eval.split(",")) if source.startswith("hf:")
                   for path in resolve_dataset(source)]
    train_paths, exclude = [], []
    for i, source in enumerate(train_sources):
        skip: list[int] = []
        if source.startswith("toy:"):
            records = [r for r in toy_records(source[4:], data.toy_size, spec.seed) if question(r) not in held_out]
            source = str(write_jsonl(records, workdir / "data" / f"train_{source[4:]}.jsonl"))
        elif not data.eval:
            skip = held_out_indices(source, data.eval_fraction, spec.seed + 2000 + i, spec.train.batch_size,
                                    data.max_record_chars)
            if skip:
                chosen = set(skip)
                records = [r for index, r in read_records(source, max_record_chars=data.max_record_chars)
                           if index in chosen and isinstance(r, dict)]
                eval_paths.append(str(write_jsonl(records, workdir / "data" / f"eval_heldout_{i}.jsonl")))
        train_paths.append(source)
        exclude.append(skip)
    if not train_paths:
        raise ValueError("data.train is empty: give one or more files (comma-separated) or toy:NAME")
    return train_paths, eval_paths, exclude


@dataclasses.dataclass
class Inputs:
    pipeline: DataPipeline
    eval_pipeline: DataPipeline | None
    eval_records: list[dict]  # raw eval records (those with an ``answer`` are scored by exact match)
    reference_cache: dict | None  # {"status": "computed" | "reused", "path": ...} with a precomputed reference


def load_inputs(spec: RunSpec, engine, workdir: Path, log: Callable[[str], None]) -> Inputs:
    """Validated, tokenised data in pipelines for ``engine`` (``jaxalign.train.build.Engine``)."""
    staging = Path(tempfile.mkdtemp(prefix=".inputs-", dir=workdir))  # toy files land in the run folder only
    try:  # once everything loaded, so a failed start leaves an existing run folder as it was
        inputs = _load(spec, engine, workdir, staging, log)
        for made in sorted((staging / "data").glob("*")):
            (workdir / "data").mkdir(exist_ok=True)
            made.replace(workdir / "data" / made.name)
        return inputs
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _load(spec: RunSpec, engine, workdir: Path, staging: Path, log: Callable[[str], None]) -> Inputs:
    data, kind = spec.data, engine.objective.data_kind
    train_paths, eval_paths, exclude = materialise_data(spec, staging)
    sources, reports = load_sources(train_paths, engine.tokenizer, kind=kind, on_invalid=data.on_invalid,
                                    exclude=exclude)
    for report in reports:
        log(f"data: {report.summary().replace(str(staging), str(workdir))}")
    eval_sources = load_sources(eval_paths, engine.tokenizer, kind=kind, on_invalid="skip")[0] if eval_paths else []
    cache = None
    if spec.objective.uses_reference and spec.reference.kind == "precomputed":
        cache_dir = path_inside(workdir, spec.reference.cache_dir or "reference_cache", "reference.cache_dir")

        def attach(sources, paths):
            return reference_cache.attach(sources, engine.graphdef, engine.base_params, engine.tokenizer, kind,
                                          engine.hparams, cache_dir,
                                          key_parts={"paths": paths, "max_length": data.max_length,
                                                     "max_prompt_length": data.max_prompt_length},
                                          batch_size=spec.train.batch_size // spec.train.grad_accum,
                                          batch_sharding=engine.batch_sharding)

        if eval_sources:
            eval_sources, _ = attach(eval_sources, eval_paths)
        sources, cache = attach(sources, train_paths)
        log(f"reference log-probs {cache['status']}: {cache['path']}")
    pad_id = padding_id(engine.hf_tokenizer)
    hosts = dict(num_hosts=jax.process_count(), host_index=jax.process_index())
    pipeline = DataPipeline(sources, kind, PipelineConfig(
        batch_size=spec.train.batch_size, seed=spec.seed, shuffle=data.shuffle, weights=data.mixture_weights(),
        packing=data.packing, row_length=data.row_length, max_pairs_per_row=data.max_pairs_per_row,
        shared_prefix=data.shared_prefix, bucket_step=data.bucket_step, pad_id=pad_id),
        **hosts)
    eval_pipeline, eval_records = None, []
    if eval_sources:
        eval_pipeline = DataPipeline(eval_sources, kind, PipelineConfig(batch_size=spec.train.batch_size,
                                                                        shuffle=False, bucket_step=data.bucket_step,
                                                                        pad_id=pad_id), **hosts)
        eval_records = [r for path in eval_paths for _, r in read_records(path, max_record_chars=data.max_record_chars)
                        if isinstance(r, dict)]
    return Inputs(pipeline, eval_pipeline, eval_records, cache)


def device_batch(sharding, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """This host's rows of a batch as global arrays split over the data-parallel axes."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def real_tokens(batch: dict[str, np.ndarray]) -> int:
    return int(sum(v.sum() for k, v in batch.items() if k.endswith("attention_mask")))


class Prefetcher:
    """Batches from ``pipeline`` prepared ``depth`` steps ahead on a host thread: each item is (device batch,
    real tokens, the pipeline's position after that batch), so a checkpoint records the position of the last
    batch the step consumed, not of the ones waiting. ``sharding=None``: the host batch, not placed (for a caller
    that changes it first). Errors in the thread are raised in the caller."""

    def __init__(self, pipeline: DataPipeline, sharding, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(pipeline, sharding), daemon=True,
                                        name="jaxalign-prefetch")
        self._thread.start()

    def _fill(self, pipeline, sharding) -> None:
        while not self._done.is_set():
            try:
                batch = next(pipeline)
                placed = batch if sharding is None else device_batch(sharding, batch)
                item: Any = (placed, real_tokens(batch), pipeline.state())
            except BaseException as err:  # handed to the consumer, which raises it
                item = err
            while not self._done.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def __next__(self):
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=10)
