"""KTO: unpaired data, the mismatched KL sequences, and the loss against a PyTorch restatement of TRL 1.16's
``KTOTrainer._compute_loss`` on transformers models."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxalign import losses
from jaxalign.data.batching import kl_rows, pad_batch
from jaxalign.data.dataset import DataError, load_examples
from jaxalign.models import load_hf
from jaxalign.objectives import KTOParams, get_objective

torch = pytest.importorskip("torch")
F = torch.nn.functional


def unpaired_examples(seed=0, n=6, vocab=128, t=14):
    rng = np.random.RandomState(seed)
    out = []
    for i in range(n):
        prompt = rng.randint(3, vocab, 2 + i % 3)
        completion = rng.randint(3, vocab, rng.randint(2, t - len(prompt) - 4))
        tokens = np.concatenate([prompt, completion]).astype(np.int32)
        mask = np.concatenate([np.zeros(len(prompt)), np.ones(len(completion))]).astype(np.int8)
        out.append({"tokens": tokens, "loss_mask": mask, "label": np.int8(i % 3 != 1)})
    return out


def test_kl_rows_pair_each_prompt_with_the_previous_completion():
    examples = unpaired_examples()
    rows = kl_rows(examples, 16, 0)
    for i, example in enumerate(examples):
        prev = examples[i - 1]
        p, c = int(np.flatnonzero(example["loss_mask"])[0]), int(np.flatnonzero(prev["loss_mask"])[0])
        expected = np.concatenate([example["tokens"][:p], prev["tokens"][c:]])
        n = len(expected)
        np.testing.assert_array_equal(rows["kl_tokens"][i, :n], expected)
        assert rows["kl_attention_mask"][i].sum() == n
        np.testing.assert_array_equal(rows["kl_loss_mask"][i, :n], np.r_[np.zeros(p), np.ones(n - p)])
    assert kl_rows(examples, 5, 0)["kl_tokens"].shape == (6, 5)  # cut to the batch's length


# ------------------------------------------------------------------------------ TRL 1.16, restated in PyTorch
def trl_completion_logps(model, ids, attention, completion_mask):
    labels = ids.masked_fill(completion_mask == 0, -100)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    shifted = labels[:, 1:].clone()
    keep = shifted != -100
    shifted[~keep] = 0
    per_token = torch.gather(logits.log_softmax(-1), 2, shifted.unsqueeze(2)).squeeze(2) * keep
    return per_token.sum(-1)


def trl_kto_loss(policy, reference, batch, *, beta, desirable_weight, undesirable_weight, loss_type):
    """``KTOTrainer._compute_loss`` (one process): KL log-probs of the mismatched sequences under no_grad for the
    policy, the reference on both, ``kl = (KL_logps − ref_KL_logps).mean().clamp(min=0)``, the per-label losses
    concatenated (desirable first) and ``nanmean``."""
    t = {k: torch.tensor(v).long() for k, v in batch.items()}
    calculate_kl = loss_type != "apo_zero_unpaired"
    if calculate_kl:
        with torch.no_grad():
            kl_logps = trl_completion_logps(policy, t["kl_tokens"], t["kl_attention_mask"], t["kl_loss_mask"])
    completion_logps = trl_completion_logps(policy, t["tokens"], t["attention_mask"], t["loss_mask"])
    bool_labels = t["label"].bool()
    chosen_idx = torch.nonzero(bool_labels, as_tuple=False).view(-1)
    rejected_idx = torch.nonzero(~bool_labels, as_tuple=False).view(-1)
    chosen_logps = completion_logps.index_select(0, chosen_idx)
    rejected_logps = completion_logps.index_select(0, rejected_idx)
    with torch.no_grad():
        ref_kl_logps = trl_completion_logps(reference, t["kl_tokens"], t["kl_attention_mask"], t["kl_loss_mask"])
        ref_completion_logps = trl_completion_logps(reference, t["tokens"], t["attention_mask"], t["loss_mask"])
    ref_chosen_logps = ref_completion_logps.index_select(0, chosen_idx)
    ref_rejected_logps = ref_completion_logps.index_select(0, rejected_idx)
    kl = (kl_logps - ref_kl_logps).mean().detach().clamp(min=0) if calculate_kl else torch.zeros(1)
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    if loss_type == "kto":
        chosen_losses = 1 - F.sigmoid(beta * (chosen_logratios - kl))
        rejected_losses = 1 - F.sigmoid(beta * (kl - rejected_logratios))
    else:
        chosen_losses = 1 - F.sigmoid(beta * chosen_logratios)
        rejected_losses = F.sigmoid(beta * rejected_logratios)
    losses_ = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)
    return losses_.nanmean(), kl


@pytest.mark.parametrize(("loss_type", "weights", "beta"), [
    pytest.param("kto", (1.0, 1.0), 0.1, marks=pytest.mark.slow), ("kto", (1.33, 0.7), 0.5),
    pytest.param("apo_zero_unpaired", (1.0, 1.0), 0.3, marks=pytest.mark.slow)])
def test_kto_equals_trl_on_transformers_models(loss_type, weights, beta, tmp_path):
    from torch_reference import assert_grads_match, jax_grads_by_hf_name, make_reference

    policy_torch = make_reference("llama", tmp_path / "policy", seed=11)
    reference_torch = make_reference("llama", tmp_path / "reference", seed=12)
    with torch.no_grad():  # a policy that has moved from its reference, so the KL point is not clamped to 0
        for p_pol, p_ref in zip(policy_torch.parameters(), reference_torch.parameters(), strict=True):
            p_pol.copy_(p_ref + 0.02 * torch.randn_like(p_ref))
    policy_torch.save_pretrained(str(tmp_path / "policy"))
    batch = pad_batch(unpaired_examples(1), "unpaired", 16, 0)
    expected, kl = trl_kto_loss(policy_torch, reference_torch, batch, beta=beta, desirable_weight=weights[0],
                                undesirable_weight=weights[1], loss_type=loss_type)
    expected.backward()

    model, reference = load_hf(tmp_path / "policy"), load_hf(tmp_path / "reference")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    hparams = KTOParams(beta=beta, desirable_weight=weights[0], undesirable_weight=weights[1], loss_type=loss_type)
    jbatch = {k: jnp.asarray(v) for k, v in batch.items()}

    def loss_fn(p):
        loss, metrics = get_objective("kto").fn(nnx.merge(graphdef, p, rest), jbatch, hparams, reference=reference)
        return loss, metrics

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    assert float(loss) == pytest.approx(expected.item(), rel=1e-5)
    assert float(metrics["kl"].value) == pytest.approx(float(kl), rel=1e-4, abs=1e-7)
    if loss_type == "kto":
        assert float(kl) > 0  # the reference point is really exercised
    assert_grads_match(policy_torch, jax_grads_by_hf_name(grads), rtol=1e-4)


def test_kto_loss_function_and_errors():
    policy, ref = jnp.array([-3.0, -5.0, -2.0]), jnp.array([-4.0, -4.0, -2.5])
    loss, parts = losses.kto(policy, ref, jnp.array([1, 0, 1]), 0.2, beta=0.5, undesirable_weight=2.0)
    sig = jax.nn.sigmoid
    np.testing.assert_allclose(loss, [1 - sig(0.5 * (1 - 0.2)), 2 * (1 - sig(0.5 * (0.2 + 1))),
                                      1 - sig(0.5 * (0.5 - 0.2))], rtol=1e-6)
    np.testing.assert_allclose(parts["rewards"], [0.5, -0.5, 0.25])
    assert float(losses.kto_kl(jnp.array([-1.0, -2.0]), jnp.array([0.0, 0.0]))) == 0.0  # clamped at 0
    assert float(losses.kto_kl(jnp.array([1.0, 3.0, 9.0]), jnp.zeros(3), valid=jnp.array([1, 1, 0]))) == 2.0
    with pytest.raises(ValueError, match="loss_type"):
        KTOParams(loss_type="bco")
    with pytest.raises(ValueError, match="needs a reference"):
        get_objective("kto").fn(None, {}, KTOParams())


# ------------------------------------------------------------------------------------------------- data
def test_unpaired_records_and_preference_pairs_load(tmp_path):
    from jaxalign.data import TokenizeConfig, Tokenizer
    from jaxalign.data.toy import toy_tokenizer

    tok = Tokenizer(toy_tokenizer(), TokenizeConfig(max_length=128))
    rows = [{"prompt": "What is 2+2?", "completion": " 4", "label": True},
            {"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": "Yo"}],
             "label": False},
            {"prompt": "Capital of France?", "chosen": " Paris", "rejected": " Rome"}]
    path = tmp_path / "kto.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    examples, report = load_examples(path, tok, kind="unpaired")
    assert report.valid == 3 and [int(e["label"]) for e in examples] == [1, 0, 1, 0]
    assert tok.hf.decode(examples[3]["tokens"][examples[3]["loss_mask"] > 0]).startswith(" Rome")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "completion": "b", "label": "yes"}) + "\n"
                   + json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    with pytest.raises(DataError) as err:
        load_examples(bad, tok, kind="unpaired")
    assert "record 0, field 'label': expected true (desirable) or false" in str(err.value)
    assert "record 1, field 'label': missing" in str(err.value)
    # an SFT objective refuses undesirable completions instead of training on them
    with pytest.raises(DataError, match="record 1, field 'label': false"):
        load_examples(path, tok, kind="sft")


def test_config_refuses_a_precomputed_reference_and_single_example_micro_batches():
    from jaxalign.train import ConfigError, load_config, validate

    with pytest.raises(ConfigError, match="cannot serve KTO"):
        validate(load_config("kto", ["--config.reference.kind=precomputed"]))
    with pytest.raises(ConfigError, match="at least 2 examples per micro-batch"):
        validate(load_config("kto", ["--config.train.batch_size=4", "--config.train.grad_accum=4"]))
    single = ["--config.train.batch_size=4", "--config.train.grad_accum=4", "--config.mesh.data=1",
              "--config.mesh.fsdp=1", "--config.objective.params.loss_type=apo_zero_unpaired"]
    validate(load_config("kto", single), num_devices=1)
