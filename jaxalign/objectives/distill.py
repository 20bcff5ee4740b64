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
from jaxalign.objectives.common import EngineParams, Metric, example_weights, require


@dataclasses.dataclass(frozen=True)
class DistillParams(EngineParams):
    """``teacher``: the teacher model (a Hugging Face folder, a .gguf file, a Hub id or a jaxalign run folder) with
    the student's tokenizer; ``beta``: the generalized JSD's interpolation (GKD's default 0.5; 0 = forward KL, the
    classic KD; 1 = reverse KL); ``temperature``: both distributions at ``logits / temperature``, and the sampling
    temperature of generated completions (TRL uses one value for both; its default is 0.9).

    ``lmbda``: the probability that a step trains on the student's own samples of the batch's prompts (GKD's
    on-policy fraction; TRL's default 0.5, here 0 = the data's completions only); ``seq_kd``: the other steps train
    on the teacher's samples (sequence-level KD) instead of the data's; ``max_new_tokens``: the sampled completions'
    limit (TRL's default 128)."""

    teacher: str = ""
    beta: float = 0.5
    temperature: float = 1.0
    lmbda: float = 0.0
    seq_kd: bool = False
    max_new_tokens: int = 128

    def __post_init__(self):
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta={self.beta} must be in [0, 1] (0 = forward KL, 1 = reverse KL)")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0")
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError(f"lmbda={self.lmbda} must be in [0, 1] (the share of steps on the student's samples)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")

    @property
    def samples_completions(self) -> bool:
        """Whether some steps train on sampled completions (``lmbda > 0`` or ``seq_kd``)."""
        return self.lmbda > 0 or self.seq_kd


def distill(model, batch, hparams: DistillParams = DistillParams(), *, reference=None, **_):
    """Batch fields: ``tokens``, ``attention_mask``, ``loss_mask`` ``[B, T]``, optional ``segment_ids`` (packing)
    and ``example_weight``; ``reference`` is the teacher."""
    if reference is None:
        raise ValueError("distill needs the teacher model: pass reference=teacher")
    tokens, attention_mask, loss_mask = require(batch, "tokens", "attention_mask", "loss_mask", objective="distill")
    segments = batch.get("segment_ids")
    with jax.named_scope("policy"):
        student_hidden, _ = model.hidden_states(tokens, attention_mask, segment_ids=segments)
        student_logits = model.unembed(student_hidden)[:, :-1]
    with jax.named_scope("teacher"):
        teacher_hidden, _ = reference.hidden_states(tokens, attention_mask, segment_ids=segments)
        teacher_logits = jax.lax.stop_gradient(reference.unembed(teacher_hidden)[:, :-1])
    divergence = losses.generalized_jsd(student_logits, teacher_logits, beta=hparams.beta,
                                        temperature=hparams.temperature)
    trained = jnp.asarray(loss_mask[:, 1:], jnp.float32) * example_weights(batch, "tokens", tokens.shape[0])[:, None]
    targets = tokens[:, 1:, None].astype(jnp.int32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(jax.lax.stop_gradient(student_logits).astype(jnp.float32), -1),
                               targets, axis=-1)[..., 0]
    teacher_nll = -jnp.take_along_axis(jax.nn.log_softmax(teacher_logits.astype(jnp.float32), -1), targets,
                                       axis=-1)[..., 0]
    total, count = (divergence * trained).sum(), trained.sum()
    metrics = {"loss": Metric(jax.lax.stop_gradient(total), count),
               "nll/token": Metric((nll * trained).sum(), count),
               "teacher_nll/token": Metric((teacher_nll * trained).sum(), count)}
    return total / jnp.maximum(count, 1e-9), metrics
