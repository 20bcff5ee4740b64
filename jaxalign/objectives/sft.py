"""SFT objective: one forward pass, token NLL on the completion."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxalign import losses
from jaxalign.objectives.common import (
    EngineParams,
    Metric,
    example_weights,
    policy_token_logps,
    require,
    token_nll_metric,
    weighted_means,
)

NORMALIZATIONS = ("token", "sequence")


@dataclasses.dataclass(frozen=True)
class SFTParams(EngineParams):
    """``normalization``: ``token`` = mean NLL over every trained token of the batch (TRL's default);
    ``sequence`` = mean over sequences of each sequence's token-mean NLL (the IFT code's SFT)."""

    normalization: str = "token"

    def __post_init__(self):
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization={self.normalization!r}; expected one of {NORMALIZATIONS}")


def reduce_sequence_losses(per_seq: jax.Array, nll_sum: jax.Array, n_tokens: jax.Array, weight: jax.Array,
                           normalization: str) -> Metric:
    """The batch loss as ``Metric(total, count)`` under ``normalization``; sequences without trained tokens
    are left out of the sequence mean."""
    if normalization == "token":
        return Metric((nll_sum * weight).sum(), (n_tokens * weight).sum())
    has_tokens = weight * (n_tokens > 0)
    return Metric((per_seq * has_tokens).sum(), has_tokens.sum())


def sft(model, batch, hparams: SFTParams = SFTParams(), **_) -> tuple[jax.Array, dict[str, Metric]]:
    """Batch fields: ``tokens``, ``attention_mask``, ``loss_mask`` ``[B, T]``; optional ``segment_ids``,
    ``example_weight``."""
    tokens, attention_mask, loss_mask = require(batch, "tokens", "attention_mask", "loss_mask", objective="sft")
    with jax.named_scope("policy"):
        logps = policy_token_logps(model, tokens, attention_mask, loss_mask, segment_ids=batch.get("segment_ids"),
                                   chunk_size=hparams.logps_chunk_size)
    per_seq, per_example = losses.sft(logps, loss_mask)
    weight = example_weights(batch, "tokens", tokens.shape[0])
    loss = reduce_sequence_losses(per_seq, per_example["nll/sum"], per_example["len/completion"], weight,
                                  hparams.normalization)
    metrics = weighted_means(per_example, weight)
    metrics["loss"] = Metric(jax.lax.stop_gradient(loss.total), loss.count)
    metrics["nll/token"] = token_nll_metric(per_example, weight)
    return loss.total / jnp.maximum(loss.count, 1.0), metrics
