"""GKD's on-policy and sequence-level distillation batches (TRL 1.16 ``GKDTrainer.training_step``).

Before each optimizer step of a ``distill`` run with ``lmbda > 0`` or ``seq_kd``, the step's completions are chosen:
with probability ``lmbda`` the student's own samples, otherwise the teacher's samples when ``seq_kd`` (sequence-level
KD), otherwise the data's completions. Sampled completions continue each row's prompt (its tokens before the last
trained span: every turn but the last, with the generation prompt, as TRL's GKD collator builds it) with
``jaxalign.sampling.sample`` at the objective's ``temperature`` (TRL: ``do_sample``, ``top_k=0``, ``top_p=1``), at most
``max_new_tokens`` tokens, up to and including the first EOS (TRL's completion mask). Only the completion is trained.

The choice and the sampling key are functions of the run's seed and the step, so a resumed run draws exactly what
the uninterrupted one drew. Rows longer than ``data.max_length`` are cut there (the data's own limit).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxalign.data.batching import bucket_length, default_buckets, pad_batch
from jaxalign.data.tokenize import padding_id
from jaxalign.parallel.distributed import gather_rows, to_host
from jaxalign.sampling.generate import left_pad, sample

SEQUENCE_FIELDS = ("tokens", "attention_mask", "loss_mask", "segment_ids", "positions")


def enabled(hparams) -> bool:
    """Whether an objective's hyper-parameters ask for sampled completions (GKD's ``lmbda`` or ``seq_kd``)."""
    return bool(getattr(hparams, "samples_completions", False))


def completion_source(hparams, seed: int, step: int) -> str:
    """``"student"`` with probability ``lmbda``, else ``"teacher"`` with ``seq_kd``, else ``"data"`` (TRL's order:
    the student's coin first), drawn from ``(seed, step)``."""
    if hparams.lmbda > 0 and np.random.default_rng([seed, 4049, step]).random() < hparams.lmbda:
        return "student"
    return "teacher" if hparams.seq_kd else "data"


def sampling_seed(seed: int, step: int) -> int:
    return int(np.random.default_rng([seed, 4051, step]).integers(2**31 - 1))


def prompts_of(batch: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Each row's prompt: its real tokens before the start of its last trained span. A row without prompt tokens
    is an error (there is nothing to sample from)."""
    prompts = []
    for row, (tokens, attention, trained) in enumerate(zip(batch["tokens"], batch["attention_mask"],
                                                          batch["loss_mask"], strict=True)):
        real = int(np.asarray(attention).sum())
        positions = np.flatnonzero(np.asarray(trained)[:real])
        if positions.size:
            gaps = np.flatnonzero(np.diff(positions) > 1)
            start = int(positions[gaps[-1] + 1] if gaps.size else positions[0])
        else:
            start = real
        if start == 0:
            raise ValueError(f"on-policy distillation: row {row} of the batch has no prompt tokens before its "
                             "completion, so there is nothing to sample a completion from; give every record a prompt "
                             "(or set objective.params.lmbda=0 and seq_kd=False)")
        prompts.append(np.asarray(tokens[:start], np.int32))
    return prompts


def completion_rows(prompt_ids: np.ndarray, prompt_mask: np.ndarray, completion: np.ndarray, lengths: np.ndarray, *,
                    pad_id: int, max_length: int, buckets) -> dict[str, np.ndarray]:
    """Right-padded rows ``prompt + completion[:length]`` from left-padded prompts ``[N, P]`` and sampled
    completions ``[N, M]`` (``lengths`` up to and including EOS), cut to ``max_length`` tokens, padded to the
    smallest of ``buckets`` that holds the longest; ``loss_mask`` 1 on the completion's tokens only."""
    examples = []
    for ids, mask, new, length in zip(prompt_ids, prompt_mask, completion, lengths, strict=True):
        prompt = ids[mask.astype(bool)]
        row = np.concatenate([prompt, new[:int(length)]])[:max_length]
        examples.append({"tokens": row, "loss_mask": (np.arange(len(row)) >= len(prompt)).astype(np.int32)})
    width = bucket_length(max(len(e["tokens"]) for e in examples), buckets)
    return pad_batch(examples, "sft", width, pad_id)


class GKDBatches:
    """Turns a step's host batch into the batch GKD trains on (see the module doc). ``stats()`` returns, and
    resets, what the steps since the last call drew (for the metrics)."""

    def __init__(self, engine, spec):
        self.engine, self.hp, self.seed = engine, spec.objective.params, spec.seed
        self.max_length = spec.data.max_length
        self.buckets = default_buckets(spec.data.max_length)
        self.pad = padding_id(engine.hf_tokenizer)
        self.eos = engine.tokenizer.eos_id
        self.processes, self.process = jax.process_count(), jax.process_index()
        self._steps, self._student, self._teacher, self._lengths, self._clipped = 0, 0, 0, [], 0

    def describe(self) -> str:
        hp = self.hp
        sources = [f"the student's samples with probability {hp.lmbda:g}"] if hp.lmbda > 0 else []
        sources.append("the teacher's samples otherwise" if hp.seq_kd else "the data's completions otherwise")
        return (f"distill: each step trains on {', '.join(sources)} (up to {hp.max_new_tokens} new tokens at "
                f"temperature {hp.temperature:g}, rows cut to data.max_length={self.max_length})")

    def model(self, source: str):
        engine = self.engine
        return engine.policy() if source == "student" else engine.parts.reference(engine.frozen)

    def __call__(self, batch: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
        source = completion_source(self.hp, self.seed, step)
        self._steps += 1
        if source == "data":
            return batch
        prompts = prompts_of(batch)
        width = bucket_length(int(gather_rows(np.asarray([max(map(len, prompts))])).max()), self.buckets)
        ids, mask = left_pad([p.tolist() for p in prompts], self.pad, width)
        ids, mask = gather_rows(ids), gather_rows(mask)  # every process samples the whole batch, keeps its rows
        generation = sample(self.model(source), ids, prompt_mask=mask, max_new_tokens=self.hp.max_new_tokens,
                            temperature=self.hp.temperature, eos_id=self.eos, pad_id=self.pad,
                            seed=sampling_seed(self.seed, step))
        completion, lengths = to_host(generation.tokens), to_host(generation.lengths)
        rows = completion_rows(ids, mask, completion, lengths, pad_id=self.pad, max_length=self.max_length,
                               buckets=self.buckets)
        local = len(prompts)
        mine = slice(self.process * local, (self.process + 1) * local)
        self._student += source == "student"
        self._teacher += source == "teacher"
        self._lengths.extend(lengths.tolist())
        self._clipped += int((lengths >= self.hp.max_new_tokens).sum())
        kept = {k: v for k, v in batch.items() if k not in SEQUENCE_FIELDS}
        return {**kept, **{k: v[mine] for k, v in rows.items()}}

    def stats(self) -> dict[str, float]:
        steps = max(self._steps, 1)
        out = {"gkd/student_steps": self._student / steps, "gkd/teacher_steps": self._teacher / steps}
        if self._lengths:
            out["completion/mean_length"] = float(np.mean(self._lengths))
            out["completion/clipped_ratio"] = self._clipped / len(self._lengths)
        self._steps, self._student, self._teacher, self._lengths, self._clipped = 0, 0, 0, [], 0
        return out
