"""Pairwise preference losses on summed sequence log-probs: DPO (sigmoid / IPO / hinge), SimPO, ORPO.

Inputs are per-pair ``[B]`` arrays. Each function returns ``(per_pair_loss [B], metrics)`` with per-pair
metrics under TRL's names (``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``) so callers can average them exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")


def _f32(*arrays):
    return tuple(jnp.asarray(a, jnp.float32) for a in arrays)


def _reward_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps) -> dict[str, jax.Array]:
    return {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/margins": chosen_rewards - rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).astype(jnp.float32),
        "logps/chosen": chosen_logps,
        "logps/rejected": rejected_logps,
    }


def dpo(policy_chosen: jax.Array, policy_rejected: jax.Array, ref_chosen: jax.Array, ref_rejected: jax.Array,
        *, beta: float = 0.1, label_smoothing: float = 0.0, loss_type: str = "sigmoid",
        ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Direct Preference Optimization (Rafailov et al., 2023, arXiv 2305.18290) and variants.


    With ``h = (π_c − ref_c) − (π_r − ref_r)`` (log-probs, ``[B]``):
      * ``sigmoid``: ``−(1−ε)·log σ(β h) − ε·log σ(−β h)`` (ε = ``label_smoothing``, cDPO);
      * ``ipo``: ``(h − 1/(2β))²`` (Azar et al., 2023, arXiv 2310.12036; pass length-averaged log-probs as TRL does);
      * ``hinge``: ``max(0, 1 − β h)`` (SLiC, Zhao et al., 2023);
      * ``robust``: ``[−(1−ε) log σ(β h) + ε log σ(−β h)] / (1 − 2ε)`` (rDPO, Chowdhury et al., 2024; TRL's
        ``label_smoothing`` for noisy labels).
    Zero reference log-probs give reference-free DPO. Rewards: ``β (π − ref)``, gradient-free.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}; expected one of {DPO_LOSS_TYPES}")
    policy_chosen, policy_rejected, ref_chosen, ref_rejected = _f32(policy_chosen, policy_rejected, ref_chosen,
                                                                    ref_rejected)
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if loss_type == "sigmoid":
        loss = -(1 - label_smoothing) * jax.nn.log_sigmoid(beta * h) - label_smoothing * jax.nn.log_sigmoid(-beta * h)
    elif loss_type == "ipo":
        loss = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        loss = (-(1 - label_smoothing) * jax.nn.log_sigmoid(beta * h)
                + label_smoothing * jax.nn.log_sigmoid(-beta * h)) / (1 - 2 * label_smoothing)
    else:
        loss = jax.nn.relu(1 - beta * h)
    chosen_rewards = jax.lax.stop_gradient(beta * (policy_chosen - ref_chosen))
    rejected_rewards = jax.lax.stop_gradient(beta * (policy_rejected - ref_rejected))
    return loss, _reward_metrics(chosen_rewards, rejected_rewards, jax.lax.stop_gradient(policy_chosen),
                                 jax.lax.stop_gradient(policy_rejected))


def simpo(chosen_logps: jax.Array, rejected_logps: jax.Array, chosen_len: jax.Array, rejected_len: jax.Array,
          *, beta: float = 2.0, gamma_beta_ratio: float = 0.8, label_smoothing: float = 0.0,
          loss_type: str = "sigmoid") -> tuple[jax.Array, dict[str, jax.Array]]:
    """SimPO (Meng et al., 2024, arXiv 2405.14734): reference-free, length-normalised margin loss.

    ``a = logps / len``; ``z = β·(a_c − a_r − γ/β)``; ``sigmoid``: ``−(1−ε) log σ(z) − ε log σ(−z)``;
    ``hinge``: ``max(0, 1 − z)``. Rewards are ``β·a`` (as in the official trainer).
    """
    if loss_type not in ("sigmoid", "hinge"):
        raise ValueError(f"loss_type={loss_type!r}; expected 'sigmoid' or 'hinge'")
    chosen_logps, rejected_logps, chosen_len, rejected_len = _f32(chosen_logps, rejected_logps, chosen_len,
                                                                  rejected_len)
    chosen_avg = chosen_logps / jnp.maximum(chosen_len, 1.0)
    rejected_avg = rejected_logps / jnp.maximum(rejected_len, 1.0)
    z = beta * (chosen_avg - rejected_avg - gamma_beta_ratio)
    if loss_type == "sigmoid":
        loss = -(1 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)
    else:
        loss = jax.nn.relu(1 - z)
    metrics = _reward_metrics(jax.lax.stop_gradient(beta * chosen_avg), jax.lax.stop_gradient(beta * rejected_avg),
                              jax.lax.stop_gradient(chosen_avg), jax.lax.stop_gradient(rejected_avg))
    return loss, {**metrics, "len/chosen": chosen_len, "len/rejected": rejected_len}


def log1mexp(x: jax.Array) -> jax.Array:
    """``log(1 − exp(x))`` for ``x < 0``, stable at both ends (Mächler, 2012)."""
    return jnp.where(x > -jnp.log(2.0), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def orpo(chosen_logps: jax.Array, rejected_logps: jax.Array, chosen_len: jax.Array, rejected_len: jax.Array,
         *, lam: float = 0.1, max_avg_logp: float = -1e-6) -> tuple[jax.Array, dict[str, jax.Array]]:
    """ORPO (Hong et al., 2024, arXiv 2403.07691): SFT plus an odds-ratio preference term.

    With length-normalised ``a = logps / len`` clamped to ``a ≤ max_avg_logp`` (so the odds stay finite as
    ``p → 1``) and ``log odds(y) = a − log(1 − e^a)``:
    ``L = −a_c − λ·log σ(log odds(y_c) − log odds(y_r))``. Rewards are ``λ·a`` (TRL's convention).
    """
    chosen_logps, rejected_logps, chosen_len, rejected_len = _f32(chosen_logps, rejected_logps, chosen_len,
                                                                  rejected_len)
    chosen_avg = jnp.minimum(chosen_logps / jnp.maximum(chosen_len, 1.0), max_avg_logp)
    rejected_avg = jnp.minimum(rejected_logps / jnp.maximum(rejected_len, 1.0), max_avg_logp)
    log_odds = (chosen_avg - log1mexp(chosen_avg)) - (rejected_avg - log1mexp(rejected_avg))
    ratio = jax.nn.log_sigmoid(log_odds)
    nll = -chosen_avg
    loss = nll - lam * ratio
    metrics = _reward_metrics(jax.lax.stop_gradient(lam * chosen_avg), jax.lax.stop_gradient(lam * rejected_avg),
                              jax.lax.stop_gradient(chosen_avg), jax.lax.stop_gradient(rejected_avg))
    metrics.update({"nll_loss": jax.lax.stop_gradient(nll), "log_odds_ratio": jax.lax.stop_gradient(ratio),
                    "log_odds_chosen": jax.lax.stop_gradient(log_odds), "len/chosen": chosen_len,
                    "len/rejected": rejected_len})
    return loss, metrics
