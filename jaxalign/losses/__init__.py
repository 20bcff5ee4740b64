"""Pure loss functions on log-probs (optax style): per-example, unreduced outputs plus a metrics dict.

Nothing here runs a model or touches I/O; ``jaxalign.objectives`` runs the forward passes and calls these.
"""

from jaxalign.losses.distill import blocked_generalized_jsd, generalized_jsd
from jaxalign.losses.grpo import GRPO_LOSS_TYPES, group_advantages, grpo, grpo_terms, sampling_correction
from jaxalign.losses.ift import ift, ift_weights, reverse_discounted_cumsum
from jaxalign.losses.kto import KTO_LOSS_TYPES, kto, kto_kl
from jaxalign.losses.logps import (
    fused_head_logps,
    greedy_from_hidden,
    log_sum_sq_probs,
    sequence_logps,
    token_logps,
    token_logps_from_hidden,
)
from jaxalign.losses.mpo import mpo, reward_gap
from jaxalign.losses.preference import (
    CPO_LOSS_TYPES,
    DPO_LOSS_TYPES,
    F_DIVERGENCE_LOSS_TYPES,
    F_DIVERGENCES,
    SORTING_LOSS_TYPES,
    alphapo_rewards,
    cpo,
    dpo,
    f_divergence_scores,
    log1mexp,
    loss_types,
    orpo,
    simpo,
)
from jaxalign.losses.reward import bradley_terry
from jaxalign.losses.sft import sft

__all__ = [
    "CPO_LOSS_TYPES",
    "DPO_LOSS_TYPES",
    "F_DIVERGENCES",
    "F_DIVERGENCE_LOSS_TYPES",
    "GRPO_LOSS_TYPES",
    "KTO_LOSS_TYPES",
    "SORTING_LOSS_TYPES",
    "alphapo_rewards",
    "blocked_generalized_jsd",
    "bradley_terry",
    "cpo",
    "dpo",
    "f_divergence_scores",
    "fused_head_logps",
    "generalized_jsd",
    "greedy_from_hidden",
    "group_advantages",
    "grpo",
    "grpo_terms",
    "ift",
    "ift_weights",
    "kto",
    "kto_kl",
    "log1mexp",
    "log_sum_sq_probs",
    "loss_types",
    "mpo",
    "orpo",
    "reverse_discounted_cumsum",
    "reward_gap",
    "sampling_correction",
    "sequence_logps",
    "sft",
    "simpo",
    "token_logps",
    "token_logps_from_hidden",
]
