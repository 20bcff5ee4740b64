"""Objectives on real (tiny, random) transformers models against PyTorch restatements of the official code.

Each reference below restates the official trainer's lines (named in its docstring) and runs them on a
``transformers`` model; jaxalign runs the same weights loaded with ``load_hf``. Loss and every parameter's
gradient are compared.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxalign.models import load_hf
from jaxalign.objectives import MPOParams, get_objective

torch = pytest.importorskip("torch")
F = torch.nn.functional

T = 16  # the padded length (the official collator pads right, to a multiple of 8)


def right_padded_pairs(seed: int, b: int = 3, vocab: int = 128):
    """``{chosen,rejected}_{tokens,attention_mask,loss_mask}`` ``[b, T]``: a shared prompt of 3-5 tokens, then
    responses of different lengths, right padding (token 0)."""
    rng = np.random.RandomState(seed)
    out = {}
    prompts = [rng.randint(3, vocab, 3 + row % 3) for row in range(b)]
    for side in ("chosen", "rejected"):
        tokens = np.zeros((b, T), np.int32)
        attention = np.zeros((b, T), np.int32)
        loss_mask = np.zeros((b, T), np.int32)
        for row, prompt in enumerate(prompts):
            response = rng.randint(3, vocab, rng.randint(2, T - len(prompt) - 1))
            seq = np.concatenate([prompt, response])
            tokens[row, :len(seq)] = seq
            attention[row, :len(seq)] = 1
            loss_mask[row, len(prompt):len(seq)] = 1
        out.update({f"{side}_tokens": tokens, f"{side}_attention_mask": attention, f"{side}_loss_mask": loss_mask})
    return out


def jax_loss_and_grads(model, objective: str, batch, hparams, **kwargs):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    fn = get_objective(objective).fn
    jbatch = {k: jnp.asarray(v) for k, v in batch.items()}

    def loss_fn(p):
        loss, _ = fn(nnx.merge(graphdef, p, rest), jbatch, hparams, **kwargs)
        return loss

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return float(loss), grads


def concatenated_inputs(batch, prefix=""):
    """TRL's ``concatenated_inputs`` (decoder only): chosen rows then rejected rows, and their trained-token mask."""
    ids = torch.cat([torch.tensor(batch[f"{prefix}chosen_tokens"]), torch.tensor(batch[f"{prefix}rejected_tokens"])])
    attention = torch.cat([torch.tensor(batch[f"{prefix}chosen_attention_mask"]),
                           torch.tensor(batch[f"{prefix}rejected_attention_mask"])])
    trained = torch.cat([torch.tensor(batch[f"{prefix}chosen_loss_mask"]),
                         torch.tensor(batch[f"{prefix}rejected_loss_mask"])])
    return ids.long(), attention.long(), trained


def cross_entropy_loss(logits, labels):
    """The ``cross_entropy_loss`` both ``ORPOTrainer`` and ``CPOTrainer.concatenated_forward`` define."""
    logits = logits[..., :-1, :].contiguous()
    labels = labels[..., 1:].contiguous()
    return torch.nn.CrossEntropyLoss()(logits.view(-1, logits.shape[-1]), labels.view(-1))


# --------------------------------------------------------------------------------------------------- MPO
def official_mpo_concatenated_forward(model, batch, prefix):
    """LLaMA-Factory ``CustomDPOTrainer.concatenated_forward`` as circle-hit/MPO runs it: chosen and rejected
    concatenated on the batch axis; ``get_batch_logps`` (labels -100 on prompt and padding, shifted) divided by
    the valid length; the last hidden layer averaged over every position (dim 1, padding included)."""
    ids, attention, trained = concatenated_inputs(batch, prefix)
    labels = torch.where(trained.bool(), ids, torch.full_like(ids, -100)).long()
    out = model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
    logits = out.logits.float()
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_mask = labels != -100
    labels[labels == -100] = 0
    per_token_logps = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    all_logps = (per_token_logps * loss_mask).sum(-1)
    valid_length = loss_mask.sum(-1)
    avg = all_logps / valid_length
    hidden = out.hidden_states[-1].float().mean(dim=1)
    half = ids.shape[0] // 2
    return avg[:half], avg[half:], hidden[:half], hidden[half:]


def official_mpo_loss(policy, reference, batch, beta):
    """``CustomDPOTrainer.get_batch_loss_metrics`` (loss_type mpo): ``nn.MSELoss()(β·target_gap, source_gap)``
    plus the ``en_retain_loss`` ``nn.MSELoss`` between the policy's and the reference's pooled hidden states of
    the source (dominant) chosen and rejected sequences."""
    t_chosen, t_rejected, _, _ = official_mpo_concatenated_forward(policy, batch, "target_")
    _, _, p_hidden_c, p_hidden_r = official_mpo_concatenated_forward(policy, batch, "dominant_")
    with torch.no_grad():
        s_chosen, s_rejected, r_hidden_c, r_hidden_r = official_mpo_concatenated_forward(reference, batch,
                                                                                         "dominant_")
    mse = torch.nn.MSELoss()
    gap_loss = mse(beta * (t_chosen - t_rejected), s_chosen - s_rejected)
    retain = mse(torch.cat([p_hidden_c, p_hidden_r]), torch.cat([r_hidden_c, r_hidden_r]))
    return gap_loss + retain


@pytest.mark.parametrize("beta", [pytest.param(1.0, marks=pytest.mark.slow), 1.5])
def test_mpo_on_right_padded_batches_equals_the_official_code(beta, tmp_path):
    from torch_reference import assert_grads_match, jax_grads_by_hf_name, make_reference

    policy_torch = make_reference("llama", tmp_path / "policy", seed=3)
    reference_torch = make_reference("llama", tmp_path / "reference", seed=4)
    batch = {**{f"target_{k}": v for k, v in right_padded_pairs(0).items()},
             **{f"dominant_{k}": v for k, v in right_padded_pairs(1).items()}}
    assert (batch["target_chosen_attention_mask"] == 0).any()  # right padding is what is being tested

    expected = official_mpo_loss(policy_torch, reference_torch, batch, beta)
    expected.backward()
    loss, grads = jax_loss_and_grads(load_hf(tmp_path / "policy"), "mpo", batch, MPOParams(beta=beta),
                                     reference=load_hf(tmp_path / "reference"))
    assert loss == pytest.approx(float(expected), rel=1e-5)
    grads = jax_grads_by_hf_name(grads)
    # transformers builds the embedding with padding_idx=pad_token_id, whose row never gets a gradient; only
    # the official mean pooling reads padding positions, so that row is the one place the two may differ
    pad = policy_torch.config.pad_token_id
    assert not policy_torch.model.embed_tokens.weight.grad[pad].any()
    grads["model.embed_tokens.weight"][pad] = 0.0
    assert_grads_match(policy_torch, grads, rtol=1e-4)


# -------------------------------------------------------------------------------------------------- ORPO
def trl_log1mexp(x):
    t = -0.6931471805599453
    return torch.where(x < t, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def trl_orpo_loss(model, batch, beta):
    """TRL 1.16 ``ORPOTrainer.concatenated_forward`` + ``odds_ratio_loss`` + ``get_batch_loss_metrics`` (decoder
    only): the NLL is ``nn.CrossEntropyLoss`` over the chosen rows with labels = every non-padding token (prompt and
    response); the odds use response-only average log-probs; ``loss = nll − mean(β·log σ(log odds))``."""
    ids, attention, trained = concatenated_inputs(batch)
    len_chosen = batch["chosen_tokens"].shape[0]
    all_logits = model(input_ids=ids, attention_mask=attention).logits

    labels = torch.where(attention == 1, ids, -100)
    chosen_nll_loss = cross_entropy_loss(all_logits[:len_chosen], labels[:len_chosen])
    response_labels = torch.where(trained.bool(), ids, -100)[:, 1:].clone()
    logits = all_logits[:, :-1, :]
    loss_mask = response_labels != -100
    response_labels = torch.where(response_labels == -100, 0, response_labels)
    per_token_logps = torch.gather(logits.log_softmax(-1), 2, response_labels.unsqueeze(2)).squeeze(2)
    all_logps = (per_token_logps * loss_mask).sum(-1) / loss_mask.sum(-1)
    chosen_logps, rejected_logps = all_logps[:len_chosen].float(), all_logps[len_chosen:].float()
    log_odds = (chosen_logps - rejected_logps) - (trl_log1mexp(chosen_logps) - trl_log1mexp(rejected_logps))
    losses = beta * F.logsigmoid(log_odds)
    return chosen_nll_loss - losses.mean()


@pytest.mark.parametrize("chunk", [pytest.param(0, marks=pytest.mark.slow), 32])
def test_orpo_with_trl_nll_equals_trl(chunk, tmp_path):
    from torch_reference import assert_grads_match, jax_grads_by_hf_name, make_reference

    from jaxalign.objectives import ORPOParams

    policy_torch = make_reference("llama", tmp_path / "policy", seed=5)
    batch = right_padded_pairs(2, b=4)
    expected = trl_orpo_loss(policy_torch, batch, beta=0.25)
    expected.backward()
    model = load_hf(tmp_path / "policy")
    loss, grads = jax_loss_and_grads(model, "orpo", batch, ORPOParams(lam=0.25, nll="trl", logps_chunk_size=chunk))
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    assert_grads_match(policy_torch, jax_grads_by_hf_name(grads), rtol=1e-4)
    # the default NLL is the chosen response's mean, per pair: a different number on the same batch
    response_only, _ = jax_loss_and_grads(model, "orpo", batch, ORPOParams(lam=0.25))
    assert abs(response_only - loss) > 1e-3


# --------------------------------------------------------------------------------------------------- CPO
def trl_cpo_loss(model, batch, *, beta, loss_type, cpo_alpha, alpha, simpo_gamma=0.5, label_smoothing=0.0):
    """TRL 1.16 ``CPOTrainer``: ``concatenated_forward`` (NLL = ``nn.CrossEntropyLoss`` over the chosen rows'
    response labels; log-probs averaged for ipo / simpo), ``cpo_loss`` (AlphaPO's ``(1 − p^(−α))/α``), and
    ``loss = losses.mean() + cpo_alpha · nll`` (``alphapo``: simpo with ``cpo_alpha = 0``, as ``CPOConfig`` maps it)."""
    if loss_type == "alphapo":
        loss_type, cpo_alpha = "simpo", 0.0
    ids, attention, trained = concatenated_inputs(batch)
    len_chosen = batch["chosen_tokens"].shape[0]
    all_logits = model(input_ids=ids, attention_mask=attention).logits
    labels = torch.where(trained.bool(), ids, -100)

    nll_loss = cross_entropy_loss(all_logits[:len_chosen], labels[:len_chosen]) if cpo_alpha else 0.0
    shifted = labels[:, 1:].clone()
    loss_mask = shifted != -100
    shifted[shifted == -100] = 0
    per_token_logps = torch.gather(all_logits[:, :-1].log_softmax(-1), 2, shifted.unsqueeze(2)).squeeze(2)
    all_logps = (per_token_logps * loss_mask).sum(-1)
    if loss_type in ("ipo", "simpo"):
        all_logps = all_logps / loss_mask.sum(-1)
    policy_chosen_logps, policy_rejected_logps = all_logps[:len_chosen], all_logps[len_chosen:]
    if alpha != 0.0:
        chosen_probs, rejected_probs = torch.exp(policy_chosen_logps), torch.exp(policy_rejected_logps)
        logits = (1 - chosen_probs.pow(-alpha)) / alpha - (1 - rejected_probs.pow(-alpha)) / alpha
    else:
        logits = policy_chosen_logps - policy_rejected_logps
    if loss_type == "simpo":
        logits = logits - simpo_gamma / beta
        losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                  - F.logsigmoid(-beta * logits) * label_smoothing)
    elif loss_type == "sigmoid":
        losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                  - F.logsigmoid(-beta * logits) * label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    else:
        losses = (logits - 1 / (2 * beta)) ** 2
    return losses.mean() + cpo_alpha * nll_loss


@pytest.mark.parametrize(("loss_type", "alpha", "smoothing"), [
    pytest.param("sigmoid", 0.0, 0.0, marks=pytest.mark.slow), ("sigmoid", 0.0, 0.1),
    pytest.param("hinge", 0.0, 0.0, marks=pytest.mark.slow), pytest.param("ipo", 0.0, 0.0, marks=pytest.mark.slow),
    pytest.param("simpo", 0.0, 0.0, marks=pytest.mark.slow), ("alphapo", 0.25, 0.0),
    pytest.param("sigmoid", -0.1, 0.0, marks=pytest.mark.slow)])
def test_cpo_and_alphapo_equal_trl(loss_type, alpha, smoothing, tmp_path):
    from torch_reference import assert_grads_match, jax_grads_by_hf_name, make_reference

    from jaxalign.objectives import CPOParams

    policy_torch = make_reference("llama", tmp_path / "policy", seed=7)
    batch = right_padded_pairs(3, b=4)
    beta = 2.0 if loss_type in ("simpo", "alphapo") else 0.1
    expected = trl_cpo_loss(policy_torch, batch, beta=beta, loss_type=loss_type, cpo_alpha=1.0, alpha=alpha,
                            label_smoothing=smoothing)
    expected.backward()
    params = CPOParams(beta=beta, loss_type=loss_type, alpha=alpha, label_smoothing=smoothing)
    loss, grads = jax_loss_and_grads(load_hf(tmp_path / "policy"), "cpo", batch, params)
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    assert_grads_match(policy_torch, jax_grads_by_hf_name(grads), rtol=1e-4)
