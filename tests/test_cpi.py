"""CPI-FT building blocks: SLERP, Jaccard grouping, global top-p masks, fusion, frozen optimizer entries."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxalign.cpi import core_mask, freeze, fuse, group_tasks, jaccard, jaccard_matrix, mask_size, slerp
from jaxalign.cpi.masks import path_name
from jaxalign.models import LlamaConfig, create_model


def test_slerp_endpoints_unit_norm_and_fallbacks():
    rng = np.random.RandomState(0)
    a, b = rng.randn(2, 16).astype(np.float32)
    a, b = jnp.asarray(a / np.linalg.norm(a)), jnp.asarray(b / np.linalg.norm(b))
    np.testing.assert_allclose(slerp(a, b, 0.0), a, atol=1e-6)
    np.testing.assert_allclose(slerp(a, b, 1.0), b, atol=1e-6)
    for omega in np.linspace(0, 1, 11):
        assert float(jnp.linalg.norm(slerp(a, b, omega))) == pytest.approx(1.0, abs=1e-5)
    halfway = slerp(a, b, 0.5)  # equal angles to both ends
    assert float(halfway @ a) == pytest.approx(float(halfway @ b), abs=1e-5)
    collinear = slerp(a, 2 * a, 0.25)
    np.testing.assert_allclose(collinear, 1.25 * a, atol=1e-6)  # linear fallback
    zero = slerp(jnp.zeros(16), b, 0.5)
    np.testing.assert_allclose(zero, 0.5 * b, atol=1e-6)
    assert np.isfinite(np.asarray(slerp(a, -a, 0.5))).all()


def test_jaccard_and_grouping_on_hand_made_masks():
    masks = [{"w": jnp.array([1, 1, 0, 0, 0, 0], bool)}, {"w": jnp.array([0, 1, 1, 0, 0, 0], bool)},
             {"w": jnp.array([0, 0, 0, 0, 1, 1], bool)}, {"w": jnp.array([0, 0, 0, 0, 0, 1], bool)}]
    assert jaccard(masks[0], masks[1]) == pytest.approx(1 / 3)
    assert jaccard(masks[0], masks[2]) == 0.0
    similarity = jaccard_matrix(masks)
    np.testing.assert_allclose(np.diag(similarity), 1.0)
    assert group_tasks(similarity, 0.3) == [[0, 1], [2, 3]]
    assert group_tasks(similarity, 0.6) == [[0], [1], [2], [3]]
    assert group_tasks(similarity, 0.0) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("fraction", [0.05, 0.3, 0.77])
def test_global_top_p_equals_brute_force_sort(seed, fraction):
    rng = np.random.RandomState(seed)
    shapes = {"b": {"c": (7,)}, "a": (5, 4), "z": (3, 2, 2)}
    base = jax.tree.map(lambda s: jnp.zeros(s), shapes, is_leaf=lambda x: isinstance(x, tuple))
    tuned = jax.tree.map(lambda s: jnp.asarray(rng.randint(-4, 5, s).astype(np.float32)), shapes,
                         is_leaf=lambda x: isinstance(x, tuple))  # many ties
    mask = core_mask(base, tuned, fraction)
    # brute force: every entry with (path, flat index), sort by |Δ| descending then path and index ascending
    entries = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tuned)[0]:
        for index, value in enumerate(np.abs(np.asarray(leaf)).reshape(-1)):
            entries.append((-value, path_name(path), index))
    k = int(np.floor(fraction * len(entries)))
    expected = {(name, index) for _, name, index in sorted(entries)[:k]}
    got = {(path_name(path), index) for path, leaf in jax.tree_util.tree_flatten_with_path(mask)[0]
           for index in np.flatnonzero(np.asarray(leaf).reshape(-1))}
    assert got == expected and mask_size(mask) == k


def test_excluded_tensors_and_fusion_rules():
    base = {"embed": jnp.zeros(4), "w": jnp.zeros(4)}
    tuned_a = {"embed": jnp.full(4, 9.0), "w": jnp.array([3.0, 0.1, 0.0, 0.0])}
    tuned_b = {"embed": jnp.zeros(4), "w": jnp.array([1.0, 0.0, 2.0, 0.0])}
    mask_a = core_mask(base, tuned_a, 0.25, include=lambda name: name != "embed")
    mask_b = core_mask(base, tuned_b, 0.5, include=lambda name: name != "embed")
    assert not np.asarray(mask_a["embed"]).any()
    np.testing.assert_array_equal(mask_a["w"], [True, False, False, False])
    np.testing.assert_array_equal(mask_b["w"], [True, False, True, False])
    fused = fuse(base, [tuned_a, tuned_b], [mask_a, mask_b])
    # overlap at index 0 goes to the larger update (task a: 3 > 1); index 2 is task b's core
    assert float(fused["w"][0]) == 3.0 and float(fused["w"][2]) == 2.0
    # non-core entries of w: base is zero, so the fold is linear (zero-norm fallback) then SLERP
    assert np.isfinite(np.asarray(fused["embed"])).all()


def test_frozen_entries_stay_bit_identical_under_adamw():
    rng = np.random.RandomState(0)
    params = {"w": jnp.asarray(rng.randn(6, 5).astype(np.float32)), "b": jnp.asarray(rng.randn(5).astype(np.float32))}
    frozen = {"w": jnp.asarray(rng.rand(6, 5) > 0.5), "b": jnp.zeros(5, bool).at[0].set(True)}
    tx = freeze(optax.adamw(1e-2, weight_decay=0.1), frozen)
    state = tx.init(params)
    start = jax.tree.map(np.asarray, params)
    for step in range(50):
        grads = jax.tree.map(lambda p, s=step: jnp.asarray(rng.randn(*p.shape).astype(np.float32)) + s, params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    for name in params:
        now, was, f = np.asarray(params[name]), start[name], np.asarray(frozen[name])
        np.testing.assert_array_equal(now[f], was[f])
        assert (now[~f] != was[~f]).all()


@pytest.mark.slow  # end to end; the default suite keeps its parts
def test_masks_and_fusion_on_a_sharded_model(mesh8):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2)
    plain = [nnx.to_pure_dict(nnx.state(create_model(config, seed=s))) for s in range(3)]
    with jax.set_mesh(mesh8):
        sharded = [nnx.to_pure_dict(nnx.state(create_model(config, seed=s, mesh=mesh8))) for s in range(3)]
        assert len(sharded[1]["layers"][0]["mlp"]["up_proj"].addressable_shards) == 8
        masks = [core_mask(sharded[0], sharded[i], 0.02) for i in (1, 2)]
        fused = fuse(sharded[0], sharded[1:], masks)
    plain_masks = [core_mask(plain[0], plain[i], 0.02) for i in (1, 2)]
    for a, b in zip(jax.tree.leaves(masks), jax.tree.leaves(plain_masks), strict=True):
        np.testing.assert_array_equal(a, b)
    plain_fused = fuse(plain[0], plain[1:], plain_masks)
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(plain_fused), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.slow  # end to end; the default suite keeps its parts
def test_pipeline_runs_end_to_end(tmp_path):
    from jaxalign.cpi.pipeline import run
    from jaxalign.train import load_config

    overrides = {"workdir": tmp_path, "cpi.tasks": "add,copy", "cpi.train_per_task": 64, "cpi.eval_per_task": 4,
                 "cpi.base_steps": 4, "cpi.probe_steps": 4, "cpi.stage_steps": 2, "cpi.sample_per_task": 16,
                 "cpi.tau": 1.1, "cpi.ablations": True, "cpi.forgetting": "add,copy", "cpi.probe_lr": 1e-3,
                 "train.batch_size": 8, "model.shape.hidden_size": 32, "model.shape.num_layers": 1,
                 "model.shape.intermediate_size": 64, "model.shape.num_heads": 2, "model.shape.num_kv_heads": 1}
    config = load_config("cpi", [f"--config.{k}={v}" for k, v in overrides.items()])
    report = run(config)
    assert report["groups"] == [["add"], ["copy"]]  # tau above 1: every task alone, staged in order
    assert set(report["scores"]) == {"base", "probe_add", "probe_copy", "fused", "cpi_ft", "multi_task_sft",
                                     "sequential_sft", "cpi_ft_no_fusion", "cpi_ft_no_freezing"}
    assert set(report["forgetting"]) == {"sequential_sft", "multi_task_sft", "cpi_ft", "cpi_ft_no_fusion",
                                         "cpi_ft_no_freezing"}
    test = report["forgetting_test"]
    assert (test["a"], test["b"]) == ("add", "copy")
    assert set(test) >= {"after_a", "after_b_plain", "after_b_core_frozen"}
    total = sum(report["core_sizes"].values())
    assert total > 0 and len(report["jaccard"]) == 2
    assert (tmp_path / "report.md").read_text().startswith("| model | add | copy | mean |")
    for key, value in (("cpi.stage_data", "sequential"), ("cpi.forgetting", "add,add"), ("cpi.forgetting", "add,sub"),
                       ("cpi.eval_pool", "train")):
        bad = load_config("cpi", [f"--config.{k}={v}" for k, v in {**overrides, key: value}.items()])
        with pytest.raises(ValueError, match=key):
            run(bad)


def test_validation_pool_is_apart_from_the_test_pool_and_the_training_data():
    from jaxalign.cpi.pipeline import _task_data
    from jaxalign.data.toy import pool_of
    from jaxalign.train import load_config

    def questions(pool):
        cpi = load_config("cpi", ["--config.cpi.train_per_task=400", "--config.cpi.eval_per_task=50",
                                  f"--config.cpi.eval_pool={pool}"]).cpi
        train, evaluation = _task_data(cpi, seed=3)
        asked = {t: {r["messages"][0]["content"] for r in records} for t, records in evaluation.items()}
        trained = {r["messages"][0]["content"] for records in train.values() for r in records}
        assert all(len(records) == 50 for records in evaluation.values())
        assert not trained & set().union(*asked.values())  # nothing scored is trained on
        for record in evaluation["add"]:
            a, b = (int(x) for x in record["messages"][0]["content"].removeprefix("Add ").rstrip(".").split(" and "))
            assert pool_of(a, "+", b) == pool
        return asked

    test, validation = questions("test"), questions("validation")
    for task in test:
        assert not test[task] & validation[task], task  # the two pools share no question, words included
