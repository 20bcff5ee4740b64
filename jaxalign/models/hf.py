"""Hugging Face checkpoints in and out: ``config.json`` + safetensors (single file or sharded with an index).

``load_hf`` reads tensors lazily, one at a time, and places each straight into its target sharding.
``save_hf`` writes a folder that ``transformers.AutoModelForCausalLM`` loads. Pickle checkpoints
(``pytorch_model.bin``) are refused: safetensors only.

Parameter layout: our kernels are ``[in..., out...]`` with heads split out (q: ``[D, H, hd]``,
o: ``[H, hd, D]``); Hugging Face stores ``[out, in]``. ``hf_layout`` names the HF tensor and the rule.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxalign.models.config import SUPPORTED_ARCHITECTURES, LlamaConfig, RopeScaling
from jaxalign.models.factory import abstract_model, build_model
from jaxalign.models.llama import LlamaForCausalLM, layer_paths
from jaxalign.parallel.mesh import Rules

_HF_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
             "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
GEMMA = ("gemma2", "gemma3_text")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_ARCH_FROM_CLASS = {cls: arch for arch, cls in _HF_CLASS.items()}
_ARCH_FROM_CLASS.update({cls.replace("ForCausalLM", "ForSequenceClassification"): arch
                         for arch, cls in _HF_CLASS.items()})


class CheckpointError(ValueError):
    """A checkpoint folder or file that cannot be read as this model; the message names what is wrong."""


# ---------------------------------------------------------------------------------------------- config


def config_from_hf(hf: Mapping[str, Any], *, dtype: str = "float32", param_dtype: str | None = None,
                   source: str = "config.json") -> LlamaConfig:
    """``LlamaConfig`` from a Hugging Face ``config.json`` dict (old ``rope_theta``/``rope_scaling`` spelling
    or transformers v5's ``rope_parameters``)."""
    arch = hf.get("model_type")
    if arch == "gemma3" or "Gemma3ForConditionalGeneration" in (hf.get("architectures") or []):
        raise CheckpointError(f"{source}: a Gemma 3 image-text checkpoint (Gemma3ForConditionalGeneration); jaxalign "
                              "loads the text-only Gemma3ForCausalLM (gemma3_text), e.g. gemma-3-1b")
    if arch not in SUPPORTED_ARCHITECTURES:
        classes = hf.get("architectures") or []
        arch = next((_ARCH_FROM_CLASS[c] for c in classes if c in _ARCH_FROM_CLASS), arch)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{source}: unsupported architecture model_type={hf.get('model_type')!r} "
            f"(architectures={hf.get('architectures')}); supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise CheckpointError(f"{source}: hidden_act={act!r} is not supported (silu / SwiGLU, gelu_pytorch_tanh / "
                              "GeGLU)")
    try:
        rope_params = dict(hf.get("rope_parameters") or {})
        local_theta = 0.0
        if "full_attention" in rope_params:  # transformers v5, Gemma 3: one entry per layer type
            local_theta = float((rope_params.get("sliding_attention") or {}).get("rope_theta", 10000.0))
            rope_params = dict(rope_params["full_attention"])
        elif arch == "gemma3_text":
            local_theta = float(hf.get("rope_local_base_freq", 10000.0))
        scaling = dict(hf.get("rope_scaling") or rope_params)
        rope_theta = float(rope_params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise CheckpointError(f"{source}: rope type {rope_type!r} is not supported "
                                  "(supported: default, linear, llama3)")
        partial = float(rope_params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
        if partial != 1.0:
            raise CheckpointError(f"{source}: partial_rotary_factor={partial} (RoPE on part of each head) is not "
                                  "supported")
        rope = RopeScaling(
            rope_type=rope_type,
            factor=float(scaling.get("factor", 1.0)),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)))
        num_heads = int(hf["num_attention_heads"])
        num_layers = int(hf["num_hidden_layers"])
        hidden = int(hf["hidden_size"])
        window, window_layers = 0, ()
        if arch in ("mistral", "phi3", "mixtral") and hf.get("sliding_window"):
            window = int(hf["sliding_window"])
        if arch in GEMMA and hf.get("sliding_window"):  # local / global layers: layer_types, or the old pattern
            window = int(hf["sliding_window"])
            every = 2 if arch == "gemma2" else int(hf.get("sliding_window_pattern", 6))
            window_layers = tuple(bool((i + 1) % every) for i in range(num_layers))
        if arch in ("qwen2", "qwen3", "qwen3_moe") and hf.get("sliding_window") and hf.get("use_sliding_window",
                                                                                             False):
            window = int(hf["sliding_window"])
            first = int(hf.get("max_window_layers", num_layers))
            window_layers = tuple(i >= first for i in range(num_layers))
        if hf.get("layer_types") and window:
            window_layers = tuple(t == "sliding_attention" for t in hf["layer_types"])
        attention_bias = bool(hf.get("attention_bias", False))
        return LlamaConfig(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch in GEMMA)),
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=arch in ("llama", "qwen3", "qwen3_moe", *GEMMA) and attention_bias,
            qk_norm=arch in ("qwen3", "gemma3_text", "qwen3_moe"),
            **_moe_fields(hf, arch, num_layers),
            hidden_act=_ACTIVATIONS[act],
            **(dict(norm_offset=1.0, embed_scale=True, sandwich_norms=True,
                    query_pre_attn_scalar=int(hf.get("query_pre_attn_scalar") or 0),
                    attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
                    final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
                    local_rope_theta=local_theta) if arch in GEMMA else {}),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=window,
            sliding_window_layers=window_layers,
            architecture=arch,
            dtype=dtype,
            param_dtype=param_dtype or dtype,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            num_labels=_num_labels(hf, source),
        )
    except KeyError as err:
        raise CheckpointError(f"{source}: missing field {err.args[0]!r}") from None
    except (TypeError, ValueError, OverflowError) as err:
        if isinstance(err, CheckpointError):
            raise
        message = str(err)
        for ours, theirs in _HF_FIELD_NAMES.items():
            message = re.sub(rf"\b{ours}=", f"{theirs}=", message)
        raise CheckpointError(f"{source}: {message}") from None


def _moe_fields(hf: Mapping[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral / Qwen3-MoE ``config.json`` (none for dense models)."""
    if arch == "mixtral":
        return dict(num_experts=int(hf.get("num_local_experts", 8)),
                    num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)), norm_topk_prob=True,
                    router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))
    if arch == "qwen3_moe":
        dense = set(hf.get("mlp_only_layers") or [])
        step = int(hf.get("decoder_sparse_step", 1))
        return dict(num_experts=int(hf.get("num_experts") or hf.get("num_local_experts", 128)),
                    num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
                    moe_intermediate_size=int(hf.get("moe_intermediate_size", 768)),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
                    moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)))
    return {}


def _num_labels(hf: Mapping[str, Any], source: str) -> int:
    """0 for a causal LM; 1 for a ``*ForSequenceClassification`` reward model (one label), else an error."""
    if not any(str(c).endswith("ForSequenceClassification") for c in hf.get("architectures") or []):
        return 0
    labels = len(hf["id2label"]) if isinstance(hf.get("id2label"), Mapping) else int(hf.get("num_labels", 2))
    if labels != 1:
        raise CheckpointError(f"{source}: a sequence classifier with {labels} labels; jaxalign loads reward models "
                              "(num_labels=1) only")
    return 1


# our config field -> the config.json field it comes from (for messages about a config.json)
_HF_FIELD_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                   "num_kv_heads": "num_key_value_heads"}


def config_to_hf(config: LlamaConfig) -> dict[str, Any]:
    """``config.json`` contents for ``config`` (legacy ``rope_theta``/``rope_scaling`` spelling, which
    transformers 4.x and 5.x both read)."""
    arch = config.architecture
    if arch == "qwen2" and (not config.qkv_bias or config.o_bias):
        raise CheckpointError("qwen2 checkpoints need q/k/v biases and no o_proj bias")
    if arch in ("mistral", "phi3") and (config.qkv_bias or config.o_bias or config.mlp_bias):
        raise CheckpointError(f"{arch} checkpoints have no biases; save as architecture='llama'")
    if arch == "phi3" and config.sliding_window and not all(config.sliding_window_layers):
        raise CheckpointError("phi3's sliding window covers every layer; save per-layer windows as 'qwen2'")
    gemma = dict(norm_offset=1.0, embed_scale=True, sandwich_norms=True, hidden_act="gelu_tanh")
    if (arch in GEMMA) != all(getattr(config, k) == v for k, v in gemma.items()):
        raise CheckpointError(f"architecture {arch!r}: Gemma checkpoints (and only they) have (1 + weight) norms, "
                              "scaled embeddings, sandwich norms and GeGLU")
    if arch not in GEMMA and (config.attn_softcap or config.final_softcap or config.local_rope_theta
                              or config.query_pre_attn_scalar):
        raise CheckpointError(f"architecture {arch!r} has no soft-capping, local RoPE base or query_pre_attn_scalar")
    if arch == "gemma2" and config.local_rope_theta:
        raise CheckpointError("gemma2 uses one RoPE base for every layer; a local base is gemma3_text's")
    if arch == "mixtral" and not (config.norm_topk_prob and all(config.moe_layers)):
        raise CheckpointError("mixtral renormalises the top-k router weights in every (sparse) layer; save other "
                              "routings as 'qwen3_moe'")
    if arch in ("llama", "qwen3", "qwen3_moe", *GEMMA) and config.qkv_bias != config.o_bias:
        raise CheckpointError(f"{arch}'s attention_bias puts biases on q, k, v and o alike; "
                              "save q/k/v-only biases as architecture='qwen2'")
    rope_scaling = None
    if config.rope_scaling.rope_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": config.rope_scaling.factor}
    elif config.rope_scaling.rope_type == "llama3":
        rope_scaling = {"rope_type": "llama3", "factor": config.rope_scaling.factor,
                        "low_freq_factor": config.rope_scaling.low_freq_factor,
                        "high_freq_factor": config.rope_scaling.high_freq_factor,
                        "original_max_position_embeddings": config.rope_scaling.original_max_position_embeddings}
    out: dict[str, Any] = {
        "architectures": [_HF_CLASS[arch].replace("ForCausalLM", "ForSequenceClassification") if config.num_labels
                          else _HF_CLASS[arch]],
        "model_type": arch,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_id) if isinstance(config.eos_token_id, tuple)
        else config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "torch_dtype": config.param_dtype,
        "use_cache": True,
    }
    if config.num_labels:
        out.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    if arch == "llama":
        out.update(attention_bias=config.qkv_bias, mlp_bias=config.mlp_bias)
    if arch in ("qwen3", "qwen3_moe"):
        out["attention_bias"] = config.qkv_bias
    if arch == "mixtral":
        out.update(num_local_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                   router_aux_loss_coef=config.router_aux_loss_coef, sliding_window=config.sliding_window or None)
    if arch == "qwen3_moe":
        out.update(num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                   moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
                   router_aux_loss_coef=config.router_aux_loss_coef, decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(config.num_layers) if not config.is_moe(i)])
    if arch == "mistral":
        out["sliding_window"] = config.sliding_window or None
    if arch == "phi3":
        out.update(sliding_window=config.sliding_window or None,
                   original_max_position_embeddings=config.max_position_embeddings)
    if arch in GEMMA:
        del out["hidden_act"]
        out.update(hidden_activation="gelu_pytorch_tanh", attention_bias=config.qkv_bias,
                   query_pre_attn_scalar=config.query_pre_attn_scalar or config.head_dim,
                   attn_logit_softcapping=config.attn_softcap or None,
                   final_logit_softcapping=config.final_softcap or None, sliding_window=config.sliding_window or None,
                   layer_types=["sliding_attention" if config.layer_window(i) else "full_attention"
                                for i in range(config.num_layers)])
    if arch == "gemma3_text":
        out["rope_local_base_freq"] = config.local_rope_theta or config.rope_theta
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        out["use_sliding_window"] = bool(config.sliding_window)
        out["sliding_window"] = config.sliding_window or None
        out["max_window_layers"] = config.num_layers
        out["layer_types"] = ["sliding_attention" if config.layer_window(i) else "full_attention"
                              for i in range(config.num_layers)]
    return out


# ---------------------------------------------------------------------------------------------- layout

# (our path pattern, HF name template, kind). kind "linear:N" = kernel whose first N dims are inputs.
_LAYOUT = (
    (r"embed_tokens", "model.embed_tokens.weight", "copy"),
    (r"norm\.weight", "model.norm.weight", "copy"),
    (r"lm_head", "lm_head.weight", "linear:1"),
    (r"score", "score.weight", "linear:1"),
    (r"layers\.(\d+)\.(input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|"
     r"post_feedforward_layernorm)\.weight", "model.layers.{0}.{1}.weight", "copy"),
    (r"layers\.(\d+)\.self_attn\.([qkv])_proj", "model.layers.{0}.self_attn.{1}_proj.weight", "linear:1"),
    (r"layers\.(\d+)\.self_attn\.o_proj", "model.layers.{0}.self_attn.o_proj.weight", "linear:2"),
    (r"layers\.(\d+)\.self_attn\.([qkv])_bias", "model.layers.{0}.self_attn.{1}_proj.bias", "flat"),
    (r"layers\.(\d+)\.self_attn\.o_bias", "model.layers.{0}.self_attn.o_proj.bias", "copy"),
    (r"layers\.(\d+)\.self_attn\.([qk])_norm\.weight", "model.layers.{0}.self_attn.{1}_norm.weight", "copy"),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_proj", "model.layers.{0}.mlp.{1}_proj.weight", "linear:1"),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_bias", "model.layers.{0}.mlp.{1}_proj.bias", "copy"),
    (r"layers\.(\d+)\.mlp\.router", "model.layers.{0}.mlp.gate.weight", "linear:1"),
    # one [E, in, out] array <-> E tensors [out, in], the per-expert layout of the Hub and of transformers' save
    (r"layers\.(\d+)\.mlp\.experts_(gate|up|down)", "model.layers.{0}.mlp.experts.{{e}}.{1}_proj.weight", "experts"),
)
# Mixtral's names for the same tensors
_MIXTRAL_NAMES = ((".mlp.gate.", ".block_sparse_moe.gate."), (".mlp.experts.", ".block_sparse_moe.experts."),
                  (".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2."))


def arch_name(config: LlamaConfig, name: str) -> str:
    """An HF tensor name as ``config.architecture`` spells it (Mixtral's ``block_sparse_moe.experts.E.w1``)."""
    if config.architecture == "mixtral" and (".mlp.gate." in name or ".mlp.experts." in name):
        for ours, theirs in _MIXTRAL_NAMES:
            name = name.replace(ours, theirs)
    return name


def expert_names(config: LlamaConfig, template: str) -> list[str]:
    """The per-expert tensor names of an ``experts`` entry (``...experts.{e}...``), in expert order."""
    return [arch_name(config, template.format(e=e)) for e in range(config.num_experts)]


# Phi-3 stores q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (rows stacked in this order): split
# on load, fused again on save
_FUSED = {"phi3": {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}}


def fused_rows(config: LlamaConfig, name: str) -> tuple[str, int, int, int] | None:
    """For a per-projection HF name (``...self_attn.k_proj.weight``) of an architecture that fuses it, the fused
    tensor's name, the part's rows ``[start, stop)`` and the fused tensor's row count; None when the tensor is
    stored on its own."""
    for fused, parts in _FUSED.get(config.architecture, {}).items():
        owner = fused.split(".")[0]
        match = re.fullmatch(rf"model\.layers\.(\d+)\.{owner}\.({'|'.join(parts)})\.weight", name)
        if match:
            hd, f = config.head_dim, config.intermediate_size
            rows = {"q_proj": config.num_heads * hd, "k_proj": config.num_kv_heads * hd,
                    "v_proj": config.num_kv_heads * hd, "gate_proj": f, "up_proj": f}
            start = sum(rows[p] for p in parts[:parts.index(match.group(2))])
            return (f"model.layers.{match.group(1)}.{fused}.weight", start, start + rows[match.group(2)],
                    sum(rows[p] for p in parts))
    return None


def hf_layout(path: tuple) -> tuple[str, str]:
    dotted = ".".join(str(p) for p in path)
    for pattern, template, kind in _LAYOUT:
        match = re.fullmatch(pattern, dotted)
        if match:
            return template.format(*match.groups()), kind
    raise KeyError(f"no Hugging Face name for parameter {dotted}")


def hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the HF tensor that holds one of our parameters of ``shape``."""
    if kind == "copy":
        return shape
    if kind == "flat":
        return (math.prod(shape),)
    n_in = int(kind.split(":")[1])
    return (math.prod(shape[n_in:]), math.prod(shape[:n_in]))


def from_hf(kind: str, tensor: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """HF tensor -> our layout."""
    if kind.startswith("linear"):
        return np.ascontiguousarray(tensor.T).reshape(shape)
    return tensor.reshape(shape)


def to_hf(kind: str, array: np.ndarray) -> np.ndarray:
    """Our layout -> HF tensor."""
    shape = hf_shape(kind, array.shape)
    if kind.startswith("linear"):
        return np.ascontiguousarray(array.reshape(shape[1], shape[0]).T)
    return array.reshape(shape)


# ---------------------------------------------------------------------------------------------- loading


# safetensors dtype -> bytes per element (the format's own names)
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_ST_FLOAT = {"F16", "BF16", "F32", "F64"}
_MAX_HEADER = 100 * 2**20  # safetensors itself refuses headers over 100 MB


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor as a safetensors header describes it (checked against the file before any read)."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


def read_safetensors_header(file: Path) -> dict[str, TensorEntry]:
    """The tensors a safetensors file holds, validated against the file itself: header length within the file,
    every dtype known, every shape a list of non-negative integers whose size matches its byte range, every range
    inside the data section and none overlapping. Raises ``CheckpointError`` naming the file and the tensor."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{file}: not a safetensors file ({size} bytes, shorter than its header length)")
        length = int.from_bytes(prefix, "little")
        if length > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{file}: the header claims {length} bytes but the file has {size - 8} after the "
                                  "length field (truncated or not a safetensors file)")
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{file}: the safetensors header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: the safetensors header is not a JSON object")
    data_size = size - 8 - length
    entries, ranges = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{file}: tensor {name}"
        if not isinstance(info, dict) or info.get("dtype") not in _ST_ITEMSIZE:
            raise CheckpointError(f"{where}: unknown dtype {info.get('dtype') if isinstance(info, dict) else info!r}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_size):
            raise CheckpointError(f"{where}: data_offsets {offsets!r} lie outside the file's {data_size} data bytes "
                                  "(truncated or corrupt)")
        nbytes = math.prod(shape) * _ST_ITEMSIZE[info["dtype"]]
        if offsets[1] - offsets[0] != nbytes:
            raise CheckpointError(f"{where}: shape {tuple(shape)} of {info['dtype']} needs {nbytes} bytes but its "
                                  f"data_offsets span {offsets[1] - offsets[0]}")
        entries[name] = TensorEntry(file, info["dtype"], tuple(shape))
        ranges.append((offsets[0], offsets[1], name))
    ranges.sort()
    for (_, end, first), (start, _, second) in itertools.pairwise(ranges):
        if start < end:
            raise CheckpointError(f"{file}: tensors {first} and {second} overlap in the file")
    return entries


def _safetensors_files(folder: Path) -> dict[str, TensorEntry]:
    """Maps each tensor name to its (validated) entry in the safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index}: not a valid safetensors index ({err})") from None
        missing = sorted({f for f in weight_map.values() if not (folder / f).exists()})
        if missing:
            raise CheckpointError(f"{index} lists shard files that do not exist: {missing}")
        headers = {file: read_safetensors_header(folder / file) for file in set(weight_map.values())}
        absent = [name for name, file in weight_map.items() if name not in headers[file]]
        if absent:
            raise CheckpointError(f"{index} maps {absent[0]} to {weight_map[absent[0]]}, which does not hold it")
        return {name: headers[file][name] for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = (f" ({', '.join(pickles)} are pickle files, which jaxalign does not load for security; convert "
                "them to safetensors)" if pickles else "")
        raise CheckpointError(f"{folder}: no *.safetensors weights found{hint}")
    names: dict[str, TensorEntry] = {}
    for file in files:
        names.update(read_safetensors_header(file))
    return names


def new_score_head(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A reward head for a causal-LM checkpoint trained as a reward model: normal(0, 0.02), as transformers
    initialises ``score``, from ``seed``."""
    return (0.02 * np.random.default_rng([seed, 7]).standard_normal(shape)).astype(np.float32)


def per_layer_shapes(config: LlamaConfig) -> Iterator[tuple[tuple, tuple[int, ...]]]:
    """``(path, shape)`` of every parameter of a ``config`` model, per layer (``("layers", i, ...)``) whether or not
    the model stacks its layers (``scan_layers``)."""
    for path, variable in nnx.to_flat_state(nnx.state(abstract_model(config), nnx.Param)):
        shape = tuple(variable.shape)
        for layer_path, index in layer_paths(config, path):
            yield layer_path, shape if index is None else shape[1:]


def per_layer_arrays(model: LlamaForCausalLM) -> Iterator[tuple[tuple, np.ndarray]]:
    """``(path, host array)`` of every parameter of ``model``, per layer; each weight is gathered to the host once
    (a stacked one, then sliced there)."""
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        array = np.asarray(jax.device_get(variable.get_value()))
        for layer_path, index in layer_paths(model.config, path):
            yield layer_path, array if index is None else array[index]


def check_weights(files: Mapping[str, TensorEntry], config: LlamaConfig, folder: Path) -> None:
    """Every tensor ``config`` needs is in ``files`` with the shape it needs and a floating-point dtype (a reward
    model's ``score`` head may be missing: a causal LM becoming a reward model gets a new one)."""
    for our_path, shape in per_layer_shapes(config):
        name, kind = hf_layout(our_path)
        if kind == "experts":
            checks = [(n, hf_shape("linear:1", shape[1:])) for n in expert_names(config, name)]
        elif (fused := fused_rows(config, name)) is not None:
            checks = [(fused[0], (fused[3], config.hidden_size))]
        else:
            checks = [(arch_name(config, name), hf_shape(kind, shape))]
        for name, expected in checks:
            entry = files.get(name)
            if entry is None and name == "score.weight":
                continue
            if entry is None:
                raise CheckpointError(f"{folder}: tensor {name} is missing from the checkpoint "
                                      f"(needed for parameter {'.'.join(map(str, our_path))})")
            if entry.shape != expected:
                raise CheckpointError(f"{entry.file}: tensor {name} has shape {entry.shape} but the config needs "
                                      f"{expected}")
            if entry.dtype not in _ST_FLOAT:
                raise CheckpointError(f"{entry.file}: tensor {name} has dtype {entry.dtype}; weights must be "
                                      f"floating point ({', '.join(sorted(_ST_FLOAT))})")


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    config_path = Path(path) / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face model folder)")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_path}: invalid JSON ({err})") from None


def load_hf(path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None, mesh: Mesh | None = None,
            rules: Rules | None = None, config_overrides: Mapping[str, Any] | None = None,
            seed: int = 0) -> LlamaForCausalLM:
    """Loads a Hugging Face Llama / Mistral / Qwen2 / Qwen3 / Phi-3 / Gemma 2 / Gemma 3 (text) folder
    (``config.json`` + safetensors).

    ``dtype`` is the compute dtype and, unless ``param_dtype`` is given, the parameter dtype. With
    ``mesh``, each tensor is read once and placed directly into its ``NamedSharding``.
    ``config_overrides`` replaces config fields that are not in the checkpoint (e.g. ``attention_impl``).
    ``config_overrides={"num_labels": 1}`` loads a causal LM as a reward model: its LM head is dropped and a new
    ``score`` head is drawn from ``seed`` (a reward-model checkpoint keeps its own).
    Raises ``CheckpointError`` naming the tensor and both shapes when the weights do not fit the config.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{path}: not a directory (load_hf expects a Hugging Face model folder)")
    dtype_name = jnp.dtype(dtype).name
    config = config_from_hf(read_hf_config(folder), dtype=dtype_name,
                            param_dtype=jnp.dtype(param_dtype).name if param_dtype is not None else None,
                            source=str(folder / "config.json")).replace(**(config_overrides or {}))
    files = _safetensors_files(folder)
    check_weights(files, config, folder)  # every needed tensor present, shaped and typed right: before any read
    handles: dict[Path, Any] = {}
    used: set[str] = set()

    def handle(name: str):
        file = files[name].file
        if file not in handles:
            handles[file] = safe_open(str(file), framework="numpy")
        used.add(name)
        return handles[file]

    def load_tensor(our_path: tuple, shape: tuple[int, ...]) -> np.ndarray:
        name, kind = hf_layout(our_path)
        if name == "score.weight" and name not in files:
            return new_score_head(shape, seed)
        if kind == "experts":
            return np.stack([from_hf("linear:1", handle(n).get_tensor(n), shape[1:])
                             for n in expert_names(config, name)])
        if (fused := fused_rows(config, name)) is not None:
            return from_hf(kind, handle(fused[0]).get_slice(fused[0])[fused[1]:fused[2]], shape)
        name = arch_name(config, name)
        return from_hf(kind, handle(name).get_tensor(name), shape)

    try:
        model = build_model(config, load_tensor, mesh=mesh, rules=rules)
    finally:
        handles.clear()
    ignorable = re.compile(r".*rotary_emb\.inv_freq|lm_head\.weight")
    unused = sorted(n for n in files if n not in used and not ignorable.fullmatch(n))
    if unused:
        warnings.warn(f"{folder}: {len(unused)} tensors were not used: {unused[:5]}", stacklevel=2)
    return model


# ---------------------------------------------------------------------------------------------- saving


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", size.upper())
    if not match:
        raise ValueError(f"max_shard_size={size!r}: expected bytes or a size like '5GB', '500MB'")
    return int(float(match.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}[match.group(2)])


def save_hf(model: LlamaForCausalLM, path: str | os.PathLike, *, max_shard_size: int | str = "5GB",
            tokenizer=None) -> None:
    """Writes ``config.json`` + safetensors (sharded with an index above ``max_shard_size``) that
    ``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads; also the tokenizer if given.

    Tensors are gathered to the host one at a time, in the parameter dtype.
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    limit = _parse_size(max_shard_size)
    shards: list[dict[str, np.ndarray]] = [{}]
    shard_bytes = 0
    pending: dict[str, dict[int, np.ndarray]] = {}  # fused tensors (Phi-3) until all their parts are read
    for our_path, array in per_layer_arrays(model):
        name, kind = hf_layout(our_path)
        if kind == "experts":
            items = [(n, to_hf("linear:1", array[e])) for e, n in enumerate(expert_names(config, name))]
        elif (fused := fused_rows(config, name)) is not None:
            parts = pending.setdefault(fused[0], {})
            parts[fused[1]] = to_hf(kind, array)
            if sum(len(p) for p in parts.values()) < fused[3]:
                continue
            items = [(fused[0], np.concatenate([parts[start] for start in sorted(parts)]))]
            del pending[fused[0]]
        else:
            items = [(arch_name(config, name), to_hf(kind, array))]
        for name, tensor in items:
            if shards[-1] and shard_bytes + tensor.nbytes > limit:
                shards.append({})
                shard_bytes = 0
            shards[-1][name] = tensor
            shard_bytes += tensor.nbytes
    for stale in [*folder.glob("model*.safetensors"), folder / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / file), metadata=metadata)
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(t.nbytes for shard in shards for t in shard.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(config_to_hf(config), indent=2))
    generation = {k: v for k, v in (("bos_token_id", config.bos_token_id), ("pad_token_id", config.pad_token_id),
                                    ("eos_token_id", config_to_hf(config)["eos_token_id"])) if v is not None}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
