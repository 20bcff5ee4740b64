"""Log-probabilities of the trained tokens, from logits or (memory-light) from hidden states.

Conventions (DESIGN.md): ``tokens [B, T]`` int, ``loss_mask [B, T]`` marks trained tokens in token positions
(unshifted); logits at position ``t-1`` predict token ``t``, so position 0 never carries a log-prob. All math
is float32 whatever the model dtype.
"""

from __future__ import annotations

from functools import partial

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


def _vocab_tiles(kernel: jax.Array, tile: int) -> jax.Array:
    """``[D, V]`` -> ``[n, D, tile]``, zero-padded on the vocabulary to ``n * tile`` columns."""
    dim, vocab = kernel.shape
    n = -(-vocab // tile)
    return jnp.pad(kernel, ((0, 0), (0, n * tile - vocab))).reshape(dim, n, tile).transpose(1, 0, 2)


def _tile_logits(hidden: jax.Array, kernel_tile: jax.Array, start: jax.Array, vocab: int) -> jax.Array:
    """float32 logits of one vocabulary tile, ``-inf`` on the padding columns past ``vocab``."""
    logits = jnp.dot(hidden, kernel_tile, preferred_element_type=jnp.float32)
    column = start + jnp.arange(kernel_tile.shape[1])
    return jnp.where(column < vocab, logits, -jnp.inf)


def _fused_forward(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, tile: int):
    """``(logps [N], logsumexp [N])`` by one pass over vocabulary tiles with a running max and sum."""
    vocab = kernel.shape[1]
    tiles = _vocab_tiles(kernel.astype(hidden.dtype), tile)
    ones = jnp.ones((tile,), jnp.float32)

    def body(carry, xs):
        running_max, running_sum, target = carry
        kernel_tile, start = xs
        logits = _tile_logits(hidden, kernel_tile, start, vocab)
        new_max = jnp.maximum(running_max, logits.max(axis=-1))
        # exp as an elementwise pass and the row sum as a matrix-vector product: both vectorise on the CPU,
        # where a fused exp-and-sum reduction runs several times slower
        running_sum = running_sum * jnp.exp(running_max - new_max) + jnp.exp(logits - new_max[:, None]) @ ones
        local = targets - start
        inside = (local >= 0) & (local < tile)
        picked = jnp.take_along_axis(logits, jnp.clip(local, 0, tile - 1)[:, None], axis=-1)[:, 0]
        return (new_max, running_sum, target + jnp.where(inside, picked, 0.0)), None

    rows = hidden.shape[0]
    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows,), jnp.float32))
    starts = jnp.arange(tiles.shape[0], dtype=jnp.int32) * tile
    (running_max, running_sum, target), _ = jax.lax.scan(body, init, (tiles, starts))
    lse = running_max + jnp.log(running_sum)
    return target - lse, lse


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def fused_head_logps(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, tile: int) -> jax.Array:
    """``log_softmax(hidden @ kernel)[row, targets[row]]`` as ``[N]`` float32, never holding ``[N, V]``.

    The vocabulary is walked in tiles of ``tile`` columns (a ``lax.scan``): the forward pass keeps a running
    max and sum per row (online log-sum-exp), the backward pass recomputes each tile's logits and forms its
    gradient ``g * (onehot - softmax)`` directly, so at most ``N x tile`` logits exist at once and no
    ``[N, V]`` scatter or second log-sum-exp is made. Four matmuls of ``N x D x V`` in all (forward,
    recompute, two for the gradients) against three for the plain path, with far fewer passes over memory.

    Args:
      hidden: ``[N, D]`` final (normed) hidden states, any float dtype (the matmuls run in it, accumulating
        in float32).
      kernel: ``[D, V]`` unembedding.
      targets: ``[N]`` integer ids in ``[0, V)``.
      tile: vocabulary columns per tile.
    """
    return _fused_forward(hidden, kernel, targets, tile)[0]


def _fused_head_fwd(hidden, kernel, targets, tile):
    logps, lse = _fused_forward(hidden, kernel, targets, tile)
    return logps, (hidden, kernel, targets, lse)


def _fused_head_bwd(tile, residuals, grad):
    hidden, kernel, targets, lse = residuals
    vocab = kernel.shape[1]
    tiles = _vocab_tiles(kernel.astype(hidden.dtype), tile)
    grad = grad.astype(jnp.float32)

    def body(grad_hidden, xs):
        kernel_tile, start = xs
        logits = _tile_logits(hidden, kernel_tile, start, vocab)
        onehot = (start + jnp.arange(tile)) == targets[:, None]
        dlogits = (grad[:, None] * (onehot - jnp.exp(logits - lse[:, None]))).astype(hidden.dtype)
        grad_hidden = grad_hidden + jnp.dot(dlogits, kernel_tile.T, preferred_element_type=jnp.float32)
        return grad_hidden, jnp.dot(hidden.T, dlogits, preferred_element_type=jnp.float32)

    starts = jnp.arange(tiles.shape[0], dtype=jnp.int32) * tile
    grad_hidden, grad_tiles = jax.lax.scan(body, jnp.zeros(hidden.shape, jnp.float32), (tiles, starts))
    grad_kernel = grad_tiles.transpose(1, 0, 2).reshape(kernel.shape[0], -1)[:, :vocab]
    return grad_hidden.astype(hidden.dtype), grad_kernel.astype(kernel.dtype), None


fused_head_logps.defvjp(_fused_head_fwd, _fused_head_bwd)


def token_logps_from_hidden(hidden: jax.Array, head_kernel: jax.Array, tokens: jax.Array, loss_mask: jax.Array,
                            *, chunk_size: int = 512) -> jax.Array:
    """Memory-light, fused ``token_logps``: never builds the ``[B, T, V]`` logits (``fused_head_logps``).

    Args:
      hidden: final (normed) hidden states ``[B, T, D]``.
      head_kernel: ``[D, V]`` unembedding (the transposed embedding table for tied models).
      tokens, loss_mask: as in ``token_logps``.
      chunk_size: vocabulary columns per tile; at most ``B * T * chunk_size`` logits exist at once.
    Returns:
      ``[B, T]`` float32, equal to ``token_logps(hidden @ head_kernel, tokens, loss_mask)``.
    """
    batch, length, dim = hidden.shape
    targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1))).astype(jnp.int32)  # target of position t is token t+1
    tile = min(chunk_size, head_kernel.shape[1])
    logps = fused_head_logps(hidden.reshape(-1, dim), head_kernel, targets.reshape(-1), tile)
    logps = logps.reshape(batch, length)[:, : length - 1]
    mask = loss_mask[:, 1:].astype(bool)
    return jnp.pad(jnp.where(mask, logps, 0.0), ((0, 0), (1, 0)))


def greedy_from_hidden(hidden: jax.Array, head_kernel: jax.Array, *, chunk_size: int = 512) -> jax.Array:
    """``argmax(hidden @ head_kernel, -1)`` as ``[B, T]`` int32, over vocabulary tiles of ``chunk_size`` columns
    (ties go to the lowest id, as ``argmax``)."""
    batch, length, dim = hidden.shape
    vocab = head_kernel.shape[1]
    tile = min(chunk_size, vocab)
    flat = hidden.reshape(-1, dim)
    tiles = _vocab_tiles(head_kernel.astype(hidden.dtype), tile)

    def body(carry, xs):
        best_value, best_index = carry
        kernel_tile, start = xs
        logits = _tile_logits(flat, kernel_tile, start, vocab)
        value, index = logits.max(axis=-1), start + jnp.argmax(logits, axis=-1).astype(jnp.int32)
        better = value > best_value
        return (jnp.where(better, value, best_value), jnp.where(better, index, best_index)), None

    init = (jnp.full((flat.shape[0],), -jnp.inf, jnp.float32), jnp.zeros((flat.shape[0],), jnp.int32))
    starts = jnp.arange(tiles.shape[0], dtype=jnp.int32) * tile
    (_, best), _ = jax.lax.scan(body, init, (tiles, starts))
    return best.reshape(batch, length)
