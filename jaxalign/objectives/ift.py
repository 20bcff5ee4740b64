"""IFT objective: two forward passes, temporal-residual input mixing and relation-propagation weights.

Pass 1 (no gradient) gives the model's greedy guess ``ŝ_t = argmax z_{t−1}`` for every position. Pass 2 runs
on input embeddings mixed ``(1−λ)·E[s_t] + λ·E[ŝ_t]`` at trained (completion) positions only, with the
embedding table under ``stop_gradient`` (the official code uses a frozen copy re-synced after each step),
then applies ``jaxalign.losses.ift``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxalign import losses
from jaxalign.objectives.common import (
    EngineParams,
    Metric,
    example_weights,
    policy_token_logps,
    require,
    resolve_chunk_size,
    token_nll_metric,
    weighted_means,
)
from jaxalign.objectives.sft import NORMALIZATIONS, reduce_sequence_losses

LAMBDA_SCHEDULES = ("constant", "linear")
EMBEDDING_GRADS = ("none", "ground_truth")


@dataclasses.dataclass(frozen=True)
class IFTParams(EngineParams):
    """Defaults from the official scripts: λ = 0.2 (constant), γ = 0.95, sequence-mean normalisation.

    ``lambda_schedule``: ``constant`` (λ = ``max_lambda``) or ``linear`` (``min_lambda`` → ``max_lambda`` over
    ``warmup_steps``); ``disturb_std > 0`` multiplies λ by ``1 + disturb_std·ε``, ε ~ N(0, 1) per step (the
    paper's "noisy λ", 0.5 there). λ is clamped to [0, 1].

    ``embedding_grad``: ``none`` (official code: inputs come from a frozen copy of the table, so the input
    embeddings get no gradient; a tied table still learns through the LM head) or ``ground_truth`` (the
    ``(1−λ)·E[s]`` term keeps its gradient, only the guess ``λ·E[ŝ]`` is a constant; with λ = γ = 0 this is
    SFT exactly, input embeddings included).
    """

    max_lambda: float = 0.2
    min_lambda: float = 0.0
    lambda_schedule: str = "constant"
    warmup_steps: int = 150
    disturb_std: float = 0.0
    gamma: float = 0.95
    detach_weights: bool = False
    embedding_grad: str = "none"
    normalization: str = "sequence"

    def __post_init__(self):
        if self.embedding_grad not in EMBEDDING_GRADS:
            raise ValueError(f"embedding_grad={self.embedding_grad!r}; expected one of {EMBEDDING_GRADS}")
        if self.lambda_schedule not in LAMBDA_SCHEDULES:
            raise ValueError(f"lambda_schedule={self.lambda_schedule!r}; expected one of {LAMBDA_SCHEDULES}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization={self.normalization!r}; expected one of {NORMALIZATIONS}")
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"gamma={self.gamma} must be in [0, 1]")


def ift_lambda(hparams: IFTParams, step, rng=None) -> jax.Array:
    """λ at ``step`` (official ``update_lambda``)."""
    lam = jnp.asarray(hparams.max_lambda, jnp.float32)
    if hparams.lambda_schedule == "linear":
        progress = jnp.minimum(1.0, jnp.asarray(step, jnp.float32) / max(hparams.warmup_steps, 1))
        lam = hparams.min_lambda + (hparams.max_lambda - hparams.min_lambda) * progress
    if hparams.disturb_std > 0:
        if rng is None:
            raise ValueError("disturb_std > 0 needs an rng")
        lam = lam * (1 + hparams.disturb_std * jax.random.normal(jax.random.fold_in(rng, step)))
    return jnp.clip(lam, 0.0, 1.0)


def mixed_embeddings(model, tokens, attention_mask, loss_mask, lam, *, chunk_size: int = 0,
                     embedding_grad: str = "none") -> jax.Array:
    """Input embeddings for pass 2: the true embedding everywhere, mixed with the greedy guess's embedding
    where ``loss_mask`` is set. The guess never carries gradient to the table; the true term does only with
    ``embedding_grad="ground_truth"``."""
    table = jax.lax.stop_gradient(model.embed_tokens[...])
    true_table = model.embed_tokens[...] if embedding_grad == "ground_truth" else table
    with jax.named_scope("ift_pass1"):
        hidden, _ = model.hidden_states(tokens, attention_mask)
        hidden = jax.lax.stop_gradient(hidden)
        chunk_size = resolve_chunk_size(chunk_size, tokens.shape[0], tokens.shape[1], model.config.vocab_size)
        if chunk_size > 0:
            kernel = jax.lax.stop_gradient(model.head_kernel())
            greedy = losses.greedy_from_hidden(hidden, kernel, chunk_size=chunk_size)
        else:
            greedy = jnp.argmax(jax.lax.stop_gradient(model.unembed(hidden)), axis=-1)
    predicted = jnp.concatenate([tokens[:, :1], greedy[:, :-1].astype(tokens.dtype)], axis=1)
    dtype = model.config.dtype
    true = model.embed_rows(true_table, tokens)
    guess = model.embed_rows(table, predicted)
    lam = jnp.asarray(lam, dtype)
    return jnp.where(loss_mask.astype(bool)[..., None], (1 - lam) * true + lam * guess, true)


def ift(model, batch, hparams: IFTParams = IFTParams(), *, step=0, rng=None, **_):
    """Batch fields: ``tokens``, ``attention_mask``, ``loss_mask`` ``[B, T]``; optional ``example_weight``."""
    tokens, attention_mask, loss_mask = require(batch, "tokens", "attention_mask", "loss_mask", objective="ift")
    lam = ift_lambda(hparams, step, rng)
    embeds = mixed_embeddings(model, tokens, attention_mask, loss_mask, lam, chunk_size=hparams.logps_chunk_size,
                              embedding_grad=hparams.embedding_grad)
    with jax.named_scope("ift_pass2"):
        logps = policy_token_logps(model, tokens, attention_mask, loss_mask, inputs_embeds=embeds,
                                   chunk_size=hparams.logps_chunk_size)
    per_seq, per_example = losses.ift(-logps, loss_mask, gamma=hparams.gamma, detach_weights=hparams.detach_weights)
    weight = example_weights(batch, "tokens", tokens.shape[0])
    # Σ_t w_t ℓ_t with its gradient (the metric ``ift/weighted_sum`` is a stopped copy): the token mean's numerator
    weighted_sum = per_seq * jnp.maximum(per_example["len/completion"], 1.0)
    loss = reduce_sequence_losses(per_seq, weighted_sum, per_example["len/completion"], weight, hparams.normalization)
    metrics = weighted_means(per_example, weight)
    metrics["loss"] = Metric(jax.lax.stop_gradient(loss.total), loss.count)
    metrics["ift/lambda"] = Metric(lam, jnp.ones(()))
    metrics["nll/token"] = token_nll_metric(per_example, weight)
    return loss.total / jnp.maximum(loss.count, 1.0), metrics
