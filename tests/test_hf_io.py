"""Hugging Face folders in and out: config spellings, round trips, sharded files, clear errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxalign.models import CheckpointError, config_from_hf, create_model, load_hf, save_hf
from jaxalign.models.config import LlamaConfig, RopeScaling

LEGACY = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500000.0,
          "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}}


def test_config_both_rope_spellings():
    legacy = config_from_hf(LEGACY)
    v5 = dict(LEGACY)
    del v5["rope_theta"], v5["rope_scaling"]
    v5["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert config_from_hf(v5) == legacy
    assert legacy.rope_theta == 500000.0 and legacy.rope_scaling.rope_type == "llama3"
    assert legacy.head_dim == 16
    plain = config_from_hf({**v5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e5}})
    assert plain.rope_scaling == RopeScaling() and plain.rope_theta == 1e5


def test_llama3_inv_freq_matches_transformers():
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = HFConfig(**{k: v for k, v in LEGACY.items() if k != "model_type"}, max_position_embeddings=131072)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    np.testing.assert_allclose(config_from_hf(LEGACY).inv_freq(), expected.numpy(), rtol=1e-6)


def test_config_errors_name_the_problem():
    with pytest.raises(CheckpointError, match="unsupported architecture model_type='gpt2'"):
        config_from_hf({**LEGACY, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(CheckpointError, match="missing field 'hidden_size'"):
        config_from_hf({k: v for k, v in LEGACY.items() if k != "hidden_size"})
    with pytest.raises(CheckpointError, match="rope type 'yarn'"):
        config_from_hf({**LEGACY, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(CheckpointError, match="hidden_act='gelu'"):
        config_from_hf({**LEGACY, "hidden_act": "gelu"})
    with pytest.raises(CheckpointError, match=r"num_experts=1099511627776 must be an integer in \[0, 16384\]"):
        config_from_hf({**LEGACY, "model_type": "mixtral", "num_local_experts": 2**40})  # checked before building
    with pytest.raises(CheckpointError, match="Gemma 3 image-text checkpoint"):
        config_from_hf({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                        "text_config": {}})
    with pytest.raises(CheckpointError, match=r"partial_rotary_factor=0\.75"):
        config_from_hf({**LEGACY, "model_type": "phi3", "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match=r"attn_softcap=50\.0 .* needs attention_impl=.xla."):
        config_from_hf({**LEGACY, "model_type": "gemma2", "attn_logit_softcapping": 50.0}).replace(
            attention_impl="cudnn")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_save_hf_round_trip_through_transformers(arch, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                         num_kv_heads=2, architecture=arch, qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
                         tie_word_embeddings=arch == "qwen2", bos_token_id=1, eos_token_id=2,
                         rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16) if arch == "llama" else RopeScaling())
    model = create_model(config, seed=4)
    if arch == "qwen2":  # non-zero biases, so the round trip checks them
        for layer in model.layers:
            layer.self_attn.q_bias[...] = 0.1 * jnp.ones_like(layer.self_attn.q_bias[...])
    if arch == "qwen3":  # q/k norm weights away from 1, different per head dimension
        for i, layer in enumerate(model.layers):
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight[...] = 1 + 0.2 * jnp.sin(jnp.arange(norm.weight.shape[0]) + i)
    save_hf(model, tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    if arch == "phi3":  # fused on disk as transformers' Phi3 keeps them
        assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"} <= names
        assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in names)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True).eval()
    tokens = np.random.RandomState(0).randint(0, 128, (2, 10))
    mask = np.ones_like(tokens)
    mask[1, :3] = 0
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits.numpy()
    got = np.asarray(model(jnp.asarray(tokens), jnp.asarray(mask)))
    assert np.abs(got - expected)[mask.astype(bool)].max() <= 1e-4
    reloaded = load_hf(tmp_path)
    assert reloaded.config == config
    np.testing.assert_array_equal(reloaded(jnp.asarray(tokens), jnp.asarray(mask)), got)


CONFIG_KEYS = {
    "gemma2": ("layer_types", "sliding_window", "query_pre_attn_scalar", "final_logit_softcapping",
               "attn_logit_softcapping"),
    "gemma3_text": ("layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters"),
    "mixtral": ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "sliding_window"),
    "qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
                  "router_aux_loss_coef"),
}


@pytest.mark.parametrize("arch", list(CONFIG_KEYS))
def test_checkpoints_save_back_to_what_transformers_loads(arch, tmp_path):
    """A transformers Gemma / MoE folder loaded, saved by ``save_hf`` and loaded by transformers again: the same
    config (caps, local RoPE base, layer types, query scale; experts, routing, dense layers), the same weights
    (MoE: the per-expert layout transformers itself saves) and the same logits."""
    torch = pytest.importorskip("torch")
    from torch_reference import make_reference, torch_logits
    from transformers import AutoModelForCausalLM

    reference = make_reference(arch, tmp_path / "reference")
    model = load_hf(tmp_path / "reference")
    save_hf(model, tmp_path / "saved")
    assert load_hf(tmp_path / "saved").config == model.config
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), local_files_only=True).eval()
    for key in CONFIG_KEYS[arch]:
        assert getattr(again.config, key) == getattr(reference.config, key), key
    names = set(load_file(str(tmp_path / "saved" / "model.safetensors")))
    assert names == set(load_file(str(tmp_path / "reference" / "model.safetensors")))
    tokens = np.random.RandomState(2).randint(3, 128, (2, 11))
    mask = np.ones_like(tokens)
    mask[0, 8:] = 0
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), reference.state_dict().values(),
                                                     strict=True))
    expected = torch_logits(again, tokens, mask)
    got = np.asarray(model(jnp.asarray(tokens), jnp.asarray(mask)))
    assert np.abs(got - expected)[mask.astype(bool)].max() <= 1e-4


def test_sharded_files_and_loading_into_a_mesh(tmp_path, mesh8, tiny_config):
    model = create_model(tiny_config, seed=5)
    save_hf(model, tmp_path, max_shard_size="60KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((tmp_path / f).exists() for f in files)
    assert not (tmp_path / "model.safetensors").exists()
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, 128, (4, 8)))
    with jax.set_mesh(mesh8):
        sharded = load_hf(tmp_path, mesh=mesh8)
        logits = jax.jit(lambda m, t: m(t))(sharded, tokens)
    assert tuple(sharded.layers[1].self_attn.k_proj[...].sharding.spec) == ("fsdp", "tensor", None)
    np.testing.assert_allclose(logits, model(tokens), atol=1e-5)
    save_hf(model, tmp_path)  # re-saving as one file removes the stale shards
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]


def test_bf16_checkpoint_loads_in_float32(tmp_path, tiny_config):
    model = create_model(tiny_config.replace(param_dtype="bfloat16"), seed=6)
    save_hf(model, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["model.norm.weight"].dtype.name == "bfloat16"
    loaded = load_hf(tmp_path, dtype=jnp.float32)
    assert loaded.layers[0].mlp.up_proj[...].dtype == jnp.float32
    np.testing.assert_array_equal(loaded.layers[0].mlp.up_proj[...],
                                  model.layers[0].mlp.up_proj[...].astype(jnp.float32))


def test_mismatched_shape_names_tensor_and_shapes(tmp_path, tiny_config):
    save_hf(create_model(tiny_config), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((97, 64), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight has shape \(97, 64\) but "
                                              r"the config needs \(96, 64\)"):
        load_hf(tmp_path)


def test_fused_phi3_tensors_are_checked_whole_and_refused_as_peft_targets(tmp_path, tiny_config):
    from jaxalign.models import lora

    config = tiny_config.replace(architecture="phi3")
    model = create_model(config, seed=2)
    save_hf(model, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    qkv = tensors["model.layers.1.self_attn.qkv_proj.weight"]
    heads = config.num_heads + 2 * config.num_kv_heads
    assert qkv.shape == (heads * config.head_dim, config.hidden_size)
    np.testing.assert_array_equal(load_hf(tmp_path).layers[1].self_attn.v_proj[...],
                                  model.layers[1].self_attn.v_proj[...])
    tensors["model.layers.1.self_attn.qkv_proj.weight"] = qkv[:-2]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    rows = heads * config.head_dim
    with pytest.raises(CheckpointError, match=rf"qkv_proj\.weight has shape \({rows - 2}, 64\) but the config "
                                              rf"needs \({rows}, 64\)"):
        load_hf(tmp_path)
    adapters = lora.LoRAConfig(rank=2, targets=("q_proj", "o_proj"))
    with pytest.raises(ValueError, match="phi3 checkpoints fuse q_proj into one module"):
        lora.save_peft(lora.with_adapters(model, adapters), adapters, tmp_path / "peft")


def test_missing_tensor_and_unsafe_formats(tmp_path, tiny_config):
    save_hf(create_model(tiny_config), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.v_proj\.weight is missing"):
        load_hf(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickle"):
        load_hf(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_hf(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="mistral checkpoints have no biases"):
        save_hf(create_model(tiny_config.replace(architecture="mistral", qkv_bias=True)), tmp_path / "x")


def test_config_overrides(tmp_path, tiny_config):
    save_hf(create_model(tiny_config), tmp_path)
    assert load_hf(tmp_path, config_overrides={"attention_impl": "dot_product"}).config.attention_impl == "dot_product"
    with pytest.raises(ValueError, match="attention_impl='flash'"):
        load_hf(tmp_path, config_overrides={"attention_impl": "flash"})
