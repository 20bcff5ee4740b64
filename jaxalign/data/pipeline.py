"""A deterministic, seedable, host-sharded batch stream whose position can be saved and restored exactly.

The order of epoch ``e`` is a pure function of ``(seed, e)``: sources are mixed by weight (each source's
examples in a per-epoch permutation, cycled when a source is up-weighted), shuffled, then grouped into
batches (or packed into rows first). Every host computes the same global batch and keeps its slice, so hosts
agree on padding lengths without talking. ``state()`` is ``{"epoch", "step"}`` plus what must match on
restore; ``restore(state)`` continues with exactly the next batch of an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from jaxalign.data.batching import (
    bucket_length,
    default_buckets,
    max_sequence_length,
    pack_rows,
    packed_batch,
    packed_size,
    pad_batch,
)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """``batch_size`` is global (rows per step over all hosts). ``packing`` fills rows of ``row_length``
    (SFT: examples; preference: whole pairs, at most ``max_pairs_per_row``). Without packing, sequences pad
    to the smallest of ``buckets`` (default: powers of two up to the longest example, or with ``bucket_step`` the
    multiples of it) that fits.
    ``shared_prefix`` (preference data): each pair's prompt written once (``packed_batch``), in the packed rows, or
    without packing one pair per row (``[prompt, chosen completion, rejected completion]``), the row padded to the
    smallest bucket that holds the batch's longest pair (the buckets then count a pair's row tokens)."""

    batch_size: int
    seed: int = 0
    shuffle: bool = True
    weights: tuple[float, ...] | None = None
    packing: bool = False
    row_length: int = 0
    max_pairs_per_row: int = 8
    shared_prefix: bool = False
    buckets: tuple[int, ...] | None = None
    bucket_step: int = 0
    pad_id: int = 0


class DataPipeline:
    """Batches of tokenised examples (from ``load_sources``) for an objective of ``kind``."""

    def __init__(self, sources: Sequence[Sequence[dict]], kind: str, config: PipelineConfig, *,
                 num_hosts: int = 1, host_index: int = 0):
        if not sources or not all(sources):
            raise ValueError("every data source needs at least one example")
        if config.weights is not None and len(config.weights) != len(sources):
            raise ValueError(f"{len(config.weights)} mixture weights for {len(sources)} sources")
        if config.batch_size % num_hosts:
            raise ValueError(f"batch_size={config.batch_size} is not divisible by the {num_hosts} hosts")
        if config.packing and kind not in ("sft", "lm", "preference"):
            raise ValueError(f"packing is available for SFT and preference data, not {kind!r}")
        if config.packing and config.row_length <= 0:
            raise ValueError("packing needs row_length > 0")
        if config.shared_prefix and kind != "preference":
            raise ValueError(f"shared_prefix writes each preference pair's prompt once: it needs preference data, "
                             f"not {kind!r} data")
        self.kind, self.config = kind, config
        self.num_hosts, self.host_index = num_hosts, host_index
        self.examples = [example for source in sources for example in source]
        with_margin = sum("margin" in example for example in self.examples)
        if 0 < with_margin < len(self.examples):
            raise ValueError(f"{with_margin} of {len(self.examples)} examples have a 'margin' field: give every "
                             "record a margin, or none")
        self._sizes = [len(source) for source in sources]
        self._offsets = np.cumsum([0, *self._sizes[:-1]])
        self._row_sizes = None  # shared prefix without packing: each pair's row tokens
        if config.shared_prefix and not config.packing:
            self._row_sizes = np.asarray([packed_size(example, pairs=True, shared_prefix=True)
                                          for example in self.examples])
        longest = max_sequence_length(self.examples, kind) if self._row_sizes is None else int(self._row_sizes.max())
        self.buckets = tuple(config.buckets) if config.buckets else default_buckets(longest, step=config.bucket_step)
        if max(self.buckets) < longest:
            what = "sequence" if self._row_sizes is None else "shared-prefix pair row"
            raise ValueError(f"the longest {what} has {longest} tokens but the largest bucket is {max(self.buckets)}")
        self.epoch, self.step = 0, 0
        self._units: list[list[int]] | None = None
        self._units_epoch = -1
        if self.steps_per_epoch == 0:
            raise ValueError(f"one epoch makes {len(self._epoch_units(0))} rows, fewer than batch_size="
                             f"{config.batch_size}")

    # ------------------------------------------------------------------------------------------ order
    def epoch_order(self, epoch: int) -> np.ndarray:
        """Example indices of ``epoch`` in training order."""
        total = sum(self._sizes)
        if self.config.weights is None:
            counts = self._sizes
        else:
            weights = np.asarray(self.config.weights, np.float64)
            counts = np.rint(weights / weights.sum() * total).astype(int).tolist()
        parts = []
        for i, (size, count) in enumerate(zip(self._sizes, counts, strict=True)):
            order = np.random.default_rng([self.config.seed, epoch, i]).permutation(size) if self.config.shuffle \
                else np.arange(size)
            parts.append(self._offsets[i] + np.resize(order, count))
        order = np.concatenate(parts)
        if self.config.shuffle:
            order = np.random.default_rng([self.config.seed, epoch]).permutation(order)
        return order

    def _epoch_units(self, epoch: int) -> list[list[int]]:
        """Rows of example indices (one example per row without packing)."""
        if self._units_epoch != epoch:
            order = self.epoch_order(epoch)
            if self.config.packing:
                examples = [self.examples[i] for i in order]
                rows = pack_rows(examples, self.config.row_length, pairs=self.kind == "preference",
                                 shared_prefix=self.config.shared_prefix)
                self._units = [[int(order[j]) for j in row] for row in rows]
            else:
                self._units = [[int(i)] for i in order]
            self._units_epoch = epoch
        return self._units

    @property
    def steps_per_epoch(self) -> int:
        return len(self._epoch_units(self.epoch)) // self.config.batch_size

    # ------------------------------------------------------------------------------------------ state
    def state(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "seed": self.config.seed,
                "batch_size": self.config.batch_size, "num_examples": len(self.examples)}

    def restore(self, state: dict) -> None:
        for key in ("seed", "batch_size", "num_examples"):
            if state.get(key) != self.state()[key]:
                raise ValueError(f"cannot restore the data position: {key} was {state.get(key)}, now "
                                 f"{self.state()[key]} (the data or its settings changed)")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])

    # ------------------------------------------------------------------------------------------ batches
    def global_batch(self, epoch: int, step: int) -> dict[str, np.ndarray]:
        """The whole batch ``step`` of ``epoch`` (all hosts' rows)."""
        size = self.config.batch_size
        rows = self._epoch_units(epoch)[step * size:(step + 1) * size]
        if self.config.packing:
            batch = packed_batch(self.examples, rows, self.config.row_length, self.config.pad_id,
                                 pairs=self.kind == "preference", max_pairs_per_row=self.config.max_pairs_per_row,
                                 shared_prefix=self.config.shared_prefix)
        elif self._row_sizes is not None:  # one shared-prefix pair per row
            length = bucket_length(int(max(self._row_sizes[row[0]] for row in rows)), self.buckets)
            batch = packed_batch(self.examples, rows, length, self.config.pad_id, pairs=True, max_pairs_per_row=1,
                                 shared_prefix=True)
        else:
            examples = [self.examples[row[0]] for row in rows]
            length = bucket_length(max_sequence_length(examples, self.kind), self.buckets)
            batch = pad_batch(examples, self.kind, length, self.config.pad_id)
        batch["example_weight"] = np.ones(size, np.float32)
        return batch

    def __next__(self) -> dict[str, np.ndarray]:
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        batch = self.global_batch(self.epoch, self.step)
        self.step += 1
        per_host = self.config.batch_size // self.num_hosts
        rows = slice(self.host_index * per_host, (self.host_index + 1) * per_host)
        return {name: value[rows] for name, value in batch.items()}

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self
