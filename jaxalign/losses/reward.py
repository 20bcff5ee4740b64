"""Reward-model training: the Bradley-Terry pairwise loss on scalar scores, as TRL 1.16's ``RewardTrainer``."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def bradley_terry(chosen_rewards: jax.Array, rejected_rewards: jax.Array, *, margin: jax.Array | None = None,
                  center_rewards_coefficient: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-pair ``−log σ(r_c − r_r − m) + c·(r_c + r_r)²`` ``[B]``, whose batch mean is TRL's loss (``m``: the
    record's ``margin``, Llama 2's margin loss; ``c``: ``center_rewards_coefficient``, Eisenstein et al., 2023,
    which keeps rewards centred at 0). Metrics per pair, under the DPO family's names: ``rewards/accuracies``
    (r_c > r_r; TRL's ``accuracy``), ``rewards/margins`` (r_c − r_r; TRL's ``margin``), ``rewards/chosen``,
    ``rewards/rejected``, ``mean_reward`` (of the two)."""
    chosen = jnp.asarray(chosen_rewards, jnp.float32)
    rejected = jnp.asarray(rejected_rewards, jnp.float32)
    gap = chosen - rejected
    shifted = gap if margin is None else gap - jnp.asarray(margin, jnp.float32)
    loss = -jax.nn.log_sigmoid(shifted)
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * (chosen + rejected) ** 2
    gap = jax.lax.stop_gradient(gap)
    metrics = {"rewards/accuracies": (gap > 0).astype(jnp.float32), "rewards/margins": gap,
               "rewards/chosen": jax.lax.stop_gradient(chosen), "rewards/rejected": jax.lax.stop_gradient(rejected),
               "mean_reward": jax.lax.stop_gradient((chosen + rejected) / 2)}
    return loss, metrics
