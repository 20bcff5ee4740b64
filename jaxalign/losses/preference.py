"""Pairwise preference losses on summed sequence log-probs: DPO (TRL 1.16's loss types), SimPO, ORPO, CPO.

Inputs are per-pair ``[B]`` arrays. Each function returns ``(per_pair_loss [B], metrics)`` with per-pair
metrics under TRL's names (``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``) so callers can average them exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

# TRL 1.16's DPOTrainer loss types, in its order
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# the losses whose reward difference cancels f-DPO's log Z term (TRL refuses the others)
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
SORTING_LOSS_TYPES = ("aot", "aot_unpaired")  # sort over the batch: per-pair weights would be misaligned


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


def loss_types(loss_type: str | Sequence[str]) -> tuple[str, ...]:
    """``"sigmoid"``, ``"sigmoid,sft"`` or ``("sigmoid", "sft")`` as a tuple of names (each checked)."""
    names = tuple(n.strip() for n in loss_type.split(",")) if isinstance(loss_type, str) else tuple(loss_type)
    unknown = [n for n in names if n not in DPO_LOSS_TYPES]
    if not names or unknown:
        raise ValueError(f"loss_type={loss_type!r}; expected one or more of {DPO_LOSS_TYPES}")
    return names


def f_divergence_scores(logratios: jax.Array, f_divergence_type: str, alpha: float = 0.5) -> jax.Array:
    """f-DPO (Wang et al., 2023, arXiv 2309.16240): ``f'(π/π_ref)`` of the log-ratios, as TRL computes it
    (``reverse_kl`` = the log-ratio itself; alpha's exponent clamped at 80 as TRL clamps float32)."""
    if f_divergence_type == "reverse_kl":
        return logratios
    if f_divergence_type == "forward_kl":
        return 1 - jnp.exp(-logratios)
    if f_divergence_type == "js_divergence":
        return jnp.log(2.0) + jax.nn.log_sigmoid(logratios)
    if f_divergence_type == "alpha_divergence":
        if abs(alpha - 1.0) < 1e-6:
            return logratios
        return (jnp.exp(jnp.minimum((alpha - 1.0) * logratios, 80.0)) - 1.0) / (alpha - 1.0)
    raise ValueError(f"f_divergence_type={f_divergence_type!r}; expected one of {F_DIVERGENCES}")


def _sorted(x: jax.Array, valid: jax.Array) -> jax.Array:
    """The valid entries of ``x`` sorted ascending, written back to the valid slots in order (the k-th valid
    slot gets the k-th smallest value), 0 in the others: filler rows stay out of the sort."""
    slots = jnp.argsort(jnp.logical_not(valid), stable=True)  # the valid slots first, in order
    values = jnp.where(jnp.sort(valid)[::-1], jnp.sort(jnp.where(valid, x, jnp.inf)), 0.0)
    return jnp.zeros_like(x).at[slots].set(values)


def dpo(policy_chosen: jax.Array, policy_rejected: jax.Array, ref_chosen: jax.Array, ref_rejected: jax.Array,
        *, beta: float = 0.1, label_smoothing: float = 0.0, loss_type: str | Sequence[str] = "sigmoid",
        loss_weights: Sequence[float] | None = None, chosen_len: jax.Array | None = None,
        rejected_len: jax.Array | None = None, valid: jax.Array | None = None,
        sequence_weights: jax.Array | None = None, sft_chosen_logps: jax.Array | None = None,
        discopop_tau: float = 0.05, f_divergence_type: str = "reverse_kl", f_alpha_divergence_coef: float = 0.5,
        ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Direct Preference Optimization (Rafailov et al., 2023, arXiv 2305.18290) and TRL 1.16's variants.

    Log-ratios ``ρ = π − ref`` (summed log-probs, ``[B]``), scores ``s = f'(ρ)`` (``f_divergence_type``,
    reverse KL: ``s = ρ``), ``h = s_c − s_r``. Per pair, for each ``loss_type`` (a name, ``"a,b"`` or a
    sequence, combined as ``Σ loss_weights[k] · loss_k``, TRL's ``loss_weights``):
      * ``sigmoid``: ``−(1−ε)·log σ(βh) − ε·log σ(−βh)`` (ε = ``label_smoothing``: cDPO; TRL 1.16 has ε = 0);
      * ``hinge``: ``max(0, 1 − βh)`` (SLiC);
      * ``ipo``: ``(h − 1/(2β))²`` (IPO); with ``chosen_len``/``rejected_len`` the scores are length-averaged
        first, as TRL does;
      * ``exo_pair``: EXO's reverse KL to ``[1−ε, ε]`` (needs ε > 0; EXO recommends 1e-3);
      * ``nca_pair``: ``−log σ(βρ_c) − ½ log σ(−βρ_c) − ½ log σ(−βρ_r)`` (NCA);
      * ``robust``: ``[−(1−ε) log σ(βh) + ε log σ(−βh)] / (1 − 2ε)`` (rDPO);
      * ``bco_pair``: ``−log σ(βρ_c) − log σ(−βρ_r)`` (TRL 1.16: no running reward mean);
      * ``sppo_hard``: ``(ρ_c − 1/(2β))² + (ρ_r + 1/(2β))²``;
      * ``aot``, ``aot_unpaired``: AOT's sorted log-ratio gaps (over the ``valid`` rows of this batch);
      * ``apo_zero``, ``apo_down``: APO (D'Oosterlinck et al., 2024);
      * ``discopop``: DiscoPOP's blend of logistic and exponential losses (``discopop_tau``);
      * ``sft``: the chosen completions' NLL, one token mean over the batch's valid rows (``sft_chosen_logps``:
        the unweighted summed log-probs if ``policy_chosen`` are weighted, as LD-DPO's are), needs ``chosen_len``;
      * ``sigmoid_norm``: ``−log σ(β(s_c/len_c − s_r/len_r))``, needs the lengths.
    ``sequence_weights`` (e.g. WPO's) multiply every pair's loss. Zero reference log-probs give
    reference-free DPO. Rewards: ``βρ``, gradient-free.
    """
    names = loss_types(loss_type)
    weights = tuple(loss_weights) if loss_weights is not None else (1.0,) * len(names)
    if len(weights) != len(names):
        raise ValueError(f"loss_weights={loss_weights!r} has {len(weights)} entries for loss types {names}")
    if f_divergence_type != "reverse_kl" and not set(names) <= set(F_DIVERGENCE_LOSS_TYPES):
        raise ValueError(f"f_divergence_type={f_divergence_type!r} works with {F_DIVERGENCE_LOSS_TYPES} only, "
                         f"not {names}")
    if "exo_pair" in names and label_smoothing <= 0:
        raise ValueError("loss_type exo_pair needs label_smoothing > 0 (EXO recommends 1e-3)")
    if {"sft", "sigmoid_norm"} & set(names) and (chosen_len is None or rejected_len is None):
        raise ValueError(f"loss types sft and sigmoid_norm need chosen_len and rejected_len; got {names}")
    if sequence_weights is not None and set(names) & set(SORTING_LOSS_TYPES):
        raise ValueError("sequence weights (WPO) cannot be combined with aot / aot_unpaired, which sort the pairs")
    policy_chosen, policy_rejected, ref_chosen, ref_rejected = _f32(policy_chosen, policy_rejected, ref_chosen,
                                                                    ref_rejected)
    valid = jnp.ones(policy_chosen.shape, bool) if valid is None else jnp.asarray(valid) > 0
    chosen_ratio, rejected_ratio = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    chosen_score = f_divergence_scores(chosen_ratio, f_divergence_type, f_alpha_divergence_coef)
    rejected_score = f_divergence_scores(rejected_ratio, f_divergence_type, f_alpha_divergence_coef)
    h = chosen_score - rejected_score
    eps = label_smoothing

    def averaged():
        c_len, r_len = _f32(chosen_len, rejected_len)
        return chosen_score / jnp.maximum(c_len, 1.0) - rejected_score / jnp.maximum(r_len, 1.0)

    def smoothed_sigmoid(delta):
        return -(1 - eps) * jax.nn.log_sigmoid(beta * delta) - eps * jax.nn.log_sigmoid(-beta * delta)

    def one(name):
        if name == "sigmoid":
            return smoothed_sigmoid(h)
        if name == "hinge":
            return jax.nn.relu(1 - beta * h)
        if name == "ipo":
            delta = h if chosen_len is None or rejected_len is None else averaged()
            return (delta - 1 / (2 * beta)) ** 2
        if name == "exo_pair":
            z = beta * h
            return (jax.nn.sigmoid(z) * (jax.nn.log_sigmoid(z) - jnp.log1p(-eps))
                    + jax.nn.sigmoid(-z) * (jax.nn.log_sigmoid(-z) - jnp.log(eps)))
        if name == "nca_pair":
            return (-jax.nn.log_sigmoid(beta * chosen_ratio) - 0.5 * jax.nn.log_sigmoid(-beta * chosen_ratio)
                    - 0.5 * jax.nn.log_sigmoid(-beta * rejected_ratio))
        if name == "robust":
            return (-(1 - eps) * jax.nn.log_sigmoid(beta * h) + eps * jax.nn.log_sigmoid(-beta * h)) / (1 - 2 * eps)
        if name == "bco_pair":
            return -jax.nn.log_sigmoid(beta * chosen_ratio) - jax.nn.log_sigmoid(-beta * rejected_ratio)
        if name == "sppo_hard":
            return (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
        if name == "aot":
            return smoothed_sigmoid(_sorted(policy_chosen - policy_rejected, valid)
                                    - _sorted(ref_chosen - ref_rejected, valid))
        if name == "aot_unpaired":
            return smoothed_sigmoid(_sorted(chosen_ratio, valid) - _sorted(rejected_ratio, valid))
        if name == "apo_zero":
            return 1 - jax.nn.sigmoid(beta * chosen_ratio) + jax.nn.sigmoid(beta * rejected_ratio)
        if name == "apo_down":
            return jax.nn.sigmoid(beta * chosen_ratio) + 1 - jax.nn.sigmoid(beta * (chosen_ratio - rejected_ratio))
        if name == "discopop":
            logits = beta * h
            modulation = jax.nn.sigmoid(logits / discopop_tau)
            return -jax.nn.log_sigmoid(logits) * (1 - modulation) + jnp.exp(-logits) * modulation
        if name == "sft":
            logps = policy_chosen if sft_chosen_logps is None else jnp.asarray(sft_chosen_logps, jnp.float32)
            tokens = jnp.where(valid, jnp.asarray(chosen_len, jnp.float32), 0.0).sum()
            return jnp.broadcast_to(-jnp.where(valid, logps, 0.0).sum() / jnp.maximum(tokens, 1.0), h.shape)
        return -jax.nn.log_sigmoid(beta * averaged())  # sigmoid_norm

    loss = sum(weight * one(name) for name, weight in zip(names, weights, strict=True))
    if sequence_weights is not None:
        loss = loss * jax.lax.stop_gradient(jnp.asarray(sequence_weights, jnp.float32))
    chosen_rewards = jax.lax.stop_gradient(beta * chosen_ratio)
    rejected_rewards = jax.lax.stop_gradient(beta * rejected_ratio)
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
         *, lam: float = 0.1, max_avg_logp: float = -1e-6, nll: jax.Array | None = None,
         ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """ORPO (Hong et al., 2024, arXiv 2403.07691): SFT plus an odds-ratio preference term.

    With length-normalised ``a = logps / len`` clamped to ``a ≤ max_avg_logp`` (so the odds stay finite as
    ``p → 1``) and ``log odds(y) = a − log(1 − e^a)``:
    ``L = NLL − λ·log σ(log odds(y_c) − log odds(y_r))``, ``NLL = −a_c`` unless ``nll`` ``[B]`` is given (TRL's
    prompt-and-response token mean). Rewards are ``λ·a`` (TRL's convention).
    """
    chosen_logps, rejected_logps, chosen_len, rejected_len = _f32(chosen_logps, rejected_logps, chosen_len,
                                                                  rejected_len)
    chosen_avg = jnp.minimum(chosen_logps / jnp.maximum(chosen_len, 1.0), max_avg_logp)
    rejected_avg = jnp.minimum(rejected_logps / jnp.maximum(rejected_len, 1.0), max_avg_logp)
    log_odds = (chosen_avg - log1mexp(chosen_avg)) - (rejected_avg - log1mexp(rejected_avg))
    ratio = jax.nn.log_sigmoid(log_odds)
    nll = -chosen_avg if nll is None else jnp.asarray(nll, jnp.float32)
    loss = nll - lam * ratio
    metrics = _reward_metrics(jax.lax.stop_gradient(lam * chosen_avg), jax.lax.stop_gradient(lam * rejected_avg),
                              jax.lax.stop_gradient(chosen_avg), jax.lax.stop_gradient(rejected_avg))
    metrics.update({"nll_loss": jax.lax.stop_gradient(nll), "log_odds_ratio": jax.lax.stop_gradient(ratio),
                    "log_odds_chosen": jax.lax.stop_gradient(log_odds), "len/chosen": chosen_len,
                    "len/rejected": rejected_len})
    return loss, metrics


CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


def alphapo_rewards(logps: jax.Array, alpha: float) -> jax.Array:
    """AlphaPO's reward shape (Gupta et al., 2025, arXiv 2501.03884): ``(1 − p^(−α)) / α`` with ``p = e^logps``,
    computed as ``−expm1(−α·logps) / α``; α = 0 is the log-prob itself."""
    logps = jnp.asarray(logps, jnp.float32)
    return logps if alpha == 0 else -jnp.expm1(-alpha * logps) / alpha


def cpo(chosen_logps: jax.Array, rejected_logps: jax.Array, chosen_len: jax.Array, rejected_len: jax.Array,
        *, beta: float = 0.1, label_smoothing: float = 0.0, loss_type: str = "sigmoid", simpo_gamma: float = 0.5,
        alpha: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """CPO's preference term (Xu et al., 2024, arXiv 2401.08417), reference-free, as TRL 1.16's ``CPOTrainer``.

    Log-probs are summed, or length-averaged for ``ipo`` and ``simpo`` (TRL's ``average_log_prob``); rewards
    ``r = alphapo_rewards(logps, α)``, ``z = r_c − r_r`` (minus ``simpo_gamma/β`` for ``simpo``):
    ``sigmoid`` / ``simpo``: ``−(1−ε) log σ(βz) − ε log σ(−βz)``; ``hinge``: ``max(0, 1 − βz)``; ``ipo``:
    ``(z − 1/(2β))²``. AlphaPO = ``simpo`` with α ≠ 0 and no NLL term. The NLL (behaviour-cloning) term is the
    objective's. Rewards logged: ``β·r``."""
    if loss_type not in CPO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}; expected one of {CPO_LOSS_TYPES}")
    chosen_logps, rejected_logps, chosen_len, rejected_len = _f32(chosen_logps, rejected_logps, chosen_len,
                                                                  rejected_len)
    if loss_type in ("ipo", "simpo"):
        chosen_logps = chosen_logps / jnp.maximum(chosen_len, 1.0)
        rejected_logps = rejected_logps / jnp.maximum(rejected_len, 1.0)
    chosen_rewards, rejected_rewards = alphapo_rewards(chosen_logps, alpha), alphapo_rewards(rejected_logps, alpha)
    z = chosen_rewards - rejected_rewards
    if loss_type == "simpo":
        z = z - simpo_gamma / beta
    if loss_type in ("sigmoid", "simpo"):
        loss = -jax.nn.log_sigmoid(beta * z) * (1 - label_smoothing) - jax.nn.log_sigmoid(-beta * z) * label_smoothing
    elif loss_type == "hinge":
        loss = jax.nn.relu(1 - beta * z)
    else:
        loss = (z - 1 / (2 * beta)) ** 2
    metrics = _reward_metrics(jax.lax.stop_gradient(beta * chosen_rewards),
                              jax.lax.stop_gradient(beta * rejected_rewards), jax.lax.stop_gradient(chosen_logps),
                              jax.lax.stop_gradient(rejected_logps))
    return loss, metrics
