"""Reward-model objective: the decoder with a scalar ``score`` head (``LlamaConfig.num_labels = 1``) scores the
chosen and rejected sequence of each pair in one forward pass; Bradley-Terry loss (TRL's ``RewardTrainer``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxalign import losses
from jaxalign.objectives.common import EngineParams, Metric, concat_pair, weighted_means
from jaxalign.objectives.preference import pair_weights


@dataclasses.dataclass(frozen=True)
class RewardParams(EngineParams):
    """``center_rewards_coefficient`` (TRL's; 0 = off, TRL's None; 1e-2 suggested by Eisenstein et al.). A record's
    ``margin`` field, when the data has one, is subtracted inside the sigmoid."""

    center_rewards_coefficient: float = 0.0

    def __post_init__(self):
        if self.center_rewards_coefficient < 0:
            raise ValueError(f"center_rewards_coefficient={self.center_rewards_coefficient} must be >= 0")


def reward(model, batch, hparams: RewardParams = RewardParams(), **_):
    """Batch fields as for ``dpo`` (``chosen_*``, ``rejected_*``), optional ``margin [B]`` and ``example_weight``;
    ``model`` is a reward model (``num_labels=1``)."""
    tokens, attention_mask, _ = concat_pair(batch, "", "reward")
    with jax.named_scope("policy"):
        scores = model.rewards(tokens, attention_mask)
    half = tokens.shape[0] // 2
    per_pair, per_example = losses.bradley_terry(scores[:half], scores[half:], margin=batch.get("margin"),
                                                 center_rewards_coefficient=hparams.center_rewards_coefficient)
    weight = pair_weights(batch, half)
    metrics = weighted_means(per_example, weight)
    total = (per_pair * weight).sum()
    metrics["loss"] = Metric(jax.lax.stop_gradient(total), weight.sum())
    return total / jnp.maximum(weight.sum(), 1e-9), metrics
