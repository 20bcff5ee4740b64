"""Flax NNX decoder for the Llama family (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 dense, Phi-3, Gemma 2, Gemma 3
text, SmolLM2), one config for all.

RMSNorm (or Gemma's ``1 + weight`` form), rotary embeddings (default / linear / Llama-3 scaling; a local base for
sliding layers), grouped-query attention, SwiGLU or GeGLU MLP, optional q/k/v (and o) biases, per-head q/k RMSNorm
before RoPE (Qwen3, Gemma 3), Gemma's scaled embeddings, sandwich norms and soft-capped attention scores and
logits, tied or untied embeddings, configurable head_dim, optional (per-layer) sliding window.

The forward pass takes token ids or input embeddings, an attention mask (left or right padding),
optional positions, optional segment ids (packing: attention stays inside a segment and positions
restart), and an optional ``KVCache`` for incremental decoding. Every parameter carries logical axis
names (Flax's standard ``out_sharding`` metadata, so ``nnx.get_partition_spec`` reads them), mapped to mesh axes
by ``jaxalign.parallel``. A projection with a LoRA adapter
attached next to it (``q_proj_lora``, see ``jaxalign.models.lora``) adds the adapter's low-rank update.

With ``config.scans`` (``scan_layers``) the repeated layers are stored stacked (``StackedLayers``, cut by
``layer_plan``) and run by one ``lax.scan``; ``unstack_layers`` / ``stack_layers`` convert state trees between
that layout and the per-layer one (``("layers", i, ...)``), which Hugging Face files and adapters use.

Numerics follow the PyTorch reference (transformers' ``LlamaForCausalLM``): RMSNorm and softmax in
float32, rotary tables in float32, matmuls in ``config.dtype``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxalign.models.config import LlamaConfig
from jaxalign.models.flash import SegmentMask, flash_attention
from jaxalign.parallel.mesh import constrain

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


class KVCache(NamedTuple):
    """Decoding state: every layer's values ``[layers, B, kv_heads, S, head_dim]`` (head-major) and keys
    ``[layers, B, kv_heads, head_dim, S]`` (transposed: XLA:CPU multiplies the queries by keys in that layout
    2.2-2.5x faster) over the S slots; a decode step writes each layer's new slots in place. A scanned model's
    cache is one stacked array each (the scan carries it); a model run layer by layer holds tuples of per-layer
    arrays, so no step copies a layer's cache out of a stack (on the CPU that copy cost 96 ms of a 246 ms decode
    step at batch 48 with 384 slots on SmolLM2-135M; docs/benchmarks.md, decoding).

    ``valid [B, S]`` marks slots holding real tokens, ``index`` is the number of slots written (the same
    for every row), ``lengths [B]`` the number of real tokens seen per row (the next position).
    """

    keys: jax.Array
    values: jax.Array
    valid: jax.Array
    index: jax.Array
    lengths: jax.Array

    @classmethod
    def init(cls, config: LlamaConfig, batch_size: int, max_length: int) -> KVCache:
        """An empty cache laid out for a ``config`` model: stacked when it scans layers, per layer otherwise."""
        values = (batch_size, config.num_kv_heads, max_length, config.head_dim)
        keys = values[:2] + values[:1:-1] if keys_transposed(config) else values
        if layer_plan(config)[2]:
            keys, values = ((config.num_layers, *shape) for shape in (keys, values))
            keys, values = jnp.zeros(keys, config.dtype), jnp.zeros(values, config.dtype)
        else:
            keys = tuple(jnp.zeros(keys, config.dtype) for _ in range(config.num_layers))
            values = tuple(jnp.zeros(values, config.dtype) for _ in range(config.num_layers))
        return cls(keys=keys, values=values,
                   valid=jnp.zeros((batch_size, max_length), bool), index=jnp.zeros((), jnp.int32),
                   lengths=jnp.zeros((batch_size,), jnp.int32))

    @property
    def max_length(self) -> int:
        return self.valid.shape[1]


def keys_transposed(config: LlamaConfig) -> bool:
    """Whether a ``config`` model's KV cache holds keys as ``[..., head_dim, S]``: for the XLA einsum attention
    (``attention_impl`` "xla" or "pallas", which decodes with it), not for ``jax.nn.dot_product_attention``, which
    takes ``[S, head_dim]`` keys."""
    return config.attention_impl not in ("dot_product", "cudnn")


CAUSAL_MIN_LENGTH = 256  # shorter self-attention is one dense product (``causal_blocks``)
CAUSAL_BLOCK = 64  # query rows per block of the causal self-attention, while at most ``CAUSAL_BLOCKS_MAX`` blocks
CAUSAL_BLOCKS_MAX = 8


def causal_blocks(length: int, slots: int) -> int:
    """Query blocks of the ``"xla"`` self-attention over ``length`` tokens: 1 (one dense product) below
    ``CAUSAL_MIN_LENGTH`` tokens or against a KV cache's slots; otherwise ``length // CAUSAL_BLOCK`` blocks, at most
    ``CAUSAL_BLOCKS_MAX``, of ``ceil(length / blocks)`` rows (the last one shorter), each computing its scores
    against the keys up to its own end (the causal part) only. Smaller blocks compute fewer scores, but each block
    adds slices of the keys and values and, in the backward, a sum of their gradients; on the CPU the train step
    ran no faster with 8 blocks than with 4 at 256 tokens, nor with 7 than with 4 at 452 (docs/benchmarks.md)."""
    if slots != length or length < CAUSAL_MIN_LENGTH:
        return 1
    return min(CAUSAL_BLOCKS_MAX, length // CAUSAL_BLOCK)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def causal_block_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                           cap: float) -> jax.Array:
    """One query block of softmax attention, ``[B, KV, G, Q, hd]`` from queries ``q [B, KV, G, Q, hd]`` (the ``G``
    query heads of each kv head), keys and values ``[B, KV, S, hd]`` and the boolean ``mask [B, Q, S]``; scores
    ``softcap(q·k · scale, cap)`` in float32, hidden ones at ``_MASK_VALUE`` as in the dense path.

    The backward is written by hand, as flash attention's: the forward keeps only the output and each row's
    maximum and log-normaliser, and the backward computes the probabilities again from them, with
    ``sum(dO · O)`` in place of the softmax's row sums over the keys: fewer passes over the ``[Q, S]`` scores and
    no saved probabilities, for a second score product. On the CPU the SFT step at 4 layers x 256 tokens takes
    0.96-0.97x the time it takes with XLA's derivative of the same blocks, and the compiled step a fifth less
    temporary memory (docs/benchmarks.md)."""
    return _block_forward(q, k, v, mask, scale, cap)[0]


def attention_scores(q, k, batch_dims: str, scale: float, cap: float) -> jax.Array:
    """Scaled, soft-capped float32 scores of queries ``[..., Q, hd]`` against keys ``[..., S, hd]``."""
    scores = jnp.einsum(f"{batch_dims}qd,{batch_dims}sd->{batch_dims}qs", q, k, preferred_element_type=jnp.float32)
    return softcap(scores * scale, cap)


def _block_scores(q, k, mask, scale: float, cap: float) -> jax.Array:
    """Masked float32 scores ``[B, KV, G, Q, S]`` of a query block (``attention_scores`` per kv head)."""
    batch, kv, groups, rows, hd = q.shape
    scores = attention_scores(q.reshape(batch, kv, groups * rows, hd), k, "bk", scale, cap)
    return jnp.where(mask[:, None, None], scores.reshape(batch, kv, groups, rows, k.shape[2]), _MASK_VALUE)


def _block_forward(q, k, v, mask, scale, cap):
    batch, kv, groups, rows = q.shape[:4]
    scores = _block_scores(q, k, mask, scale, cap)
    top = scores.max(axis=-1)
    weights = jnp.exp(scores - top[..., None])
    total = weights.sum(axis=-1)
    out = jnp.einsum("bkqs,bksd->bkqd", weights.astype(q.dtype).reshape(batch, kv, groups * rows, -1), v,
                     preferred_element_type=jnp.float32).reshape(q.shape)
    out = (out / total[..., None]).astype(q.dtype)
    # the maximum and log-normaliser kept apart: a row that sees no key (all scores _MASK_VALUE) then gets the
    # probabilities 1/S again, where max + log(total) would round to _MASK_VALUE and give 1
    return out, (q, k, v, mask, out, top, jnp.log(total))


def _block_backward(scale, cap, residuals, d_out):
    q, k, v, mask, out, top, log_total = residuals
    batch, kv, groups, rows = q.shape[:4]
    stacked = (batch, kv, groups * rows, -1)
    scores = _block_scores(q, k, mask, scale, cap)
    probs = jnp.exp((scores - top[..., None]) - log_total[..., None])
    d_probs = jnp.einsum("bkqd,bksd->bkqs", d_out.reshape(stacked), v, preferred_element_type=jnp.float32)
    delta = (d_out.astype(jnp.float32) * out.astype(jnp.float32)).sum(axis=-1)
    d_scores = probs * (d_probs.reshape(probs.shape) - delta[..., None])
    if cap:  # through the cap: 1 - tanh², with tanh = capped score / cap (the hidden ones get no gradient below)
        d_scores = d_scores * (1.0 - jnp.square(scores / cap))
    d_scores = (jnp.where(mask[:, None, None], d_scores, 0.0) * scale).astype(q.dtype).reshape(stacked)
    d_q = jnp.einsum("bkqs,bksd->bkqd", d_scores, k).reshape(q.shape)
    d_k = jnp.einsum("bkqs,bkqd->bksd", d_scores, q.reshape(stacked))
    d_v = jnp.einsum("bkqs,bkqd->bksd", probs.astype(q.dtype).reshape(stacked), d_out.reshape(stacked))
    return d_q, d_k, d_v, None


causal_block_attention.defvjp(_block_forward, _block_backward)


def _replace_at(items: tuple, index: int, item) -> tuple:
    return (*items[:index], item, *items[index + 1:])


class ModelOutput(NamedTuple):
    logits: jax.Array
    hidden: jax.Array
    cache: KVCache | None


def _param(rngs: nnx.Rngs, shape, axes, dtype, scale: float | None = None, init: str = "normal") -> nnx.Param:
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (scale or 0.02) * jax.random.normal(rngs.params(), shape, jnp.float32)
        value = value.astype(dtype)
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def dense(x: jax.Array, kernel: jax.Array, contract: int = 1) -> jax.Array:
    """``x`` contracted over its last ``contract`` dims with the first ``contract`` dims of ``kernel``, as one 2-D
    matmul over the flattened positions. Same math as the einsum; but on the CPU, XLA lowers the weight gradient
    of a ``[B, T, D]`` einsum to a transposed-operand dot that runs 2-3x slower than the 2-D form (measured in
    docs/benchmarks.md), and the reshapes are free everywhere."""
    lead, inner = x.shape[: x.ndim - contract], kernel.shape[:contract]
    out = kernel.shape[contract:]
    flat = x.reshape(-1, math.prod(inner)) @ kernel.reshape(math.prod(inner), -1)
    return flat.reshape(*lead, *out)


def project(module: nnx.Module, name: str, x: jax.Array, contract: int = 1) -> jax.Array:
    """``x`` through the kernel ``name`` of ``module`` (``dense``); an int8 kernel (``quantize_int8``, decoding with
    ``weights="int8"``) is multiplied by its per-output-channel scale ``{name}_scale`` after the product."""
    y = dense(x, getattr(module, name)[...].astype(x.dtype), contract)
    scale = getattr(module, f"{name}_scale", None)
    return y if scale is None else y * scale[...].astype(y.dtype)


INT8_KERNELS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1, "down_proj": 1,
                "lm_head": 1}  # kernel -> its contracted leading dims; the tied embedding table is per row


def int8_weights(kernel: jax.Array, contract: int) -> tuple[jax.Array, jax.Array]:
    """Symmetric per-output-channel int8: ``(q, scale)`` with ``kernel ~= q * scale``, ``q`` in [-127, 127] and
    ``scale`` (float32, the output dims) = the channel's largest magnitude over the ``contract`` leading dims / 127
    (1 where a channel is all zero)."""
    magnitude = jnp.max(jnp.abs(kernel.astype(jnp.float32)), axis=tuple(range(contract)))
    scale = jnp.where(magnitude > 0, magnitude / 127.0, 1.0)
    return jnp.clip(jnp.round(kernel.astype(jnp.float32) / scale), -127, 127).astype(jnp.int8), scale


def quantize_int8(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """``model`` with every attention and MLP kernel, the LM head and the embedding table (per row: its rows are
    the tied head's output channels) stored as int8 with per-output-channel scales (``{name}_scale``), in place.
    For decoding (``sampling.decoding_model(weights="int8")``): per-layer (unrolled) models only; a mixture of
    experts' experts and router stay as they are."""
    if layer_plan(model.config)[2]:
        raise ValueError("int8 weights need the layers one by one (decoding_model unrolls a scanned model)")
    for _, module in nnx.iter_modules(model):
        for name, contract in INT8_KERNELS.items():
            variable = getattr(module, name, None)
            if isinstance(variable, nnx.Param):
                q, scale = int8_weights(variable[...], contract)
                variable.set_value(q)
                setattr(module, f"{name}_scale", nnx.Variable(scale))
    q, scale = int8_weights(model.embed_tokens[...].T, 1)  # per row of the [V, D] table
    model.embed_tokens.set_value(q.T)
    model.embed_tokens_scale = nnx.Variable(scale)
    return model


def with_adapter(module: nnx.Module, kernel: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """``y`` (= ``x`` through ``kernel``) plus the LoRA update of the adapter attached as ``{kernel}_lora``, if any
    (``jaxalign.models.lora``)."""
    adapter = getattr(module, f"{kernel}_lora", None)
    return y if adapter is None else y + adapter(x).astype(y.dtype)


class RMSNorm(nnx.Module):
    """``weight · x / rms(x)``; with ``offset`` (Gemma: 1) ``(offset + weight) · x / rms(x)`` with the weight
    applied in float32 before the cast (Gemma's order) and initialised to zeros."""

    def __init__(self, dim: int, eps: float, param_dtype, rngs: nnx.Rngs, offset: float = 0.0):
        self.eps, self.offset = eps, offset
        self.weight = _param(rngs, (dim,), ("norm",), param_dtype, init="zeros" if offset else "ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (normed * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...].astype(x.dtype) * normed.astype(x.dtype)


def norm(config: LlamaConfig, dim: int, rngs: nnx.Rngs) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, config.param_dtype, rngs, offset=config.norm_offset)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["valid"],
                   meta_fields=["prompt", "size", "completion"])
@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """The mask of shared-prefix group rows (``data.batching.group_rows``): ``prompt`` slots (left-padded), then
    ``size`` completions of ``completion`` slots each (right-padded); ``valid [B, T]`` marks real tokens. A prompt
    token sees the real prompt tokens up to itself, a completion token the real prompt tokens and its own
    completion's up to itself: the attention is computed per block, ``P² + G·C·(P + C)`` scores a row instead of
    ``(P + G·C)²``."""

    valid: jax.Array
    prompt: int
    size: int
    completion: int


def softcap(x: jax.Array, cap: float) -> jax.Array:
    """``cap · tanh(x / cap)`` (Gemma's soft-capping); ``x`` itself when ``cap`` is 0."""
    return cap * jnp.tanh(x / cap) if cap else x


def rotary_tables(config: LlamaConfig, positions: jax.Array, local: bool = False) -> tuple[jax.Array, jax.Array]:
    """cos/sin ``[B, T, head_dim]`` (float32) for integer ``positions [B, T]`` (``local``: the sliding layers'
    base, ``LlamaConfig.local_rope``)."""
    inv_freq = jnp.asarray(config.inv_freq(local), jnp.float32)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on ``x [B, T, heads, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, window: int, rngs: nnx.Rngs):
        self.config = config
        self.window = window
        d, h, kv, hd, pd = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                            config.param_dtype)
        std = d ** -0.5
        self.q_proj = _param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), pd, std)
        self.k_proj = _param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd, std)
        self.v_proj = _param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd, std)
        self.o_proj = _param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), pd, (h * hd) ** -0.5)
        if config.qkv_bias:
            self.q_bias = _param(rngs, (h, hd), ("heads", "head_dim"), pd, init="zeros")
            self.k_bias = _param(rngs, (kv, hd), ("kv_heads", "head_dim"), pd, init="zeros")
            self.v_bias = _param(rngs, (kv, hd), ("kv_heads", "head_dim"), pd, init="zeros")
        if config.o_bias:
            self.o_bias = _param(rngs, (d,), ("embed",), pd, init="zeros")
        if config.qk_norm:  # Qwen3, Gemma 3: one RMSNorm over head_dim shared by every head, before RoPE
            self.q_norm = norm(config, hd, rngs)
            self.k_norm = norm(config, hd, rngs)
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5

    def _project(self, x, name: str) -> jax.Array:
        y = with_adapter(self, f"{name}_proj", x, project(self, f"{name}_proj", x))
        if self.config.qkv_bias:
            y = y + getattr(self, f"{name}_bias")[...].astype(x.dtype)
        if self.config.qk_norm and name != "v":
            y = getattr(self, f"{name}_norm")(y)
        return y

    def __call__(self, x, cos, sin, mask, cache_kv=None, cache_index=None):
        """x ``[B,T,D]``; mask ``[B,T,S]`` bool over the S key slots; ``cache_kv``: None, or ``(keys, values,
        layer)`` with every layer's cache (``KVCache.keys``: a stack, or a tuple of per-layer arrays) and this
        layer's index in it (an int, or traced under ``lax.scan`` for a stack): the new keys and values are written
        at slot ``cache_index`` of that layer and the updated caches returned."""
        cfg = self.config
        q = apply_rotary(self._project(x, "q"), cos, sin)
        k = apply_rotary(self._project(x, "k"), cos, sin)
        v = self._project(x, "v")
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, kv_heads, T, head_dim]
        keys_t, new_kv = None, None  # keys_t: with a transposed cache, every slot's keys [B, kv_heads, hd, S]
        if cache_kv is not None:  # the cache is head-major too, so no decode step transposes all of it
            keys, values, layer = cache_kv
            transposed = keys_transposed(cfg)
            if transposed:
                k = k.transpose(0, 1, 3, 2)
            k_at, v_at = (0, 0, 0, cache_index) if transposed else (0, 0, cache_index, 0), (0, 0, cache_index, 0)
            if isinstance(keys, tuple):  # per-layer caches: this layer's arrays are updated and read as they are
                k = jax.lax.dynamic_update_slice(keys[layer], k.astype(keys[layer].dtype), k_at)
                v = jax.lax.dynamic_update_slice(values[layer], v.astype(values[layer].dtype), v_at)
                new_kv = (_replace_at(keys, layer, k), _replace_at(values, layer, v))
            else:
                keys = jax.lax.dynamic_update_slice(keys, k[None].astype(keys.dtype), (layer, *k_at))
                values = jax.lax.dynamic_update_slice(values, v[None].astype(values.dtype), (layer, *v_at))
                k = jax.lax.dynamic_index_in_dim(keys, layer, 0, keepdims=False)
                v = jax.lax.dynamic_index_in_dim(values, layer, 0, keepdims=False)
                new_kv = (keys, values)
            k, v = k.astype(x.dtype), v.astype(x.dtype)
            if transposed:
                keys_t, k = k, None
        with jax.named_scope("attention_core"):  # the scores, mask, softmax and weighted sum (profiles name it)
            heads = self._attend(q, k, v, keys_t, mask, cache_kv is None)
        return self._output(heads), new_kv

    def _attend(self, q, k, v, keys_t, mask, self_attention: bool) -> jax.Array:
        """The heads ``[B, T, H, hd]`` from rotated queries ``[B, T, H, hd]`` and head-major keys and values
        (``[B, KV, S, hd]``; or ``keys_t`` ``[B, KV, hd, S]`` from a transposed cache, ``k`` then None)."""
        cfg = self.config
        batch, length = q.shape[:2]
        if isinstance(mask, SegmentMask):  # attention_impl="pallas" without a KV cache
            return flash_attention(q, k, v, mask, scale=self.scale, window=self.window)
        if isinstance(mask, GroupLayout):
            return self._grouped(q, k, v, mask)
        if cfg.attention_impl in ("dot_product", "cudnn"):
            return jax.nn.dot_product_attention(
                q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask=mask[:, None, :, :], scale=self.scale,
                implementation=None if cfg.attention_impl == "dot_product" else cfg.attention_impl)
        # grouped-query attention as batched 2-D products per (batch, kv head): the query heads of a group are
        # stacked along the query positions ([B, KV, G*T, hd]); on the CPU this runs 1.4x faster (forward +
        # backward) than a 5-D einsum, whose transposed operands XLA handles poorly there
        groups, slots = cfg.num_heads // cfg.num_kv_heads, v.shape[2]
        blocks = causal_blocks(length, slots) if self_attention and keys_t is None else 1
        if blocks > 1:
            return self._causal_blocked(q, k, v, mask, blocks)
        q = q.reshape(batch, length, cfg.num_kv_heads, groups, cfg.head_dim).transpose(0, 2, 3, 1, 4)
        q = q.reshape(batch, cfg.num_kv_heads, groups * length, cfg.head_dim)
        if keys_t is None:
            scores = jnp.einsum("bkqd,bksd->bkqs", q, k, preferred_element_type=jnp.float32)
        else:  # XLA:CPU runs this product 2.2-2.5x faster than against [S, head_dim] keys (docs/benchmarks.md)
            scores = jnp.einsum("bkqd,bkds->bkqs", q, keys_t, preferred_element_type=jnp.float32)
        scores = softcap(scores.reshape(batch, cfg.num_kv_heads, groups, length, slots) * self.scale, cfg.attn_softcap)
        scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        probs = probs.reshape(batch, cfg.num_kv_heads, groups * length, slots)
        out = jnp.einsum("bkqs,bksd->bkqd", probs, v)
        out = out.reshape(batch, cfg.num_kv_heads, groups, length, cfg.head_dim).transpose(0, 3, 1, 2, 4)
        return out.reshape(batch, length, cfg.num_heads, cfg.head_dim)

    def _causal_blocked(self, q, k, v, mask, blocks: int) -> jax.Array:
        """Self-attention (no cache) in ``blocks`` query blocks (``causal_block_attention``), block ``i`` against
        the keys up to its own end only: the causal mask hides the rest, so the scores above the diagonal blocks
        are never computed. Equal to the dense path at every query that sees at least one key (a query that sees
        none, at a left padding position, averages the values it is given, as the dense path does over all of
        them)."""
        cfg = self.config
        batch, length = q.shape[:2]
        kv, groups, hd = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        size = -(-length // blocks)
        q = q.reshape(batch, length, kv, groups, hd).transpose(0, 2, 3, 1, 4)  # [B, KV, G, T, hd]
        outs = []
        for start in range(0, length, size):
            end = min(start + size, length)
            outs.append(causal_block_attention(q[:, :, :, start:end], k[:, :, :end], v[:, :, :end],
                                               mask[:, start:end, :end], self.scale, cfg.attn_softcap))
        out = jnp.concatenate(outs, axis=3).transpose(0, 3, 1, 2, 4)
        return out.reshape(batch, length, cfg.num_heads, hd)

    def _scores(self, q, k, batch_dims: str) -> jax.Array:
        return attention_scores(q, k, batch_dims, self.scale, self.config.attn_softcap)

    def _grouped(self, q, k, v, layout: GroupLayout) -> jax.Array:
        """Attention over group rows (``GroupLayout``) as the dense path computes it at every real token, block by
        block: the prompt's queries against the prompt's keys, each completion's queries against the prompt's keys
        and its own (one softmax over both). Queries of a kv head's group stay stacked along the rows, as in the
        dense path."""
        cfg = self.config
        batch, kv, hd = q.shape[0], cfg.num_kv_heads, cfg.head_dim
        groups, p, g, c = cfg.num_heads // kv, layout.prompt, layout.size, layout.completion
        valid = layout.valid.astype(bool)
        kp, vp = k[:, :, :p], v[:, :, :p]

        q_prompt = q[:, :p].reshape(batch, p, kv, groups, hd).transpose(0, 2, 3, 1, 4)
        q_prompt = q_prompt.reshape(batch, kv, groups * p, hd)
        scores = self._scores(q_prompt, kp, "bk").reshape(batch, kv, groups, p, p)
        seen = (jnp.arange(p)[None, :] <= jnp.arange(p)[:, None])[None] & valid[:, None, :p]
        probs = jax.nn.softmax(jnp.where(seen[:, None, None], scores, _MASK_VALUE), axis=-1).astype(q.dtype)
        out_prompt = jnp.einsum("bkqs,bksd->bkqd", probs.reshape(batch, kv, groups * p, p), vp)
        out_prompt = out_prompt.reshape(batch, kv, groups, p, hd).transpose(0, 3, 1, 2, 4)

        q_own = q[:, p:].reshape(batch, g, c, kv, groups, hd).transpose(0, 3, 1, 4, 2, 5)  # [B, KV, G, groups, C, hd]
        q_own = q_own.reshape(batch, kv, g, groups * c, hd)
        k_own, v_own = (x[:, :, p:].reshape(batch, kv, g, c, hd) for x in (k, v))
        to_prompt = self._scores(q_own.reshape(batch, kv, g * groups * c, hd), kp, "bk")
        scores = jnp.concatenate([to_prompt.reshape(batch, kv, g, groups * c, p), self._scores(q_own, k_own, "bkg")],
                                 axis=-1).reshape(batch, kv, g, groups, c, p + c)
        own_valid = valid[:, p:].reshape(batch, g, 1, c)
        seen = jnp.concatenate([jnp.broadcast_to(valid[:, None, None, :p], (batch, g, c, p)),
                                (jnp.arange(c)[None, :] <= jnp.arange(c)[:, None])[None, None] & own_valid], axis=-1)
        probs = jax.nn.softmax(jnp.where(seen[:, None, :, None], scores, _MASK_VALUE), axis=-1).astype(q.dtype)
        probs = probs.reshape(batch, kv, g, groups * c, p + c)
        out_own = (jnp.einsum("bkqs,bksd->bkqd", probs[..., :p].reshape(batch, kv, g * groups * c, p), vp)
                   .reshape(batch, kv, g, groups * c, hd)
                   + jnp.einsum("bkgqs,bkgsd->bkgqd", probs[..., p:], v_own))
        out_own = out_own.reshape(batch, kv, g, groups, c, hd).transpose(0, 2, 4, 1, 3, 5)
        return jnp.concatenate([out_prompt.reshape(batch, p, cfg.num_heads, hd),
                                out_own.reshape(batch, g * c, cfg.num_heads, hd)], axis=1)

    def _output(self, heads: jax.Array) -> jax.Array:
        y = with_adapter(self, "o_proj", heads, project(self, "o_proj", heads, contract=2))
        if self.config.o_bias:
            y = y + self.o_bias[...].astype(heads.dtype)
        return y


class MLP(nnx.Module):
    def __init__(self, config: LlamaConfig, rngs: nnx.Rngs):
        self.config = config
        d, f, pd = config.hidden_size, config.intermediate_size, config.param_dtype
        self.gate_proj = _param(rngs, (d, f), ("embed", "mlp"), pd, d ** -0.5)
        self.up_proj = _param(rngs, (d, f), ("embed", "mlp"), pd, d ** -0.5)
        self.down_proj = _param(rngs, (f, d), ("mlp", "embed"), pd, f ** -0.5)
        if config.mlp_bias:
            self.gate_bias = _param(rngs, (f,), ("mlp",), pd, init="zeros")
            self.up_bias = _param(rngs, (f,), ("mlp",), pd, init="zeros")
            self.down_bias = _param(rngs, (d,), ("embed",), pd, init="zeros")

    def __call__(self, x):
        def through(inputs, name):
            y = with_adapter(self, f"{name}_proj", inputs, project(self, f"{name}_proj", inputs))
            return y + getattr(self, f"{name}_bias")[...].astype(x.dtype) if self.config.mlp_bias else y

        gate = through(x, "gate")
        activated = jax.nn.gelu(gate, approximate=True) if self.config.hidden_act == "gelu_tanh" else jax.nn.silu(gate)
        hidden = activated * through(x, "up")
        return through(constrain(hidden, ("batch", "length", "mlp")), "down")


class MoE(nnx.Module):
    """A dropless mixture of SwiGLU experts (Mixtral, Qwen3-MoE). Router: ``softmax(x @ router)`` in float32, the
    ``num_experts_per_tok`` largest (renormalised with ``norm_topk_prob``). The token x expert assignments are
    sorted by expert and each expert's rows go through ``jax.lax.ragged_dot`` (grouped matmuls): no
    ``[tokens, experts, d]`` tensor and no capacity limit, so no token is dropped. Experts carry the ``expert``
    logical axis. ``__call__`` returns the output and the router logits ``[tokens, experts]``."""

    def __init__(self, config: LlamaConfig, rngs: nnx.Rngs):
        self.config = config
        d, f, e, pd = config.hidden_size, config.moe_intermediate_size, config.num_experts, config.param_dtype
        self.router = _param(rngs, (d, e), ("embed", None), pd, d ** -0.5)
        self.experts_gate = _param(rngs, (e, d, f), ("expert", "embed", "mlp"), pd, d ** -0.5)
        self.experts_up = _param(rngs, (e, d, f), ("expert", "embed", "mlp"), pd, d ** -0.5)
        self.experts_down = _param(rngs, (e, f, d), ("expert", "mlp", "embed"), pd, f ** -0.5)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        shape, k = x.shape, cfg.num_experts_per_tok
        flat = x.reshape(-1, shape[-1])
        logits = dense(flat, self.router[...].astype(x.dtype))
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, chosen = jax.lax.top_k(probs, k)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        experts = chosen.reshape(-1)
        order = jnp.argsort(experts, stable=True)  # the assignments grouped by expert
        token = order // k
        sizes = jnp.bincount(experts, length=cfg.num_experts).astype(jnp.int32)

        def grouped(inputs, kernel):
            return jax.lax.ragged_dot(inputs, kernel[...].astype(inputs.dtype), sizes)

        rows = flat[token]
        hidden = jax.nn.silu(grouped(rows, self.experts_gate)) * grouped(rows, self.experts_up)
        out = grouped(hidden, self.experts_down) * weights.reshape(-1)[order][:, None].astype(x.dtype)
        combined = jnp.zeros_like(flat).at[token].add(out)
        return combined.reshape(shape), logits


def router_stats(logits: jax.Array, mask: jax.Array, top_k: int) -> jax.Array:
    """``[2E + 1]``: per expert, how many real tokens picked it and its summed router probability, then the
    number of real tokens (what the load-balancing loss needs; summable over layers and forwards)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weight = mask.reshape(-1).astype(jnp.float32)
    picked = jax.nn.one_hot(jax.lax.top_k(probs, top_k)[1], probs.shape[-1], dtype=jnp.float32).sum(axis=1)
    return jnp.concatenate([(picked * weight[:, None]).sum(0), (probs * weight[:, None]).sum(0), weight.sum()[None]])


_ROUTER_SINK: contextvars.ContextVar[list | None] = contextvars.ContextVar("jaxalign_router_sink", default=None)


@contextlib.contextmanager
def recording_router_stats() -> Iterator[list]:
    """Inside the block every forward of a mixture-of-experts model (without a KV cache) appends ``(model, stats)``
    to the yielded list; ``router_aux_loss`` turns one model's entries into its load-balancing loss."""
    sink: list = []
    token = _ROUTER_SINK.set(sink)
    try:
        yield sink
    finally:
        _ROUTER_SINK.reset(token)


def router_aux_loss(sink: list, model) -> jax.Array | None:
    """``model``'s load-balancing loss over the forwards recorded in ``sink`` (as one batch), or None."""
    values = [stats for owner, stats in sink if owner is model]
    return load_balancing_loss(sum(values), model.config.num_experts) if values else None


def load_balancing_loss(stats: jax.Array, num_experts: int) -> jax.Array:
    """The Switch Transformer load-balancing loss as transformers' ``load_balancing_loss_func`` computes it over
    all sparse layers: ``E · Σ_e (assignments to e / rows) · (mean router probability of e)``."""
    rows = jnp.maximum(stats[-1], 1e-9)
    return num_experts * jnp.sum(stats[:num_experts] / rows * stats[num_experts:2 * num_experts] / rows)


class DecoderLayer(nnx.Module):
    """Pre-norm residual blocks. Llama's ``post_attention_layernorm`` is the MLP's input norm; with
    ``sandwich_norms`` (Gemma) it normalises the attention output, and ``pre_feedforward_layernorm`` /
    ``post_feedforward_layernorm`` surround the MLP (transformers' names in both cases)."""

    def __init__(self, config: LlamaConfig, layer: int, rngs: nnx.Rngs):
        self.sandwich = config.sandwich_norms
        self.input_layernorm = norm(config, config.hidden_size, rngs)
        self.self_attn = Attention(config, config.layer_window(layer), rngs)
        self.post_attention_layernorm = norm(config, config.hidden_size, rngs)
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(config, config.hidden_size, rngs)
            self.post_feedforward_layernorm = norm(config, config.hidden_size, rngs)
        self.mlp = MoE(config, rngs) if config.is_moe(layer) else MLP(config, rngs)

    def _mlp(self, x):
        if isinstance(self.mlp, MoE):
            return self.mlp(x)
        return self.mlp(x), None

    def __call__(self, x, cos, sin, mask, cache_kv=None, cache_index=None):
        """``(x, new_kv, router logits or None)``."""
        attn, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_kv, cache_index)
        if self.sandwich:
            x = x + self.post_attention_layernorm(attn)
            out, router = self._mlp(self.pre_feedforward_layernorm(x))
            x = x + self.post_feedforward_layernorm(out)
        else:
            x = x + attn
            out, router = self._mlp(self.post_attention_layernorm(x))
            x = x + out
        return constrain(x, ("batch", "length", "act_embed")), new_kv, router


def positions_from_mask(attention_mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """Positions ``[B, T]``: 0, 1, ... over real tokens (left padding gets 0), restarting per segment.

    Right padding keeps counting past a row's last real token, as transformers' ``arange`` positions do, so the
    hidden states at padding positions (which MPO's official mean pooling reads) equal transformers'; the
    positions of real tokens do not depend on the padding."""
    if segment_ids is None:
        mask = attention_mask.astype(jnp.int32)
        index = jnp.arange(mask.shape[1], dtype=jnp.int32)[None, :]
        last = jnp.max(jnp.where(mask > 0, index, -1), axis=1, keepdims=True)
        past_end = mask.sum(axis=1, keepdims=True) - 1 + index - last
        return jnp.where(index > last, past_end, jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0))
    index = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)[None, :]
    boundary = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(boundary, index, 0), axis=1)
    return index - start


def _attention_mask(q_slots, k_slots, k_valid, q_segments, k_segments, window: int, q_prefixes=None,
                    positions=None) -> jax.Array:
    """``[B, T, S]``: key slot visible from query slot (causal, valid, same segment or the query's prefix
    segment, inside the window). The window counts slots, or ``positions`` (self-attention without a cache) where
    they are given: in shared-prefix rows the other completions' slots lie between a completion and its prompt, so
    only positions give its distance to the prompt."""
    mask = (k_slots[:, None, :] <= q_slots[:, :, None]) & k_valid[:, None, :]
    if q_segments is not None:
        same = q_segments[:, :, None] == k_segments[:, None, :]
        if q_prefixes is not None:
            same |= q_prefixes[:, :, None] == k_segments[:, None, :]
        mask &= same
    if window:
        at_q, at_k = (q_slots, k_slots) if positions is None else (positions, positions)
        mask &= at_q[:, :, None] - at_k[:, None, :] < window
    return mask


def _call_layer(layer, *args):
    return layer(*args)


@functools.lru_cache(maxsize=256)
def layer_plan(config: LlamaConfig) -> tuple[int, int, int]:
    """``(prefix, period, blocks)``: how a scanned decoder (``config.scans``) stores and runs its layers: the first
    ``prefix`` layers one by one, then ``blocks`` consecutive blocks of ``period`` layers that are alike block for
    block (the same attention window, rotary base and dense/sparse MLP at each position of the block: Gemma 2
    alternates sliding and global layers, period 2; Gemma 3 has five sliding layers per global one, period 6),
    stacked and run by one ``lax.scan``, then the rest one by one. Among the cuts with at least two blocks it takes
    the one with the fewest layers to compile (``prefix + period + rest``), ties to the shortest prefix, then
    period. ``(num_layers, 0, 0)``: nothing stacked (unscanned, or no layer repeats)."""
    n = config.num_layers
    best = (n, 0, 0)
    if not config.scans:
        return best
    signature = [(config.layer_window(i), config.local_rope(i), config.is_moe(i)) for i in range(n)]

    def cost(plan):  # layers to compile: all but the blocks after the first
        _, period, blocks = plan
        return n - (blocks - 1) * period

    for prefix in range(n - 1):
        for period in range(1, (n - prefix) // 2 + 1):
            if prefix + period >= cost(best):  # no cut starting here can compile fewer layers
                break
            end = prefix  # the layers prefix .. end + period - 1 repeat with this period
            while end + period < n and signature[end] == signature[end + period]:
                end += 1
            plan = (prefix, period, min((end - prefix) // period + 1, (n - prefix) // period))
            if plan[2] >= 2 and cost(plan) < cost(best):
                best = plan
    return best


def layer_paths(config: LlamaConfig, path: tuple) -> list[tuple[tuple, int | None]]:
    """The per-layer state paths ``("layers", i, ...)`` that the state path ``path`` holds, each with its index in
    the stacked axis (None: not stacked). A stacked block's ``("layers", "blocks", j, ...)`` holds one layer per
    block; every other path holds itself."""
    if len(path) < 3 or path[0] != "layers" or path[1] not in ("head", "blocks", "tail"):
        return [(path, None)]
    prefix, period, blocks = layer_plan(config)
    part, index, rest = path[1], path[2], path[3:]
    if part == "blocks":
        return [(("layers", prefix + b * period + index, *rest), b) for b in range(blocks)]
    return [(("layers", index if part == "head" else prefix + period * blocks + index, *rest), None)]


def _is_layer_tree(tree) -> bool:
    return isinstance(tree, dict) and isinstance(tree.get("layers"), dict) and "blocks" in tree["layers"]


def _take(leaf, b: int):
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = leaf.sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)
    return leaf[b]


def _stack(leaves, consume: bool = False):
    first = leaves[0]
    if isinstance(first, jax.ShapeDtypeStruct):
        sharding = first.sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec))
        return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype, sharding=sharding)
    if isinstance(first, np.ndarray):
        return np.stack(leaves)
    stacked = jnp.stack(leaves)
    if consume:  # the per-layer arrays go as soon as their stack exists: one extra leaf in memory, not a tree
        for leaf in leaves:
            leaf.delete()
    return stacked


def unstack_layers(config: LlamaConfig, tree):
    """``tree`` (a model-state pure dict, or any pytree holding such dicts: optimizer moments, adapters) with every
    stacked layer tree in per-layer form, ``{"layers": {0: ..., 1: ...}}``: the layout of an unscanned model, and the
    one Hugging Face files and PEFT adapters are written from. Leaves may be arrays or ``ShapeDtypeStruct`` (with
    their shardings); trees already per layer are returned as they are."""
    prefix, period, blocks = layer_plan(config)

    def convert(node):
        if not _is_layer_tree(node):
            return node
        source, layers = node["layers"], {}
        layers.update(source.get("head", {}))
        for j, sub in source["blocks"].items():
            for b in range(blocks):
                layers[prefix + b * period + j] = jax.tree.map(lambda leaf, b=b: _take(leaf, b), sub)
        for k, sub in source.get("tail", {}).items():
            layers[prefix + period * blocks + k] = sub
        return {**node, "layers": dict(sorted(layers.items()))}

    return jax.tree.map(convert, tree, is_leaf=_is_layer_tree)


def stack_layers(config: LlamaConfig, tree, *, consume: bool = False):
    """The inverse of ``unstack_layers``: the per-layer trees of ``tree`` in the layout of a scanned model of
    ``config`` (unchanged when ``config`` stacks nothing). ``consume``: delete each per-layer device array once
    its stack is made (a tree nothing else holds, such as one just restored from a checkpoint)."""
    prefix, period, blocks = layer_plan(config)
    if not blocks:
        return tree

    def per_layer(node):
        return (isinstance(node, dict) and isinstance(node.get("layers"), dict)
                and all(isinstance(k, int) for k in node["layers"]) and bool(node["layers"]))

    def convert(node):
        if not per_layer(node):
            return node
        source = node["layers"]
        stacked = {"blocks": {j: jax.tree.map(lambda *leaves: _stack(leaves, consume),
                                              *[source[prefix + b * period + j] for b in range(blocks)])
                              for j in range(period) if prefix + j in source}}
        head = {i: source[i] for i in range(prefix) if i in source}
        tail = {k: source[prefix + period * blocks + k] for k in range(config.num_layers - prefix - period * blocks)
                if prefix + period * blocks + k in source}
        return {**node, "layers": {**({"head": head} if head else {}), **stacked, **({"tail": tail} if tail else {})}}

    return jax.tree.map(convert, tree, is_leaf=per_layer)


def other_layer_layout(config: LlamaConfig):
    """``(to_other, to_this)``: pytree converters between the layer layout of a ``config`` model and the one it
    would have with ``scan_layers`` the other way (for checkpoints saved either way); None when both are per layer.
    ``to_this`` is for trees just restored: when it stacks, it frees each per-layer array once stacked."""
    other = config.replace(scan_layers=not config.scans)
    if layer_plan(config)[2]:
        return (lambda tree: unstack_layers(config, tree)), (lambda tree: stack_layers(config, tree, consume=True))
    if layer_plan(other)[2]:
        return (lambda tree: stack_layers(other, tree)), (lambda tree: unstack_layers(other, tree))
    return None


def stack_modules(modules: list[nnx.Module]) -> nnx.Module:
    """One module of ``modules[0]``'s structure whose every variable stacks the modules' values on a new leading
    axis (logical name ``layers``, not sharded)."""
    graphdef = nnx.graphdef(modules[0])

    def stacked(*variables):
        axes = variables[0].get_metadata().get("out_sharding")
        value = jnp.stack([v.get_value() for v in variables])
        return variables[0].replace(value=value, **({"out_sharding": ("layers", *axes)} if axes else {}))

    states = [nnx.state(module) for module in modules]
    return nnx.merge(graphdef, jax.tree.map(stacked, *states, is_leaf=lambda x: isinstance(x, nnx.Variable)))


class StackedLayers(nnx.Module):
    """A scanned decoder's layers as ``layer_plan`` cuts them: ``head`` and ``tail`` hold layers one by one,
    ``blocks[j]`` the ``j``-th layer of every block, its variables stacked ``[blocks, ...]``."""

    def __init__(self, config: LlamaConfig, layers: list[DecoderLayer]):
        prefix, period, blocks = layer_plan(config)
        self.head = nnx.List(layers[:prefix])
        self.blocks = nnx.List([stack_modules(layers[prefix + j:prefix + period * blocks:period])
                                for j in range(period)])
        self.tail = nnx.List(layers[prefix + period * blocks:])


# What a rematerialised layer keeps for the backward pass (``LlamaConfig.remat_policy``): "nothing" recomputes the
# whole layer (least memory); "dots" keeps every matmul output (least recomputation); "dots_no_batch" keeps the
# projections' outputs but not the attention score matmuls (whose size grows with the sequence squared).
_POLICIES = {
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
_remat_layers = {name: nnx.remat(_call_layer, policy=policy) for name, policy in _POLICIES.items()}


class LlamaForCausalLM(nnx.Module):
    """The decoder with its LM head.

    ``model(tokens, attention_mask)`` returns logits ``[B, T, V]``. With ``cache=`` or
    ``return_hidden=True`` it returns a ``ModelOutput(logits, hidden, cache)`` instead.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.config = config
        d, v, pd = config.hidden_size, config.vocab_size, config.param_dtype
        self.embed_tokens = _param(rngs, (v, d), ("vocab", "embed"), pd, d ** -0.5)
        layers = [DecoderLayer(config, i, rngs) for i in range(config.num_layers)]  # the same draws scanned or not
        self.layers = StackedLayers(config, layers) if layer_plan(config)[2] else nnx.List(layers)
        self.norm = norm(config, d, rngs)
        if config.num_labels:  # a reward model: transformers' ``score`` (normal(0, 0.02) init), no LM head
            self.score = _param(rngs, (d, config.num_labels), ("embed", None), pd, 0.02)
        elif not config.tie_word_embeddings:
            self.lm_head = _param(rngs, (d, v), ("embed", "vocab"), pd, d ** -0.5)

    def layer(self, i: int) -> DecoderLayer:
        """Layer ``i`` as a module of its own (an unscanned model's, or a scanned model's head or tail layer; a
        stacked layer's weights live in ``layers.blocks``)."""
        if isinstance(self.layers, nnx.List):
            return self.layers[i]
        prefix, period, blocks = layer_plan(self.config)
        if i < prefix:
            return self.layers.head[i]
        if i >= prefix + period * blocks:
            return self.layers.tail[i - prefix - period * blocks]
        raise ValueError(f"layer {i} is stacked in layers.blocks[{(i - prefix) % period}] (scan_layers)")

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Token embeddings ``[B, T, D]`` in the compute dtype."""
        scale = getattr(self, "embed_tokens_scale", None)
        if scale is None:
            return self.embed_rows(self.embed_tokens[...], tokens)
        rows = (jnp.take(self.embed_tokens[...], tokens, axis=0).astype(jnp.float32)  # int8 rows (quantize_int8)
                * jnp.take(scale[...], tokens, axis=0)[..., None])
        if self.config.embed_scale:
            rows = rows * self.config.hidden_size ** 0.5
        return rows.astype(self.config.dtype)

    def embed_rows(self, table: jax.Array, tokens: jax.Array) -> jax.Array:
        """``tokens``' rows of ``table`` (this model's embedding table, or a copy of it, e.g. without gradient) as
        the model embeds them: Gemma multiplies by ``sqrt(hidden_size)``, rounded to the table's dtype as
        transformers does; in the compute dtype."""
        embedded = jnp.take(table, tokens, axis=0)
        if self.config.embed_scale:
            embedded = embedded * jnp.asarray(self.config.hidden_size ** 0.5, table.dtype)
        return embedded.astype(self.config.dtype)

    def unembed(self, hidden: jax.Array) -> jax.Array:
        """Logits ``[B, T, V]`` from final (normed) hidden states (soft-capped with ``final_softcap``)."""
        logits = dense(hidden, self.head_kernel().astype(hidden.dtype))
        scale = getattr(self, "embed_tokens_scale" if self.config.tie_word_embeddings else "lm_head_scale", None)
        if scale is not None:  # an int8 head (quantize_int8): per-output-channel scales
            logits = logits * scale[...].astype(logits.dtype)
        return constrain(softcap(logits, self.config.final_softcap), ("batch", "length", "vocab"))

    def head_kernel(self) -> jax.Array:
        """The unembedding ``[D, V]`` (the transposed embedding table when tied)."""
        if self.config.num_labels and not self.config.tie_word_embeddings:
            raise ValueError("a reward model (num_labels=1) has no LM head: score sequences with rewards()")
        return self.embed_tokens[...].T if self.config.tie_word_embeddings else self.lm_head[...]

    def rewards(self, tokens: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        """A reward model's scalar score ``[B]`` (float32) per sequence: the ``score`` head on the final hidden state
        of the rightmost real token that is not ``pad_token_id`` (transformers' ``ForSequenceClassification``
        rule, so a trailing EOS that doubles as the pad token is skipped exactly as there)."""
        if not self.config.num_labels:
            raise ValueError("rewards() needs a reward model (num_labels=1); this is a causal LM")
        if attention_mask is None:
            attention_mask = jnp.ones(tokens.shape, bool)
        hidden, _ = self.hidden_states(tokens, attention_mask)
        keep = attention_mask.astype(bool)
        if self.config.pad_token_id is not None:
            keep &= tokens != self.config.pad_token_id
        last = jnp.max(jnp.where(keep, jnp.arange(tokens.shape[1]), 0), axis=1)
        pooled = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
        return jnp.dot(pooled.astype(jnp.float32), self.score[...].astype(jnp.float32))[:, 0]

    def _layers(self, x: jax.Array, inputs, stats_of, kv):
        """Runs the decoder layers on ``x``; ``kv``: None or ``(keys, values, index)`` of the KV cache.

        One by one, or in a scanned model (``StackedLayers``) the head layers one by one, the stacked blocks by one
        ``lax.scan`` over their stacked weights (the cache stays in the scan's carry and each layer writes its new
        slots in place), then the tail layers. The same math either way. With ``remat`` (training, no cache) each
        layer run one by one, and each scanned block, is rematerialised under the policy. Returns the hidden states,
        the sparse layers' router statistics (without a cache; summed per block) and the updated ``(keys, values)``
        stacks (or None)."""
        cfg = self.config
        remat = cfg.remat and kv is None
        cache, stats = None if kv is None else kv[:2], []

        def layer_call(run, layer, i, slot, x, cache):  # i: the layer's place (static); slot: its index in the cache
            x, cache, router = run(layer, x, *inputs(i), None if cache is None else (*cache, slot),
                                   None if kv is None else kv[2])
            return x, cache, None if router is None or kv is not None else stats_of(router)

        def unrolled(x, cache, indices):
            run = _remat_layers[cfg.remat_policy] if remat else _call_layer
            for i in indices:
                x, cache, layer_stats = layer_call(run, self.layer(i), i, i, x, cache)
                if layer_stats is not None:
                    stats.append(layer_stats)
            return x, cache

        prefix, period, blocks = layer_plan(cfg)
        if not blocks:
            x, cache = unrolled(x, cache, range(cfg.num_layers))
            return x, stats, cache
        x, cache = unrolled(x, cache, range(prefix))
        graphdefs, stacked = zip(*(nnx.split(template) for template in self.layers.blocks), strict=True)

        def block(carry, xs):
            (x, cache), (states, b) = carry, xs
            block_stats = []
            for j, (graphdef, state) in enumerate(zip(graphdefs, states, strict=True)):
                x, cache, layer_stats = layer_call(_call_layer, nnx.merge(graphdef, state), prefix + j,
                                                   prefix + b * period + j, x, cache)
                if layer_stats is not None:
                    block_stats.append(layer_stats)
            return (x, cache), sum(block_stats) if block_stats else None

        if remat:  # the block as a whole (a remat per layer inside a scan body would add barriers)
            block = jax.checkpoint(block, policy=_POLICIES[cfg.remat_policy], prevent_cse=False)
        (x, cache), block_stats = jax.lax.scan(block, (x, cache), (stacked, jnp.arange(blocks)))
        if block_stats is not None:
            stats.append(block_stats.sum(axis=0))
        x, cache = unrolled(x, cache, range(prefix + period * blocks, cfg.num_layers))
        return x, stats, cache

    def hidden_states(
        self,
        tokens: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        *,
        inputs_embeds: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        prefix_ids: jax.Array | None = None,
        cache: KVCache | None = None,
        group_layout: tuple[int, int, int] | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Final-norm hidden states ``[B, T, D]`` and the updated cache (None without one). ``prefix_ids``
        (with ``segment_ids``; shared-prefix rows): a second segment each token also attends to (0 = none).
        ``group_layout = (P, G, C)``: the rows are GRPO group rows (``data.batching.group_rows``; with their
        ``segment_ids`` / ``prefix_ids``); ``attention_impl="xla"`` then computes attention block by block
        (``GroupLayout``; not in sliding-window models, whose windows take the general mask)."""
        if (tokens is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of tokens and inputs_embeds")
        x = self.embed(tokens) if inputs_embeds is None else inputs_embeds.astype(self.config.dtype)
        batch, length = x.shape[:2]
        if attention_mask is None:
            attention_mask = (segment_ids > 0) if segment_ids is not None else jnp.ones((batch, length), bool)
        attention_mask = attention_mask.astype(bool)
        if cache is not None and segment_ids is not None:
            raise ValueError("segment_ids (packing) cannot be combined with a KV cache")
        if prefix_ids is not None and segment_ids is None:
            raise ValueError("prefix_ids name segments: pass segment_ids too")

        if cache is None:
            if positions is None:
                positions = positions_from_mask(attention_mask, segment_ids)
            slots = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
            k_slots, k_valid, k_segments = slots, attention_mask, segment_ids
        else:
            if positions is None:
                positions = cache.lengths[:, None] + positions_from_mask(attention_mask)
            slots = cache.index + jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
            k_valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, attention_mask, cache.index, 1)
            k_slots = jnp.broadcast_to(jnp.arange(cache.max_length, dtype=jnp.int32), (batch, cache.max_length))
            k_segments = None

        tables = {local: rotary_tables(self.config, positions, local)
                  for local in {self.config.local_rope(i) for i in range(self.config.num_layers)}}
        windows = {self.config.layer_window(i) for i in range(self.config.num_layers)}
        if group_layout is not None and group_layout[0] + group_layout[1] * group_layout[2] != length:
            raise ValueError(f"group_layout {group_layout} (prompt, completions, completion length) does not "
                             f"describe rows of {length} slots")
        if group_layout is not None and cache is None and windows == {0} and self.config.attention_impl == "xla":
            masks = {0: GroupLayout(attention_mask, *map(int, group_layout))}
        elif self.config.attention_impl == "pallas" and cache is None:  # one mask as vectors; each layer its window
            vectors = SegmentMask.build(attention_mask, segment_ids, prefix_ids,
                                        None if prefix_ids is None else positions)
            masks = dict.fromkeys(windows, vectors)
        else:
            window_positions = positions if prefix_ids is not None and cache is None else None
            masks = {window: _attention_mask(slots, k_slots, k_valid, segment_ids, k_segments, window, prefix_ids,
                                             window_positions)
                     for window in windows}
        x = constrain(x, ("batch", "length", "act_embed"))

        def inputs(i):  # what layer i reads besides the hidden states: its rotary tables and mask
            return (*tables[self.config.local_rope(i)], masks[self.config.layer_window(i)])

        def stats_of(router):  # a sparse layer's load-balancing statistics
            return router_stats(router, attention_mask, self.config.num_experts_per_tok)

        kv = None if cache is None else (cache.keys, cache.values, cache.index)
        x, stats, kv = self._layers(x, inputs, stats_of, kv)
        hidden = self.norm(x)
        if stats and (sink := _ROUTER_SINK.get()) is not None:  # the load-balancing loss' inputs
            sink.append((self, sum(stats)))
        if cache is None:
            return hidden, None
        new_cache = KVCache(keys=kv[0], values=kv[1], valid=k_valid, index=cache.index + length,
                            lengths=cache.lengths + attention_mask.sum(axis=1, dtype=jnp.int32))
        return hidden, new_cache

    def __call__(
        self,
        tokens: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        *,
        inputs_embeds: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        prefix_ids: jax.Array | None = None,
        cache: KVCache | None = None,
        return_hidden: bool = False,
    ) -> jax.Array | ModelOutput:
        """Logits ``[B, T, V]``; a ``ModelOutput`` when ``cache`` is given or ``return_hidden`` is set.

        tokens ``[B, T]`` int (or ``inputs_embeds [B, T, D]``); attention_mask ``[B, T]`` 1 on real tokens
        (left or right padding); positions ``[B, T]`` (default: counted over real tokens, per segment);
        segment_ids ``[B, T]`` (packing; 0 = padding); prefix_ids ``[B, T]`` (shared-prefix packing: the segment a
        token attends to besides its own, 0 = none; positions are then given).
        """
        hidden, new_cache = self.hidden_states(tokens, attention_mask, inputs_embeds=inputs_embeds,
                                               positions=positions, segment_ids=segment_ids, prefix_ids=prefix_ids,
                                               cache=cache)
        logits = self.unembed(hidden)
        if cache is None and not return_hidden:
            return logits
        return ModelOutput(logits=logits, hidden=hidden, cache=new_cache)
