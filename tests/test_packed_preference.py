"""Padding-free preference training: pair-packed rows give the padded batch's losses and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxalign.data import DataPipeline, PipelineConfig
from jaxalign.data.batching import pack_rows, packed_batch, packed_size, pad_batch, shared_prompt_length
from jaxalign.models import LlamaConfig, create_model
from jaxalign.objectives import get_objective, make_params
from jaxalign.train import load_config, train

TINY = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def pairs(n: int, seed: int = 0) -> list[dict]:
    """Pairs with a shared prompt and heavy-tailed completion lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = rng.integers(3, 96, rng.integers(2, 8)).tolist()
        example = {}
        for side in ("chosen", "rejected"):
            completion = rng.integers(3, 96, min(int(rng.pareto(1.5) * 3) + 1, 20)).tolist()
            example[f"{side}_tokens"] = np.asarray(prompt + completion, np.int32)
            example[f"{side}_loss_mask"] = np.asarray([0] * len(prompt) + [1] * len(completion), np.int8)
        out.append(example)
    return out


def loss_and_grads(name, batch, model, reference, **params):
    objective = get_objective(name)
    graphdef, state = nnx.split(model)

    def loss(state):
        return objective.fn(nnx.merge(graphdef, state), batch, make_params(name, params), reference=reference)

    (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(state)
    return value, metrics, grads


@pytest.mark.parametrize(("name", "params"), [("dpo", {}), ("dpo", {"loss_type": "ipo"}), ("simpo", {}),
                                              ("orpo", {}), ("dpo", {"logps_chunk_size": 8}),
                                              ("dpo", {"ld_alpha": 0.4, "use_weighting": True}),
                                              ("orpo", {"nll": "trl"}),
                                              ("dpo", {"loss_type": "sigmoid_norm,sft,aot", "logps_chunk_size": 8})])
def test_packed_equals_padded(name, params):
    examples = pairs(12)
    model, reference = create_model(TINY, seed=1), create_model(TINY, seed=2)
    length = max(max(len(e["chosen_tokens"]), len(e["rejected_tokens"])) for e in examples)
    padded = {k: jnp.asarray(v) for k, v in pad_batch(examples, "preference", length, 0).items()}
    rows = pack_rows(examples, 48, pairs=True)
    packed = {k: jnp.asarray(v) for k, v in packed_batch(examples, rows, 48, 0, pairs=True,
                                                        max_pairs_per_row=6).items()}
    assert len(rows) < len(examples)  # several pairs share a row
    padded_out = loss_and_grads(name, padded, model, reference if name == "dpo" else None, **params)
    packed_out = loss_and_grads(name, packed, model, reference if name == "dpo" else None, **params)
    np.testing.assert_allclose(packed_out[0], padded_out[0], rtol=1e-5, atol=1e-6)
    for key in ("rewards/accuracy", "len/chosen"):
        if key in padded_out[1]:
            assert float(packed_out[1][key].value) == pytest.approx(float(padded_out[1][key].value), rel=1e-5)
    for a, b in zip(jax.tree.leaves(packed_out[2]), jax.tree.leaves(padded_out[2]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def shared_pairs(n: int, seed: int = 0) -> list[dict]:
    """``pairs`` plus the cases a shared prefix must handle: completions that begin alike (the shared part stops
    at the first trained token), a pair with no prompt (nothing to share) and a prompt-heavy pair."""
    out = pairs(n, seed)
    out[1]["rejected_tokens"][len(out[1]["rejected_tokens"]) - np.count_nonzero(out[1]["rejected_loss_mask"])] = \
        out[1]["chosen_tokens"][len(out[1]["chosen_tokens"]) - np.count_nonzero(out[1]["chosen_loss_mask"])]
    for side in ("chosen", "rejected"):
        out[2][f"{side}_tokens"] = out[2][f"{side}_tokens"][np.asarray(out[2][f"{side}_loss_mask"], bool)]
        out[2][f"{side}_loss_mask"] = np.ones(len(out[2][f"{side}_tokens"]), np.int8)
    prompt = np.arange(3, 27, dtype=np.int32)
    for side, completion in (("chosen", [40, 41]), ("rejected", [50, 51, 52])):
        out[3][f"{side}_tokens"] = np.concatenate([prompt, completion]).astype(np.int32)
        out[3][f"{side}_loss_mask"] = np.asarray([0] * len(prompt) + [1] * len(completion), np.int8)
    return out


def test_shared_prefix_rows_hold_each_prompt_once():
    examples = shared_pairs(6)
    assert [shared_prompt_length(e) for e in examples[:4]] == [
        int(np.argmax(examples[0]["chosen_loss_mask"])), int(np.argmax(examples[1]["chosen_loss_mask"])), 0, 24]
    rows = pack_rows(examples, 64, pairs=True, shared_prefix=True)
    batch = packed_batch(examples, rows, 64, 0, pairs=True, max_pairs_per_row=4, shared_prefix=True)
    unshared = pack_rows(examples, 64, pairs=True)
    assert sum(batch["attention_mask"].sum(axis=1)) == sum(
        len(e["chosen_tokens"]) + len(e["rejected_tokens"]) - shared_prompt_length(e) for e in examples)
    assert len(rows) <= len(unshared)
    for r, row in enumerate(rows):  # each sequence reads back from its prompt and its completion's segment
        for k, index in enumerate(row):
            example = examples[index]
            for side, segment in (("chosen", 2 * k + 1), ("rejected", 2 * k + 2)):
                where = np.flatnonzero(batch["segment_ids"][r] == segment)
                prompt = np.flatnonzero(batch["segment_ids"][r] == batch["prefix_ids"][r, where[0]]) \
                    if batch["prefix_ids"][r, where[0]] else np.zeros(0, int)
                full = np.concatenate([prompt, where])
                np.testing.assert_array_equal(batch["tokens"][r, full], example[f"{side}_tokens"])
                np.testing.assert_array_equal(batch["positions"][r, full], np.arange(len(full)))
                np.testing.assert_array_equal(batch["predictor_index"][r, full[1:]], full[:-1])
                trained = np.asarray(example[f"{side}_loss_mask"], bool)
                trained[0] = False
                np.testing.assert_array_equal(batch["loss_mask"][r, full], trained)


@pytest.mark.parametrize(("name", "params", "window"), [("dpo", {"ld_alpha": 0.4, "use_weighting": True}, 0),
                                                        ("dpo", {"loss_type": "ipo", "logps_chunk_size": 8}, 0),
                                                        ("simpo", {}, 0), ("orpo", {"nll": "trl"}, 0),
                                                        ("dpo", {}, 5)])
def test_shared_prefix_equals_padded(name, params, window):
    """A pair's prompt computed once, its completions attending to it: the padded batch's losses and gradients.
    ``window``: a sliding window shorter than the pairs, which must count positions, not slots, in shared rows."""
    examples = shared_pairs(12, seed=4)
    config = TINY.replace(sliding_window=window)
    model, reference = create_model(config, seed=1), create_model(config, seed=2)
    length = max(max(len(e["chosen_tokens"]), len(e["rejected_tokens"])) for e in examples)
    padded = {k: jnp.asarray(v) for k, v in pad_batch(examples, "preference", length, 0).items()}
    rows = pack_rows(examples, 64, pairs=True, shared_prefix=True)
    shared = {k: jnp.asarray(v) for k, v in packed_batch(examples, rows, 64, 0, pairs=True, max_pairs_per_row=6,
                                                        shared_prefix=True).items()}
    padded_out = loss_and_grads(name, padded, model, reference if name == "dpo" else None, **params)
    shared_out = loss_and_grads(name, shared, model, reference if name == "dpo" else None, **params)
    np.testing.assert_allclose(shared_out[0], padded_out[0], rtol=1e-5, atol=1e-6)
    for key in ("rewards/accuracy", "rewards/margins", "len/chosen", "nll_loss"):
        if key in padded_out[1]:
            assert float(shared_out[1][key].value) == pytest.approx(float(padded_out[1][key].value), rel=1e-5)
    for a, b in zip(jax.tree.leaves(shared_out[2]), jax.tree.leaves(padded_out[2]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_shared_prefix_without_packing_is_one_pair_per_bucketed_row():
    """``shared_prefix`` without packing: each pair its own row ``[prompt, chosen, rejected]``, padded to the
    smallest bucket that holds the batch's longest such row; the DPO loss and gradients equal the padded batch's."""
    examples = shared_pairs(8, seed=5)
    pipeline = DataPipeline([examples], "preference", PipelineConfig(batch_size=8, shuffle=False,
                                                                     shared_prefix=True))
    batch = next(pipeline)
    sizes = [packed_size(e, pairs=True, shared_prefix=True) for e in examples]
    assert pipeline.buckets[-1] == max(sizes) and batch["tokens"].shape == (8, max(sizes))
    np.testing.assert_array_equal(batch["pair_mask"], np.ones((8, 1)))
    np.testing.assert_array_equal(batch["attention_mask"].sum(1), sizes)
    model, reference = create_model(TINY, seed=1), create_model(TINY, seed=2)
    length = max(max(len(e["chosen_tokens"]), len(e["rejected_tokens"])) for e in examples)
    padded = {k: jnp.asarray(v) for k, v in pad_batch(examples, "preference", length, 0).items()}
    shared = {k: jnp.asarray(v) for k, v in batch.items()}
    a = loss_and_grads("dpo", padded, model, reference)
    b = loss_and_grads("dpo", shared, model, reference)
    np.testing.assert_allclose(b[0], a[0], rtol=1e-5, atol=1e-6)
    for x, y in zip(jax.tree.leaves(b[2]), jax.tree.leaves(a[2]), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)
    stepped = DataPipeline([examples], "preference", PipelineConfig(batch_size=4, shuffle=False, shared_prefix=True,
                                                                    bucket_step=8))
    assert stepped.buckets == (*range(8, max(sizes), 8), max(sizes))
    for rows in (sizes[:4], sizes[4:]):
        assert next(stepped)["tokens"].shape[1] == min(-(-max(rows) // 8) * 8, max(sizes))
    with pytest.raises(ValueError, match="longest shared-prefix pair row has"):
        DataPipeline([examples], "preference", PipelineConfig(batch_size=8, shared_prefix=True, buckets=(16,)))
    with pytest.raises(ValueError, match="needs preference data, not 'sft'"):
        DataPipeline([[{"tokens": np.ones(4, np.int32), "loss_mask": np.ones(4, np.int8)}]], "sft",
                     PipelineConfig(batch_size=1, shared_prefix=True))


@pytest.mark.slow
def test_packed_precomputed_reference_equals_padded():
    examples = pairs(10, seed=3)
    rng = np.random.default_rng(0)
    for example in examples:
        example["ref_chosen_logps"], example["ref_rejected_logps"] = rng.normal(-20, 5, 2).astype(np.float32)
    model = create_model(TINY, seed=1)
    length = max(max(len(e["chosen_tokens"]), len(e["rejected_tokens"])) for e in examples)
    padded = pad_batch(examples, "preference", length, 0)
    rows = pack_rows(examples, 40, pairs=True)
    packed = packed_batch(examples, rows, 40, 0, pairs=True, max_pairs_per_row=8)
    assert packed["ref_chosen_logps"].shape == (len(rows), 8)
    a = loss_and_grads("dpo", {k: jnp.asarray(v) for k, v in padded.items()}, model, None)
    b = loss_and_grads("dpo", {k: jnp.asarray(v) for k, v in packed.items()}, model, None)
    np.testing.assert_allclose(b[0], a[0], rtol=1e-5)


@pytest.mark.parametrize(("packing", "shared_prefix"), [(True, False), (True, True), (False, True)])
def test_packed_dpo_trains_end_to_end(tmp_path, packing, shared_prefix):
    common = ["--config.model.shape.hidden_size=32", "--config.model.shape.intermediate_size=64",
              "--config.model.shape.num_layers=1", "--config.model.shape.num_heads=2",
              "--config.model.shape.num_kv_heads=1", "--config.data.toy_size=200", "--config.data.toy_eval_size=16",
              "--config.data.max_length=48", "--config.train.steps=4", "--config.eval.generate=0",
              "--config.logging.tensorboard=False", "--config.logging.plot=False", "--config.train.batch_size=8",
              f"--config.data.packing={packing}", "--config.data.row_length=128",
              f"--config.data.shared_prefix={shared_prefix}"]
    summary = train(load_config("dpo", [*common, f"--config.workdir={tmp_path / 'run'}"]))
    assert summary["step"] == 4 and summary["final_eval"]["loss"] > 0
