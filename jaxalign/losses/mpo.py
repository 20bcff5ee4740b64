"""MPO — Multilingual reward gaP Optimization (Zhao et al., ACL 2025, arXiv 2505.16869).

As in the official code (``circle-hit/MPO``, ``CustomDPOTrainer.mpo_loss``): the policy's length-normalised
reward gap on the target-language pair is pulled towards the frozen model's gap on the dominant-language
pair, and the dominant language's last-layer hidden states are kept where the frozen model has them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reward_gap(chosen_logps: jax.Array, rejected_logps: jax.Array, chosen_len: jax.Array,
               rejected_len: jax.Array) -> jax.Array:
    """``RG = logps_c / len_c − logps_r / len_r`` per pair ``[B]`` (float32; lengths guarded at 1)."""
    chosen = jnp.asarray(chosen_logps, jnp.float32) / jnp.maximum(jnp.asarray(chosen_len, jnp.float32), 1.0)
    rejected = jnp.asarray(rejected_logps, jnp.float32) / jnp.maximum(jnp.asarray(rejected_len, jnp.float32), 1.0)
    return chosen - rejected


def mpo(target_chosen_logps: jax.Array, target_rejected_logps: jax.Array, target_chosen_len: jax.Array,
        target_rejected_len: jax.Array, ref_dominant_gap: jax.Array, *, beta: float = 1.0,
        policy_hidden: jax.Array | None = None, ref_hidden: jax.Array | None = None,
        ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-pair MPO loss ``(β·RG_target − RG_dominant)² + mean((h_policy − h_ref)²)``.

    Args:
      target_*: the policy's summed log-probs and token counts on the target-language pair, ``[B]``.
      ref_dominant_gap: the frozen model's reward gap on the dominant-language pair, ``[B]`` (no gradient).
      beta: scale on the target gap (1.0 for Llama-3.1, 1.5 for Gemma-2 / Qwen2.5 in the official configs).
      policy_hidden, ref_hidden: pooled last-layer hidden states of the dominant chosen and rejected
        sequences, ``[B, ..., D]`` (e.g. ``[B, 2, D]``); the preservation term is their squared difference
        averaged over all non-batch axes (the batch mean equals the official ``nn.MSELoss``). Omit both to
        drop the term.
    Returns:
      ``(per_pair_loss [B], metrics)``; ``rewards/*`` are the policy's average log-probs on the target pair, as
      the official trainer logs them.
    """
    if (policy_hidden is None) != (ref_hidden is None):
        raise ValueError("pass both policy_hidden and ref_hidden, or neither")
    chosen_len = jnp.maximum(jnp.asarray(target_chosen_len, jnp.float32), 1.0)
    rejected_len = jnp.maximum(jnp.asarray(target_rejected_len, jnp.float32), 1.0)
    chosen_avg = jnp.asarray(target_chosen_logps, jnp.float32) / chosen_len
    rejected_avg = jnp.asarray(target_rejected_logps, jnp.float32) / rejected_len
    target_gap = chosen_avg - rejected_avg
    dominant_gap = jax.lax.stop_gradient(jnp.asarray(ref_dominant_gap, jnp.float32))
    gap_loss = (beta * target_gap - dominant_gap) ** 2
    loss = gap_loss
    metrics = {
        "rewards/chosen": jax.lax.stop_gradient(chosen_avg),
        "rewards/rejected": jax.lax.stop_gradient(rejected_avg),
        "rewards/margins": jax.lax.stop_gradient(target_gap),
        "rewards/accuracies": jax.lax.stop_gradient((target_gap > 0).astype(jnp.float32)),
        "reward_gap/target": jax.lax.stop_gradient(target_gap),
        "reward_gap/dominant": dominant_gap,
        "mpo/gap_loss": jax.lax.stop_gradient(gap_loss),
        "len/chosen": chosen_len,
        "len/rejected": rejected_len,
    }
    if policy_hidden is not None:
        diff = jnp.asarray(policy_hidden, jnp.float32) - jax.lax.stop_gradient(jnp.asarray(ref_hidden, jnp.float32))
        hidden_loss = jnp.mean(diff.reshape(diff.shape[0], -1) ** 2, axis=-1)
        loss = loss + hidden_loss
        metrics["mpo/hidden_loss"] = jax.lax.stop_gradient(hidden_loss)
    return loss, metrics
