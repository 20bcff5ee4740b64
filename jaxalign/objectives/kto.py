"""KTO objective: unpaired desirable / undesirable completions against a frozen reference, with TRL's KL
reference point estimated from mismatched (prompt, completion) pairs of the same batch.

Passes: the policy on the completions (with gradient); the policy on the mismatched sequences and the reference on
both, gradient-free. The reference point ``z = max(0, mean(π − ref))`` over the batch's mismatched sequences is
one number per (micro-)batch, as TRL computes it per device batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxalign import losses
from jaxalign.objectives.common import EngineParams, Metric, example_weights, policy_token_logps, require


@dataclasses.dataclass(frozen=True)
class KTOParams(EngineParams):
    """TRL 1.16's ``KTOConfig``: ``beta=0.1``, ``desirable_weight`` / ``undesirable_weight`` (λ_D, λ_U; the paper
    recommends ``λ_D·n_D / (λ_U·n_U)`` in [1, 4/3]), ``loss_type`` kto | apo_zero_unpaired (no KL term)."""

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    loss_type: str = "kto"

    def __post_init__(self):
        if self.loss_type not in losses.KTO_LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r}; expected one of {losses.KTO_LOSS_TYPES}")
        if self.beta <= 0:
            raise ValueError(f"beta={self.beta} must be > 0")
        if self.desirable_weight < 0 or self.undesirable_weight < 0:
            raise ValueError("desirable_weight and undesirable_weight must be >= 0")

    @property
    def uses_kl(self) -> bool:
        return self.loss_type == "kto"


def completion_logps(model, batch, prefix: str, chunk_size: int, scope: str) -> jax.Array:
    """Summed log-probs ``[B]`` of the trained tokens of ``{prefix}tokens``."""
    tokens, attention_mask, loss_mask = require(batch, f"{prefix}tokens", f"{prefix}attention_mask",
                                                f"{prefix}loss_mask", objective="kto")
    with jax.named_scope(scope):
        return policy_token_logps(model, tokens, attention_mask, loss_mask, chunk_size=chunk_size).sum(axis=1)


def kto(model, batch, hparams: KTOParams = KTOParams(), *, reference=None, **_):
    """Batch fields: ``tokens``, ``attention_mask``, ``loss_mask`` ``[B, T]``, ``label [B]`` (1 = desirable); for
    ``loss_type="kto"`` the mismatched ``kl_{tokens,attention_mask,loss_mask}`` ``[B, T]``; optional
    ``example_weight``."""
    if reference is None:
        raise ValueError("kto needs a reference: pass reference=model (the frozen initial policy)")
    chunk = hparams.logps_chunk_size
    (labels,) = require(batch, "label", objective="kto")
    policy = completion_logps(model, batch, "", chunk, "policy")
    ref = jax.lax.stop_gradient(completion_logps(reference, batch, "", chunk, "reference"))
    weight = example_weights(batch, "tokens", policy.shape[0])
    kl = jnp.zeros((), jnp.float32)
    if hparams.uses_kl:
        policy_kl = jax.lax.stop_gradient(completion_logps(model, batch, "kl_", chunk, "policy_kl"))
        ref_kl = jax.lax.stop_gradient(completion_logps(reference, batch, "kl_", chunk, "reference_kl"))
        kl = losses.kto_kl(policy_kl, ref_kl, valid=weight > 0)
    per_example, parts = losses.kto(policy, ref, labels, kl, beta=hparams.beta,
                                    desirable_weight=hparams.desirable_weight,
                                    undesirable_weight=hparams.undesirable_weight, loss_type=hparams.loss_type)
    count = weight.sum()
    total = (per_example * weight).sum()
    desirable, undesirable = parts["desirable"] * weight, parts["undesirable"] * weight
    metrics = {
        "loss": Metric(jax.lax.stop_gradient(total), count),
        "kl": Metric(kl * count, count),
        "rewards/chosen": Metric((parts["rewards"] * desirable).sum(), desirable.sum()),
        "rewards/rejected": Metric((parts["rewards"] * undesirable).sum(), undesirable.sum()),
        "logps/chosen": Metric((parts["logps"] * desirable).sum(), desirable.sum()),
        "logps/rejected": Metric((parts["logps"] * undesirable).sum(), undesirable.sum()),
        "desirable_share": Metric(desirable.sum(), count),
    }
    return total / jnp.maximum(count, 1e-9), metrics
