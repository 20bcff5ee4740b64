"""Shared pieces of the objectives: weighted metrics (sums and denominators) and the policy forward pass."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxalign.losses import token_logps, token_logps_from_hidden
from jaxalign.losses.logps import HEAD_BLOCK_ROWS


class Metric(NamedTuple):
    """A mean kept as ``total / count`` so micro-batches, devices and hosts combine exactly (Tunix style)."""

    total: jax.Array
    count: jax.Array

    @property
    def value(self) -> jax.Array:
        return self.total / jnp.maximum(self.count, 1e-9)


Metrics = dict[str, Metric]


@dataclasses.dataclass(frozen=True)
class EngineParams:
    """Engine settings every objective's hyper-parameter class inherits (defined here once).

    ``logps_chunk_size``: the vocabulary tile of the fused LM-head log-probs (``token_logps_from_hidden``);
    0 = the plain ``[B, T, V]`` logits; -1 = chosen by backend and size (``resolve_chunk_size``). The reference
    pass and the precomputed reference use the same path as the policy."""

    logps_chunk_size: int = -1


def example_weights(batch: Mapping[str, Any], key: str, size: int) -> jax.Array:
    """``batch["example_weight"]`` (1 = real example, 0 = filler row) or ones."""
    weight = batch.get("example_weight")
    if weight is None:
        return jnp.ones((size,), jnp.float32)
    weight = jnp.asarray(weight, jnp.float32)
    if weight.shape != (size,):
        raise ValueError(f"example_weight has shape {weight.shape}, expected ({size},) to match {key}")
    return weight


def weighted_means(per_example: Mapping[str, jax.Array], weight: jax.Array) -> Metrics:
    """Each ``[B]`` metric as ``Metric(Σ w·m, Σ w)``."""
    count = weight.sum()
    return {name: Metric((jax.lax.stop_gradient(value) * weight).sum(), count) for name, value in per_example.items()}


def token_nll_metric(per_example: Mapping[str, jax.Array], weight: jax.Array) -> Metric:
    """Mean NLL over every trained token of the batch (``nll/sum`` over ``len/completion``)."""
    return Metric(jax.lax.stop_gradient((per_example["nll/sum"] * weight).sum()),
                  (per_example["len/completion"] * weight).sum())


def require(batch: Mapping[str, Any], *keys: str, objective: str) -> list[jax.Array]:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise KeyError(f"the {objective} objective needs batch fields {missing}; the batch has {sorted(batch)}")
    return [batch[k] for k in keys]


# ``logps_chunk_size=-1`` (automatic): on accelerators, the fused path (``token_logps_from_hidden``) when the
# forward pass's logits would exceed AUTO_CHUNK_ELEMENTS (2^27 float32 logits are 512 MB per buffer, and the plain
# path keeps several such buffers for the backward), with blocks x tiles of about AUTO_CHUNK_TARGET logits. On the
# CPU the fused path is taken from CPU_FUSED_ELEMENTS logits up, with blocks x tiles of about CPU_TILE_TARGET
# logits (8 MB, cache-sized): the DPO step measured 2.2x faster than on the plain path at the GPT-2 vocabulary,
# 9 % slower at the SmolLM2-135M shape (docs/benchmarks.md).
AUTO_CHUNK_ELEMENTS = 1 << 27
AUTO_CHUNK_TARGET = 1 << 24
CPU_TILE_TARGET = 1 << 21
CPU_FUSED_ELEMENTS = 1 << 22  # on the CPU, logits smaller than this (16 MB) take the plain path
MIN_TILE, MAX_CPU_TILE = 128, 4096


def resolve_chunk_size(chunk_size: int, rows: int, length: int, vocab: int, backend: str | None = None) -> int:
    """The vocabulary tile width of the fused log-prob path, or 0 for the plain ``[B, T, V]`` logits.

    ``chunk_size >= 0`` is returned as given; ``-1`` chooses by backend (default: JAX's) and size."""
    if chunk_size >= 0:
        return chunk_size
    tokens = max(rows * length, 1)
    block = min(tokens, HEAD_BLOCK_ROWS)  # rows per block of the fused head
    if (backend or jax.default_backend()) == "cpu":
        if tokens * vocab < CPU_FUSED_ELEMENTS:  # tiny logits: the plain path compiles faster, runs as fast
            return 0
        target, cap = CPU_TILE_TARGET, MAX_CPU_TILE
    elif tokens * vocab < AUTO_CHUNK_ELEMENTS:
        return 0
    else:
        target, cap = AUTO_CHUNK_TARGET, vocab
    tile = MIN_TILE
    while tile * 2 * block <= target and tile * 2 <= cap:
        tile *= 2
    return min(tile, vocab)


SHARED_FIELDS = ("positions", "prefix_ids", "predictor_index")  # shared-prefix rows' layout (``policy_token_logps``)


def policy_token_logps(model, tokens: jax.Array, attention_mask: jax.Array, loss_mask: jax.Array, *,
                       inputs_embeds: jax.Array | None = None, segment_ids: jax.Array | None = None,
                       shared: Mapping[str, jax.Array] | None = None, chunk_size: int = 0,
                       return_hidden: bool = False, temperature: float = 1.0,
                       group_layout: tuple[int, int, int] | None = None):
    """Token log-probs ``[B, T]`` of ``tokens`` under ``model`` (and the final hidden states if asked);
    ``temperature != 1``: of ``softmax(logits / temperature)`` (RL's sampling distribution, as TRL trains it).

    ``shared``: shared-prefix rows' ``SHARED_FIELDS`` (``packed_batch``, ``group_rows``); the
    hidden state at slot ``t`` is then the one that predicts token ``t + 1`` (its prompt's last for a completion's
    first token), and the returned hidden states are in that order. ``group_layout``: GRPO group rows' ``(P, G, C)``
    (``LlamaForCausalLM.hidden_states``).

    ``chunk_size > 0`` takes the fused, memory-light path (``token_logps_from_hidden``, vocabulary tiles of
    ``chunk_size`` columns): the ``[B, T, V]`` logits are never held at once; ``-1`` chooses
    (``resolve_chunk_size``).
    """
    extra = {} if shared is None else {"positions": shared["positions"], "prefix_ids": shared["prefix_ids"]}
    if group_layout is not None:
        extra["group_layout"] = group_layout
    hidden, _ = model.hidden_states(None if inputs_embeds is not None else tokens, attention_mask,
                                    inputs_embeds=inputs_embeds, segment_ids=segment_ids, **extra)
    if shared is not None:  # slot t takes the state that predicts token t + 1
        source = jnp.asarray(shared["predictor_index"], jnp.int32)
        source = jnp.concatenate([source[:, 1:], jnp.full_like(source[:, :1], tokens.shape[1] - 1)], axis=1)
        hidden = jnp.take_along_axis(hidden, source[..., None], axis=1)
    chunk_size = resolve_chunk_size(chunk_size, tokens.shape[0], tokens.shape[1], model.config.vocab_size)
    # the temperature divides the logits: through a linear head that is dividing the hidden states; a soft-capped
    # head is not linear, so there it divides the capped logits (as TRL divides the model's logits)
    cap = model.config.final_softcap
    after = temperature if cap else 1.0
    scaled = hidden if temperature == 1.0 or cap else hidden / jnp.asarray(temperature, hidden.dtype)
    if chunk_size > 0:
        logps = token_logps_from_hidden(scaled, model.head_kernel(), tokens, loss_mask, chunk_size=chunk_size,
                                        softcap=cap, logit_scale=1.0 / after)
    else:
        logps = token_logps(model.unembed(scaled) / after, tokens, loss_mask)
    return (logps, hidden) if return_hidden else logps


def concat_pair(batch: Mapping[str, Any], prefix: str, objective: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``[prefix]chosen_*`` and ``[prefix]rejected_*`` stacked on the batch axis (``[2B, T]``), padded to
    a common length, so one forward pass serves both."""
    fields = ("tokens", "attention_mask", "loss_mask")
    chosen = require(batch, *(f"{prefix}chosen_{f}" for f in fields), objective=objective)
    rejected = require(batch, *(f"{prefix}rejected_{f}" for f in fields), objective=objective)
    length = max(chosen[0].shape[1], rejected[0].shape[1])

    def pad(x):
        return jnp.pad(jnp.asarray(x), ((0, 0), (0, length - x.shape[1])))

    return tuple(jnp.concatenate([pad(c), pad(r)], axis=0) for c, r in zip(chosen, rejected, strict=True))
