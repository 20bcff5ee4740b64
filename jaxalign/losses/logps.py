"""Log-probabilities of the trained tokens, from logits or (memory-light) from hidden states.

Conventions (DESIGN.md): ``tokens [B, T]`` int, ``loss_mask [B, T]`` marks trained tokens in token positions
(unshifted); logits at position ``t-1`` predict token ``t``, so position 0 never carries a log-prob. All math
is float32 whatever the model dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _shifted_logps(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """``log softmax(logits[:, t-1])[tokens[:, t]]`` for t >= 1, as ``[B, T-1]`` float32."""
    logits = logits[:, :-1].astype(jnp.float32)
    target = jnp.take_along_axis(logits, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
    return target - jax.nn.logsumexp(logits, axis=-1)


def token_logps(logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """Per-token log-probabilities ``[B, T]`` (float32): ``log p(tokens[t] | tokens[<t])`` where
    ``loss_mask[t]`` is set, 0 elsewhere; position 0 is always 0.

    Args:
      logits: ``[B, T, V]``, any float dtype (cast to float32).
      tokens: ``[B, T]`` integer ids.
      loss_mask: ``[B, T]``, 1 on trained tokens.
    """
    logps = _shifted_logps(logits, tokens)
    mask = loss_mask[:, 1:].astype(bool)
    return jnp.pad(jnp.where(mask, logps, 0.0), ((0, 0), (1, 0)))


def sequence_logps(logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(sum_logps [B], n_tokens [B])``: summed log-prob of the trained tokens and how many there are
    (position 0 is never counted, since nothing predicts it)."""
    n_tokens = loss_mask[:, 1:].astype(jnp.float32).sum(axis=1)
    return token_logps(logits, tokens, loss_mask).sum(axis=1), n_tokens


def token_logps_from_hidden(hidden: jax.Array, head_kernel: jax.Array, tokens: jax.Array, loss_mask: jax.Array,
                            *, chunk_size: int = 256) -> jax.Array:
    """Memory-light ``token_logps``: never builds the ``[B, T, V]`` logits or log-softmax at once.

    The sequence is cut into chunks of ``chunk_size`` positions; each chunk's logits ``hidden @ head_kernel``
    are formed, reduced to the target log-prob and thrown away, and rematerialised in the backward pass
    (``jax.checkpoint``). Peak memory for the head is ``B * chunk_size * V`` floats instead of ``B * T * V``.

    Args:
      hidden: final (normed) hidden states ``[B, T, D]``.
      head_kernel: ``[D, V]`` unembedding (the transposed embedding table for tied models).
      tokens, loss_mask: as in ``token_logps``.
      chunk_size: positions per chunk; T is padded up to a multiple of it.
    Returns:
      ``[B, T]`` float32, equal to ``token_logps(hidden @ head_kernel, tokens, loss_mask)``.
    """
    batch, length, _ = hidden.shape
    targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1))).astype(jnp.int32)  # target of position t is token t+1
    n_chunks = -(-length // chunk_size)
    pad = n_chunks * chunk_size - length
    hidden_chunks = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(batch, n_chunks, chunk_size, -1)
    target_chunks = jnp.pad(targets, ((0, 0), (0, pad))).reshape(batch, n_chunks, chunk_size)

    @jax.checkpoint
    def chunk_logps(h, t):
        logits = (h @ head_kernel.astype(h.dtype)).astype(jnp.float32)
        target = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        return target - jax.nn.logsumexp(logits, axis=-1)

    logps = jax.lax.map(lambda xs: chunk_logps(*xs), (hidden_chunks.swapaxes(0, 1), target_chunks.swapaxes(0, 1)))
    logps = logps.swapaxes(0, 1).reshape(batch, -1)[:, : length - 1]
    mask = loss_mask[:, 1:].astype(bool)
    return jnp.pad(jnp.where(mask, logps, 0.0), ((0, 0), (1, 0)))


def greedy_from_hidden(hidden: jax.Array, head_kernel: jax.Array, *, chunk_size: int = 256) -> jax.Array:
    """``argmax(hidden @ head_kernel, -1)`` as ``[B, T]`` int32, computed chunk by chunk over the sequence."""
    batch, length, _ = hidden.shape
    n_chunks = -(-length // chunk_size)
    pad = n_chunks * chunk_size - length
    chunks = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(batch, n_chunks, chunk_size, -1)
    best = jax.lax.map(lambda h: jnp.argmax(h @ head_kernel.astype(h.dtype), axis=-1).astype(jnp.int32),
                       chunks.swapaxes(0, 1))
    return best.swapaxes(0, 1).reshape(batch, -1)[:, :length]
