"""MPO objective: policy on the target-language pair, frozen reference on the dominant-language pair (or
precomputed gap and hidden states), policy on the dominant pair for the preservation term."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxalign import losses
from jaxalign.objectives.common import EngineParams
from jaxalign.objectives.preference import pair_logps, reduce_pair_losses

POOLINGS = ("mean", "last", "masked_mean")


@dataclasses.dataclass(frozen=True)
class MPOParams(EngineParams):
    """``beta`` scales the target gap (official: 1.0 Llama-3.1, 1.5 Gemma-2 / Qwen2.5). ``pooling`` of the
    last-layer hidden states for the preservation term: ``mean`` over every position including padding
    (official code), ``last`` real token (the paper's description), or ``masked_mean`` over real tokens.
    ``preserve_hidden=False`` drops the preservation term (and the policy's dominant-pair pass)."""

    beta: float = 1.0
    pooling: str = "mean"
    preserve_hidden: bool = True

    def __post_init__(self):
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling={self.pooling!r}; expected one of {POOLINGS}")


def pool_hidden(hidden: jax.Array, attention_mask: jax.Array, pooling: str) -> jax.Array:
    """``[N, T, D]`` hidden states -> ``[N, D]`` float32."""
    hidden = hidden.astype(jnp.float32)
    mask = attention_mask.astype(jnp.float32)
    if pooling == "mean":
        return hidden.mean(axis=1)
    if pooling == "masked_mean":
        return (hidden * mask[..., None]).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)[:, None]
    positions = jnp.arange(mask.shape[1])
    last = jnp.max(jnp.where(mask > 0, positions, -1), axis=1)
    return jnp.take_along_axis(hidden, jnp.maximum(last, 0)[:, None, None], axis=1)[:, 0]


def dominant_pass(model, batch, hparams: MPOParams, scope: str):
    """(reward gap ``[B]``, pooled hidden ``[B, 2, D]``) of ``model`` on the dominant pair."""
    chosen, rejected, chosen_len, rejected_len, hidden, mask = pair_logps(
        model, batch, "mpo", prefix="dominant_", chunk_size=hparams.logps_chunk_size, scope=scope,
        return_hidden=True)
    pooled = pool_hidden(hidden, mask, hparams.pooling)
    half = pooled.shape[0] // 2
    return losses.reward_gap(chosen, rejected, chosen_len, rejected_len), jnp.stack([pooled[:half], pooled[half:]], 1)


def mpo(model, batch, hparams: MPOParams = MPOParams(), *, reference=None, **_):
    """Batch fields: ``target_{chosen,rejected}_{tokens,attention_mask,loss_mask}`` and
    ``dominant_{chosen,rejected}_{...}`` ``[B, T]``; optional precomputed ``ref_dominant_gap [B]`` and
    ``ref_dominant_hidden [B, 2, D]`` (then no reference model is needed), ``example_weight``."""
    chosen, rejected, chosen_len, rejected_len = pair_logps(model, batch, "mpo", prefix="target_",
                                                            chunk_size=hparams.logps_chunk_size)
    precomputed = "ref_dominant_gap" in batch and (not hparams.preserve_hidden or "ref_dominant_hidden" in batch)
    if precomputed:
        ref_gap, ref_hidden = batch["ref_dominant_gap"], batch.get("ref_dominant_hidden")
    elif reference is not None:
        ref_gap, ref_hidden = dominant_pass(reference, batch, hparams, "reference")
    else:
        raise ValueError("mpo needs a reference: pass reference=model or put ref_dominant_gap (and "
                         "ref_dominant_hidden when preserve_hidden) in the batch")
    policy_hidden = None
    if hparams.preserve_hidden:
        _, policy_hidden = dominant_pass(model, batch, hparams, "policy_dominant")
        ref_hidden = jax.lax.stop_gradient(jnp.asarray(ref_hidden, jnp.float32))
    else:
        ref_hidden = None
    per_pair, per_example = losses.mpo(chosen, rejected, chosen_len, rejected_len, jax.lax.stop_gradient(ref_gap),
                                       beta=hparams.beta, policy_hidden=policy_hidden, ref_hidden=ref_hidden)
    return reduce_pair_losses(per_pair, per_example, batch, chosen_len, rejected_len)
