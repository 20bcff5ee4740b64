"""Autoregressive generation: one jitted prefill + ``lax.while_loop`` decode over a KV cache.

No Python loop per token and no recompilation per token or per length: the cache and output buffers are sized to
a bucket (at least 256 positions, doubling) and ``max_new_tokens``, the temperature and ``top_p`` are traced, so a
graph is compiled once per (model, batch, prompt length, bucket, greedy or not, top-k, nucleus on/off). Prompts
are left-padded. Besides the tokens, every step's chosen-token log-probability and top-1 probability (under the
model's untempered distribution) are returned, for confidence-based methods (Nudging, SATER), and the chosen token's
log-probability and the entropy under the tempered distribution it was sampled from (for RL).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxalign.models.llama import KVCache, LlamaForCausalLM, layer_plan, quantize_int8, unstack_layers

MIN_CACHE_BUCKET = 128
DECODE_LAYERS = ("auto", "scanned", "unrolled")
DECODE_WEIGHTS = ("model", "float32", "bfloat16", "int8")
# the backends where layers="auto" unrolls a scanned model for decoding: measured faster there (docs/benchmarks.md)
UNROLL_BACKENDS = ("cpu", "gpu")


class Generation(NamedTuple):
    """``tokens [B, N]`` (``pad_id`` after EOS), ``logps [B, N]`` of the chosen tokens, ``top1_probs [B, N]``
    (probability of the most likely token at each step), ``lengths [B]`` (tokens up to and including EOS), all
    under the model's untempered distribution; ``sampling_logps [B, N]`` and ``entropy [B, N]``: the chosen token's
    log-probability and the entropy of ``softmax(logits / temperature)`` (before top-k / top-p; equal to ``logps``
    and the untempered entropy when greedy). 0 after a row ends."""

    tokens: jax.Array
    logps: jax.Array
    top1_probs: jax.Array
    lengths: jax.Array
    sampling_logps: jax.Array | None = None
    entropy: jax.Array | None = None


def sample_logits(logits: jax.Array, key: jax.Array, *, temperature: float | jax.Array = 0.0, top_k: int = 0,
                  top_p: float | jax.Array = 1.0) -> jax.Array:
    """Next token ``[B]`` from logits ``[B, V]``: greedy when ``temperature == 0`` (a Python number), else
    temperature sampling restricted to the ``top_k`` most likely tokens and to the smallest set whose probability
    reaches ``top_p`` (nucleus)."""
    logits = logits.astype(jnp.float32)
    if isinstance(temperature, int | float) and temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if not (isinstance(top_p, int | float) and top_p >= 1.0):
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # the smallest logit still inside the nucleus (the top token is always kept)
        kept = jnp.where(mass_before < top_p, sorted_logits, jnp.inf)
        threshold = jnp.min(kept, axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    # inverse-CDF sampling: one uniform number per row instead of a Gumbel draw per vocabulary entry (the RNG
    # dominated a decode step at a 4k vocabulary on the CPU); the first token whose cumulative probability exceeds
    # u * total has a positive probability, so top-k / top-p exclusions are never drawn
    cdf = jnp.cumsum(jax.nn.softmax(logits, axis=-1), axis=-1)
    u = jax.random.uniform(key, (logits.shape[0], 1), jnp.float32) * cdf[:, -1:]
    return jnp.minimum(jnp.sum(cdf <= u, axis=-1), logits.shape[-1] - 1).astype(jnp.int32)


def left_pad(sequences, pad_id: int, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> left-padded ``(tokens [N, width], mask [N, width])`` int32 (width: the longest by default)."""
    width = max(len(s) for s in sequences) if width is None else width
    tokens = np.full((len(sequences), width), pad_id, np.int32)
    mask = np.zeros((len(sequences), width), np.int32)
    for row, ids in enumerate(sequences):
        if ids:
            tokens[row, width - len(ids):], mask[row, width - len(ids):] = ids, 1
    return tokens, mask


def cache_bucket(length: int) -> int:
    """The KV cache's slots for ``length`` positions: the smallest of 128, 192, 256, 384, 512, 768, ... (powers of
    two and 1.5 times them) that holds them. Few sizes, so few compiles across prompt lengths, and at most a third
    of the slots unused: every decode step's attention reads every slot, and in the GRPO benchmark's rollout
    (32 + 64 positions, 32 rows) a 128-slot cache decoded 1.46x faster than the 256 slots of the former
    power-of-two buckets from 256 (docs/benchmarks.md)."""
    size = MIN_CACHE_BUCKET
    while True:
        if size >= length:
            return size
        if size * 3 // 2 >= length:
            return size * 3 // 2
        size *= 2


def repeat_rows(cache: KVCache, times: int) -> KVCache:
    """``cache`` with each row repeated ``times`` times (rows ``b*times + s``): one prefill serving several
    samples."""
    def rep(x, axis=0):
        return jnp.repeat(x, times, axis=axis)

    def rep_kv(x):  # a stack [layers, B, ...] or a tuple of per-layer [B, ...] arrays
        return tuple(map(rep, x)) if isinstance(x, tuple) else rep(x, 1)

    return KVCache(keys=rep_kv(cache.keys), values=rep_kv(cache.values), valid=rep(cache.valid),
                   index=cache.index, lengths=rep(cache.lengths))


def prefill(model: LlamaForCausalLM, prompt_tokens, prompt_mask, cache_length: int) -> tuple[jax.Array, KVCache]:
    """Runs left-padded prompts ``[B, T]`` into a fresh KV cache of ``cache_length`` slots: the logits of each
    prompt's last token ``[B, V]`` (only those go through the LM head, not ``[B, T, V]``) and the cache."""
    hidden, cache = model.hidden_states(prompt_tokens, prompt_mask,
                                        cache=KVCache.init(model.config, prompt_tokens.shape[0], cache_length))
    return model.unembed(hidden[:, -1:])[:, 0], cache


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_length", "greedy", "top_k", "nucleus", "pad_id",
                                             "num_samples", "layers", "weights"))
def _generate(graphdef, state, prompt_tokens, prompt_mask, key, max_new_tokens, temperature, top_p, eos_ids,
              stop_below, *,
              cache_length: int, greedy: bool, top_k: int, nucleus: bool, pad_id: int,
              num_samples: int = 1, layers: str = "auto", weights: str = "model") -> Generation:
    # the decode layout is made inside the compiled call: its copies (unstacked layers, cast weights) are one
    # pass over the weights per call, where building them eagerly cost a dispatch per layer and leaf (0.6 s for a
    # 32-layer tiny model, more than its whole decode)
    model = decoding_model(nnx.merge(graphdef, state), layers=layers, weights=weights)
    prompts, prompt_len = prompt_tokens.shape
    room = cache_length - prompt_len
    first_logits, cache = prefill(model, prompt_tokens, prompt_mask, cache_length)
    batch = prompts * num_samples  # each prompt's KV cache is computed once and shared by its samples
    prefill_cache = cache if num_samples == 1 else repeat_rows(cache, num_samples)
    first_logits = jnp.repeat(first_logits, num_samples, axis=0)

    def cond(carry):
        step, done = carry[0], carry[4]
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step, cache, last_logits, outputs, done, lengths, key = carry
        key, sample_key = jax.random.split(key)
        next_token = sample_logits(last_logits, sample_key, temperature=0.0 if greedy else temperature, top_k=top_k,
                                   top_p=top_p if nucleus else 1.0)
        logits = last_logits.astype(jnp.float32)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        tempered = log_probs if greedy else jax.nn.log_softmax(logits / temperature, axis=-1)
        chosen_logp = jnp.take_along_axis(log_probs, next_token[:, None], axis=-1)[:, 0]
        top1 = jnp.exp(log_probs.max(-1))
        done = done | (top1 < stop_below)  # unsure: stop before emitting this token
        next_token = jnp.where(done, pad_id, next_token)
        columns = (next_token, chosen_logp, top1, jnp.take_along_axis(tempered, next_token[:, None], axis=-1)[:, 0],
                   -jnp.sum(jnp.exp(tempered) * jnp.where(jnp.isfinite(tempered), tempered, 0.0), axis=-1))
        outputs = tuple(jax.lax.dynamic_update_slice_in_dim(buffer, jnp.where(done, blank, value)[:, None], step, 1)
                        for buffer, value, blank in zip(outputs, columns, (pad_id, 0.0, 0.0, 0.0, 0.0), strict=True))
        lengths = lengths + (~done).astype(jnp.int32)
        done = done | jnp.isin(next_token, eos_ids)
        step_out = model(next_token[:, None], jnp.ones((batch, 1), bool), cache=cache)
        return step + 1, step_out.cache, step_out.logits[:, -1], outputs, done, lengths, key

    buffers = (jnp.full((batch, room), pad_id, jnp.int32), *(jnp.zeros((batch, room), jnp.float32) for _ in range(4)))
    carry = (jnp.zeros((), jnp.int32), prefill_cache, first_logits, buffers, jnp.zeros((batch,), bool),
             jnp.zeros((batch,), jnp.int32), key)
    result = jax.lax.while_loop(cond, body, carry)
    tokens, logps, top1, sampling_logps, entropy = result[3]
    return Generation(tokens, logps, top1, result[5], sampling_logps, entropy)


def decoding_model(model: LlamaForCausalLM, *, layers: str = "auto", weights: str = "model") -> LlamaForCausalLM:
    """The model the decode loop runs, from ``model``: the same function of the tokens, laid out for decoding.

    ``layers``: "scanned" keeps a scanned model's stacked layers (``model.scan_layers``) under ``lax.scan``;
    "unrolled" gives it per-layer weights (a copy; ``sample`` makes it inside its compiled call) so the decode
    loop runs the layers one by one; "auto" unrolls on the CPU and on GPUs, where it was measured faster
    (docs/benchmarks.md, decoding): on 2 CPU cores XLA:CPU copies each layer's weight slices out of the stack at
    every step of the scan, and unrolled SmolLM2-135M decoded 1.54x the tokens/s at batch 1 on an Intel Xeon; on an
    H200 the Llama-3.2-1B shape decoded 1.89x (batch 1) and 2.22x (batch 8) unrolled. On TPUs (not measured) "auto"
    keeps the scan. Either way the unrolled layers are a second copy of the weights while the loop runs. Models
    with LoRA adapters stay as they
    are with "auto" ("unrolled" refuses them: merge the adapters first). ``weights``: "model" keeps the
    parameters' dtype; "float32" / "bfloat16" casts every floating-point parameter (the compute dtype,
    ``config.dtype``, is unchanged: weight-only). bfloat16 halves the bytes each step streams, which is what
    decoding is bound by on a GPU or TPU; on the CPU it brought no speed (XLA:CPU converts the weights before
    each matmul; docs/benchmarks.md). "int8" stores the attention and MLP kernels, the LM head and the embedding
    table as int8 with per-output-channel scales (``models.llama.quantize_int8``; a quarter of float32's bytes),
    unrolling a scanned model and refusing LoRA adapters; on SmolLM2-135M it follows float32 greedy far less
    closely than bfloat16 (docs/sampling.md)."""
    if layers not in DECODE_LAYERS:
        raise ValueError(f"layers={layers!r}: expected one of {DECODE_LAYERS}")
    if weights not in DECODE_WEIGHTS:
        raise ValueError(f"weights={weights!r}: expected one of {DECODE_WEIGHTS}")
    stacked = bool(layer_plan(model.config)[2])
    has_adapters = bool(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    adapters = stacked and has_adapters
    if layers == "unrolled" and adapters:
        raise ValueError("layers='unrolled' needs a model without LoRA adapters: merge them first "
                         "(jaxalign.models.lora.merge_weights) or decode with layers='scanned'")
    if weights == "int8" and (has_adapters or (stacked and layers == "scanned")):
        raise ValueError("weights='int8' needs a model without LoRA adapters (merge them first: "
                         "jaxalign.models.lora.merge_weights) and its layers one by one (layers='auto' or 'unrolled')")
    measured_faster = jax.default_backend() in UNROLL_BACKENDS
    unroll = stacked and not adapters and (layers == "unrolled" or weights == "int8"
                                           or (layers == "auto" and measured_faster))
    if not unroll and weights == "model":
        return model
    if unroll:
        from jaxalign.models.factory import abstract_model

        graphdef, state = nnx.split(abstract_model(model.config.replace(scan_layers=False)))
        nnx.replace_by_pure_dict(state, unstack_layers(model.config, nnx.to_pure_dict(nnx.state(model))))
    else:
        graphdef, state = nnx.split(model)
    if weights == "int8":  # new Variables (quantize_int8 sets values in place; ``model``'s own stay as they are)
        return quantize_int8(nnx.merge(graphdef, jax.tree.map(lambda x: x, state)))
    if weights != "model":
        dtype = jnp.dtype(weights)
        state = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
    return nnx.merge(graphdef, state)


def sample(model: LlamaForCausalLM, prompt_tokens, *, prompt_mask=None, max_new_tokens: int,
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, eos_id: int | tuple[int, ...] | None = None,
           pad_id: int = 0, seed: int = 0, num_samples: int = 1, stop_below: float = 0.0, layers: str = "auto",
           weights: str = "model") -> Generation:
    """Continues left-padded prompts ``[B, T]``; ``num_samples`` draws per prompt (rows ``b*num_samples + s``),
    all from one prefill of each prompt (its KV cache and first logits repeated, not recomputed).

    Returns a ``Generation`` with ``[B * num_samples, max_new_tokens]`` arrays. After a row emits an ``eos_id``
    (one id or several) the rest of the row is ``pad_id``; the loop stops once every row is done. With
    ``stop_below > 0`` a row also stops, before emitting it, at the first step whose top-1 probability is below
    ``stop_below`` (Nudging's "the base model is unsure here").
    ``layers`` and ``weights``: how the decode loop holds the model (``decoding_model``; by default a scanned
    model's layers are unrolled on the CPU, and the parameters keep their dtype).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or num_samples < 1:
        raise ValueError(f"invalid sampling settings: temperature={temperature}, top_k={top_k}, top_p={top_p}, "
                         f"num_samples={num_samples}")
    prompt_tokens = np.asarray(prompt_tokens, np.int32)
    if prompt_tokens.ndim != 2:
        raise ValueError(f"prompt_tokens must be [batch, length], got shape {prompt_tokens.shape}")
    mask = np.ones(prompt_tokens.shape, bool) if prompt_mask is None else np.asarray(prompt_mask, bool)
    if mask.shape != prompt_tokens.shape:
        raise ValueError(f"prompt_mask shape {mask.shape} differs from prompt_tokens shape {prompt_tokens.shape}")
    if not mask[:, -1].all():
        raise ValueError("prompts must be left-padded: the last column of prompt_mask must be 1 in every row")
    eos_ids = eos_id if isinstance(eos_id, tuple | list) else (eos_id,)
    eos = (-1,) if eos_id is None else tuple(int(e) for e in eos_ids)
    graphdef, state = nnx.split(model)  # _generate lays it out for decoding (decoding_model checks the options)
    out = _generate(graphdef, state, jnp.asarray(prompt_tokens), jnp.asarray(mask), jax.random.key(seed),
                    jnp.asarray(max_new_tokens, jnp.int32), jnp.asarray(temperature, jnp.float32),
                    jnp.asarray(top_p, jnp.float32), jnp.asarray(eos, jnp.int32), jnp.asarray(stop_below, jnp.float32),
                    cache_length=cache_bucket(prompt_tokens.shape[1] + max_new_tokens), greedy=temperature == 0.0,
                    top_k=int(top_k), nucleus=top_p < 1.0, pad_id=int(pad_id), num_samples=int(num_samples),
                    layers=layers, weights=weights)
    cut = lambda x: x[:, :max_new_tokens]
    return out._replace(tokens=cut(out.tokens), logps=cut(out.logps), top1_probs=cut(out.top1_probs),
                        sampling_logps=cut(out.sampling_logps), entropy=cut(out.entropy))


def generate(model: LlamaForCausalLM, prompt_tokens, *, prompt_mask=None, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, eos_id: int | tuple[int, ...] | None = None,
             pad_id: int = 0, seed: int = 0, layers: str = "auto", weights: str = "model") -> jax.Array:
    """New tokens ``[B, max_new_tokens]`` for left-padded prompts (``prompt_mask`` 1 on real tokens; None = no
    padding), ``pad_id`` after EOS. See ``sample`` for several samples per prompt and per-step probabilities."""
    return sample(model, prompt_tokens, prompt_mask=prompt_mask, max_new_tokens=max_new_tokens,
                  temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id, pad_id=pad_id, seed=seed,
                  layers=layers, weights=weights).tokens


def truncate_at_stop(text: str, stops: tuple[str, ...] | list[str]) -> str:
    """``text`` cut before the first occurrence of any stop string."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=len(text))
    return text[:cut]


def stop_string_lengths(tokens, lengths, stops, decode) -> np.ndarray:
    """Completion lengths ``[B]`` cut after the token that completes the first occurrence of any of ``stops`` (as
    transformers' ``stop_strings``: the stop string stays in the output). ``decode(ids) -> str`` decodes a list of
    token ids. Cutting after sampling equals stopping the loop there: earlier tokens never depend on later ones."""
    stops = [s for s in stops if s]
    out = np.asarray(lengths).copy()
    if not stops:
        return out
    tokens = np.asarray(tokens)
    for row, n in enumerate(out):
        ids = tokens[row, :n].tolist()
        if not any(s in decode(ids) for s in stops):
            continue
        low, high = 1, int(n)  # the shortest prefix whose text contains a stop string (monotone in the length)
        while low < high:
            mid = (low + high) // 2
            if any(s in decode(ids[:mid]) for s in stops):
                high = mid
            else:
                low = mid + 1
        out[row] = low
    return out
