"""``losses.dpo`` and the DPO objective against a PyTorch restatement of TRL 1.16's ``DPOTrainer._compute_loss``.

``trl_dpo_loss`` below restates, line for line, the loss-type loop of TRL 1.16 (every ``loss_type``, their
``loss_weights`` combination, the f-divergence scores, WPO's ``use_weighting`` weights) on per-sequence log-prob
sums; ``trl_ld_logps`` restates its LD-DPO shared/tail split, and ``trl_wpo_weights`` its WPO weights from per-token
log-probs and ``log_sum_sq_probs``. ``exo_pair`` with TRL's own ε check; ``sigmoid`` with ε = 0 (TRL 1.16 ignores
``label_smoothing`` there; jaxalign keeps cDPO's ε).
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxalign import losses, objectives
from jaxalign.models import create_model
from jaxalign.objectives import DPOParams, get_objective

torch = pytest.importorskip("torch")
F = torch.nn.functional

BETA = 0.3


# ------------------------------------------------------------------------------ TRL 1.16, restated in PyTorch
def trl_scores(chosen_logratios, rejected_logratios, f_divergence_type, alpha):
    if f_divergence_type == "reverse_kl":
        return chosen_logratios, rejected_logratios
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-chosen_logratios), 1 - torch.exp(-rejected_logratios)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(chosen_logratios), math.log(2) + F.logsigmoid(rejected_logratios)
    coef = 1.0 / (alpha - 1.0)
    t_chosen = torch.clamp((alpha - 1.0) * chosen_logratios, max=80.0)
    t_rejected = torch.clamp((alpha - 1.0) * rejected_logratios, max=80.0)
    return (torch.exp(t_chosen) - 1.0) * coef, (torch.exp(t_rejected) - 1.0) * coef


def trl_dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, completion_mask,
                 chosen_per_token_logps, loss_types, loss_weights, *, beta=BETA, label_smoothing=0.0,
                 discopop_tau=0.05, f_divergence_type="reverse_kl", alpha=0.5, wpo_weights=None,
                 shift_completion_mask=None):
    """``completion_mask`` ``[2B, T]`` (chosen rows first), ``chosen_per_token_logps`` ``[B, T']`` (0 off the
    completion) on ``shift_completion_mask`` (default: ``completion_mask``); the rest ``[B]``."""
    shift_completion_mask = completion_mask if shift_completion_mask is None else shift_completion_mask
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_scores, rejected_scores = trl_scores(chosen_logratios, rejected_logratios, f_divergence_type, alpha)
    delta_score = chosen_scores - rejected_scores
    loss = 0.0
    for loss_type, loss_weight in zip(loss_types, loss_weights, strict=True):
        if loss_type == "sigmoid":
            per_sequence_loss = -F.logsigmoid(beta * delta_score)
        elif loss_type == "hinge":
            per_sequence_loss = torch.relu(1 - beta * delta_score)
        elif loss_type == "ipo":
            chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
            chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
            rejected_avg_score = rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0)
            ipo_delta = chosen_avg_score - rejected_avg_score
            per_sequence_loss = (ipo_delta - 1 / (2 * beta)) ** 2
        elif loss_type == "exo_pair":
            epsilon = torch.tensor(label_smoothing, dtype=torch.float64)
            qw = torch.sigmoid(beta * delta_score)
            log_qw = F.logsigmoid(beta * delta_score)
            log_pw = torch.log1p(-epsilon)
            ql = torch.sigmoid(-beta * delta_score)
            log_ql = F.logsigmoid(-beta * delta_score)
            log_pl = torch.log(epsilon)
            per_sequence_loss = qw * (log_qw - log_pw) + ql * (log_ql - log_pl)
        elif loss_type == "nca_pair":
            chosen_rewards = beta * chosen_logratios
            rejected_rewards = beta * rejected_logratios
            per_sequence_loss = (-F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards)
                                 - 0.5 * F.logsigmoid(-rejected_rewards))
        elif loss_type == "robust":
            clean_loss_term = -(1 - label_smoothing) * F.logsigmoid(beta * delta_score)
            flipped_loss_term = -label_smoothing * F.logsigmoid(-beta * delta_score)
            per_sequence_loss = (clean_loss_term - flipped_loss_term) / (1 - 2 * label_smoothing)
        elif loss_type == "bco_pair":
            chosen_rewards = beta * chosen_logratios
            rejected_rewards = beta * rejected_logratios
            per_sequence_loss = -F.logsigmoid(chosen_rewards) - F.logsigmoid(-rejected_rewards)
        elif loss_type == "sppo_hard":
            winner_margin_error = (chosen_logratios - 0.5 / beta) ** 2
            loser_margin_error = (rejected_logratios + 0.5 / beta) ** 2
            per_sequence_loss = winner_margin_error + loser_margin_error
        elif loss_type == "aot":
            logratios = chosen_logps - rejected_logps
            ref_logratios = ref_chosen_logps - ref_rejected_logps
            logratios_sorted, _ = torch.sort(logratios, dim=0)
            ref_logratios_sorted, _ = torch.sort(ref_logratios, dim=0)
            delta = logratios_sorted - ref_logratios_sorted
            per_sequence_loss = (-F.logsigmoid(beta * delta) * (1 - label_smoothing)
                                 - F.logsigmoid(-beta * delta) * label_smoothing)
        elif loss_type == "aot_unpaired":
            chosen_logratios_sorted, _ = torch.sort(chosen_logratios, dim=0)
            rejected_logratios_sorted, _ = torch.sort(rejected_logratios, dim=0)
            delta = chosen_logratios_sorted - rejected_logratios_sorted
            per_sequence_loss = (-F.logsigmoid(beta * delta) * (1 - label_smoothing)
                                 - F.logsigmoid(-beta * delta) * label_smoothing)
        elif loss_type == "apo_zero":
            losses_chosen = 1 - torch.sigmoid(beta * chosen_logratios)
            losses_rejected = torch.sigmoid(beta * rejected_logratios)
            per_sequence_loss = losses_chosen + losses_rejected
        elif loss_type == "apo_down":
            losses_chosen = torch.sigmoid(beta * chosen_logratios)
            losses_rejected = 1 - torch.sigmoid(beta * (chosen_logratios - rejected_logratios))
            per_sequence_loss = losses_chosen + losses_rejected
        elif loss_type == "discopop":
            logits = delta_score * beta
            log_ratio_modulation = torch.sigmoid(logits / discopop_tau)
            logistic_component = -F.logsigmoid(logits)
            exp_component = torch.exp(-logits)
            per_sequence_loss = logistic_component * (1 - log_ratio_modulation) + exp_component * log_ratio_modulation
        elif loss_type == "sft":
            chosen_mask, _ = shift_completion_mask.chunk(2, dim=0)
            batch_loss = -chosen_per_token_logps[chosen_mask.bool()].mean()
            per_sequence_loss = batch_loss.expand(chosen_per_token_logps.size(0))
        elif loss_type == "sigmoid_norm":
            chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
            chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
            rejected_avg_score = rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0)
            delta = chosen_avg_score - rejected_avg_score
            per_sequence_loss = -F.logsigmoid(beta * delta)
        if wpo_weights is not None:
            chosen_weights, rejected_weights = wpo_weights.chunk(2, dim=0)
            per_sequence_loss *= chosen_weights * rejected_weights
        loss += per_sequence_loss.mean() * loss_weight
    return loss


def trl_ld_logps(per_token_logps, shift_completion_mask, ld_alpha):
    """``_compute_loss``'s LD-DPO branch: ``[2B, T-1]`` shifted per-token log-probs -> ``[2B]``."""
    comp_pos = shift_completion_mask.cumsum(dim=1)
    comp_lens = shift_completion_mask.sum(dim=1).long()
    chosen_lens, rejected_lens = comp_lens.chunk(2, dim=0)
    shared_lens = torch.minimum(chosen_lens, rejected_lens)
    shared_lens = torch.cat([shared_lens, shared_lens], dim=0)
    shared_mask = (comp_pos > 0) & (comp_pos <= shared_lens.unsqueeze(1))
    tail_mask = comp_pos > shared_lens.unsqueeze(1)
    shared_logps = (per_token_logps * shared_mask).sum(dim=1)
    tail_logps = (per_token_logps * tail_mask).sum(dim=1)
    return shared_logps + ld_alpha * tail_logps


def trl_wpo_weights(per_token_logps, log_sum_sq_probs, shift_completion_mask):
    completion_lengths = shift_completion_mask.sum(dim=1).clamp_min(1)
    with torch.no_grad():
        aligned_logps = (per_token_logps - log_sum_sq_probs) * shift_completion_mask
    mean_logps = aligned_logps.sum(dim=1) / completion_lengths
    return torch.exp(mean_logps)


# ----------------------------------------------------------------------------------------- random inputs
def random_sums(seed, b=6, t=9):
    """Per-token log-probs ``[2B, T]`` on a completion mask (chosen rows first), their sums, and reference sums."""
    rng = np.random.RandomState(seed)
    mask = np.zeros((2 * b, t))
    for row in range(2 * b):
        start = rng.randint(1, 4)
        mask[row, start:start + rng.randint(2, t - start + 1)] = 1
    token_logps = -rng.exponential(0.8, (2 * b, t)) * mask
    ref = (token_logps * mask).sum(1) + rng.randn(2 * b) * 1.5
    return token_logps, mask, ref


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-12))


CASES = [(name,) for name in losses.DPO_LOSS_TYPES] + [
    ("sigmoid", "sft"), ("apo_zero", "sigmoid_norm", "sft"), ("hinge", "ipo", "exo_pair"),
]


@pytest.mark.parametrize("types", CASES, ids=["+".join(c) for c in CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_loss_type_and_combination_equals_trl(types, seed):
    token_logps, mask, ref = random_sums(seed)
    b = mask.shape[0] // 2
    weights = [1.0] if len(types) == 1 else [0.5 + 0.25 * k for k in range(len(types))]
    smoothing = 0.01 if "exo_pair" in types else (0.2 if set(types) & {"robust", "aot", "aot_unpaired"} else 0.0)

    lp = torch.tensor(token_logps, requires_grad=True)
    sums = (lp * torch.tensor(mask)).sum(1)
    ref_t = torch.tensor(ref)
    expected = trl_dpo_loss(sums[:b], sums[b:], ref_t[:b], ref_t[b:], torch.tensor(mask), lp[:b], types, weights,
                            label_smoothing=smoothing)
    expected.backward()

    def ours(token_logps):
        sums = (token_logps * mask).sum(1)
        counts = jnp.asarray(mask.sum(1))
        per_pair, _ = losses.dpo(sums[:b], sums[b:], ref[:b], ref[b:], beta=BETA, label_smoothing=smoothing,
                                 loss_type=types, loss_weights=weights, chosen_len=counts[:b],
                                 rejected_len=counts[b:])
        return per_pair.mean()

    loss, grad = jax.value_and_grad(ours)(jnp.asarray(token_logps, jnp.float32))
    assert float(loss) == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    assert rel(grad, lp.grad.numpy()) <= 1e-4


@pytest.mark.parametrize("divergence", ["forward_kl", "js_divergence", "alpha_divergence"])
@pytest.mark.parametrize("types", [("sigmoid",), ("ipo",), ("discopop",), ("sigmoid_norm", "sft")])
def test_f_divergences_equal_trl(divergence, types):
    token_logps, mask, ref = random_sums(3)
    b = mask.shape[0] // 2
    lp = torch.tensor(token_logps, requires_grad=True)
    sums = (lp * torch.tensor(mask)).sum(1)
    ref_t = torch.tensor(ref)
    weights = [1.0] * len(types)
    expected = trl_dpo_loss(sums[:b], sums[b:], ref_t[:b], ref_t[b:], torch.tensor(mask), lp[:b], types, weights,
                            f_divergence_type=divergence, alpha=0.3)
    expected.backward()

    def ours(token_logps):
        sums = (token_logps * mask).sum(1)
        counts = jnp.asarray(mask.sum(1))
        return losses.dpo(sums[:b], sums[b:], ref[:b], ref[b:], beta=BETA, loss_type=types, chosen_len=counts[:b],
                          rejected_len=counts[b:], f_divergence_type=divergence,
                          f_alpha_divergence_coef=0.3)[0].mean()

    loss, grad = jax.value_and_grad(ours)(jnp.asarray(token_logps, jnp.float32))
    assert float(loss) == pytest.approx(expected.item(), rel=1e-5)
    assert rel(grad, lp.grad.numpy()) <= 1e-4


def test_aot_sorts_only_the_valid_pairs():
    token_logps, mask, ref = random_sums(4)
    b = mask.shape[0] // 2
    sums = token_logps.sum(1)
    keep = np.array([1, 0, 1, 1, 0, 1], bool)
    for name in ("aot", "aot_unpaired"):
        whole, _ = losses.dpo(sums[:b], sums[b:], ref[:b], ref[b:], beta=BETA, loss_type=name, valid=keep)
        rows = np.concatenate([np.nonzero(keep)[0], b + np.nonzero(keep)[0]])
        s, r = sums[rows], ref[rows]
        n = keep.sum()
        alone, _ = losses.dpo(s[:n], s[n:], r[:n], r[n:], beta=BETA, loss_type=name)
        np.testing.assert_allclose(np.asarray(whole)[keep], alone, rtol=1e-6)
    with pytest.raises(ValueError, match="cannot be combined with aot"):
        losses.dpo(sums[:b], sums[b:], ref[:b], ref[b:], loss_type="aot", sequence_weights=np.ones(b))
    with pytest.raises(ValueError, match="need chosen_len"):
        losses.dpo(sums[:b], sums[b:], ref[:b], ref[b:], loss_type="sft")
    with pytest.raises(ValueError, match="exo_pair needs label_smoothing"):
        losses.dpo(sums[:b], sums[b:], ref[:b], ref[b:], loss_type="exo_pair")
    with pytest.raises(ValueError, match="works with"):
        losses.dpo(sums[:b], sums[b:], ref[:b], ref[b:], loss_type="bco_pair", f_divergence_type="forward_kl")


# ------------------------------------------------------------------------------------ through the objective
def objective_batch(seed=0, b=3, t=12, vocab=128):
    rng = np.random.RandomState(seed)
    out = {}
    prompts = [rng.randint(3, vocab, 3 + row % 2) for row in range(b)]
    for side in ("chosen", "rejected"):
        tokens, attention, loss_mask = (np.zeros((b, t), np.int32) for _ in range(3))
        for row, prompt in enumerate(prompts):
            seq = np.concatenate([prompt, rng.randint(3, vocab, rng.randint(2, t - len(prompt)))])
            tokens[row, :len(seq)], attention[row, :len(seq)] = seq, 1
            loss_mask[row, len(prompt):len(seq)] = 1
        out.update({f"{side}_tokens": tokens, f"{side}_attention_mask": attention, f"{side}_loss_mask": loss_mask})
    return out


def torch_token_logps_and_lss(logits, tokens, mask):
    """The trainer's fused-head outputs, shifted: per-token log-probs on the completion and log Σ p²."""
    logits = torch.tensor(np.asarray(logits), dtype=torch.float64)[:, :-1]
    labels = torch.tensor(tokens)[:, 1:].long()
    shift_mask = torch.tensor(mask)[:, 1:].double()
    log_probs = logits.log_softmax(-1)
    per_token = torch.gather(log_probs, 2, labels.unsqueeze(2)).squeeze(2) * shift_mask
    log_sum_sq = torch.logsumexp(2 * log_probs, dim=-1)
    return per_token, log_sum_sq, shift_mask


@pytest.mark.parametrize(("ld_alpha", "use_weighting", "types"), [
    pytest.param(0.3, False, "sigmoid", marks=pytest.mark.slow),
    pytest.param(1.0, True, "sigmoid", marks=pytest.mark.slow), (0.5, True, "sigmoid,apo_zero"),
    (0.5, False, "sigmoid,sft"), pytest.param(0.0, False, "ipo", marks=pytest.mark.slow)])
def test_ld_dpo_and_wpo_through_the_objective_equal_trl(ld_alpha, use_weighting, types, tiny_config):
    policy, reference = create_model(tiny_config, seed=5), create_model(tiny_config, seed=6)
    batch = objective_batch()
    jbatch = {k: jnp.asarray(v) for k, v in batch.items()}
    tokens = np.concatenate([batch["chosen_tokens"], batch["rejected_tokens"]])
    attention = np.concatenate([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
    mask = np.concatenate([batch["chosen_loss_mask"], batch["rejected_loss_mask"]])
    b = tokens.shape[0] // 2
    names = tuple(types.split(","))

    def trl_side(model):
        per_token, lss, shift_mask = torch_token_logps_and_lss(model(jnp.asarray(tokens), jnp.asarray(attention)),
                                                               tokens, mask)
        return per_token, lss, shift_mask

    per_token, lss, shift_mask = trl_side(policy)
    ref_token, _, _ = trl_side(reference)
    logps = trl_ld_logps(per_token, shift_mask, ld_alpha)
    ref_logps = trl_ld_logps(ref_token, shift_mask, ld_alpha)
    wpo = trl_wpo_weights(per_token, lss, shift_mask) if use_weighting else None
    expected = trl_dpo_loss(logps[:b], logps[b:], ref_logps[:b], ref_logps[b:], torch.tensor(mask).double(),
                            per_token[:b], names, [1.0] * len(names), beta=BETA, wpo_weights=wpo,
                            shift_completion_mask=shift_mask)

    for chunk in (0, 32):  # the plain and the fused (vocabulary-tiled) head
        params = DPOParams(beta=BETA, loss_type=types, ld_alpha=ld_alpha, use_weighting=use_weighting,
                           logps_chunk_size=chunk)
        loss, _ = get_objective("dpo").fn(policy, jbatch, params, reference=reference)
        assert float(loss) == pytest.approx(expected.item(), rel=1e-5)
    # the precomputed reference path applies the same LD weighting
    sums = objectives.preference.pair_sums(reference, jbatch, "dpo", ld_alpha=ld_alpha)
    precomputed, _ = get_objective("dpo").fn(policy, {**jbatch, "ref_chosen_logps": sums["chosen"],
                                                      "ref_rejected_logps": sums["rejected"]}, params)
    assert float(precomputed) == pytest.approx(float(expected), rel=1e-5)


def test_rpo_alpha_is_the_sft_term_and_params_are_checked():
    params = DPOParams(rpo_alpha=0.5)
    assert params.combination == (("sigmoid", "sft"), (1.0, 0.5))
    assert DPOParams(loss_type="sigmoid, sft", loss_weights="1, 0.25").combination == (("sigmoid", "sft"),
                                                                                      (1.0, 0.25))
    assert DPOParams(loss_type=["apo_zero", "sft"]).loss_type == ("apo_zero", "sft")
    for bad, match in [(dict(loss_type="sigmoid,bogus"), "expected one or more"),
                       (dict(loss_type="sigmoid,sft", loss_weights="1"), "one weight per loss type"),
                       (dict(loss_type="exo_pair"), "exo_pair needs label_smoothing"),
                       (dict(ld_alpha=1.5), "ld_alpha"),
                       (dict(loss_type="aot", use_weighting=True), "WPO"),
                       (dict(loss_type="bco_pair", f_divergence_type="js_divergence"), "works with loss types"),
                       (dict(f_divergence_type="kl"), "f_divergence_type")]:
        with pytest.raises(ValueError, match=match):
            DPOParams(**bad)


@pytest.mark.slow
def test_a_combined_variant_trains_from_the_command_line_and_reruns_from_config_json(tmp_path):
    from jaxalign.cli import main

    small = ["--config.model.shape.hidden_size=32", "--config.model.shape.intermediate_size=64",
             "--config.model.shape.num_layers=1", "--config.model.shape.num_heads=2",
             "--config.model.shape.num_kv_heads=1", "--config.data.toy_size=200", "--config.data.toy_eval_size=16",
             "--config.data.max_length=48", "--config.train.batch_size=8", "--config.train.log_every=2",
             "--config.train.eval_every=0", "--config.eval.batches=1", "--config.eval.generate=0",
             "--config.logging.tensorboard=False", "--config.logging.plot=False", "--config.train.steps=4"]
    variant = ["--config.objective.params.loss_type=apo_zero,sft", "--config.objective.params.loss_weights=1,0.5",
               "--config.objective.params.ld_alpha=0.5", "--config.objective.params.use_weighting=True"]
    assert main(["train", "--config", "dpo", *small, *variant, f"--config.workdir={tmp_path / 'a'}"]) in (0, None)
    saved = json.loads((tmp_path / "a" / "config.json").read_text())["objective"]["params"]
    assert saved["loss_type"] == ["apo_zero", "sft"] and saved["loss_weights"] == [1.0, 0.5]
    assert main(["train", "--config", str(tmp_path / "a" / "config.json"),
                 f"--config.workdir={tmp_path / 'b'}"]) in (0, None)

    def train_losses(run):
        rows = [json.loads(r) for r in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if r["split"] == "train"]

    assert train_losses("a") == train_losses("b") and all(np.isfinite(train_losses("a")))
