"""Distillation objective: the student matches a frozen teacher's next-token distributions on completion tokens
by the generalized JSD (TRL's ``GKDTrainer``): the SFT data's completions, or (``lmbda`` / ``seq_kd``) completions the
student or the teacher samples before the step (GKD's on-policy mix and sequence-level KD; the training loop draws
them, ``jaxalign.train.onpolicy``).

The teacher is a separate model (any size, the student's tokenizer), held once on the training mesh and passed to
the objective in the reference slot (``reference=``). The loss is a token mean over every trained token of the
batch (TRL's ``batchmean`` over labels != -100), so micro-batches and hosts combine exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxalign import losses
from jaxalign.objectives.common import (
    AUTO_CHUNK_ELEMENTS,
    AUTO_CHUNK_TARGET,
    CPU_FUSED_ELEMENTS,
    EngineParams,
    Metric,
    example_weights,
    require,
)

# -1 (automatic) blocks hold about this many logits per model: on accelerators the fused log-prob path's target
# (2^24, 64 MB in float32); on the CPU half of it, where blocks of 21-64 positions ran fastest at SmolLM2's head
# (docs/benchmarks.md, the blocked distillation loss)
BLOCK_TARGET = AUTO_CHUNK_TARGET
CPU_BLOCK_TARGET = AUTO_CHUNK_TARGET // 2


@dataclasses.dataclass(frozen=True)
class DistillParams(EngineParams):
    """``teacher``: the teacher model (a Hugging Face folder, a .gguf file, a Hub id or a jaxalign run folder) with
    the student's tokenizer; ``beta``: the generalized JSD's interpolation (GKD's default 0.5; 0 = forward KL, the
    classic KD; 1 = reverse KL); ``temperature``: both distributions at ``logits / temperature``, and the sampling
    temperature of generated completions (TRL uses one value for both; its default is 0.9).

    ``lmbda``: the probability that a step trains on the student's own samples of the batch's prompts (GKD's
    on-policy fraction; TRL's default 0.5, here 0 = the data's completions only); ``seq_kd``: the other steps train
    on the teacher's samples (sequence-level KD) instead of the data's; ``max_new_tokens``: the sampled completions'
    limit (TRL's default 128).

    ``logits_block``: how the two models' ``[B, T, V]`` logits are formed: 0 = whole (the plain path); ``n > 0`` =
    ``n`` positions at a time (``losses.blocked_generalized_jsd``: never more than ``B × n × V`` logits of each
    model, the gradient formed in closed form, no more matrix products than the plain path); -1 (default) = chosen
    by backend and size (``resolve_logits_block``)."""

    teacher: str = ""
    beta: float = 0.5
    temperature: float = 1.0
    lmbda: float = 0.0
    seq_kd: bool = False
    max_new_tokens: int = 128
    logits_block: int = -1

    def __post_init__(self):
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta={self.beta} must be in [0, 1] (0 = forward KL, 1 = reverse KL)")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0")
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError(f"lmbda={self.lmbda} must be in [0, 1] (the share of steps on the student's samples)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.logits_block < -1:
            raise ValueError(f"logits_block={self.logits_block} must be -1 (automatic), 0 (whole logits) or a "
                             "number of positions per block")

    @property
    def samples_completions(self) -> bool:
        """Whether some steps train on sampled completions (``lmbda > 0`` or ``seq_kd``)."""
        return self.lmbda > 0 or self.seq_kd


def resolve_logits_block(block: int, rows: int, length: int, vocab: int, backend: str | None = None) -> int:
    """Positions per block of the blocked distillation loss, or 0 for whole logits. ``block >= 0`` is returned as
    given; -1 takes the whole logits below the thresholds the fused log-prob path uses (``resolve_chunk_size``),
    and above them blocks of about ``BLOCK_TARGET`` (accelerators) or ``CPU_BLOCK_TARGET`` logits per model."""
    if block >= 0:
        return block
    elements = rows * length * vocab
    cpu = (backend or jax.default_backend()) == "cpu"
    if elements < (CPU_FUSED_ELEMENTS if cpu else AUTO_CHUNK_ELEMENTS):
        return 0
    return int(min(length, max(1, (CPU_BLOCK_TARGET if cpu else BLOCK_TARGET) // max(rows * vocab, 1))))


def _head_is_plain(model) -> bool:
    """Whether ``model.unembed`` is ``hidden @ head_kernel()`` (capped): no int8 head scales."""
    return getattr(model, "embed_tokens_scale", None) is None and getattr(model, "lm_head_scale", None) is None


def distill(model, batch, hparams: DistillParams = DistillParams(), *, reference=None, **_):
    """Batch fields: ``tokens``, ``attention_mask``, ``loss_mask`` ``[B, T]``, optional ``segment_ids`` (packing)
    and ``example_weight``; ``reference`` is the teacher."""
    if reference is None:
        raise ValueError("distill needs the teacher model: pass reference=teacher")
    tokens, attention_mask, loss_mask = require(batch, "tokens", "attention_mask", "loss_mask", objective="distill")
    segments = batch.get("segment_ids")
    with jax.named_scope("policy"):
        student_hidden, _ = model.hidden_states(tokens, attention_mask, segment_ids=segments)
    with jax.named_scope("teacher"):
        teacher_hidden, _ = reference.hidden_states(tokens, attention_mask, segment_ids=segments)
    trained = jnp.asarray(loss_mask[:, 1:], jnp.float32) * example_weights(batch, "tokens", tokens.shape[0])[:, None]
    block = resolve_logits_block(hparams.logits_block, tokens.shape[0], tokens.shape[1] - 1, model.config.vocab_size)
    if block > 0 and _head_is_plain(model) and _head_is_plain(reference):
        total, nll, teacher_nll = losses.blocked_generalized_jsd(
            student_hidden[:, :-1], model.head_kernel(), jax.lax.stop_gradient(teacher_hidden[:, :-1]),
            jax.lax.stop_gradient(reference.head_kernel()), tokens[:, 1:].astype(jnp.int32), trained,
            hparams.beta, hparams.temperature, block, model.config.final_softcap, reference.config.final_softcap)
    else:
        total, nll, teacher_nll = _whole_logits(model, reference, student_hidden, teacher_hidden, tokens, trained,
                                                hparams)
    count = trained.sum()
    metrics = {"loss": Metric(jax.lax.stop_gradient(total), count),
               "nll/token": Metric(jax.lax.stop_gradient(nll), count),
               "teacher_nll/token": Metric(jax.lax.stop_gradient(teacher_nll), count)}
    return total / jnp.maximum(count, 1e-9), metrics


def _whole_logits(model, reference, student_hidden, teacher_hidden, tokens, trained, hparams: DistillParams):
    """``(Σ w·JSD, Σ w·NLL_student, Σ w·NLL_teacher)`` from the two models' whole ``[B, T, V]`` logits."""
    student_logits = model.unembed(student_hidden)[:, :-1]
    teacher_logits = jax.lax.stop_gradient(reference.unembed(teacher_hidden)[:, :-1])
    divergence = losses.generalized_jsd(student_logits, teacher_logits, beta=hparams.beta,
                                        temperature=hparams.temperature)
    targets = tokens[:, 1:, None].astype(jnp.int32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(jax.lax.stop_gradient(student_logits).astype(jnp.float32), -1),
                               targets, axis=-1)[..., 0]
    teacher_nll = -jnp.take_along_axis(jax.nn.log_softmax(teacher_logits.astype(jnp.float32), -1), targets,
                                       axis=-1)[..., 0]
    return (divergence * trained).sum(), (nll * trained).sum(), (teacher_nll * trained).sum()
