"""The GRPO family's losses (GRPO, BNPO, Dr.GRPO, DAPO, CISPO; GSPO's sequence-level ratio) and group advantages.

Semantics are TRL 1.16's ``GRPOTrainer._compute_loss`` and the advantage code of ``GRPOTrainer`` /
``RLOOTrainer``, for one generation batch taken whole (tests/test_grpo_losses.py restates those lines in PyTorch).
``grpo_terms`` gives the same loss as a numerator and a denominator so that micro-batches and hosts add up to
exactly the whole batch's loss for every loss type: the trainer sums numerators over micro-batches and divides once
by the denominator of the whole generation batch (for DAPO and CISPO, its trained tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
ESTIMATORS = ("grpo", "rloo")
SAMPLING_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
STD_EPS = 1e-4  # TRL's (std + 1e-4)


def _nanmean(x: jax.Array, axis=None, keepdims: bool = False) -> jax.Array:
    return jnp.nanmean(x, axis=axis, keepdims=keepdims)


def _nanstd(x: jax.Array, axis=None, keepdims: bool = False) -> jax.Array:
    """Unbiased (Bessel) standard deviation ignoring NaNs; NaN where fewer than two values (as TRL's ``nanstd``)."""
    count = jnp.sum(~jnp.isnan(x), axis=axis, keepdims=True)
    mean = jnp.nanmean(x, axis=axis, keepdims=True)
    variance = jnp.nanmean((x - mean) ** 2, axis=axis, keepdims=True) * count / jnp.maximum(count - 1, 1)
    std = jnp.where(count > 1, jnp.sqrt(variance), jnp.nan)
    return std if keepdims else (jnp.squeeze(std, axis) if axis is not None else std.reshape(()))


def group_advantages(rewards: jax.Array, group_size: int, *, scale_rewards: str = "group",
                     estimator: str = "grpo") -> jax.Array:
    """Advantages ``[N]`` of rewards ``[N]`` whose ``group_size`` completions per prompt are adjacent.

    ``estimator="grpo"`` (TRL ``GRPOTrainer``): ``r - mean(group)``, divided by ``std + 1e-4`` where ``std`` is the
    unbiased standard deviation over the group (``scale_rewards="group"``) or over the whole batch (``"batch"``;
    the mean stays per group), or not divided (``"none"``). ``estimator="rloo"`` (TRL ``RLOOTrainer``): ``r`` minus
    the mean of the other completions of its group; ``"none"`` is TRL's default, ``"batch"`` is its
    ``normalize_advantages=True`` (``(a - mean a) / (std a + 1e-4)`` over the batch), and ``"group"`` divides by the
    group's reward std + 1e-4 as GRPO does (jaxalign's addition). A NaN reward is unscorable (a reward function
    returned None): it is left out of every mean and std and its advantage is 0, as in TRL.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator={estimator!r}; choose one of {ESTIMATORS}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}; choose one of {SCALE_REWARDS}")
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1 or group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards of shape {rewards.shape} do not split into groups of {group_size}")
    grouped = rewards.reshape(-1, group_size)
    group_std = (_nanstd(grouped, axis=1, keepdims=True) if group_size > 1 else
                 jnp.zeros((grouped.shape[0], 1)))
    if estimator == "grpo":
        advantages = grouped - _nanmean(grouped, axis=1, keepdims=True)
        if scale_rewards == "group":
            advantages = advantages / (group_std + STD_EPS)
        elif scale_rewards == "batch":
            batch_std = _nanstd(rewards) if rewards.shape[0] > 1 else jnp.zeros(())
            advantages = advantages / (batch_std + STD_EPS)
        advantages = advantages.reshape(-1)
    else:
        scorable = jnp.sum(~jnp.isnan(grouped), axis=1, keepdims=True)
        if group_size > 1:
            baselines = (jnp.nansum(grouped, axis=1, keepdims=True) - grouped) / (scorable - 1)
            advantages = grouped - baselines
        else:
            advantages = jnp.zeros_like(grouped)
        if scale_rewards == "group":
            advantages = advantages / (group_std + STD_EPS)
        advantages = advantages.reshape(-1)
        if scale_rewards == "batch":
            advantages = (advantages - _nanmean(advantages)) / (_nanstd(advantages) + STD_EPS)
    return jnp.nan_to_num(advantages, nan=0.0)


def check_grpo_options(loss_type: str, importance_sampling_level: str, max_completion_length: int | None) -> None:
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}; choose one of {GRPO_LOSS_TYPES}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level={importance_sampling_level!r}; choose one of "
                         f"{IMPORTANCE_SAMPLING_LEVELS}")
    if importance_sampling_level == "sequence" and loss_type != "grpo":
        raise ValueError(f"importance_sampling_level='sequence' (GSPO) needs loss_type='grpo': {loss_type!r} sums "
                         "per-token terms, which weights each sequence by its length instead of optimising the "
                         "per-sequence objective (TRL 1.16 warns about this; jaxalign refuses)")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ValueError("loss_type='dr_grpo' divides by batch size x max_completion_length: give "
                         "max_completion_length")


def sampling_correction(old_logps: jax.Array, sampling_logps: jax.Array, loss_mask: jax.Array, *,
                        mode: str = "token_truncate", clip_min: float | None = None,
                        clip_max: float | None = 3.0) -> jax.Array:
    """Importance weights for the mismatch between the sampler's log-probs and the trainer's (TRL 1.16's
    ``vllm_importance_sampling_correction``): ``exp(old_logps - sampling_logps)`` per token (``token_*``, ``[N, T]``)
    or per sequence (``sequence_*``: the exponentiated sum over the sequence's tokens, ``[N, 1]``), then clipped to
    ``[clip_min, clip_max]`` (``*_truncate``) or set to 0 outside it (``*_mask``); None = no bound. The per-token
    loss is multiplied by these weights (``grpo_terms(..., sampling_weights=)``), before the KL term is added."""
    if mode not in SAMPLING_CORRECTIONS[1:]:
        raise ValueError(f"sampling correction mode={mode!r}; choose one of {SAMPLING_CORRECTIONS[1:]}")
    mask = jnp.asarray(loss_mask, jnp.float32)
    diff = (jnp.asarray(old_logps, jnp.float32) - jnp.asarray(sampling_logps, jnp.float32)) * mask
    diff = jax.lax.stop_gradient(jnp.nan_to_num(diff, nan=0.0))  # an unknown sampler log-prob: no correction
    ratio = jnp.exp(diff.sum(axis=1, keepdims=True) if mode.startswith("sequence") else diff)
    low = -jnp.inf if clip_min is None else clip_min
    high = jnp.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        return jnp.clip(ratio, low, high)
    return jnp.where((ratio < low) | (ratio > high), 0.0, ratio)


def grpo_terms(logps: jax.Array, old_logps: jax.Array, advantages: jax.Array, loss_mask: jax.Array, *,
               ref_logps: jax.Array | None = None, beta: float = 0.0, epsilon_low: float = 0.2,
               epsilon_high: float = 0.2, delta: float | None = None, loss_type: str = "dapo",
               importance_sampling_level: str = "token", max_completion_length: int | None = None,
               sampling_weights: jax.Array | None = None,
               ) -> tuple[jax.Array, jax.Array, dict[str, tuple[jax.Array, jax.Array]]]:
    """``(numerator, denominator, metrics)`` of the GRPO-family loss for these rows, where the loss of a batch made
    of several parts (micro-batches, hosts) is ``sum(numerators) / sum(denominators)``; ``metrics`` maps each name
    to ``(sum, count)`` in the same way. Arguments as ``grpo``.

    Denominators: ``grpo`` the number of rows (its numerator sums per-row token means), ``bnpo`` / ``dapo`` /
    ``cispo`` the trained tokens, ``dr_grpo`` rows x ``max_completion_length``. ``sampling_weights`` (``[N, T]``
    or ``[N, 1]``, from ``sampling_correction``) multiply the per-token policy loss before the KL term is added, as
    TRL does."""
    check_grpo_options(loss_type, importance_sampling_level, max_completion_length)
    mask = jnp.asarray(loss_mask, jnp.float32)
    on = mask > 0
    logps = jnp.where(on, logps.astype(jnp.float32), 0.0)  # nothing at padding reaches the gradient
    old_logps = jnp.where(on, jax.lax.stop_gradient(old_logps.astype(jnp.float32)), 0.0)
    advantages = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))[:, None]
    tokens = mask.sum(axis=1)
    log_ratio = logps - old_logps
    if importance_sampling_level == "token":
        log_weights = log_ratio
    else:
        log_weights = ((log_ratio * mask).sum(axis=1) / jnp.maximum(tokens, 1.0))[:, None]
    coef_1 = jnp.exp(log_weights)
    metrics: dict[str, tuple[jax.Array, jax.Array]] = {}

    def masked(name: str, value: jax.Array) -> None:
        """TRL's ``global_masked_mean``: over trained tokens, or over rows for a per-row value."""
        if value.shape[1] == 1:
            metrics[name] = (value.sum(), jnp.asarray(value.shape[0], jnp.float32))
        else:
            metrics[name] = ((value * mask).sum(), mask.sum())

    if loss_type == "cispo":
        clamped = jax.lax.stop_gradient(jnp.minimum(coef_1, epsilon_high))
        per_token = -clamped * advantages * logps
        masked("cispo_clip_ratio", ((coef_1 > epsilon_high) & (advantages > 0)).astype(jnp.float32))
    else:
        coef_2 = jnp.clip(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        clipped_1 = coef_1 if delta is None else jnp.minimum(coef_1, delta)
        per_token = -jnp.minimum(clipped_1 * advantages, coef_2 * advantages)
        low = (clipped_1 < 1 - epsilon_low) & (advantages < 0)  # TRL flags the delta-capped ratio
        high = (clipped_1 > 1 + epsilon_high) & (advantages > 0)
        masked("clip_ratio/low_mean", low.astype(jnp.float32))
        masked("clip_ratio/high_mean", high.astype(jnp.float32))
        masked("clip_ratio/region_mean", (low | high).astype(jnp.float32))
    if sampling_weights is not None:
        weights = jax.lax.stop_gradient(jnp.asarray(sampling_weights, jnp.float32))
        per_token = per_token * weights
        masked("sampling/importance_sampling_ratio/mean", weights)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps (the reference model's per-token log-probs)")
        ref = jnp.where(on, jax.lax.stop_gradient(ref_logps.astype(jnp.float32)), 0.0)
        per_token_kl = (jnp.exp(ref - logps) - (ref - logps) - 1) * coef_1  # k3, importance-corrected (TRL default)
        per_token = per_token + beta * per_token_kl
        masked("kl", per_token_kl)
    per_token = jnp.broadcast_to(per_token, mask.shape) * mask
    rows = jnp.asarray(mask.shape[0], jnp.float32)
    if loss_type == "grpo":
        numerator, denominator = (per_token.sum(axis=1) / jnp.maximum(tokens, 1.0)).sum(), rows
    elif loss_type == "dr_grpo":
        numerator, denominator = per_token.sum(), rows * max_completion_length
    else:
        numerator, denominator = per_token.sum(), mask.sum()
    return numerator, denominator, metrics


def grpo(logps: jax.Array, old_logps: jax.Array, advantages: jax.Array, loss_mask: jax.Array, *,
         ref_logps: jax.Array | None = None, beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
         delta: float | None = None, loss_type: str = "dapo", importance_sampling_level: str = "token",
         max_completion_length: int | None = None, sampling_weights: jax.Array | None = None,
         ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The scalar GRPO-family loss of one generation batch and its metrics.

    Args:
      logps, old_logps: ``[N, T]`` per-token log-probs of the completion tokens under the policy being trained and
        under the policy that sampled them (``old_logps`` is treated as a constant).
      advantages: ``[N]`` (``group_advantages``).
      loss_mask: ``[N, T]`` completion tokens to train (padding 0; the gradient there is exactly 0).
      ref_logps: ``[N, T]`` reference log-probs, needed when ``beta > 0`` (TRL's k3 estimator times the importance
        ratio, TRL 1.16's ``use_bias_correction_kl=True``).
      epsilon_low, epsilon_high: the clipping range ``[1 - low, 1 + high]`` (DAPO's clip-higher: 0.28); for
        ``cispo``, ``epsilon_high`` is the cap on the ratio itself (TRL recommends 5.0).
      delta: two-sided clipping (the unclipped ratio capped at ``delta``) for grpo, bnpo, dr_grpo and dapo.
      loss_type: ``grpo`` (per-sequence token mean, then the mean over sequences), ``bnpo`` (token mean over the
        batch), ``dr_grpo`` (token sum / (N x max_completion_length)), ``dapo`` (token sum / trained tokens of the
        generation batch; TRL's default), ``cispo`` (clipped-ratio weighted REINFORCE, token-normalised like dapo).
      importance_sampling_level: ``token`` or ``sequence`` (GSPO: the ratio of the sequence's mean log-ratio;
        only with ``loss_type="grpo"``).
      sampling_weights: optional ``[N, T]`` or ``[N, 1]`` importance weights for a sampler whose log-probs differ
        from the trainer's (``sampling_correction``; TRL's ``vllm_importance_sampling_correction``).
    Returns:
      ``(loss, metrics)``: TRL's clip ratios (``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
      ``clip_ratio/region_mean``; ``cispo_clip_ratio`` for cispo) and ``kl`` when ``beta > 0``.
    """
    numerator, denominator, sums = grpo_terms(
        logps, old_logps, advantages, loss_mask, ref_logps=ref_logps, beta=beta, epsilon_low=epsilon_low,
        epsilon_high=epsilon_high, delta=delta, loss_type=loss_type,
        importance_sampling_level=importance_sampling_level, max_completion_length=max_completion_length,
        sampling_weights=sampling_weights)
    metrics = {name: total / jnp.maximum(count, 1.0) for name, (total, count) in sums.items()}
    return numerator / jnp.maximum(denominator, 1.0), metrics
