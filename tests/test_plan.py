"""``jaxalign plan``: exact per-device parameter and optimizer bytes, an activation estimate close to XLA's."""

import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxalign import losses
from jaxalign.cli import main
from jaxalign.models import abstract_model, create_model
from jaxalign.objectives import get_objective, make_params
from jaxalign.plan import head_bytes, plan
from jaxalign.train import load_config
from jaxalign.train.build import model_config as model_config_of
from jaxalign.train.step import init_state, make_optimizer, make_train_step, state_shardings

SHAPE = ["--config.model.shape.hidden_size=128", "--config.model.shape.intermediate_size=384",
         "--config.model.shape.num_layers=4", "--config.model.shape.vocab_size=4096", "--config.data.max_length=128",
         "--config.train.batch_size=8"]


def device_bytes(tree) -> int:
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


def test_parameter_and_optimizer_bytes_match_a_sharded_state(mesh8):
    config = load_config("sft", [*SHAPE, "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"])
    result = plan(config, 8)
    model_config = model_config_of(config)
    tx, _ = make_optimizer(config.optim, config.train.steps)
    shardings = state_shardings(abstract_model(model_config), tx, mesh8)
    with jax.set_mesh(mesh8):
        params = nnx.to_pure_dict(nnx.state(create_model(model_config, seed=0, mesh=mesh8)))
        state = init_state(params, tx, 0, shardings)
    assert result.bytes["parameters"] == device_bytes(state.params)
    assert result.bytes["optimizer state"] == device_bytes(state.opt_state)
    single = plan(load_config("sft", [*SHAPE, "--config.mesh.data=1"]), 1)
    assert 3.9 < single.bytes["parameters"] / result.bytes["parameters"] < 4  # fsdp x tensor: 4-way (norms whole)


@pytest.mark.parametrize("length", [128, 512])  # one dense product; causal query blocks (256+ tokens)
@pytest.mark.parametrize(("name", "extra"), [
    ("sft", []), ("sft", ["--config.model.remat=True"]), ("dpo", []),
    ("sft", ["--config.model.remat=True", "--config.model.remat_policy=dots_no_batch"]),
])
def test_activation_estimate_is_within_25_percent_of_xla(name, extra, length):
    # calibrated on the plain log-prob path (the fused head is checked on its own below)
    config = load_config(name, [*SHAPE, "--config.mesh.data=1", "--config.objective.params.logps_chunk_size=0",
                                f"--config.data.max_length={length}", *extra])
    result = plan(config, 1)
    model_config = model_config_of(config)
    graphdef, params = nnx.split(create_model(model_config, seed=0))
    params = nnx.to_pure_dict(params)
    tx, _ = make_optimizer(config.optim, 10)
    objective = get_objective(name)
    step = make_train_step(graphdef, objective.fn, make_params(name, {"logps_chunk_size": 0}), tx)
    b, t = config.train.batch_size, config.data.max_length
    ones = jnp.ones((b, t), jnp.int32)
    if name == "sft":
        batch = {"tokens": ones, "attention_mask": ones, "loss_mask": ones}
    else:
        batch = {f"{side}_{k}": ones for side in ("chosen", "rejected") for k in ("tokens", "attention_mask",
                                                                                   "loss_mask")}
    batch["example_weight"] = jnp.ones((b,), jnp.float32)
    args = (init_state(params, tx, 0, None), batch) + ((params,) if objective.uses_reference else ())
    xla = step.lower(*args).compile().memory_analysis().temp_size_in_bytes
    estimate = result.bytes["activations (estimate)"] + result.bytes["gradients"]
    assert 0.75 <= estimate / xla <= 1.25, (estimate, xla)


@pytest.mark.parametrize("tile", [256, 1024, 4096])
def test_fused_head_estimate_is_within_25_percent_of_xla(tile):
    tokens, dim, vocab = 1024, 128, 4096
    hidden, kernel = jnp.ones((8, tokens // 8, dim)), jnp.ones((dim, vocab))
    ids = jnp.ones((8, tokens // 8), jnp.int32)
    loss = lambda h, k: losses.token_logps_from_hidden(h, k, ids, ids, chunk_size=tile).sum()
    xla = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, kernel).compile().memory_analysis()
    estimate = head_bytes(tokens, vocab, dim, chunk_size=tile)
    assert 0.75 <= estimate / xla.temp_size_in_bytes <= 1.25, (estimate, xla.temp_size_in_bytes)
    if tile < vocab:  # tiles narrower than the vocabulary are what saves memory
        plain = jax.jit(jax.grad(lambda h, k: losses.token_logps(h @ k, ids, ids).sum(), argnums=(0, 1)))
        assert xla.temp_size_in_bytes < plain.lower(hidden, kernel).compile().memory_analysis().temp_size_in_bytes


def test_plan_picks_the_log_prob_path_of_the_target_backend():
    config = load_config("dpo", ["--config.model.preset=llama3_8b", "--config.data.max_length=2048",
                                 "--config.train.batch_size=8"])
    on_cpu, on_tpu = plan(config, 8, backend="cpu"), plan(config, 8, backend="tpu")
    assert on_cpu.bytes["activations (estimate)"] != on_tpu.bytes["activations (estimate)"]
    small = load_config("sft", [*SHAPE, "--config.mesh.data=1"])  # 4M logits: the plain path off the CPU
    assert plan(small, 1, backend="gpu").bytes["activations (estimate)"] > plan(small, 1, backend="cpu").bytes[
        "activations (estimate)"]


def test_the_qwen3_8b_preset_has_the_released_model_s_shape():
    from jaxalign.models import LlamaConfig
    from jaxalign.train.build import ARCHITECTURES

    config = LlamaConfig(**ARCHITECTURES["qwen3_8b"])
    assert config.num_params() == 8_190_735_360  # from its config.json: 36 layers x 192.9M + 2 x 622.3M tables
    assert config.qk_norm and config.head_dim == 128
    moe = LlamaConfig(**ARCHITECTURES["qwen3_30b_a3b"])  # the model card's 30.5B total
    assert moe.num_params() == 30_532_122_624 and all(moe.is_moe(i) for i in range(48))
    planned = plan(load_config("sft:qwen3_30b_a3b"), 64)  # experts over mesh.expert=8, the batch over all 64
    assert planned.mesh == {"data": 1, "fsdp": 8, "tensor": 1, "expert": 8} and planned.rows_per_device == 1
    assert planned.bytes["parameters"] < 30_532_122_624 * 4 / 8 / 3  # the experts (95 %) split 64 ways, not 8


def test_cli_plans_an_8b_dpo_run_without_weights(capsys):
    assert main(["plan", "--config", "launch/configs/llama3_8b_dpo_v5p.py", "--devices", "32", "--hardware",
                 "v5p"]) == 0
    out = capsys.readouterr().out
    assert "8.03B parameters" in out and "fits in 95 GB" in out
    assert main(["plan", "--config", "launch/configs/llama3_8b_dpo_gpu.py", "--devices", "8", "--hardware",
                 "h100"]) == 0
    assert "fits in 80 GB" in capsys.readouterr().out
    # Full fine-tuning of 8B with a reference copy on one 80 GB GPU does not fit, and the plan says so.
    assert main(["plan", "--config", "dpo:llama3_8b", "--devices", "1", "--hardware", "h100"]) == 0
    assert "does NOT fit" in capsys.readouterr().out
    assert main(["plan", "--config", "dpo:llama3_8b", "--devices", "6", "--config.mesh.fsdp=4"]) == 2
    assert "needs 4 devices but 6" in capsys.readouterr().err
    assert main(["plan", "--config", "sft", "--devices", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}
    assert report["total"] == pytest.approx(sum(report["bytes"].values()))


def test_lora_plan_matches_a_sharded_adapter_state_and_shows_the_saving(mesh8):
    from jaxalign.models import lora

    overrides = [*SHAPE, "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
                 "--config.lora.enabled=True", "--config.lora.rank=4"]
    config = load_config("dpo", overrides)
    result = plan(config, 8)
    full = plan(load_config("dpo", overrides[:-2]), 8)
    model_config = model_config_of(config)
    lora_config = lora.LoRAConfig.from_config(config.lora)
    tx, _ = make_optimizer(config.optim, config.train.steps)
    shardings = state_shardings(lora.abstract_lora_model(model_config, lora_config), tx, mesh8, trained=nnx.LoRAParam)
    with jax.set_mesh(mesh8):
        adapters = lora.init_adapters(model_config, lora_config, seed=0, mesh=mesh8)
        state = init_state(adapters, tx, 0, shardings)
    assert result.bytes["LoRA adapters"] == device_bytes(state.params)
    assert result.bytes["optimizer state"] == device_bytes(state.opt_state)
    assert result.bytes["base parameters (frozen)"] == full.bytes["parameters"]
    assert "reference model" not in result.bytes and "reference model" in full.bytes
    assert result.trainable_params == lora.count_params(model_config, lora_config)["adapter"] < full.num_params / 10
    assert any(note.startswith("LoRA saves") for note in result.notes)
    assert result.total < full.total
