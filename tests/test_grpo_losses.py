"""``losses.grpo`` / ``grpo_terms`` / ``group_advantages`` against a PyTorch restatement of TRL 1.16.

The reference functions below restate, line for line, ``GRPOTrainer._compute_loss`` (loss types grpo, bnpo,
dr_grpo, dapo, cispo; token and sequence importance sampling; k3 KL with ``use_bias_correction_kl=True``; two-sided
clipping ``delta``; the clip-ratio metrics) for one process, no accumulation and ``steps_per_generation=1``, and the
advantage code of ``GRPOTrainer._generate_and_score_completions`` (``sum_then_normalize``) and
``RLOOTrainer`` with TRL's ``nanstd``.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxalign.losses import group_advantages, grpo, grpo_terms, sampling_correction


# ------------------------------------------------------------------------------ TRL 1.16, restated in PyTorch
def trl_nanstd(tensor, dim=None, keepdim=False):
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    variance *= correction
    std = torch.sqrt(variance)
    if keepdim:
        return std
    if dim is None:
        return std.squeeze()
    return std.squeeze(dim)


def trl_grpo_advantages(rewards, num_generations, scale_rewards):
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        if num_generations > 1:
            std_rewards = trl_nanstd(rewards.view(-1, num_generations), dim=1)
            std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
        else:
            std_rewards = torch.zeros_like(rewards)
    else:
        std_rewards = trl_nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def trl_rloo_advantages(rewards, num_generations, normalize_advantages):
    grouped_rewards = rewards.view(-1, num_generations)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    if num_generations > 1:
        baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)
        advantages = rewards - baselines.view(-1)
    else:
        advantages = torch.zeros_like(rewards)
    if normalize_advantages:
        advantages = (advantages - torch.nanmean(advantages)) / (trl_nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def trl_compute_loss(per_token_logps, old_per_token_logps, advantages, mask, ref_per_token_logps, *, beta,
                     epsilon_low, epsilon_high, delta, loss_type, importance_sampling_level, max_completion_length,
                     importance_sampling_ratio=None):
    advantages = advantages.unsqueeze(1)
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if beta != 0.0:
        per_token_kl = (torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps)
                        - 1)
        per_token_kl = per_token_kl * coef_1
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    else:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss1 = coef_1 * advantages
        per_token_loss2 = coef_2 * advantages
        per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    if importance_sampling_ratio is not None:
        per_token_loss = per_token_loss * importance_sampling_ratio
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    else:  # dapo, cispo: num_items_in_batch = the generation batch's completion tokens
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)

    def global_masked_mean(x):
        if x.shape[1] == 1:
            return (x.sum() / max(float(x.shape[0]), 1.0)).item()
        return ((x * mask).sum() / mask.sum().clamp(min=1.0)).item()

    metrics = {}
    if beta != 0.0:
        metrics["kl"] = global_masked_mean(per_token_kl)
    if loss_type == "cispo":
        metrics["cispo_clip_ratio"] = global_masked_mean(((coef_1 > epsilon_high) & (advantages > 0)).float())
    else:
        is_low_clipped = (coef_1 < 1 - epsilon_low) & (advantages < 0)
        is_high_clipped = (coef_1 > 1 + epsilon_high) & (advantages > 0)
        metrics["clip_ratio/low_mean"] = global_masked_mean(is_low_clipped.float())
        metrics["clip_ratio/high_mean"] = global_masked_mean(is_high_clipped.float())
        metrics["clip_ratio/region_mean"] = global_masked_mean((is_low_clipped | is_high_clipped).float())
    return loss, metrics


def trl_sampling_ratio(old_per_token_logps, sampling_per_token_logps, completion_mask, mode, clip_min, clip_max):
    """TRL 1.16 ``_generate_and_score_completions``: the vLLM importance-sampling ratio."""
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * completion_mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True) if sequence_level_is else per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)
    return ratio


# ------------------------------------------------------------------------------------------------- inputs
N, T, G = 8, 7, 4


def batch(seed=0):
    rng = np.random.default_rng(seed)
    logps = rng.normal(-2.0, 0.7, (N, T)).astype(np.float32)
    # ratios well outside [0.8, 1.28], per token and (through a per-row shift) per sequence
    old = (logps + rng.normal(0.0, 0.35, (N, T)) + rng.normal(0.0, 0.3, (N, 1))).astype(np.float32)
    ref = (logps + rng.normal(0.0, 0.5, (N, T))).astype(np.float32)
    lengths = np.array([7, 5, 3, 0, 6, 2, 7, 4])  # row 3 is fully masked
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    rewards = rng.normal(size=N).astype(np.float32)
    rewards[4:] = 1.0  # the second group's rewards are all equal
    return logps, old, ref, mask, rewards


def cases():
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        levels = ("token", "sequence") if loss_type == "grpo" else ("token",)
        for level, beta, eps_high, delta in itertools.product(levels, (0.0, 0.04), (0.2, 0.28), (None, 1.5)):
            yield loss_type, level, beta, eps_high, delta
    for beta, eps_high in itertools.product((0.0, 0.04), (0.2, 0.28, 1.3, 5.0)):
        yield "cispo", "token", beta, eps_high, None


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))


@pytest.mark.parametrize(("loss_type", "level", "beta", "eps_high", "delta"), list(cases()))
def test_grpo_loss_gradient_and_clip_ratios_equal_trl(loss_type, level, beta, eps_high, delta):
    logps, old, ref, mask, rewards = batch()
    advantages = np.asarray(group_advantages(jnp.asarray(rewards), G))
    options = dict(beta=beta, epsilon_low=0.2, epsilon_high=eps_high, delta=delta, loss_type=loss_type,
                   importance_sampling_level=level, max_completion_length=T)

    def ours(lp):
        return grpo(lp, jnp.asarray(old), jnp.asarray(advantages), jnp.asarray(mask), ref_logps=jnp.asarray(ref),
                    **options)

    (loss, metrics), grad = jax.value_and_grad(ours, has_aux=True)(jnp.asarray(logps))
    lp = torch.tensor(logps, dtype=torch.float64, requires_grad=True)
    expected, expected_metrics = trl_compute_loss(
        lp, torch.tensor(old, dtype=torch.float64), torch.tensor(advantages, dtype=torch.float64),
        torch.tensor(mask, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64), **options)
    expected.backward()
    assert rel(loss, expected.item()) <= 1e-5
    assert rel(grad, lp.grad.numpy()) <= 1e-4
    assert np.all(np.asarray(grad)[mask == 0] == 0.0)  # exactly 0 at masked positions
    assert set(metrics) == set(expected_metrics)
    for name, value in expected_metrics.items():
        assert float(metrics[name]) == pytest.approx(value, rel=1e-5, abs=1e-7), name
    if loss_type != "cispo" and eps_high == 0.2:
        assert expected_metrics["clip_ratio/region_mean"] > 0  # the batch does clip


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
def test_micro_batches_add_up_to_the_whole_batch(loss_type):
    logps, old, ref, mask, rewards = batch(1)
    advantages = group_advantages(jnp.asarray(rewards), G)
    options = dict(beta=0.04, loss_type=loss_type, max_completion_length=T,
                   epsilon_high=5.0 if loss_type == "cispo" else 0.28)

    def whole(lp):
        return grpo(lp, jnp.asarray(old), advantages, jnp.asarray(mask), ref_logps=jnp.asarray(ref), **options)[0]

    def parts(lp):
        numerator = denominator = 0.0
        for rows in (slice(0, 3), slice(3, 8)):  # uneven micro-batches with different token counts
            num, den, _ = grpo_terms(lp[rows], jnp.asarray(old)[rows], advantages[rows], jnp.asarray(mask)[rows],
                                     ref_logps=jnp.asarray(ref)[rows], **options)
            numerator, denominator = numerator + num, denominator + den
        return numerator / denominator

    full_loss, full_grad = jax.value_and_grad(whole)(jnp.asarray(logps))
    split_loss, split_grad = jax.value_and_grad(parts)(jnp.asarray(logps))
    assert rel(split_loss, full_loss) <= 1e-5
    assert rel(split_grad, full_grad) <= 1e-5


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_on_policy_ratio_is_one_and_the_gradient_is_the_policy_gradient_with_baseline(loss_type):
    logps, _, _, mask, rewards = batch(2)
    advantages = np.asarray(group_advantages(jnp.asarray(rewards), G))
    lp = jnp.asarray(logps)

    def loss(x):  # mu = 1: the sampler's log-probs are the policy's own (old = stop_gradient(logps))
        return grpo(x, jax.lax.stop_gradient(x), jnp.asarray(advantages), jnp.asarray(mask), loss_type=loss_type,
                    max_completion_length=T)

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(lp)
    assert float(metrics["clip_ratio/region_mean"]) == 0.0  # ratio exactly 1: nothing clipped
    tokens = mask.sum(axis=1)
    # d/d logp_it of -(1/Z) sum_i A_i sum_t m_it logp_it, Z per loss type
    if loss_type == "grpo":
        expected = -advantages[:, None] * mask / np.maximum(tokens, 1)[:, None] / N
    elif loss_type == "dr_grpo":
        expected = -advantages[:, None] * mask / (N * T)
    else:
        expected = -advantages[:, None] * mask / mask.sum()
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-6, atol=1e-9)
    weights = -advantages[:, None] * mask  # the loss value is -mean(A) in the same normalisation
    assert float(value) == pytest.approx(float(np.sum(weights / mask.sum()) if loss_type in ("bnpo", "dapo") else
                                               np.sum(weights / np.maximum(tokens, 1)[:, None]) / N
                                               if loss_type == "grpo" else np.sum(weights) / (N * T)), rel=1e-5)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize(("loss_type", "clip_min", "clip_max"), [("dapo", None, 3.0), ("grpo", 0.5, 1.5),
                                                                 ("cispo", None, 2.0)])
def test_sampling_correction_equals_trl(mode, loss_type, clip_min, clip_max):
    logps, old, ref, mask, rewards = batch(4)
    rng = np.random.default_rng(5)
    sampler = (old + rng.normal(0.0, 0.6, old.shape)).astype(np.float32)  # a sampler in another dtype, say
    sampler[0, 1] = np.nan  # a log-prob the sampler did not report: no correction there
    advantages = np.asarray(group_advantages(jnp.asarray(rewards), G))
    options = dict(beta=0.04, epsilon_low=0.2, epsilon_high=2.0 if loss_type == "cispo" else 0.28, delta=None,
                   loss_type=loss_type, importance_sampling_level="token", max_completion_length=T)
    weights = sampling_correction(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask), mode=mode,
                                  clip_min=clip_min, clip_max=clip_max)
    t = {name: torch.tensor(x, dtype=torch.float64) for name, x in
         dict(old=old, sampler=sampler, mask=mask, ref=ref, advantages=advantages).items()}
    expected_weights = trl_sampling_ratio(t["old"], t["sampler"], t["mask"], mode, clip_min, clip_max)
    np.testing.assert_allclose(np.asarray(weights), expected_weights.numpy(), rtol=1e-5, atol=1e-7)
    assert 0 < float((expected_weights == 0).double().mean()) < 1 if mode.endswith("mask") else True

    def ours(lp):
        return grpo(lp, jnp.asarray(old), jnp.asarray(advantages), jnp.asarray(mask), ref_logps=jnp.asarray(ref),
                    sampling_weights=weights, **options)

    (loss, metrics), grad = jax.value_and_grad(ours, has_aux=True)(jnp.asarray(logps))
    lp = torch.tensor(logps, dtype=torch.float64, requires_grad=True)
    expected, _ = trl_compute_loss(lp, t["old"], t["advantages"], t["mask"], t["ref"],
                                   importance_sampling_ratio=expected_weights, **options)
    expected.backward()
    assert rel(loss, expected.item()) <= 1e-5
    assert rel(grad, lp.grad.numpy()) <= 1e-4
    assert "sampling/importance_sampling_ratio/mean" in metrics


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@pytest.mark.parametrize("group_size", [1, 4])
def test_group_advantages_equal_trl(scale_rewards, estimator, group_size):
    rng = np.random.default_rng(3)
    rewards = rng.normal(size=12).astype(np.float32)
    rewards[4:8] = 0.5  # a group with equal rewards: advantage 0 (grpo) whatever the scaling
    rewards[1] = np.nan  # an unscorable completion (every reward function returned None)
    ours = np.asarray(group_advantages(jnp.asarray(rewards), group_size, scale_rewards=scale_rewards,
                                       estimator=estimator))
    r = torch.tensor(rewards, dtype=torch.float64)
    if estimator == "grpo":
        expected = trl_grpo_advantages(r, group_size, scale_rewards).numpy()
    elif scale_rewards == "group":  # jaxalign's addition: the LOO advantage over the group's reward std
        loo = trl_rloo_advantages(r, group_size, False)
        std = (trl_nanstd(r.view(-1, group_size), dim=1) if group_size > 1 else torch.zeros(12 // group_size))
        expected = torch.nan_to_num(loo / (std.repeat_interleave(group_size) + 1e-4), nan=0.0).numpy()
    else:
        expected = trl_rloo_advantages(r, group_size, scale_rewards == "batch").numpy()
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)
    assert ours[1] == 0.0
    if estimator == "grpo" and group_size == 4:
        assert np.all(ours[4:8] == 0.0)


def test_bad_options_name_what_is_wrong():
    logps, old, _, mask, rewards = batch()
    args = (jnp.asarray(logps), jnp.asarray(old), jnp.zeros(N), jnp.asarray(mask))
    with pytest.raises(ValueError, match=r"importance_sampling_level='sequence' .* needs loss_type='grpo'"):
        grpo(*args, loss_type="dapo", importance_sampling_level="sequence")
    with pytest.raises(ValueError, match=r"dr_grpo.*max_completion_length"):
        grpo(*args, loss_type="dr_grpo")
    with pytest.raises(ValueError, match=r"beta > 0 needs ref_logps"):
        grpo(*args, beta=0.1)
    with pytest.raises(ValueError, match=r"loss_type='ppo'"):
        grpo(*args, loss_type="ppo")
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        group_advantages(jnp.asarray(rewards), 3)
