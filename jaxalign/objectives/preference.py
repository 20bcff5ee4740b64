"""Preference objectives: DPO (+IPO, hinge, label smoothing, reference-free), SimPO, ORPO.

Chosen and rejected run in one concatenated forward pass (``[2B, T]``), or, with ``data.packing``, as segments
of shared rows (padding-free: per-segment log-prob sums recover each pair). DPO's reference log-probs come from
precomputed batch fields ``ref_chosen_logps`` / ``ref_rejected_logps``, or from a frozen ``reference`` model
under ``stop_gradient``, or are zero when ``reference_free``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxalign import losses
from jaxalign.objectives.common import (
    EngineParams,
    Metric,
    concat_pair,
    example_weights,
    policy_token_logps,
    require,
    weighted_means,
)


def is_packed(batch) -> bool:
    """Pair-packed rows (``data.packing`` with preference data): ``tokens``/``segment_ids`` ``[R, L]`` holding
    each pair's chosen and rejected sequence as segments ``2k+1`` and ``2k+2``, ``pair_mask [R, P]``."""
    return "pair_mask" in batch


def packed_pair_logps(model, batch, *, chunk_size: int = 0, scope: str = "policy"):
    """``pair_logps`` of a pair-packed batch: per-segment sums of the token log-probs, flattened to ``[R·P]``
    pairs (empty pair slots give zeros and weight 0 in ``pair_weights``)."""
    tokens, attention_mask, loss_mask, segments = require(batch, "tokens", "attention_mask", "loss_mask",
                                                          "segment_ids", objective="packed preference")
    with jax.named_scope(scope):
        logps = policy_token_logps(model, tokens, attention_mask, loss_mask, segment_ids=segments,
                                   chunk_size=chunk_size)
    n_pairs = batch["pair_mask"].shape[1]
    trained = jnp.asarray(loss_mask, bool)
    # [R, L, 2P]: which segment each trained token belongs to (segment 0 = padding, never trained)
    member = ((segments[..., None] == jnp.arange(1, 2 * n_pairs + 1)) & trained[..., None]).astype(jnp.float32)
    sums = jnp.einsum("rl,rls->rs", logps, member)
    counts = member.sum(axis=1)
    return (sums[:, 0::2].reshape(-1), sums[:, 1::2].reshape(-1), counts[:, 0::2].reshape(-1),
            counts[:, 1::2].reshape(-1))


def pair_weights(batch, size: int) -> jax.Array:
    """Per-pair weights: ``example_weight`` ``[B]``, or for packed rows the ``pair_mask`` times the row weight."""
    if not is_packed(batch):
        return example_weights(batch, "chosen_tokens", size)
    pair_mask = jnp.asarray(batch["pair_mask"], jnp.float32)
    rows = example_weights(batch, "tokens", pair_mask.shape[0])
    return (pair_mask * rows[:, None]).reshape(-1)


def reference_values(batch, name: str) -> jax.Array:
    """A precomputed ``ref_*`` field as one value per pair (packed: ``[R, P]`` flattened)."""
    return jnp.asarray(batch[name], jnp.float32).reshape(-1)


def pair_logps(model, batch, objective: str, *, prefix: str = "", chunk_size: int = 0, scope: str = "policy",
               return_hidden: bool = False):
    """Summed log-probs and token counts of the chosen and rejected sequences: four ``[B]`` arrays (and the
    ``[2B, T, D]`` hidden states when asked). Pair-packed batches give ``[R·P]`` arrays."""
    if is_packed(batch) and not prefix:
        if return_hidden:
            raise ValueError(f"{objective}: hidden states of packed pairs are not supported")
        return packed_pair_logps(model, batch, chunk_size=chunk_size, scope=scope)
    tokens, attention_mask, loss_mask = concat_pair(batch, prefix, objective)
    with jax.named_scope(scope):
        out = policy_token_logps(model, tokens, attention_mask, loss_mask, chunk_size=chunk_size,
                                 return_hidden=return_hidden)
    logps, hidden = out if return_hidden else (out, None)
    sums = logps.sum(axis=1)
    counts = loss_mask[:, 1:].astype(jnp.float32).sum(axis=1)
    half = tokens.shape[0] // 2
    result = (sums[:half], sums[half:], counts[:half], counts[half:])
    return (*result, hidden, attention_mask) if return_hidden else result


def reduce_pair_losses(per_pair, per_example, batch, chosen_len, rejected_len):
    """(batch-mean loss, metrics) from per-pair losses and metrics, weighted by ``example_weight``."""
    weight = pair_weights(batch, per_pair.shape[0])
    metrics = weighted_means({**per_example, "len/chosen": chosen_len, "len/rejected": rejected_len}, weight)
    total = (per_pair * weight).sum()
    count = jnp.maximum(weight.sum(), 1e-9)
    metrics["loss"] = Metric(jax.lax.stop_gradient(total), weight.sum())
    return total / count, metrics


@dataclasses.dataclass(frozen=True)
class DPOParams(EngineParams):
    """``beta``, ``label_smoothing``, ``loss_type`` (sigmoid | ipo | hinge); ``reference_free`` uses zero
    reference log-probs; ``ipo_average`` length-normalises the log-probs for IPO (as TRL does)."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_type: str = "sigmoid"
    reference_free: bool = False
    ipo_average: bool = True

    def __post_init__(self):
        if self.loss_type not in losses.DPO_LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r}; expected one of {losses.DPO_LOSS_TYPES}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        if self.beta <= 0:
            raise ValueError(f"beta={self.beta} must be > 0")


def dpo(model, batch, hparams: DPOParams = DPOParams(), *, reference=None, **_):
    """Batch fields: ``chosen_{tokens,attention_mask,loss_mask}``, ``rejected_{...}`` ``[B, T]``; optional
    ``ref_chosen_logps`` / ``ref_rejected_logps`` ``[B]`` (summed), ``example_weight``."""
    chosen, rejected, chosen_len, rejected_len = pair_logps(model, batch, "dpo", chunk_size=hparams.logps_chunk_size)
    if "ref_chosen_logps" in batch and "ref_rejected_logps" in batch:
        ref_chosen = reference_values(batch, "ref_chosen_logps")
        ref_rejected = reference_values(batch, "ref_rejected_logps")
    elif reference is not None:
        ref_chosen, ref_rejected, _, _ = pair_logps(reference, batch, "dpo", chunk_size=hparams.logps_chunk_size,
                                                    scope="reference")
    elif hparams.reference_free:
        ref_chosen = ref_rejected = jnp.zeros_like(chosen)
    else:
        raise ValueError("dpo needs a reference: pass reference=model, put ref_chosen_logps/ref_rejected_logps "
                         "in the batch, or set reference_free=True")
    ref_chosen, ref_rejected = jax.lax.stop_gradient(ref_chosen), jax.lax.stop_gradient(ref_rejected)
    options = dict(beta=hparams.beta, label_smoothing=hparams.label_smoothing, loss_type=hparams.loss_type)
    per_pair, per_example = losses.dpo(chosen, rejected, ref_chosen, ref_rejected, **options)
    if hparams.loss_type == "ipo" and hparams.ipo_average:
        # the loss on per-token log-ratios; rewards stay on summed log-probs (as TRL logs them)
        scale_c, scale_r = 1 / jnp.maximum(chosen_len, 1.0), 1 / jnp.maximum(rejected_len, 1.0)
        per_pair, _ = losses.dpo(chosen * scale_c, rejected * scale_r, ref_chosen * scale_c, ref_rejected * scale_r,
                                 **options)
    return reduce_pair_losses(per_pair, per_example, batch, chosen_len, rejected_len)


@dataclasses.dataclass(frozen=True)
class SimPOParams(EngineParams):
    beta: float = 2.0
    gamma_beta_ratio: float = 0.8
    label_smoothing: float = 0.0
    loss_type: str = "sigmoid"

    def __post_init__(self):
        if self.loss_type not in ("sigmoid", "hinge"):
            raise ValueError(f"loss_type={self.loss_type!r}; expected 'sigmoid' or 'hinge'")


def simpo(model, batch, hparams: SimPOParams = SimPOParams(), **_):
    """Reference-free; batch fields as for ``dpo``."""
    chosen, rejected, chosen_len, rejected_len = pair_logps(model, batch, "simpo",
                                                            chunk_size=hparams.logps_chunk_size)
    per_pair, per_example = losses.simpo(chosen, rejected, chosen_len, rejected_len, beta=hparams.beta,
                                         gamma_beta_ratio=hparams.gamma_beta_ratio,
                                         label_smoothing=hparams.label_smoothing, loss_type=hparams.loss_type)
    return reduce_pair_losses(per_pair, per_example, batch, chosen_len, rejected_len)


@dataclasses.dataclass(frozen=True)
class ORPOParams(EngineParams):
    """``lam``: weight of the odds-ratio term (TRL's ``beta``; 0.1 in TRL, 0.25 in the IFT experiments)."""

    lam: float = 0.1


def orpo(model, batch, hparams: ORPOParams = ORPOParams(), **_):
    """Reference-free; batch fields as for ``dpo``."""
    chosen, rejected, chosen_len, rejected_len = pair_logps(model, batch, "orpo",
                                                            chunk_size=hparams.logps_chunk_size)
    per_pair, per_example = losses.orpo(chosen, rejected, chosen_len, rejected_len, lam=hparams.lam)
    return reduce_pair_losses(per_pair, per_example, batch, chosen_len, rejected_len)
