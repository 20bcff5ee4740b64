"""Autoregressive generation: one jitted prefill + ``lax.while_loop`` decode over a KV cache.

No Python loop per token and no recompilation per token: a graph is compiled once per (model graph,
batch, prompt length, ``max_new_tokens``, sampling mode). Prompts are left-padded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxalign.models.llama import KVCache, LlamaForCausalLM


def sample_logits(logits: jax.Array, key: jax.Array, *, temperature: float = 0.0, top_k: int = 0,
                  top_p: float = 1.0) -> jax.Array:
    """Next token ``[B]`` from logits ``[B, V]``: greedy when ``temperature == 0``, else temperature
    sampling restricted to the ``top_k`` most likely tokens and to the smallest set whose probability
    reaches ``top_p`` (nucleus)."""
    logits = logits.astype(jnp.float32)
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # the smallest logit still inside the nucleus (the top token is always kept)
        kept = jnp.where(mass_before < top_p, sorted_logits, jnp.inf)
        threshold = jnp.min(kept, axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k", "top_p",
                                             "eos_ids", "pad_id"))
def _generate(graphdef, state, prompt_tokens, prompt_mask, key, *, max_new_tokens: int, temperature: float,
              top_k: int, top_p: float, eos_ids: tuple[int, ...], pad_id: int):
    model = nnx.merge(graphdef, state)
    batch, prompt_len = prompt_tokens.shape
    cache = KVCache.init(model.config, batch, prompt_len + max_new_tokens)
    out = model(prompt_tokens, prompt_mask, cache=cache)
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)

    def cond(carry):
        step, _, _, _, done, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step, cache, last_logits, tokens, done, key = carry
        key, sample_key = jax.random.split(key)
        next_token = sample_logits(last_logits, sample_key, temperature=temperature, top_k=top_k, top_p=top_p)
        next_token = jnp.where(done, pad_id, next_token)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, next_token[:, None], step, 1)
        done = done | jnp.isin(next_token, eos)
        step_out = model(next_token[:, None], jnp.ones((batch, 1), bool), cache=cache)
        return step + 1, step_out.cache, step_out.logits[:, -1], tokens, done, key

    tokens = jnp.full((batch, max_new_tokens), pad_id, jnp.int32)
    carry = (jnp.zeros((), jnp.int32), out.cache, out.logits[:, -1], tokens, jnp.zeros((batch,), bool), key)
    return jax.lax.while_loop(cond, body, carry)[3]


def generate(model: LlamaForCausalLM, prompt_tokens, *, prompt_mask=None, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, eos_id: int | tuple[int, ...] | None = None,
             pad_id: int = 0, seed: int = 0) -> jax.Array:
    """Continues left-padded prompts ``[B, T]``; returns new tokens ``[B, max_new_tokens]``.

    ``prompt_mask`` is 1 on real tokens (None: no padding). After a row emits an ``eos_id`` (one id or
    several) the rest of the row is ``pad_id``; the loop stops early once every row is done.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"invalid sampling settings: temperature={temperature}, top_k={top_k}, top_p={top_p}")
    prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
    if prompt_tokens.ndim != 2:
        raise ValueError(f"prompt_tokens must be [batch, length], got shape {prompt_tokens.shape}")
    mask = jnp.ones(prompt_tokens.shape, bool) if prompt_mask is None else jnp.asarray(prompt_mask, bool)
    if mask.shape != prompt_tokens.shape:
        raise ValueError(f"prompt_mask shape {mask.shape} differs from prompt_tokens shape {prompt_tokens.shape}")
    if not bool(jnp.all(mask[:, -1])):
        raise ValueError("prompts must be left-padded: the last column of prompt_mask must be 1 in every row")
    eos_ids = () if eos_id is None else tuple(int(e) for e in (eos_id if isinstance(eos_id, tuple | list)
                                                               else (eos_id,)))
    graphdef, state = nnx.split(model)
    return _generate(graphdef, state, prompt_tokens, mask, jax.random.key(seed), max_new_tokens=max_new_tokens,
                     temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), eos_ids=eos_ids,
                     pad_id=int(pad_id))
