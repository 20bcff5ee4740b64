"""LoRA: adapters leave a fresh model unchanged, only adapters train, sharding and accumulation invariants, DPO
against the adapter-free base, adapter-only checkpoints and resume, merged and PEFT exports."""

import json
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from test_train import SMALL, sft_batches

from jaxalign.cli import main
from jaxalign.models import LlamaConfig, abstract_model, create_model, load_hf, lora, param_shardings
from jaxalign.objectives import get_objective, make_params
from jaxalign.parallel import make_mesh
from jaxalign.train import ConfigError, load_config, validate
from jaxalign.train.export import restore_model
from jaxalign.train.step import init_state, lora_parts, make_optimizer, make_train_step, state_shardings

TINY = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
LORA = lora.LoRAConfig(rank=4, alpha=8.0)
TOKENS = jnp.asarray(np.random.RandomState(0).randint(3, 96, (2, 9)), jnp.int32)


def perturbed(model, seed=1, scale=0.05):
    """``model`` with random (non-zero) adapters, as after some training."""
    graphdef, adapters, base = lora.split(model)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda a: a + scale * jax.random.normal(next(keys), a.shape), adapters)
    return nnx.merge(graphdef, base, adapters)


def test_fresh_adapters_give_exactly_the_base_logits_and_the_merge_matches():
    base = create_model(TINY, seed=3)
    model = lora.with_adapters(base, LORA, seed=1)
    np.testing.assert_array_equal(np.asarray(model(TOKENS)), np.asarray(base(TOKENS)))
    trained = perturbed(model)
    assert float(jnp.abs(trained(TOKENS) - base(TOKENS)).max()) > 0.1
    merged = lora.merge_weights(trained)
    assert not any(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(nnx.state(merged)))
    assert float(jnp.abs(merged(TOKENS) - trained(TOKENS)).max()) <= 1e-5
    # the base is used in place: the adapter model holds the very same arrays
    assert lora.split(model)[2]["layers"][0]["mlp"]["up_proj"] is nnx.state(base)["layers"][0]["mlp"]["up_proj"][...]
    # A [in, r] ~ U(±1/sqrt(in)) as in PEFT; B [r, out] zero; o_proj's A has both input axes
    q = lora.split(model)[1]["layers"][0]["self_attn"]["q_proj_lora"]
    o = lora.split(model)[1]["layers"][0]["self_attn"]["o_proj_lora"]
    assert q["lora_a"].shape == (32, 4) and q["lora_b"].shape == (4, 4, 8) and o["lora_a"].shape == (4, 8, 4)
    assert 0.8 / math.sqrt(32) < float(jnp.abs(q["lora_a"]).max()) <= 1 / math.sqrt(32)
    assert not np.asarray(q["lora_b"]).any()


def test_count_params_and_dropout():
    # per layer (r=4): q,o 2·32·4; k,v 32·4 + 4·16; gate,up 32·4 + 4·64; down 64·4 + 4·32
    assert lora.count_params(TINY, LORA) == {"adapter": 2 * (2 * 256 + 2 * 192 + 3 * 384),
                                             "base": sum(math.prod(v.shape) for v in
                                                         jax.tree.leaves(nnx.state(abstract_model(TINY))))}
    model = perturbed(lora.with_adapters(create_model(TINY, seed=3), lora.LoRAConfig(rank=4, dropout=0.5)))
    plain = np.asarray(model(TOKENS))
    dropped = np.asarray(lora.set_dropout_key(perturbed(model, 2, 0.0), jax.random.key(0))(TOKENS))
    assert np.abs(dropped - plain).max() > 1e-3


def lora_step_setup(name, mesh, grad_accum=1, lora_config=LORA):
    optim = ml_collections.ConfigDict(dict(name="adamw", lr=1e-2, schedule="cosine", warmup_steps=1, min_lr_ratio=0.1,
                                           weight_decay=0.01, b1=0.9, b2=0.95, eps=1e-8, rmsprop_decay=0.9,
                                           clip_norm=1.0))
    tx, schedule = make_optimizer(optim, 10)
    base_graphdef, base = nnx.split(create_model(TINY, seed=3, mesh=mesh))
    base = nnx.to_pure_dict(base)
    adapters = lora.init_adapters(TINY, lora_config, seed=1, mesh=mesh)
    shardings = frozen_shardings = batch_sharding = None
    if mesh is not None:
        shardings = state_shardings(lora.abstract_lora_model(TINY, lora_config), tx, mesh, trained=nnx.LoRAParam)
        frozen_shardings = nnx.to_pure_dict(param_shardings(abstract_model(TINY), mesh))
        batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    parts = lora_parts(lora.lora_graphdef(TINY, lora_config), base_graphdef, with_reference=False)
    step = make_train_step(parts, get_objective(name).fn, make_params(name), tx, grad_accum=grad_accum,
                           schedule=schedule, shardings=shardings, batch_sharding=batch_sharding,
                           frozen_shardings=frozen_shardings)
    return init_state(adapters, tx, 0, shardings), base, step


def test_only_adapters_get_gradients_and_optimizer_state():
    state, base, step = lora_step_setup("sft", None)
    before = jax.tree.map(np.asarray, base)
    for batch in sft_batches(2):
        state, metrics = step(state, batch, base)
    n_adapter = lora.count_params(TINY, LORA)["adapter"]
    assert sum(x.size for x in jax.tree.leaves(state.params)) == n_adapter
    # AdamW: two moments per adapter weight, plus two step counters (Adam's and the schedule's)
    assert sum(x.size for x in jax.tree.leaves(state.opt_state)) == 2 * n_adapter + 2
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert float(jnp.abs(state.params["layers"][0]["mlp"]["down_proj_lora"]["lora_b"]).max()) > 0
    assert np.isfinite(float(metrics["loss"].value))


def test_four_micro_batches_equal_the_full_batch_with_lora():
    batch = {k: jnp.asarray(v) for k, v in next(sft_batches(1)).items()}
    results = []
    for grad_accum in (1, 4):
        state, base, step = lora_step_setup("sft", None, grad_accum)
        state, metrics = step(state, batch, base)
        results.append((state, float(metrics["loss"].total)))
    for a, b in zip(jax.tree.leaves(results[1][0].params), jax.tree.leaves(results[0][0].params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert results[1][1] == pytest.approx(results[0][1], rel=1e-5)


def test_sharded_lora_step_equals_one_device(mesh8):
    one = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    results = []
    for mesh in (one, mesh8):
        with jax.set_mesh(mesh):
            state, base, step = lora_step_setup("sft", mesh)
            for batch in sft_batches(3):
                state, _ = step(state, batch, base)
        results.append(state)
    adapter = results[1].params["layers"][0]["self_attn"]["q_proj_lora"]
    assert tuple(adapter["lora_a"].sharding.spec) == ("fsdp", None)  # like q_proj's input axis; rank replicated
    assert tuple(adapter["lora_b"].sharding.spec) == (None, "tensor", None)  # like q_proj's heads
    for a, b in zip(jax.tree.leaves(results[1].params), jax.tree.leaves(results[0].params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.parametrize(("override", "message"), [
    ("--config.lora.rank=0", "lora.rank=0 must be an integer >= 1"),
    ("--config.lora.target_modules=q_proj,qkv", "lora.target_modules='q_proj,qkv': unknown qkv"),
    ("--config.lora.dropout=1.0", "lora.dropout=1.0 must be in [0, 1)"),
    ("--config.lora.alpha=0.0", "lora.alpha=0.0 must be > 0"),
])
def test_validate_names_the_lora_field(override, message):
    with pytest.raises(ConfigError) as info:
        validate(load_config("dpo", ["--config.lora.enabled=True", override]), num_devices=8)
    assert message in str(info.value)
    validate(load_config("dpo", [override]), num_devices=8)  # ignored while LoRA is off


def train_losses(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["split"] == "train"]


@pytest.mark.slow  # end to end; the default suite keeps its parts
def test_dpo_lora_starts_at_ln2_resumes_and_exports(tmp_path, capsys):
    """DPO through the CLI with the adapter-free base as reference; adapter-only checkpoints; resume; both
    export forms load in transformers / PEFT with our logits."""
    extra = ["--config.lora.enabled=True", "--config.lora.rank=4", "--config.train.log_every=1",
             "--config.train.save_every=3", "--config.optim.schedule=constant", "--config.optim.lr=1e-2",
             "--config.eval.generate=0", "--config.data.eval="]

    def run(workdir, steps):
        assert main(["train", "--config", "dpo", *SMALL, f"--config.workdir={workdir}", *extra,
                     f"--config.train.steps={steps}"]) == 0
        return capsys.readouterr().out

    out = run(tmp_path / "a", 3)
    assert "adapter parameters train" in out
    assert train_losses(tmp_path / "a")[0] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 0
    assert "resumed from" in run(tmp_path / "a", 6)
    run(tmp_path / "b", 6)
    np.testing.assert_allclose(train_losses(tmp_path / "a"), train_losses(tmp_path / "b"), rtol=1e-6)
    trained, _, step = restore_model(tmp_path / "a")
    expected_model, _, _ = restore_model(tmp_path / "b")
    assert step == 6
    for x, y in zip(jax.tree.leaves(lora.split(trained)[1]), jax.tree.leaves(lora.split(expected_model)[1]),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # the checkpoint holds the adapters and their two Adam moments, nothing of the base
    metadata = json.loads((tmp_path / "a" / "checkpoints" / "6" / "state" / "_METADATA").read_text())
    weights = [k for k in metadata["tree_metadata"] if any(n in k for n in ("layers", "embed", "norm", "lm_head"))]
    assert all("_lora" in k for k in weights), weights
    assert len(weights) == 3 * len(jax.tree.leaves(lora.split(trained)[1]))

    tokens = np.array([[1, 50, 60, 70, 2, 9]])
    ours = np.asarray(trained(jnp.asarray(tokens)))
    assert main(["export", "--checkpoint", str(tmp_path / "a"), "--out", str(tmp_path / "merged")]) == 0
    assert float(np.abs(np.asarray(load_hf(tmp_path / "merged")(jnp.asarray(tokens))) - ours).max()) <= 1e-5
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), local_files_only=True).eval()
        np.testing.assert_allclose(hf(torch.tensor(tokens)).logits.numpy(), ours, atol=1e-4)

    assert main(["export", "--checkpoint", str(tmp_path / "a"), "--out", str(tmp_path / "peft"), "--adapter"]) == 0
    peft = pytest.importorskip("peft")
    adapter_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4 and adapter_config["base_model_name_or_path"] == str(tmp_path / "peft" / "base")
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(adapter_config["base_model_name_or_path"]).eval()
        model = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
        np.testing.assert_allclose(model(torch.tensor(tokens)).logits.numpy(), ours, atol=1e-4)
