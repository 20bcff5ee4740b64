"""Configuration of the Llama-family decoder (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 dense, Phi-3, Gemma 2,
Gemma 3 text, SmolLM2).

The config is a frozen, hashable dataclass: it lives in the model's static graph definition, so
``jax.jit`` can cache on it. Dtypes are stored as strings for the same reason.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mixtral",
                           "qwen3_moe")
ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU; GeGLU with the tanh GELU (Gemma)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# "xla": explicit einsum attention (any mask, KV cache); "dot_product": jax.nn.dot_product_attention with
# XLA's choice of kernel; "cudnn": its cuDNN flash-attention kernel (NVIDIA GPUs, bf16/fp16); "pallas": jaxalign's
# blocked Pallas kernels (models.flash; the mask from segment vectors, any row layout, no [B, T, S] mask; interpret
# mode on the CPU) for forwards without a KV cache, the einsum path with one.
ATTENTION_IMPLS = ("xla", "dot_product", "cudnn", "pallas")
REMAT_POLICIES = ("nothing", "dots", "dots_no_batch")
# ``scan_layers=None`` (auto) scans decoders with more than this many layers and unrolls the smaller ones.
SCAN_MIN_LAYERS = 4


# Sane bounds for a decoder's sizes (far above any released model), checked before anything is built.
SIZE_LIMITS = {"vocab_size": (1, 2**24), "hidden_size": (1, 2**16), "intermediate_size": (1, 2**20),
               "num_layers": (1, 1024), "num_heads": (1, 1024), "num_kv_heads": (1, 1024), "head_dim": (0, 2**13),
               "max_position_embeddings": (1, 2**26), "sliding_window": (0, 2**26), "num_experts": (0, 2**14),
               "num_experts_per_tok": (1, 2**14), "moe_intermediate_size": (0, 2**20),
               "query_pre_attn_scalar": (0, 2**20)}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``rope_type``: ``default`` | ``linear`` | ``llama3``."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of one decoder. Defaults describe the tiny test model (0.14M parameters).

    ``qkv_bias``/``o_bias``: Qwen2 has biases on q, k, v only; Llama's and Qwen3's ``attention_bias`` puts them on
    all four. ``qk_norm``: an RMSNorm over ``head_dim`` on each query and key head before RoPE (Qwen3, Gemma 3).

    Gemma: ``norm_offset=1`` (RMSNorm scales by ``1 + weight``, in float32), ``embed_scale`` (embeddings times
    ``sqrt(hidden_size)``), ``sandwich_norms`` (an RMSNorm on the attention and MLP outputs before each residual,
    and ``pre_feedforward_layernorm`` before the MLP), ``hidden_act='gelu_tanh'``, ``query_pre_attn_scalar``
    (attention scale ``query_pre_attn_scalar ** -0.5``; 0 = ``head_dim``), ``attn_softcap`` / ``final_softcap``
    (``cap · tanh(x / cap)`` on attention scores / final logits; 0 = off) and ``local_rope_theta`` (Gemma 3: the
    sliding-window layers' RoPE base, without ``rope_scaling``; 0 = every layer uses ``rope_theta``).

    Mixture of experts (Mixtral, Qwen3-MoE): ``num_experts`` (0 = dense) SwiGLU experts of
    ``moe_intermediate_size``, ``num_experts_per_tok`` routed per token (softmax, top-k, renormalised with
    ``norm_topk_prob``), ``moe_layers`` (per layer, whether it is sparse; default all), and
    ``router_aux_loss_coef``: the load-balancing loss' weight in training.
    ``sliding_window_layers``: per layer, whether the sliding window applies (Mistral: all; Qwen2: per
    ``layer_types``). ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype.
    """

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norm_offset: float = 0.0
    embed_scale: bool = False
    sandwich_norms: bool = False
    hidden_act: str = "silu"
    query_pre_attn_scalar: int = 0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    local_rope_theta: float = 0.0
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0  # 0: intermediate_size
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0
    moe_layers: tuple[bool, ...] = ()
    sliding_window: int = 0  # 0: none
    sliding_window_layers: tuple[bool, ...] = ()
    architecture: str = "llama"
    attention_impl: str = "xla"
    remat: bool = False
    remat_policy: str = "nothing"  # with remat: what each layer keeps (models.llama.REMAT_POLICIES)
    scan_layers: bool | None = None  # run repeated layers under lax.scan; None: when num_layers > SCAN_MIN_LAYERS
    dtype: str = "float32"
    param_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    num_labels: int = 0  # 0: a causal LM (LM head); 1: a reward model (scalar ``score`` head, no LM head)

    def __post_init__(self):
        out_of_range = [f"{name}={getattr(self, name)!r} must be an integer in [{low}, {high}]"
                        for name, (low, high) in SIZE_LIMITS.items()
                        if not (isinstance(getattr(self, name), int) and low <= getattr(self, name) <= high)]
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0
                    and (name != "rms_norm_eps" or value < 1)):
                out_of_range.append(f"{name}={value!r} must be a finite number "
                                    + ("in (0, 1)" if name == "rms_norm_eps" else "> 0"))
        if out_of_range:  # checked first: a hostile config.json must not divide by zero or build 10^9 layers
            raise ValueError("invalid LlamaConfig: " + "; ".join(out_of_range))
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if isinstance(self.moe_layers, list):
            object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        if self.num_experts and not self.moe_layers:
            object.__setattr__(self, "moe_layers", (True,) * self.num_layers)
        if self.num_experts and not self.moe_intermediate_size:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        if self.sliding_window and not self.sliding_window_layers:
            object.__setattr__(self, "sliding_window_layers", (True,) * self.num_layers)
        problems = []
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            problems.append(f"architecture {self.architecture!r} (supported: {SUPPORTED_ARCHITECTURES})")
        if self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.sliding_window_layers and len(self.sliding_window_layers) != self.num_layers:
            problems.append(f"sliding_window_layers has {len(self.sliding_window_layers)} entries for "
                            f"{self.num_layers} layers")
        if self.qk_norm != (self.architecture in ("qwen3", "gemma3_text", "qwen3_moe")):
            problems.append(f"qk_norm={self.qk_norm} with architecture {self.architecture!r}: Qwen3 and Gemma 3 "
                            "normalise q and k per head, the others do not")
        if self.num_experts < 0 or (self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts):
            problems.append(f"num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}: need "
                            "1 <= num_experts_per_tok <= num_experts (or num_experts=0, dense)")
        if self.moe_layers and (not self.num_experts or len(self.moe_layers) != self.num_layers):
            problems.append(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers"
                            + ("" if self.num_experts else " but num_experts=0"))
        if (self.architecture in ("mixtral", "qwen3_moe")) != bool(self.num_experts):
            problems.append(f"architecture {self.architecture!r} with num_experts={self.num_experts}: mixtral and "
                            "qwen3_moe are the mixture-of-experts architectures")
        if self.hidden_act not in ACTIVATIONS:
            problems.append(f"hidden_act={self.hidden_act!r} (supported: {ACTIVATIONS})")
        for name in ("norm_offset", "query_pre_attn_scalar", "attn_softcap", "final_softcap", "local_rope_theta"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                problems.append(f"{name}={value!r} must be a finite number >= 0")
        if self.attn_softcap and self.attention_impl != "xla":
            problems.append(f"attn_softcap={self.attn_softcap} (attention-score soft-capping, Gemma 2) needs "
                            f"attention_impl='xla', not {self.attention_impl!r}")
        if self.num_labels not in (0, 1):
            problems.append(f"num_labels={self.num_labels}: only 0 (causal LM) and 1 (a reward model's scalar head) "
                            "are supported")
        if self.remat_policy not in REMAT_POLICIES:
            problems.append(f"remat_policy={self.remat_policy!r} (supported: {REMAT_POLICIES})")
        if self.attention_impl not in ATTENTION_IMPLS:
            problems.append(f"attention_impl={self.attention_impl!r} (supported: {ATTENTION_IMPLS})")
        for name in ("dtype", "param_dtype"):
            try:
                jnp.dtype(getattr(self, name))
            except TypeError:
                problems.append(f"{name}={getattr(self, name)!r} is not a dtype name")
        if problems:
            raise ValueError("invalid LlamaConfig: " + "; ".join(problems))

    def replace(self, **changes) -> LlamaConfig:
        return dataclasses.replace(self, **changes)

    @property
    def scans(self) -> bool:
        """Whether the forward pass runs the decoder's repeated layers under ``lax.scan`` (``scan_layers``)."""
        return self.num_layers > SCAN_MIN_LAYERS if self.scan_layers is None else bool(self.scan_layers)

    def layer_window(self, layer: int) -> int:
        """Sliding-window size of ``layer`` (0 = full attention)."""
        if self.sliding_window and self.sliding_window_layers and self.sliding_window_layers[layer]:
            return self.sliding_window
        return 0

    def num_params(self) -> int:
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        attn += self.qkv_bias * hd * (self.num_heads + 2 * self.num_kv_heads) + self.o_bias * d
        mlp = 3 * d * self.intermediate_size + self.mlp_bias * (2 * self.intermediate_size + d)
        experts = self.num_experts * 3 * d * self.moe_intermediate_size + d * self.num_experts
        per_layer = attn + (4 if self.sandwich_norms else 2) * d + self.qk_norm * 2 * hd
        mlps = sum(experts if self.is_moe(i) else mlp for i in range(self.num_layers))
        head = d * self.num_labels if self.num_labels else 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.num_layers * per_layer + mlps + self.vocab_size * d + d + head

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of training on one token of a ``seq_len``-slot row, forward and backward (the PaLM formula):
        6 x the weights a token is multiplied by (the LM or score head, not the embedding lookup; a mixture of
        experts' routed ``num_experts_per_tok`` experts, not all of them) + 12 x layers x heads x head_dim x
        ``seq_len`` for attention over the whole row (causal masking not subtracted). A forward pass is a third."""
        d, ffn = self.hidden_size, self.moe_intermediate_size
        unused = sum(3 * d * ffn * (self.num_experts - self.num_experts_per_tok)
                     for i in range(self.num_layers) if self.is_moe(i))
        lookup = 0 if self.tie_word_embeddings and not self.num_labels else self.vocab_size * d
        weights = self.num_params() - lookup - unused
        return 6 * weights + 12 * self.num_layers * self.num_heads * self.head_dim * seq_len

    def is_moe(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return bool(self.num_experts) and self.moe_layers[layer]

    def local_rope(self, layer: int) -> bool:
        """Whether ``layer`` takes the local RoPE (``local_rope_theta``, no scaling): Gemma 3's sliding layers."""
        return bool(self.local_rope_theta) and self.layer_window(layer) > 0

    def inv_freq(self, local: bool = False) -> np.ndarray:
        """Rotary inverse frequencies ``[head_dim // 2]`` (float64), after ``rope_scaling``; ``local``: the
        sliding layers' (``local_rope_theta``, unscaled)."""
        theta = self.local_rope_theta if local else self.rope_theta
        inv = 1.0 / (theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
        if local:
            return inv
        scaling = self.rope_scaling
        if scaling.rope_type == "linear":
            return inv / scaling.factor
        if scaling.rope_type == "llama3":
            # Llama 3.1: leave high frequencies, divide low ones by `factor`, interpolate in between.
            low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
            high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
            smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
                      / (scaling.high_freq_factor - scaling.low_freq_factor))
            smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return np.where(medium, smoothed, scaled)
        return inv
