"""Objectives on tiny models: TRL golden values, IFT invariants, references, accumulation, padding."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxalign import losses, objectives
from jaxalign.models import create_model, load_hf
from jaxalign.objectives import DistillParams, DPOParams, IFTParams, MPOParams, SFTParams, get_objective, make_params

ASSETS = Path(__file__).parent / "assets"


@pytest.fixture(scope="module")
def model(tiny_config):
    return create_model(tiny_config, seed=21)


def sft_batch(side="right", seed=0, b=4, t=10, vocab=128):
    """Prompt of 3-5 tokens then a completion; padding on ``side``."""
    rng = np.random.RandomState(seed)
    tokens = np.zeros((b, t), np.int32)
    attention = np.zeros((b, t), np.int32)
    loss_mask = np.zeros((b, t), np.int32)
    for row in range(b):
        length = t - row
        prompt = 3 + row % 3
        start = 0 if side == "right" else t - length
        tokens[row, start:start + length] = rng.randint(3, vocab, length)
        attention[row, start:start + length] = 1
        loss_mask[row, start + prompt:start + length] = 1
    return {"tokens": tokens, "attention_mask": attention, "loss_mask": loss_mask}


def pair_batch(seed=0, prefix=""):
    chosen, rejected = sft_batch(seed=seed), sft_batch(seed=seed + 100)
    rejected["tokens"][:, :3] = chosen["tokens"][:, :3]  # shared prompt start
    return {f"{prefix}{side}_{k}": v for side, part in (("chosen", chosen), ("rejected", rejected))
            for k, v in part.items()}


def run(name, model, batch, hparams=None, **kwargs):
    fn = get_objective(name).fn
    hparams = hparams if hparams is not None else make_params(name)
    return fn(model, {k: jnp.asarray(v) for k, v in batch.items()}, hparams, **kwargs)


# --------------------------------------------------------------------------------------- TRL golden
@pytest.mark.parametrize("variant", ["sigmoid_0.0", "ipo_0.0", "hinge_0.0", "robust_0.1"])
def test_dpo_reproduces_trl_first_step(variant):
    golden = json.loads((ASSETS / "trl_dpo_golden.json").read_text())
    expected = golden["variants"][variant]
    policy, reference = load_hf(ASSETS / "trl_dpo_policy"), load_hf(ASSETS / "trl_dpo_reference")
    ids, attention, completion = (np.array(golden["batch"][k]) for k in ("input_ids", "attention_mask",
                                                                         "completion_mask"))
    half = len(ids) // 2
    batch = {}
    for side, rows in (("chosen", slice(0, half)), ("rejected", slice(half, None))):
        batch.update({f"{side}_tokens": ids[rows], f"{side}_attention_mask": attention[rows],
                      f"{side}_loss_mask": completion[rows]})
    hparams = DPOParams(beta=golden["beta"], loss_type=expected["loss_type"],
                        label_smoothing=expected["label_smoothing"])
    loss, metrics = jax.jit(lambda p, r, b: run("dpo", p, b, hparams, reference=r))(policy, reference, batch)
    assert abs(float(loss) - expected["loss"]) <= 1e-4
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                 "logps/rejected"):
        assert abs(float(metrics[name].value) - expected[name]) <= 1e-4, name


# ------------------------------------------------------------------------------------------------- DPO
def test_dpo_reference_sources_agree(model, tiny_config):
    batch = pair_batch()
    at_self, metrics = run("dpo", model, batch, reference=model)
    np.testing.assert_allclose(at_self, np.log(2), rtol=1e-6)
    other = create_model(tiny_config, seed=5)
    with_model, _ = run("dpo", model, batch, reference=other)
    chosen, rejected, _, _ = objectives.preference.pair_logps(other, {k: jnp.asarray(v) for k, v in batch.items()},
                                                              "dpo")
    precomputed, _ = run("dpo", model, {**batch, "ref_chosen_logps": chosen, "ref_rejected_logps": rejected})
    np.testing.assert_allclose(precomputed, with_model, rtol=1e-6)
    free, _ = run("dpo", model, batch, DPOParams(reference_free=True))
    zeros = {"ref_chosen_logps": np.zeros(4, np.float32), "ref_rejected_logps": np.zeros(4, np.float32)}
    np.testing.assert_allclose(free, run("dpo", model, {**batch, **zeros})[0], rtol=1e-6)
    assert float(metrics["len/chosen"].value) == pytest.approx(batch["chosen_loss_mask"][:, 1:].sum() / 4)
    with pytest.raises(ValueError, match="needs a reference"):
        run("dpo", model, batch)
    with pytest.raises(KeyError, match="rejected_tokens"):
        run("simpo", model, {k: v for k, v in batch.items() if k != "rejected_tokens"})


@pytest.mark.parametrize("name", ["sft", "ift", "dpo", "simpo", "orpo"])
def test_left_and_right_padding_agree(model, name):
    def build(side):
        if name in ("sft", "ift"):
            return sft_batch(side)
        chosen, rejected = sft_batch(side, 0), sft_batch(side, 100)
        return {f"{s}_{k}": v for s, part in (("chosen", chosen), ("rejected", rejected)) for k, v in part.items()}

    kwargs = {"reference": create_model(model.config, seed=3)} if name == "dpo" else {}
    right, metrics_right = run(name, model, build("right"), **kwargs)
    left, metrics_left = run(name, model, build("left"), **kwargs)
    np.testing.assert_allclose(left, right, rtol=1e-5, atol=1e-6)
    for key in metrics_right:
        np.testing.assert_allclose(metrics_left[key].value, metrics_right[key].value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["sft", "dpo", "ift"])
def test_chunked_logps_objective_equals_plain(model, name):
    batch = sft_batch() if name in ("sft", "ift") else pair_batch()
    params = get_objective(name).params
    kwargs = {"reference": model} if name == "dpo" else {}
    plain_fn = lambda m: run(name, m, batch, params(), **kwargs)[0]
    chunked_fn = lambda m: run(name, m, batch, params(logps_chunk_size=4), **kwargs)[0]
    np.testing.assert_allclose(chunked_fn(model), plain_fn(model), rtol=1e-5)
    grads_plain = nnx.grad(plain_fn)(model)
    grads_chunked = nnx.grad(chunked_fn)(model)
    for a, b in zip(jax.tree.leaves(grads_chunked), jax.tree.leaves(grads_plain), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_automatic_log_prob_path_by_backend_and_size(model, monkeypatch):
    from jaxalign.objectives import common

    # accelerators: the plain path below 2^27 logits, else vocabulary tiles of about 2^24 logits
    assert common.resolve_chunk_size(-1, 8, 2048, 128256, "tpu") == 16384  # Llama-3: blocks of 1024 rows x 2^14
    assert common.resolve_chunk_size(-1, 8, 256, 4096, "gpu") == 0  # 8M logits: the plain path
    # the CPU: the fused path from 2^22 logits, cache-sized blocks x tiles (2^21 logits), 128 to 4096 columns
    assert common.resolve_chunk_size(-1, 16, 452, 50257, "cpu") == 2048
    assert common.resolve_chunk_size(-1, 1, 4, 50257, "cpu") == 0  # 201k logits: the plain path
    assert common.resolve_chunk_size(-1, 1, 128, 50257, "cpu") == 4096
    assert common.resolve_chunk_size(-1, 1, 16384, 300, "cpu") == 300  # at most V
    assert common.resolve_chunk_size(-1, 1, 512, 128256, "cpu") == 4096
    assert common.resolve_chunk_size(-1, 64, 4096, 128256, "cpu") == 2048
    assert common.resolve_chunk_size(0, 8, 2048, 128256) == 0 and common.resolve_chunk_size(64, 1, 8, 8) == 64
    batch = sft_batch()
    plain = run("sft", model, batch, SFTParams(logps_chunk_size=0))[0]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert common.resolve_chunk_size(-1, 4, 10, 128) == 0
    monkeypatch.setattr(common, "AUTO_CHUNK_ELEMENTS", 1)  # force the fused path at this tiny size
    monkeypatch.setattr(common, "AUTO_CHUNK_TARGET", 4 * 10 * 16)
    assert common.resolve_chunk_size(-1, 4, 10, 128) == 128  # never below MIN_TILE columns
    monkeypatch.setattr(common, "MIN_TILE", 16)
    assert common.resolve_chunk_size(-1, 4, 10, 128) == 16
    automatic = run("sft", model, batch, SFTParams())[0]
    np.testing.assert_allclose(automatic, plain, rtol=1e-5)


def test_jit_equals_eager(model):
    batch = {k: jnp.asarray(v) for k, v in pair_batch().items()}
    eager, _ = objectives.OBJECTIVES["orpo"].fn(model, batch, objectives.ORPOParams())
    jitted, _ = jax.jit(lambda m, b: objectives.OBJECTIVES["orpo"].fn(m, b, objectives.ORPOParams()))(model, batch)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6)


# ----------------------------------------------------------------------------------- accumulation
@pytest.mark.parametrize(("name", "hparams"), [("sft", SFTParams()), ("sft", SFTParams(normalization="sequence")),
                                               ("simpo", None), ("ift", IFTParams(gamma=0.9)),
                                               ("ift", IFTParams(gamma=0.9, normalization="token")),
                                               ("distill", DistillParams(beta=0.3)),
                                               ("distill", DistillParams(beta=0.3, logits_block=3))])
def test_micro_batches_sum_to_the_full_batch(model, tiny_config, name, hparams):
    batch = sft_batch() if name in ("sft", "ift", "distill") else pair_batch()
    batch["loss_mask" if name != "simpo" else "chosen_loss_mask"][0, :] = 0  # a row with nothing to train
    extra = {"reference": create_model(tiny_config, seed=4)} if name == "distill" else {}  # the teacher

    def summed(m, part):
        loss, metrics = run(name, m, part, hparams, **extra)
        return loss * metrics["loss"].count, metrics

    full_loss, _ = run(name, model, batch, hparams, **extra)
    halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
    total, count, grads = 0.0, 0.0, None
    for part in halves:
        (value, metrics), grad = nnx.value_and_grad(summed, has_aux=True)(model, part)
        total, count = total + value, count + metrics["loss"].count
        grads = grad if grads is None else jax.tree.map(jnp.add, grads, grad)
    np.testing.assert_allclose(total / count, full_loss, rtol=1e-5)
    full_grads = nnx.grad(lambda m: run(name, m, batch, hparams, **extra)[0])(model)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(full_grads), strict=True):
        # f32 sums in another order: the tolerance follows the leaf's scale (in one CI run on a loaded machine one
        # entry of SimPO's input-table gradient, whose entries reach 1.66, was 1.2e-6 off: over atol 1e-6)
        np.testing.assert_allclose(np.asarray(a) / float(count), b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


# ------------------------------------------------------------------------------------------------- IFT
@pytest.mark.parametrize("normalization", ["sequence", "token"])
@pytest.mark.parametrize("embedding_grad", ["ground_truth", "none"])
def test_ift_without_mixing_or_propagation_is_sft(model, embedding_grad, normalization):
    # under either averaging: the token mean once trained nothing (its numerator was a stopped metric)
    batch = sft_batch()
    ift_params = IFTParams(max_lambda=0.0, gamma=0.0, embedding_grad=embedding_grad, normalization=normalization)
    sft_params = SFTParams(normalization=normalization)
    ift_loss, _ = run("ift", model, batch, ift_params)
    sft_loss, _ = run("sft", model, batch, sft_params)
    assert float(ift_loss) == pytest.approx(float(sft_loss), rel=1e-6)
    ift_grads = nnx.grad(lambda m: run("ift", m, batch, ift_params)[0])(model)
    sft_grads = nnx.grad(lambda m: run("sft", m, batch, sft_params)[0])(model)
    if embedding_grad == "none":  # the official code's frozen input table: everything else is SFT's gradient
        assert float(jnp.abs(ift_grads.embed_tokens[...]).max()) == 0.0
        ift_grads.embed_tokens[...] = sft_grads.embed_tokens[...]
    for a, b in zip(jax.tree.leaves(ift_grads), jax.tree.leaves(sft_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_ift_mixes_only_completion_positions(model):
    batch = {k: jnp.asarray(v) for k, v in sft_batch("left").items()}
    mixed = objectives.mixed_embeddings(model, batch["tokens"], batch["attention_mask"], batch["loss_mask"], 0.5)
    true = model.embed(batch["tokens"])
    untouched = ~batch["loss_mask"].astype(bool)
    np.testing.assert_array_equal(np.asarray(mixed)[untouched], np.asarray(true)[untouched])
    assert np.abs(np.asarray(mixed - true)[~untouched]).max() > 0
    # the first completion token is predicted from prompt positions only, so its loss does not move with λ
    first = np.argmax(np.asarray(batch["loss_mask"]), axis=1)

    def first_token_logps(lam):
        embeds = objectives.mixed_embeddings(model, batch["tokens"], batch["attention_mask"], batch["loss_mask"], lam)
        logps = objectives.common.policy_token_logps(model, batch["tokens"], batch["attention_mask"],
                                                     batch["loss_mask"], inputs_embeds=embeds)
        return np.asarray(logps)[np.arange(4), first]

    np.testing.assert_allclose(first_token_logps(0.7), first_token_logps(0.0), atol=1e-6)


def test_ift_gradient_skips_the_input_embedding_table(model):
    grads = nnx.grad(lambda m: run("ift", m, sft_batch(), IFTParams(max_lambda=0.3))[0])(model)
    assert float(jnp.abs(grads.embed_tokens[...]).max()) == 0.0
    assert float(jnp.abs(grads.lm_head[...]).max()) > 0.0
    # ground_truth: the table's gradient is exactly that of (1-λ)·E[s] with the guess's embedding held constant
    batch = {k: jnp.asarray(v) for k, v in sft_batch().items()}
    lam = 0.3
    guess = objectives.mixed_embeddings(model, batch["tokens"], batch["attention_mask"], batch["loss_mask"], 1.0)

    def with_constant_guess(table):
        true = jnp.take(table, batch["tokens"], axis=0)
        embeds = jnp.where(batch["loss_mask"].astype(bool)[..., None], (1 - lam) * true + lam * guess, true)
        logps = objectives.common.policy_token_logps(model, batch["tokens"], batch["attention_mask"],
                                                     batch["loss_mask"], inputs_embeds=embeds)
        return losses.ift(-logps, batch["loss_mask"], gamma=0.95)[0].mean()

    expected = jax.grad(with_constant_guess)(model.embed_tokens[...])
    params = IFTParams(max_lambda=lam, embedding_grad="ground_truth")
    grads = nnx.grad(lambda m: run("ift", m, sft_batch(), params)[0])(model)
    np.testing.assert_allclose(grads.embed_tokens[...], expected, atol=1e-6)


def test_ift_lambda_schedule():
    linear = IFTParams(max_lambda=0.4, min_lambda=0.1, lambda_schedule="linear", warmup_steps=10)
    np.testing.assert_allclose([objectives.ift_lambda(linear, s) for s in (0, 5, 10, 50)], [0.1, 0.25, 0.4, 0.4],
                               rtol=1e-6)
    noisy = IFTParams(max_lambda=0.2, disturb_std=0.5)
    values = np.array([objectives.ift_lambda(noisy, s, jax.random.key(0)) for s in range(200)])
    assert values.min() >= 0 and values.max() <= 1 and 0.15 < values.mean() < 0.25 and values.std() > 0.05
    with pytest.raises(ValueError, match="rng"):
        objectives.ift_lambda(noisy, 0)
    with pytest.raises(ValueError, match="lambda_schedule"):
        IFTParams(lambda_schedule="cosine")


# ------------------------------------------------------------------------------------------------- MPO
def test_mpo_reference_paths_and_pooling(model, tiny_config):
    batch = {**pair_batch(0, "target_"), **pair_batch(7, "dominant_")}
    reference = create_model(tiny_config, seed=9)
    jbatch = {k: jnp.asarray(v) for k, v in batch.items()}
    for pooling in ("mean", "last", "masked_mean"):
        params = MPOParams(beta=1.5, pooling=pooling)
        with_model, metrics = run("mpo", model, batch, params, reference=reference)
        gap, hidden = objectives.mpo.dominant_pass(reference, jbatch, params, "reference")
        precomputed, _ = run("mpo", model, {**batch, "ref_dominant_gap": gap, "ref_dominant_hidden": hidden}, params)
        np.testing.assert_allclose(precomputed, with_model, rtol=1e-6)
        assert hidden.shape == (4, 2, tiny_config.hidden_size)
        assert float(metrics["mpo/hidden_loss"].value) > 0
    # against itself the preservation term vanishes and the gap term is (β·RG_t − RG_d)²
    _, metrics = run("mpo", model, batch, MPOParams(beta=1.0), reference=model)
    assert float(metrics["mpo/hidden_loss"].value) == pytest.approx(0.0, abs=1e-12)
    no_hidden, metrics = run("mpo", model, {**batch, "ref_dominant_gap": np.zeros(4, np.float32)},
                             MPOParams(preserve_hidden=False))
    assert "mpo/hidden_loss" not in metrics
    target_gap = objectives.preference.pair_logps(model, jbatch, "mpo", prefix="target_")
    gap = np.asarray(target_gap[0] / target_gap[2] - target_gap[1] / target_gap[3])
    np.testing.assert_allclose(no_hidden, np.mean(gap**2), rtol=1e-5)
    np.testing.assert_allclose(metrics["mpo/gap_loss"].value, no_hidden, rtol=1e-6)
    with pytest.raises(ValueError, match="needs a reference"):
        run("mpo", model, batch)


def test_pool_hidden():
    hidden = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
    mask = jnp.array([[1, 1, 1, 0], [0, 1, 1, 1]])
    np.testing.assert_allclose(objectives.pool_hidden(hidden, mask, "last"), hidden[jnp.array([0, 1]),
                                                                                    jnp.array([2, 3])])
    np.testing.assert_allclose(objectives.pool_hidden(hidden, mask, "masked_mean")[0], hidden[0, :3].mean(0))
    np.testing.assert_allclose(objectives.pool_hidden(hidden, mask, "mean"), hidden.mean(1))


def test_registry_and_params_errors():
    assert set(objectives.OBJECTIVES) == {"sft", "dpo", "simpo", "orpo", "cpo", "kto", "reward", "distill", "ift",
                                          "mpo", "grpo"}
    assert make_params("dpo", {"beta": 0.2}).beta == 0.2
    with pytest.raises(ValueError, match=r"no hyper-parameters \['betta'\]"):
        make_params("dpo", {"betta": 0.2})
    with pytest.raises(KeyError, match="unknown objective 'bco'"):
        get_objective("bco")
    with pytest.raises(ValueError, match="label_smoothing"):
        DPOParams(label_smoothing=0.5)
