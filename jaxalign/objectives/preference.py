"""Preference objectives: DPO (TRL 1.16's loss types and their combinations, LD-DPO, WPO, f-DPO), SimPO, ORPO, CPO.

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
from jaxalign.losses.logps import log_sum_sq_probs
from jaxalign.objectives.common import (
    SHARED_FIELDS,
    EngineParams,
    Metric,
    concat_pair,
    example_weights,
    policy_token_logps,
    require,
    resolve_chunk_size,
    weighted_means,
)


def is_packed(batch) -> bool:
    """Pair-packed rows (``data.packing`` with preference data): ``tokens``/``segment_ids`` ``[R, L]`` holding
    each pair's chosen and rejected sequence as segments ``2k+1`` and ``2k+2``, ``pair_mask [R, P]``; with
    ``data.shared_prefix`` the pair's prompt once, as segment ``2P+k+1`` (``prefix_ids``, ``predictor_index``)."""
    return "pair_mask" in batch


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
        sums = pair_sums(model, batch, objective, chunk_size=chunk_size, scope=scope)
        return sums["chosen"], sums["rejected"], sums["chosen_len"], sums["rejected_len"]
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


def _pairs(x: jax.Array, packed: bool) -> tuple[jax.Array, jax.Array]:
    """Per-segment values ``[R, S]`` as (chosen ``[n]``, rejected ``[n]``): unpacked rows hold one sequence each
    (chosen rows first), pair-packed rows hold pair k as segments 2k+1, 2k+2."""
    if packed:
        return x[:, 0::2].reshape(-1), x[:, 1::2].reshape(-1)
    half = x.shape[0] // 2
    return x[:half, 0], x[half:, 0]


def _unpairs(chosen: jax.Array, rejected: jax.Array, like: jax.Array, packed: bool) -> jax.Array:
    """The inverse of ``_pairs``: per-pair values back in the ``[R, S]`` layout of ``like``."""
    if packed:
        return jnp.stack([chosen.reshape(like.shape[0], -1), rejected.reshape(like.shape[0], -1)], -1).reshape(
            like.shape)
    return jnp.concatenate([chosen, rejected])[:, None]


def pair_sums(model, batch, objective: str, *, chunk_size: int = 0, scope: str = "policy", ld_alpha: float = 1.0,
              wpo: bool = False, whole_sequence: bool = False) -> dict[str, jax.Array]:
    """Per-pair ``[n]`` sums of the chosen and rejected token log-probs, for packed and unpacked batches:
    ``chosen``, ``rejected`` (LD-DPO-weighted when ``ld_alpha != 1``), ``chosen_len``, ``rejected_len`` (trained
    tokens), ``chosen_raw``/``rejected_raw`` (unweighted sums), and with ``wpo`` the WPO sequence weight
    ``chosen_wpo``/``rejected_wpo`` = ``exp(mean_t (log p_t − log Σ_v p_v²))``, gradient-free.

    LD-DPO (Liu et al., 2024, arXiv 2409.06411), as TRL 1.16: the first ``min(len_c, len_r)`` completion tokens of
    both sequences count fully, the tokens past it ``ld_alpha`` times.

    ``whole_sequence`` adds ``chosen_whole``/``chosen_whole_len``: the summed log-probs and count of every real token
    of the chosen sequence that something predicts (prompt and response, not the first token), TRL's ORPO NLL."""
    packed = is_packed(batch)
    shared = dict(zip(SHARED_FIELDS, require(batch, *SHARED_FIELDS, objective=f"shared-prefix {objective}"),
                      strict=True)) if packed and "prefix_ids" in batch else None
    if packed:
        tokens, attention_mask, loss_mask, segments = require(batch, "tokens", "attention_mask", "loss_mask",
                                                              "segment_ids", objective=f"packed {objective}")
        n_segments = 2 * batch["pair_mask"].shape[1]
    else:
        tokens, attention_mask, loss_mask = concat_pair(batch, "", objective)
        segments, n_segments = None, 1
    trained = jnp.asarray(loss_mask, bool).at[:, 0].set(False)
    if whole_sequence:  # every real token but each sequence's first (nothing in its own sequence predicts it)
        real = jnp.asarray(attention_mask, bool)
        first = jnp.concatenate([jnp.ones_like(real[:, :1]), (segments[:, 1:] != segments[:, :-1]) if packed
                                 else jnp.zeros_like(real[:, 1:])], axis=1)
        if shared is not None:  # a completion's first token is predicted by its prompt
            first &= shared["prefix_ids"] == 0
        predicted = real & ~first
    with jax.named_scope(scope):
        logps, hidden = policy_token_logps(model, tokens, attention_mask, predicted if whole_sequence else loss_mask,
                                           segment_ids=segments, shared=shared, chunk_size=chunk_size,
                                           return_hidden=True)

    def membership(mask):  # [R, L, S]: the sequence each marked token belongs to (segment 0 = padding)
        if packed:
            return ((segments[..., None] == jnp.arange(1, n_segments + 1)) & mask[..., None]).astype(jnp.float32)
        return mask[..., None].astype(jnp.float32)

    member = membership(trained)
    counts = member.sum(axis=1)
    raw = jnp.einsum("rl,rls->rs", logps, member)
    chosen_len, rejected_len = _pairs(counts, packed)
    out = {"chosen_len": chosen_len, "rejected_len": rejected_len}
    out["chosen_raw"], out["rejected_raw"] = _pairs(raw, packed)
    if ld_alpha != 1.0:
        shared = jnp.minimum(chosen_len, rejected_len)
        position = jnp.cumsum(member, axis=1)  # 1, 2, ... over each sequence's trained tokens
        weight = jnp.where(position <= _unpairs(shared, shared, counts, packed)[:, None, :], 1.0, ld_alpha)
        out["chosen"], out["rejected"] = _pairs(jnp.einsum("rl,rls->rs", logps, member * weight), packed)
    else:
        out["chosen"], out["rejected"] = out["chosen_raw"], out["rejected_raw"]
    if wpo:
        chunk = resolve_chunk_size(chunk_size, tokens.shape[0], tokens.shape[1], model.config.vocab_size)
        normaliser = log_sum_sq_probs(hidden, model.head_kernel(), chunk_size=chunk, softcap=model.config.final_softcap)
        aligned = jnp.einsum("rl,rls->rs", jax.lax.stop_gradient(logps) - normaliser, member)
        out["chosen_wpo"], out["rejected_wpo"] = _pairs(jnp.exp(aligned / jnp.maximum(counts, 1.0)), packed)
    if whole_sequence:
        whole = membership(predicted)
        out["chosen_whole"], _ = _pairs(jnp.einsum("rl,rls->rs", logps, whole), packed)
        out["chosen_whole_len"], _ = _pairs(whole.sum(axis=1), packed)
        if shared is not None:  # the shared prompt's tokens belong to the chosen sequence too
            prompts = n_segments + 1 + jnp.arange(n_segments // 2)
            member = ((segments[..., None] == prompts) & predicted[..., None]).astype(jnp.float32)
            out["chosen_whole"] += jnp.einsum("rl,rlk->rk", logps, member).reshape(-1)
            out["chosen_whole_len"] += member.sum(axis=1).reshape(-1)
    return out


def reduce_pair_losses(per_pair, per_example, batch, chosen_len, rejected_len):
    """(batch-mean loss, metrics) from per-pair losses and metrics, weighted by ``example_weight``."""
    weight = pair_weights(batch, per_pair.shape[0])
    metrics = weighted_means({**per_example, "len/chosen": chosen_len, "len/rejected": rejected_len}, weight)
    total = (per_pair * weight).sum()
    count = jnp.maximum(weight.sum(), 1e-9)
    metrics["loss"] = Metric(jax.lax.stop_gradient(total), weight.sum())
    return total / count, metrics


def _names(value, what: str) -> tuple:
    """A config value given as ``"a,b"``, a list, or one item, as a tuple (``what`` names it in errors)."""
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    if isinstance(value, list | tuple):
        return tuple(value)
    raise ValueError(f"{what}={value!r}: expected a comma-separated string or a list")


@dataclasses.dataclass(frozen=True)
class DPOParams(EngineParams):
    """TRL 1.16's ``DPOConfig`` loss settings under its names.

    ``loss_type``: one of ``losses.DPO_LOSS_TYPES`` or several (``"sigmoid,sft"`` or a list), combined with
    ``loss_weights`` (default all 1); ``rpo_alpha > 0`` adds ``sft`` with that weight (RPO, Pang et al., 2024; TRL's
    former ``rpo_alpha``); ``label_smoothing`` (cDPO / robust / EXO's ε); ``reference_free`` uses zero reference
    log-probs; ``ipo_average`` length-normalises IPO's scores (as TRL does); ``ld_alpha < 1``: LD-DPO's weight
    on the tokens past the shared length; ``use_weighting``: WPO's sequence weights; ``discopop_tau``;
    ``f_divergence_type`` (reverse_kl | forward_kl | js_divergence | alpha_divergence) with
    ``f_alpha_divergence_coef``."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_type: str | tuple[str, ...] = "sigmoid"
    loss_weights: str | tuple[float, ...] = ""
    rpo_alpha: float = 0.0
    reference_free: bool = False
    ipo_average: bool = True
    ld_alpha: float = 1.0
    use_weighting: bool = False
    discopop_tau: float = 0.05
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5

    def __post_init__(self):
        names = losses.loss_types(_names(self.loss_type, "loss_type"))
        weights = tuple(float(w) for w in _names(self.loss_weights, "loss_weights"))
        if weights and len(weights) != len(names):
            raise ValueError(f"loss_weights={self.loss_weights!r} needs one weight per loss type {names}")
        object.__setattr__(self, "loss_type", names[0] if len(names) == 1 else names)
        object.__setattr__(self, "loss_weights", weights)
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        if "exo_pair" in names and self.label_smoothing == 0:
            raise ValueError("loss_type exo_pair needs label_smoothing > 0 (the EXO paper recommends 1e-3)")
        if self.beta <= 0:
            raise ValueError(f"beta={self.beta} must be > 0")
        if self.rpo_alpha < 0:
            raise ValueError(f"rpo_alpha={self.rpo_alpha} must be >= 0")
        if not 0 <= self.ld_alpha <= 1:
            raise ValueError(f"ld_alpha={self.ld_alpha} must be in [0, 1] (1 = no length desensitisation)")
        if self.discopop_tau <= 0:
            raise ValueError(f"discopop_tau={self.discopop_tau} must be > 0")
        if self.f_divergence_type not in losses.F_DIVERGENCES:
            raise ValueError(f"f_divergence_type={self.f_divergence_type!r}; expected one of {losses.F_DIVERGENCES}")
        types, _ = self.combination
        if self.f_divergence_type != "reverse_kl" and not set(types) <= set(losses.F_DIVERGENCE_LOSS_TYPES):
            raise ValueError(f"f_divergence_type={self.f_divergence_type!r} works with loss types "
                             f"{losses.F_DIVERGENCE_LOSS_TYPES} only, not {types}")
        if self.use_weighting and set(types) & set(losses.SORTING_LOSS_TYPES):
            raise ValueError("use_weighting (WPO) cannot be combined with aot / aot_unpaired: they sort the pairs")

    @property
    def combination(self) -> tuple[tuple[str, ...], tuple[float, ...]]:
        """(loss types, their weights), ``rpo_alpha``'s ``sft`` term included."""
        names = _names(self.loss_type, "loss_type")
        weights = tuple(self.loss_weights) or (1.0,) * len(names)
        if self.rpo_alpha > 0:
            names, weights = (*names, "sft"), (*weights, self.rpo_alpha)
        return names, weights


def dpo(model, batch, hparams: DPOParams = DPOParams(), *, reference=None, **_):
    """Batch fields: ``chosen_{tokens,attention_mask,loss_mask}``, ``rejected_{...}`` ``[B, T]`` (or pair-packed
    rows); optional ``ref_chosen_logps`` / ``ref_rejected_logps`` ``[B]`` (summed, LD-weighted like the policy's),
    ``example_weight``."""
    options = dict(chunk_size=hparams.logps_chunk_size, ld_alpha=hparams.ld_alpha)
    policy = pair_sums(model, batch, "dpo", wpo=hparams.use_weighting, **options)
    chosen, rejected, chosen_len, rejected_len = (policy[k] for k in ("chosen", "rejected", "chosen_len",
                                                                      "rejected_len"))
    if "ref_chosen_logps" in batch and "ref_rejected_logps" in batch:
        ref_chosen = reference_values(batch, "ref_chosen_logps")
        ref_rejected = reference_values(batch, "ref_rejected_logps")
    elif reference is not None:
        ref = pair_sums(reference, batch, "dpo", scope="reference", **options)
        ref_chosen, ref_rejected = ref["chosen"], ref["rejected"]
    elif hparams.reference_free:
        ref_chosen = ref_rejected = jnp.zeros_like(chosen)
    else:
        raise ValueError("dpo needs a reference: pass reference=model, put ref_chosen_logps/ref_rejected_logps "
                         "in the batch, or set reference_free=True")
    ref_chosen, ref_rejected = jax.lax.stop_gradient(ref_chosen), jax.lax.stop_gradient(ref_rejected)
    names, weights = hparams.combination
    average = "ipo" not in names or hparams.ipo_average
    per_pair, per_example = losses.dpo(
        chosen, rejected, ref_chosen, ref_rejected, beta=hparams.beta, label_smoothing=hparams.label_smoothing,
        loss_type=names, loss_weights=weights, chosen_len=chosen_len if average else None,
        rejected_len=rejected_len if average else None, valid=pair_weights(batch, chosen.shape[0]) > 0,
        sequence_weights=policy["chosen_wpo"] * policy["rejected_wpo"] if hparams.use_weighting else None,
        sft_chosen_logps=policy["chosen_raw"], discopop_tau=hparams.discopop_tau,
        f_divergence_type=hparams.f_divergence_type, f_alpha_divergence_coef=hparams.f_alpha_divergence_coef)
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


ORPO_NLL = ("response", "trl")


@dataclasses.dataclass(frozen=True)
class ORPOParams(EngineParams):
    """``lam``: weight of the odds-ratio term (TRL's ``beta``; 0.1 in TRL, 0.25 in the IFT experiments).
    ``nll``: the SFT term, ``response`` = each pair's mean NLL of its chosen response (the ORPO paper's, the IFT
    and MPO code's), ``trl`` = TRL's: one token mean over the prompt and response tokens of the batch's chosen
    sequences."""

    lam: float = 0.1
    nll: str = "response"

    def __post_init__(self):
        if self.nll not in ORPO_NLL:
            raise ValueError(f"nll={self.nll!r}; expected one of {ORPO_NLL}")


def orpo(model, batch, hparams: ORPOParams = ORPOParams(), **_):
    """Reference-free; batch fields as for ``dpo``."""
    sums = pair_sums(model, batch, "orpo", chunk_size=hparams.logps_chunk_size, whole_sequence=hparams.nll == "trl")
    chosen, rejected, chosen_len, rejected_len = (sums[k] for k in ("chosen", "rejected", "chosen_len",
                                                                    "rejected_len"))
    nll = None
    if hparams.nll == "trl":  # a batch-level token mean, the same for every pair (per micro-batch, as TRL's)
        valid = pair_weights(batch, chosen.shape[0]) > 0
        tokens = jnp.where(valid, sums["chosen_whole_len"], 0.0).sum()
        nll = jnp.broadcast_to(-jnp.where(valid, sums["chosen_whole"], 0.0).sum() / jnp.maximum(tokens, 1.0),
                               chosen.shape)
    per_pair, per_example = losses.orpo(chosen, rejected, chosen_len, rejected_len, lam=hparams.lam, nll=nll)
    return reduce_pair_losses(per_pair, per_example, batch, chosen_len, rejected_len)


CPO_LOSS_TYPES = (*losses.CPO_LOSS_TYPES, "alphapo")


@dataclasses.dataclass(frozen=True)
class CPOParams(EngineParams):
    """TRL 1.16's ``CPOConfig``: ``beta=0.1``, ``label_smoothing``, ``loss_type`` (sigmoid | hinge | ipo | simpo |
    alphapo = simpo without the NLL term, as TRL maps it), ``simpo_gamma=0.5``, ``cpo_alpha=1.0`` (weight of the
    behaviour-cloning NLL: one token mean over the chosen responses of the batch), ``alpha=0`` (AlphaPO's reward
    shape; any loss type)."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_type: str = "sigmoid"
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0
    alpha: float = 0.0

    def __post_init__(self):
        if self.loss_type not in CPO_LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r}; expected one of {CPO_LOSS_TYPES}")
        if self.beta <= 0:
            raise ValueError(f"beta={self.beta} must be > 0")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        if self.cpo_alpha < 0:
            raise ValueError(f"cpo_alpha={self.cpo_alpha} must be >= 0")

    @property
    def resolved(self) -> tuple[str, float]:
        """(the loss type CPO's loss computes, the NLL weight): ``alphapo`` is ``simpo`` with ``cpo_alpha = 0``."""
        return ("simpo", 0.0) if self.loss_type == "alphapo" else (self.loss_type, self.cpo_alpha)


def cpo(model, batch, hparams: CPOParams = CPOParams(), **_):
    """Reference-free; batch fields as for ``dpo``. ``loss = mean(cpo terms) + cpo_alpha · NLL``."""
    chosen, rejected, chosen_len, rejected_len = pair_logps(model, batch, "cpo", chunk_size=hparams.logps_chunk_size)
    loss_type, nll_weight = hparams.resolved
    per_pair, per_example = losses.cpo(chosen, rejected, chosen_len, rejected_len, beta=hparams.beta,
                                       label_smoothing=hparams.label_smoothing, loss_type=loss_type,
                                       simpo_gamma=hparams.simpo_gamma, alpha=hparams.alpha)
    valid = pair_weights(batch, chosen.shape[0]) > 0
    tokens = jnp.where(valid, chosen_len, 0.0).sum()
    nll = -jnp.where(valid, chosen, 0.0).sum() / jnp.maximum(tokens, 1.0)  # a batch token mean (per micro-batch)
    per_example["nll_loss"] = jnp.broadcast_to(jax.lax.stop_gradient(nll), chosen.shape)
    if nll_weight:
        per_pair = per_pair + nll_weight * nll
    return reduce_pair_losses(per_pair, per_example, batch, chosen_len, rejected_len)
