"""KTO — Kahneman-Tversky Optimization (Ethayarajh et al., 2024, arXiv 2402.01306), as TRL 1.16's ``KTOTrainer``.

Unpaired: each example is one completion labelled desirable or undesirable. With the policy/reference log-ratio
``ρ = π − ref`` of the completion (summed log-probs) and the reference point ``z`` (the batch's KL estimate):
desirable ``λ_D · (1 − σ(β(ρ − z)))``, undesirable ``λ_U · (1 − σ(β(z − ρ)))``. ``apo_zero_unpaired`` (APO,
D'Oosterlinck et al., 2024) drops the reference point: ``1 − σ(βρ)`` and ``σ(βρ)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def kto_kl(policy_kl_logps: jax.Array, ref_kl_logps: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """KTO's reference point: the mean over the (valid) mismatched sequences of ``π − ref``, gradient-free and
    clamped at 0, as TRL computes it."""
    ratio = jnp.asarray(policy_kl_logps, jnp.float32) - jnp.asarray(ref_kl_logps, jnp.float32)
    valid = jnp.ones(ratio.shape, bool) if valid is None else jnp.asarray(valid) > 0
    mean = jnp.where(valid, ratio, 0.0).sum() / jnp.maximum(valid.sum(), 1)
    return jnp.maximum(jax.lax.stop_gradient(mean), 0.0)


def kto(policy_logps: jax.Array, ref_logps: jax.Array, labels: jax.Array, kl: jax.Array | float = 0.0, *,
        beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
        loss_type: str = "kto") -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-example KTO loss ``[B]`` (TRL's ``losses``, whose mean over the batch is the loss) and metrics.

    Args:
      policy_logps, ref_logps: summed completion log-probs ``[B]``.
      labels: ``[B]``, 1 / True = desirable, 0 / False = undesirable.
      kl: the reference point (``kto_kl``); ignored by ``apo_zero_unpaired``.
    Metrics (per example, to be averaged over the examples they name): ``rewards/chosen`` and ``logps/chosen``
    over the desirable, ``rewards/rejected`` and ``logps/rejected`` over the undesirable (``desirable`` /
    ``undesirable`` are the indicator weights), rewards ``βρ``.
    """
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}; expected one of {KTO_LOSS_TYPES}")
    policy_logps, ref_logps = jnp.asarray(policy_logps, jnp.float32), jnp.asarray(ref_logps, jnp.float32)
    desirable = jnp.asarray(labels) > 0
    ratio = policy_logps - ref_logps
    if loss_type == "kto":
        kl = jax.lax.stop_gradient(jnp.asarray(kl, jnp.float32))
        chosen, rejected = 1 - jax.nn.sigmoid(beta * (ratio - kl)), 1 - jax.nn.sigmoid(beta * (kl - ratio))
    else:
        chosen, rejected = 1 - jax.nn.sigmoid(beta * ratio), jax.nn.sigmoid(beta * ratio)
    loss = jnp.where(desirable, desirable_weight * chosen, undesirable_weight * rejected)
    rewards = jax.lax.stop_gradient(beta * ratio)
    metrics = {"rewards": rewards, "logps": jax.lax.stop_gradient(policy_logps),
               "desirable": desirable.astype(jnp.float32), "undesirable": (~desirable).astype(jnp.float32)}
    return loss, metrics
