"""Batching and order: packing invariants, exact resume with shuffling per host, mixtures, buckets."""

import numpy as np
import pytest

from jaxalign.data import DataPipeline, PipelineConfig, TokenizeConfig, Tokenizer, load_examples
from jaxalign.data.toy import arithmetic, arithmetic_preferences, mpo_records, multitask, toy_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(toy_tokenizer(), TokenizeConfig(max_length=96))


@pytest.fixture(scope="module")
def sft_examples(tok, tmp_path_factory):
    path = write_jsonl(arithmetic(60, seed=1, style="mixed"), tmp_path_factory.mktemp("d") / "a.jsonl")
    return load_examples(path, tok, kind="sft")[0]


@pytest.fixture(scope="module")
def pair_examples(tok, tmp_path_factory):
    path = write_jsonl(arithmetic_preferences(40, seed=1), tmp_path_factory.mktemp("d") / "p.jsonl")
    return load_examples(path, tok, kind="preference")[0]


def test_padding_buckets(sft_examples):
    pipeline = DataPipeline([sft_examples], "sft", PipelineConfig(batch_size=4, seed=0, buckets=(32, 48, 64, 96)))
    for _ in range(10):
        batch = next(pipeline)
        width = batch["tokens"].shape[1]
        assert width in (32, 48, 64, 96)
        lengths = batch["attention_mask"].sum(1)
        assert lengths.max() <= width and (width == 32 or lengths.max() > {48: 32, 64: 48, 96: 64}[width])
        assert (batch["loss_mask"] <= batch["attention_mask"]).all()


def test_packing_keeps_every_token_once(sft_examples):
    pipeline = DataPipeline([sft_examples], "sft", PipelineConfig(batch_size=2, seed=3, packing=True,
                                                                 row_length=160))
    order = pipeline.epoch_order(0)
    seen = []
    for _ in range(pipeline.steps_per_epoch):
        batch = next(pipeline)
        for row in range(2):
            segments = batch["segment_ids"][row]
            for segment in range(1, segments.max() + 1):
                where = segments == segment
                seen.append(batch["tokens"][row][where])
                np.testing.assert_array_equal(batch["positions"][row][where], np.arange(where.sum()))
                assert batch["loss_mask"][row][where][0] == 0  # nothing in the segment predicts its first token
            assert (batch["attention_mask"][row] == (segments > 0)).all()
    packed_rows = pipeline._epoch_units(0)
    n_examples_used = sum(len(r) for r in packed_rows[: pipeline.steps_per_epoch * 2])
    expected = [sft_examples[i]["tokens"] for i in order[:n_examples_used]]
    assert len(seen) == n_examples_used
    for got, want in zip(seen, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_pair_aware_packing_recovers_pairs(pair_examples):
    pipeline = DataPipeline([pair_examples], "preference",
                            PipelineConfig(batch_size=2, seed=5, packing=True, row_length=200, max_pairs_per_row=4))
    order = iter(pipeline.epoch_order(0))
    for _ in range(pipeline.steps_per_epoch):
        batch = next(pipeline)
        for row in range(2):
            segments = batch["segment_ids"][row]
            for k in np.flatnonzero(batch["pair_mask"][row]):
                example = pair_examples[next(order)]
                np.testing.assert_array_equal(batch["tokens"][row][segments == 2 * k + 1], example["chosen_tokens"])
                np.testing.assert_array_equal(batch["tokens"][row][segments == 2 * k + 2], example["rejected_tokens"])
            assert batch["pair_mask"][row].sum() * 2 == segments.max()


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("hosts", [1, 2])
def test_resume_gives_the_uninterrupted_batches(sft_examples, packing, hosts):
    config = PipelineConfig(batch_size=4, seed=11, shuffle=True, packing=packing, row_length=160)
    for host in range(hosts):
        reference = DataPipeline([sft_examples], "sft", config, num_hosts=hosts, host_index=host)
        uninterrupted = [next(reference) for _ in range(40)]  # crosses epoch boundaries
        first = DataPipeline([sft_examples], "sft", config, num_hosts=hosts, host_index=host)
        for _ in range(17):
            next(first)
        saved = dict(first.state())
        resumed = DataPipeline([sft_examples], "sft", config, num_hosts=hosts, host_index=host)
        resumed.restore(saved)
        for expected in uninterrupted[17:]:
            got = next(resumed)
            assert got.keys() == expected.keys()
            for name in got:
                np.testing.assert_array_equal(got[name], expected[name])
    assert uninterrupted[0]["tokens"].shape[0] == 4 // hosts


def test_hosts_split_one_global_batch(sft_examples):
    config = PipelineConfig(batch_size=4, seed=2)
    whole = next(DataPipeline([sft_examples], "sft", config))
    halves = [next(DataPipeline([sft_examples], "sft", config, num_hosts=2, host_index=h)) for h in range(2)]
    np.testing.assert_array_equal(np.concatenate([h["tokens"] for h in halves]), whole["tokens"])


def test_order_is_seeded_and_epochs_differ(sft_examples):
    a = DataPipeline([sft_examples], "sft", PipelineConfig(batch_size=4, seed=1))
    b = DataPipeline([sft_examples], "sft", PipelineConfig(batch_size=4, seed=2))
    assert sorted(a.epoch_order(0)) == list(range(60))
    assert list(a.epoch_order(0)) != list(b.epoch_order(0)) and list(a.epoch_order(0)) != list(a.epoch_order(1))
    plain = DataPipeline([sft_examples], "sft", PipelineConfig(batch_size=4, shuffle=False))
    assert list(plain.epoch_order(0)) == list(range(60))


def test_mixture_weights(tok, sft_examples, tmp_path):
    other = load_examples(write_jsonl(multitask(20, seed=1), tmp_path / "m.jsonl"), tok, kind="sft")[0]
    pipeline = DataPipeline([sft_examples, other], "sft", PipelineConfig(batch_size=4, weights=(1.0, 3.0)))
    order = pipeline.epoch_order(0)
    from_other = int((order >= 60).sum())
    assert len(order) == 80 and from_other == 60  # 3/4 of the epoch, cycling the 20 multitask examples
    assert np.bincount(order[order >= 60] - 60).tolist() == [3] * 20


def test_restore_refuses_a_different_dataset(sft_examples):
    pipeline = DataPipeline([sft_examples], "sft", PipelineConfig(batch_size=4))
    state = pipeline.state()
    smaller = DataPipeline([sft_examples[:40]], "sft", PipelineConfig(batch_size=4))
    with pytest.raises(ValueError, match="num_examples was 60, now 40"):
        smaller.restore(state)


def test_mpo_batches(tok, tmp_path):
    examples = load_examples(write_jsonl(mpo_records(8), tmp_path / "mpo.jsonl"), tok, kind="mpo")[0]
    batch = next(DataPipeline([examples], "mpo", PipelineConfig(batch_size=4)))
    for prefix in ("target_", "dominant_"):
        for side in ("chosen", "rejected"):
            assert batch[f"{prefix}{side}_tokens"].shape == batch[f"{prefix}{side}_loss_mask"].shape
    with pytest.raises(ValueError, match="packing is available"):
        DataPipeline([examples], "mpo", PipelineConfig(batch_size=4, packing=True, row_length=64))


@pytest.mark.slow  # end to end; the default suite keeps its parts
def test_pipeline_batches_feed_the_objectives(tok, sft_examples, pair_examples, tmp_path):
    import jax.numpy as jnp

    from jaxalign.models import LlamaConfig, create_model
    from jaxalign.objectives import get_objective, make_params

    model = create_model(LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=1,
                                     num_heads=2, num_kv_heads=1), seed=0)
    mpo = load_examples(write_jsonl(mpo_records(4), tmp_path / "mpo.jsonl"), tok, kind="mpo")[0]
    cases = [("sft", [sft_examples], {}), ("ift", [sft_examples], {}), ("dpo", [pair_examples], {"reference": model}),
             ("orpo", [pair_examples], {}), ("mpo", [mpo], {"reference": model})]
    for name, sources, kwargs in cases:
        kind = {"sft": "sft", "ift": "sft", "mpo": "mpo"}.get(name, "preference")
        batch = next(DataPipeline(sources, kind, PipelineConfig(batch_size=4)))
        loss, metrics = get_objective(name).fn(model, {k: jnp.asarray(v) for k, v in batch.items()},
                                               make_params(name), **kwargs)
        assert np.isfinite(float(loss)) and float(metrics["loss"].count) > 0, name
    packed = next(DataPipeline([sft_examples], "sft", PipelineConfig(batch_size=2, packing=True, row_length=160)))
    loss, _ = get_objective("sft").fn(model, {k: jnp.asarray(v) for k, v in packed.items()}, make_params("sft"))
    assert np.isfinite(float(loss))


def test_toy_generators_are_deterministic_and_correct():
    from jaxalign.data.toy import encipher

    assert arithmetic(5, seed=3) == arithmetic(5, seed=3) and arithmetic(5, seed=3) != arithmetic(5, seed=4)
    for record in arithmetic(50, seed=0, style="verbose"):
        question = record["messages"][0]["content"]
        a, op, b = question.removeprefix("What is ").removesuffix("?").split()
        assert int(record["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert record["messages"][1]["content"].endswith(f"The answer is {record['answer']}.")
    for record in arithmetic_preferences(20):
        assert record["chosen"][0]["content"] == record["answer"] != record["rejected"][0]["content"]
    record = mpo_records(1)[0]
    assert record["target_chosen"]["value"] == encipher(record["source_chosen"]["value"])
    assert encipher("abc 12") != "abc 12" and encipher("abc 12").endswith(" 12")
    tasks = [r["task"] for r in multitask(8)]
    assert tasks == ["add", "sub", "reverse", "copy"] * 2
    reverse = multitask(4)[2]
    assert reverse["answer"] == reverse["messages"][0]["content"].split()[1].rstrip(".")[::-1]
