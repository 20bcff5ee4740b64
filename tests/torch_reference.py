"""Random tiny transformers (PyTorch) models saved with ``save_pretrained``: the parity reference."""

import numpy as np

torch = __import__("pytest").importorskip("torch")
transformers = __import__("transformers")

ARCH_CONFIGS = {
    # GQA + Llama-3 rope scaling
    "llama": dict(cls="LlamaConfig", rope_theta=500000.0, max_position_embeddings=64,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    # sliding window shorter than the test sequences, linear rope scaling, explicit head_dim
    "mistral": dict(cls="MistralConfig", sliding_window=5, head_dim=24,
                    rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # q/k/v biases, tied embeddings
    "qwen2": dict(cls="Qwen2Config", tie_word_embeddings=True),
    # per-head q/k RMSNorm, attention_bias on q, k, v and o, explicit head_dim, the second layer sliding
    "qwen3": dict(cls="Qwen3Config", head_dim=24, attention_bias=True, use_sliding_window=True, sliding_window=5,
                  max_window_layers=1),
    # fused qkv_proj and gate_up_proj in the checkpoint, a sliding window over every layer
    "phi3": dict(cls="Phi3Config", sliding_window=5),
    # (1 + w) norms, scaled embeddings, sandwich norms, GeGLU, query_pre_attn_scalar, alternating sliding layers,
    # attention and final soft-capping (weights large enough that the caps bend the values)
    "gemma2": dict(cls="Gemma2Config", head_dim=24, query_pre_attn_scalar=20, sliding_window=5,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0, initializer_range=0.3),
    # Gemma 3 text: q/k norms, a local RoPE base on the sliding layers, linear scaling on the global ones
    "gemma3_text": dict(cls="Gemma3TextConfig", model="Gemma3ForCausalLM", head_dim=24, query_pre_attn_scalar=24,
                        sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                            "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                        initializer_range=0.1),
    # 4 experts, top 2 renormalised, sliding window; Mixtral's block_sparse_moe.experts.E.w1/w2/w3 on disk
    "mixtral": dict(cls="MixtralConfig", num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                    initializer_range=0.1),
    # q/k norms, 4 experts of their own width, top 2 not renormalised, the second layer dense (mlp_only_layers)
    "qwen3_moe": dict(cls="Qwen3MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                      norm_topk_prob=False, mlp_only_layers=[1], head_dim=24, initializer_range=0.1),
}


def make_reference(arch: str, folder, seed: int = 0, **overrides):
    """Builds, randomises (biases too) and saves a tiny model; returns the eval-mode torch model."""
    kwargs = dict(ARCH_CONFIGS[arch])
    cls = getattr(transformers, kwargs.pop("cls"))
    model_cls = kwargs.pop("model", cls.__name__.replace("Config", "ForCausalLM"))
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = cls(**{**base, **kwargs, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(str(folder))
    return model


def torch_logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long))
    return out.logits.float().numpy()


def jax_grads_by_hf_name(grads_state) -> dict[str, np.ndarray]:
    """An ``nnx.State`` of gradients (our layout) as HF-named, HF-shaped arrays, to compare with ``param.grad``."""
    from flax import nnx

    from jaxalign.models.hf import hf_layout, to_hf

    out = {}
    for path, value in nnx.to_flat_state(grads_state):
        name, kind = hf_layout(path)
        out[name] = np.array(to_hf(kind, np.asarray(value.get_value() if hasattr(value, "get_value") else value)))
    return out


def assert_grads_match(torch_model, jax_grads: dict[str, np.ndarray], rtol: float = 1e-4) -> None:
    """Every trained tensor's gradient: ``|g_jax − g_torch| / |g_torch| <= rtol`` (Frobenius norms)."""
    seen = 0
    for name, param in torch_model.named_parameters():
        if param.grad is None or name not in jax_grads:
            continue
        expected = param.grad.double().numpy()
        got = jax_grads[name].astype(np.float64)
        err = np.linalg.norm(got - expected) / max(np.linalg.norm(expected), 1e-12)
        assert err <= rtol, f"{name}: relative gradient error {err:.2e}"
        seen += 1
    assert seen == len(jax_grads), f"compared {seen} of {len(jax_grads)} tensors"
