"""Intuitive Fine-Tuning (Hua et al., ACL 2025, arXiv 2405.11870): relation-propagation weights and loss.

As in the official code (``TsinghuaC3I/Intuitive-Fine-Tuning``, ``src/trainers.py``, propagation
``loss / left / L1``): each trained token's loss is weighted by the discounted sum of the (normalised) losses
from that token to the end of the sequence, and the weights are rescaled to average 1 over trained tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reverse_discounted_cumsum(values: jax.Array, gamma: float | jax.Array) -> jax.Array:
    """``G_t = Σ_{k ≥ t} γ^{k−t} values_k`` along the last axis (a linear recurrence, parallel scan)."""
    decay = jnp.broadcast_to(jnp.asarray(gamma, values.dtype), values.shape)

    def combine(left, right):
        # elements compose as affine maps x -> a·x + b, applied right-to-left along the sequence
        a_left, b_left = left
        a_right, b_right = right
        return a_left * a_right, a_right * b_left + b_right

    return jax.lax.associative_scan(combine, (decay, values), reverse=True, axis=values.ndim - 1)[1]


def ift_weights(token_losses: jax.Array, loss_mask: jax.Array, *, gamma: float | jax.Array = 0.95) -> jax.Array:
    """Relation-propagation weights ``[B, T]``, mean 1 over trained tokens, 0 elsewhere.

    ``N = Σ m``; ``u_t = m_t ℓ_t / N``; ``G_t = Σ_{k≥t} γ^{k−t} u_k`` (masked positions still count as steps);
    ``w_t = m_t G_t N / Σ_k m_k G_k``. ``γ = 0`` gives ``w = m`` (plain SFT weighting). Differentiable in
    ``token_losses`` (the official code does not detach them).

    Args:
      token_losses: ``[B, T]`` per-token NLL in token positions (0 where not trained).
      loss_mask: ``[B, T]`` trained tokens (position 0 is never trained).
      gamma: discount, a Python float or a traced scalar.
    """
    mask = jnp.asarray(loss_mask, jnp.float32).at[:, 0].set(0.0)
    losses = jnp.asarray(token_losses, jnp.float32) * mask
    n_tokens = mask.sum(axis=-1, keepdims=True)
    propagated = reverse_discounted_cumsum(losses / jnp.maximum(n_tokens, 1.0), gamma) * mask
    total = propagated.sum(axis=-1, keepdims=True)
    weights = jnp.where(total > 0, propagated * n_tokens / jnp.where(total > 0, total, 1.0), mask)
    return jnp.where(jnp.asarray(gamma) == 0, mask, weights)


def ift(token_losses: jax.Array, loss_mask: jax.Array, *, gamma: float | jax.Array = 0.95,
        detach_weights: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-sequence IFT loss ``(1/N) Σ_t m_t w_t ℓ_t`` with ``w = ift_weights(ℓ, m, γ)``.

    ``detach_weights=True`` stops the gradient through ``w`` (the official code keeps it).
    Worked example: ``ℓ = (1, 2, 3)``, γ = 0.95 → loss 1.80624 (SFT would give 2.0).

    Returns:
      ``(per_seq_loss [B], metrics)`` with per-sequence ``nll/sum`` (unweighted summed NLL),
      ``ift/weighted_sum`` and ``len/completion``.
    """
    mask = jnp.asarray(loss_mask, jnp.float32).at[:, 0].set(0.0)
    losses = jnp.asarray(token_losses, jnp.float32) * mask
    weights = ift_weights(losses, mask, gamma=gamma)
    if detach_weights:
        weights = jax.lax.stop_gradient(weights)
    n_tokens = mask.sum(axis=-1)
    weighted = (weights * losses).sum(axis=-1)
    per_seq = weighted / jnp.maximum(n_tokens, 1.0)
    return per_seq, {"nll/sum": jax.lax.stop_gradient(losses.sum(axis=-1)),
                     "ift/weighted_sum": jax.lax.stop_gradient(weighted), "len/completion": n_tokens}
