"""Supervised fine-tuning: token-mean negative log-likelihood per sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sft(token_logps: jax.Array, loss_mask: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-sequence SFT loss ``-(1/N) Σ_t m_t log p_t`` with ``N = Σ_t m_t`` (0 for a sequence with N = 0).

    Args:
      token_logps: ``[B, T]`` from ``token_logps`` (0 where not trained).
      loss_mask: ``[B, T]`` trained tokens (position 0 is never counted).
    Returns:
      ``(per_seq_loss [B], metrics)``; metrics are per-sequence: ``nll/sum`` (summed NLL, for a
      token-level mean across a batch), ``len/completion`` (N).
    """
    mask = jnp.asarray(loss_mask, jnp.float32).at[:, 0].set(0.0)
    n_tokens = mask.sum(axis=1)
    nll_sum = -(token_logps.astype(jnp.float32) * mask).sum(axis=1)
    per_seq = nll_sum / jnp.maximum(n_tokens, 1.0)
    return per_seq, {"nll/sum": nll_sum, "len/completion": n_tokens}
