"""The trainer: configs, every objective end to end, accumulation and sharding invariants, reference cache."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxalign.models import LlamaConfig, abstract_model, create_model, load_hf
from jaxalign.objectives import get_objective, make_params
from jaxalign.parallel import make_mesh
from jaxalign.train import ConfigError, load_config, train, validate
from jaxalign.train.step import init_state, make_optimizer, make_train_step, state_shardings

SMALL = ["--config.model.shape.hidden_size=32", "--config.model.shape.intermediate_size=64",
         "--config.model.shape.num_layers=1", "--config.model.shape.num_heads=2", "--config.model.shape.num_kv_heads=1",
         "--config.data.toy_size=200", "--config.data.toy_eval_size=16", "--config.data.max_length=48",
         "--config.train.batch_size=8", "--config.train.log_every=5", "--config.train.eval_every=0",
         "--config.eval.batches=1", "--config.eval.generate=8", "--config.eval.max_new_tokens=4",
         "--config.logging.tensorboard=False", "--config.logging.plot=False", "--config.optim.warmup_steps=2"]


def small_config(name, workdir, *extra):
    return load_config(name, [*SMALL, f"--config.workdir={workdir}", *extra])


# ----------------------------------------------------------------------------------------------- configs
def test_bundled_configs_load_and_validate():
    for name in ("default", "sft", "ift", "dpo", "simpo", "orpo", "cpo", "alphapo", "kto", "reward", "mpo", "grpo"):
        config = load_config(name)
        validate(config, num_devices=8)
    for name in ("distill", "gkd"):  # the user names the teacher
        with pytest.raises(ConfigError, match=r"objective\.params\.teacher is empty"):
            validate(load_config(name), num_devices=8)
    assert load_config("default").objective.name == "ift"


def test_the_default_job_trains_its_input_table_only_from_random_weights(capsys):
    params = load_config("default").objective.params
    assert (params.embedding_grad, params.normalization) == ("ground_truth", "token")
    for config in (load_config("default:smollm2"), load_config("default", ["model.path=/models/m"])):
        params = config.objective.params  # a pretrained model: the official code's settings
        assert (params.embedding_grad, params.normalization) == ("none", "sequence")
    said = capsys.readouterr().out
    assert "objective.params.embedding_grad='none'" in said and "objective.params.normalization='sequence'" in said
    chosen = load_config("default", ["model.path=/models/m", "objective.params.embedding_grad=ground_truth"])
    assert chosen.objective.params.embedding_grad == "ground_truth"  # the user's choice stands


def test_overrides_are_typed_and_checked():
    config = load_config("dpo", ["--config.optim.lr=1e-5", "--config.train.steps=7", "--config.data.shuffle=false",
                                 "--config.objective.params.beta=0.3", "--config.objective.params.loss_type=ipo"])
    assert config.optim.lr == 1e-5 and config.train.steps == 7 and config.data.shuffle is False
    assert config.objective.params.beta == 0.3 and config.objective.params.loss_type == "ipo"
    with pytest.raises(ConfigError, match=r"no field 'optim\.learning_rate'"):
        load_config("sft", ["--config.optim.learning_rate=1"])
    with pytest.raises(ConfigError, match=r"expected an integer \(e.g. 600\), got 'many'"):
        load_config("sft", ["--config.train.steps=many"])
    with pytest.raises(ConfigError, match=r"no field 'train.stepz' \(did you mean 'steps'\?\)"):
        load_config("sft", ["--config.train.stepz=3"])
    with pytest.raises(ConfigError, match=r"no section 'optm' in the config \(did you mean 'optim'\?\)"):
        load_config("sft", ["--config.optm.lr=3"])
    with pytest.raises(ValueError, match=r"did you mean 'beta' for 'betta'\?"):
        make_params("dpo", {"betta": 0.2})
    with pytest.raises(ConfigError, match="not found"):
        load_config("nonexistent")


@pytest.mark.parametrize(("override", "message"), [
    ("--config.objective.name=bco", "objective.name='bco' is unknown"),
    ("--config.mesh.fsdp=3", "needs 3 devices but 8 are available"),
    ("--config.train.batch_size=6", "not divisible by the 8 data-parallel shards"),
    ("--config.objective.params.betta=1", "no hyper-parameters ['betta']"),
    ("--config.optim.name=lion", "optim.name='lion'"),
    ("--config.model.path=/does/not/exist", "does not exist"),
])
def test_validate_names_the_field(override, message):
    config = load_config("dpo", [override])
    with pytest.raises(ConfigError) as info:
        validate(config, num_devices=8)
    assert message in str(info.value)


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("name", ["sft", "ift", "dpo", "simpo", "orpo", "cpo", "kto", "mpo"])
def test_each_objective_trains_checkpoints_and_exports(name, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from jaxalign.train.export import export

    summary = train(small_config(name, tmp_path / "run", "--config.train.steps=24", "--config.train.save_every=12",
                                 "--config.optim.lr=3e-3"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["split"] == "train"]
    assert len(losses) >= 4 and losses[-1] < losses[0], losses
    assert {"grad_norm", "lr", "tokens_per_s"} <= set(rows[-2] if rows[-1]["split"] == "eval" else rows[-1])
    if name in ("dpo", "simpo", "orpo", "cpo", "mpo"):
        assert any("rewards/margins" in r for r in rows)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["12", "24"]
    assert summary["final_eval"] and "accuracy" in summary["final_eval"]
    out = export(tmp_path / "run", tmp_path / "hf")
    reference = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    tokens = np.array([[1, 50, 60, 70, 2]])
    with torch.no_grad():
        expected = reference(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(load_hf(out)(jnp.asarray(tokens))), expected, atol=1e-4)


def test_precomputed_reference_cache_is_reused(tmp_path):
    extra = ["--config.train.steps=6", "--config.reference.kind=precomputed",
             f"--config.reference.cache_dir={tmp_path / 'cache'}"]
    first = train(small_config("dpo", tmp_path / "a", *extra))
    assert first["reference_cache"]["status"] == "computed"
    second = train(small_config("dpo", tmp_path / "b", *extra))
    assert second["reference_cache"]["status"] == "reused"
    train(small_config("dpo", tmp_path / "c", "--config.train.steps=6"))  # reference model held in memory

    def losses(run):
        rows = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(r)["loss"] for r in rows if json.loads(r)["split"] == "train"]

    assert losses("a") == losses("b")
    np.testing.assert_allclose(losses("a"), losses("c"), rtol=1e-5)


# ------------------------------------------------------------------------------------------ invariants
TINY = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def step_setup(name, mesh, grad_accum=1, **optim):
    import ml_collections

    optim_config = ml_collections.ConfigDict(dict(name="adamw", lr=1e-2, schedule="cosine", warmup_steps=1,
                                                  min_lr_ratio=0.1, weight_decay=0.01, b1=0.9, b2=0.95, eps=1e-8,
                                                  rmsprop_decay=0.9, clip_norm=1.0, **optim))
    tx, schedule = make_optimizer(optim_config, 10)
    model = create_model(TINY, seed=3)
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    shardings = state_shardings(abstract_model(TINY), tx, mesh) if mesh is not None else None
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"))) if mesh else None
    if mesh is not None:
        params = jax.device_put(params, shardings.params)
    state = init_state(params, tx, 0, shardings)
    step = make_train_step(graphdef, get_objective(name).fn, make_params(name), tx, grad_accum=grad_accum,
                           schedule=schedule, shardings=shardings, batch_sharding=batch_sharding)
    return state, step


def sft_batches(n, b=8, t=12, seed=0):
    rng = np.random.RandomState(seed)
    for _ in range(n):
        tokens = rng.randint(3, 96, (b, t)).astype(np.int32)
        lengths = rng.randint(6, t + 1, b)
        attention = (np.arange(t)[None] < lengths[:, None]).astype(np.int32)
        loss_mask = attention * (np.arange(t)[None] >= 3)
        yield {"tokens": tokens, "attention_mask": attention, "loss_mask": loss_mask.astype(np.int32),
               "example_weight": np.ones(b, np.float32)}


@pytest.mark.parametrize("name", ["sft", "ift"])
def test_four_micro_batches_equal_the_full_batch(name):
    batch = {k: jnp.asarray(v) for k, v in next(sft_batches(1)).items()}
    full, step_full = step_setup(name, None)
    accumulated, step_accum = step_setup(name, None, grad_accum=4)
    full, metrics_full = step_full(full, batch)
    accumulated, metrics_accum = step_accum(accumulated, batch)
    for a, b in zip(jax.tree.leaves(accumulated.params), jax.tree.leaves(full.params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert float(metrics_accum["loss"].total) == pytest.approx(float(metrics_full["loss"].total), rel=1e-5)


def test_fsdp_and_tensor_parallel_equal_one_device(mesh8):
    one = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    results = []
    for mesh in (one, mesh8):
        with jax.set_mesh(mesh):
            state, step = step_setup("sft", mesh)
            for batch in sft_batches(3):
                state, _ = step(state, batch)
        results.append(state)
    layer = results[1].params["layers"][0]
    assert tuple(layer["mlp"]["up_proj"].sharding.spec) == ("fsdp", "tensor")
    for a, b in zip(jax.tree.leaves(results[1].params), jax.tree.leaves(results[0].params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_nan_guard_skips_the_update():
    state, step = step_setup("sft", None)
    batch = {k: jnp.asarray(v) for k, v in next(sft_batches(1)).items()}
    before = jax.tree.map(np.asarray, state.params)
    poisoned = dict(state.params)
    poisoned["norm"] = {"weight": state.params["norm"]["weight"] * jnp.nan}
    state = state._replace(params=poisoned)
    state, _metrics = step(state, batch)
    assert int(state.skipped) == 1 and int(state.step) == 1
    assert np.isnan(np.asarray(state.params["norm"]["weight"])).all()  # unchanged (still the poisoned values)
    np.testing.assert_array_equal(np.asarray(state.params["embed_tokens"]), before["embed_tokens"])


def test_corrupt_latest_checkpoint_falls_back_with_a_warning(tmp_path):
    extra = ["--config.train.save_every=4", "--config.train.keep_checkpoints=3"]
    train(small_config("sft", tmp_path / "run", "--config.train.steps=8", *extra))
    latest = tmp_path / "run" / "checkpoints" / "8"
    for file in latest.rglob("*"):
        if file.is_file() and "state" in str(file):
            file.write_bytes(b"garbage")
    with pytest.warns(UserWarning, match=r"checkpoint 8 in .* is broken"):
        summary = train(small_config("sft", tmp_path / "run", "--config.train.steps=10", *extra))
    assert summary["step"] == 10
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [5, 10]  # resumed at 4: the first run's 5, 8 dropped


def test_remat_gives_the_same_loss_and_gradients():
    batch = {k: jnp.asarray(v) for k, v in next(sft_batches(1)).items()}
    results = []
    for remat, policy in ((False, "nothing"), (True, "nothing"), (True, "dots"), (True, "dots_no_batch")):
        model = create_model(TINY.replace(remat=remat, remat_policy=policy), seed=3)
        results.append(nnx.value_and_grad(lambda m: get_objective("sft").fn(m, batch, make_params("sft"))[0])(model))
    for other in results[1:]:
        assert float(results[0][0]) == pytest.approx(float(other[0]), rel=1e-6)
        for a, b in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(other[1]), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6)
