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


def _vocab_tiles(kernel: jax.Array, tile: int, dtype) -> tuple[jax.Array, jax.Array]:
    """``(tiles [n, D, tile], first column of each [n])``: ``kernel [D, V]`` in ``dtype``, zero-padded on the
    vocabulary to ``n * tile`` columns; what the fused head's ``lax.scan`` walks over."""
    dim, vocab = kernel.shape
    n = -(-vocab // tile)
    tiles = jnp.pad(kernel.astype(dtype), ((0, 0), (0, n * tile - vocab))).reshape(dim, n, tile).transpose(1, 0, 2)
    return tiles, jnp.arange(n, dtype=jnp.int32) * tile


def _tile_logits(hidden: jax.Array, kernel_tile: jax.Array, start: jax.Array, vocab: int,
                 softcap: float = 0.0, logit_scale: float = 1.0) -> jax.Array:
    """float32 logits of one vocabulary tile (``softcap · tanh(logits / softcap)`` with a cap, then times
    ``logit_scale``), ``-inf`` on the padding columns past ``vocab``."""
    logits = jnp.dot(hidden, kernel_tile, preferred_element_type=jnp.float32)
    if softcap:
        logits = softcap * jnp.tanh(logits / softcap)
    if logit_scale != 1.0:
        logits = logits * logit_scale
    column = start + jnp.arange(kernel_tile.shape[1])
    return jnp.where(column < vocab, logits, -jnp.inf)


HEAD_BLOCK_ROWS = 1024  # rows (positions) per block of the fused head


def _sorted_blocks(hidden: jax.Array, targets: jax.Array, valid: jax.Array, block: int):
    """``(order, hidden, targets, keep, blocks to compute)``: the rows padded to whole blocks of ``block`` rows,
    ``keep`` marking the valid ones. With ``block < N`` the valid rows are moved to the front (stable) and the
    blocks past them are never computed; with one block (``block == N``) the rows stay in place."""
    rows = hidden.shape[0]
    if block >= rows:  # one block: no reordering (what a sharded batch keeps local)
        return jnp.arange(rows), hidden, targets, valid, 1
    pad = -(-rows // block) * block - rows
    order = jnp.argsort(jnp.logical_not(valid), stable=True)
    count = valid.astype(jnp.int32).sum()
    keep = jnp.pad(valid[order], (0, pad))
    return (order, jnp.pad(hidden[order], ((0, pad), (0, 0))), jnp.pad(targets[order], (0, pad)), keep,
            (count + block - 1) // block)


def _fused_forward(hidden, kernel, targets, valid, tile: int, block: int, softcap: float = 0.0,
                   logit_scale: float = 1.0):
    """``(logps [N], residuals)``: one pass over vocabulary tiles (``lax.scan``), and in each over the blocks of
    rows to compute (a ``fori_loop``), keeping a running max, sum and target logit per row (online log-sum-exp)."""
    vocab = kernel.shape[1]
    order, rows_hidden, rows_target, keep, n_blocks = _sorted_blocks(hidden, targets, valid, block)
    padded = rows_hidden.shape[0]
    tiles_and_starts = _vocab_tiles(kernel, tile, hidden.dtype)
    ones = jnp.ones((tile,), jnp.float32)

    def tile_body(carry, xs):
        kernel_tile, start = xs

        def block_body(b, carry):
            running_max, running_sum, target = carry
            first = b * block
            h = jax.lax.dynamic_slice_in_dim(rows_hidden, first, block)
            local = jax.lax.dynamic_slice_in_dim(rows_target, first, block) - start
            old_max = jax.lax.dynamic_slice_in_dim(running_max, first, block)
            logits = _tile_logits(h, kernel_tile, start, vocab, softcap, logit_scale)
            new_max = jnp.maximum(old_max, logits.max(axis=-1))
            # exp as an elementwise pass and the row sum as a matrix-vector product: both vectorise on the
            # CPU, where a fused exp-and-sum reduction runs several times slower
            new_sum = (jax.lax.dynamic_slice_in_dim(running_sum, first, block) * jnp.exp(old_max - new_max)
                       + jnp.exp(logits - new_max[:, None]) @ ones)
            inside = (local >= 0) & (local < tile)
            picked = jnp.take_along_axis(logits, jnp.clip(local, 0, tile - 1)[:, None], axis=-1)[:, 0]
            new_target = jax.lax.dynamic_slice_in_dim(target, first, block) + jnp.where(inside, picked, 0.0)
            return tuple(jax.lax.dynamic_update_slice_in_dim(whole, part, first, 0) for whole, part in
                         ((running_max, new_max), (running_sum, new_sum), (target, new_target)))

        return jax.lax.fori_loop(0, n_blocks, block_body, carry), None

    init = (jnp.full((padded,), -jnp.inf, jnp.float32), jnp.zeros((padded,), jnp.float32),
            jnp.zeros((padded,), jnp.float32))
    (running_max, running_sum, target), _ = jax.lax.scan(tile_body, init, tiles_and_starts)
    computed = jnp.arange(padded) < n_blocks * block
    lse = jnp.where(computed, running_max + jnp.log(running_sum), 0.0)
    logps_sorted = jnp.where(keep, target - lse, 0.0)
    logps = _unsort(logps_sorted, order, block >= hidden.shape[0])
    return logps, (order, rows_hidden, rows_target, lse, keep, n_blocks)


def _unsort(sorted_rows: jax.Array, order: jax.Array, in_place: bool) -> jax.Array:
    rows = order.shape[0]
    if in_place:
        return sorted_rows[:rows]
    return jnp.zeros((rows, *sorted_rows.shape[1:]), sorted_rows.dtype).at[order].set(sorted_rows[:rows])


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def fused_head_logps(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, valid: jax.Array, tile: int,
                     block: int = HEAD_BLOCK_ROWS, softcap: float = 0.0, logit_scale: float = 1.0) -> jax.Array:
    """``log_softmax(hidden @ kernel)[row, targets[row]]`` as ``[N]`` float32 where ``valid``, else 0; never holds
    ``[N, V]``. With ``softcap`` the logits are ``softcap · tanh(hidden @ kernel / softcap)`` (Gemma 2), then
    times ``logit_scale`` (1 / a sampling temperature).

    The rows to compute are gathered to the front (only they are computed: for preference data the prompt
    positions are skipped) and cut into blocks of ``block`` rows; the vocabulary is walked in tiles of ``tile``
    columns. The forward pass keeps a running max and sum per row (online log-sum-exp); the backward pass
    recomputes each tile's logits and forms its gradient ``g * (onehot - softmax)`` directly, so at most
    ``block x tile`` logits exist at once and no ``[N, V]`` scatter or second log-sum-exp is made. Four matmuls of
    ``rows x D x V`` in all (forward, recompute, two for the gradients), over the valid rows only.

    Args:
      hidden: ``[N, D]`` final (normed) hidden states, any float dtype (the matmuls run in it, accumulating
        in float32).
      kernel: ``[D, V]`` unembedding.
      targets: ``[N]`` integer ids in ``[0, V)``.
      valid: ``[N]`` bool, the rows whose log-prob is wanted (no gradient flows from the others).
      tile: vocabulary columns per tile.
      block: rows per block.
      softcap: the final-logit cap (0 = none).
      logit_scale: a factor on the (capped) logits.
    """
    return _fused_forward(hidden, kernel, targets, valid, tile, min(block, hidden.shape[0]), softcap,
                          logit_scale)[0]


def _fused_head_fwd(hidden, kernel, targets, valid, tile, block, softcap, logit_scale):
    logps, residuals = _fused_forward(hidden, kernel, targets, valid, tile, min(block, hidden.shape[0]), softcap,
                                      logit_scale)
    return logps, (kernel, *residuals)


def _fused_head_bwd(tile, block, softcap, logit_scale, residuals, grad):
    kernel, order, rows_hidden, rows_target, lse, keep, n_blocks = residuals
    rows, vocab = order.shape[0], kernel.shape[1]
    block = min(block, rows)
    tiles_and_starts = _vocab_tiles(kernel, tile, rows_hidden.dtype)
    grad = grad.astype(jnp.float32)
    rows_grad = grad if block >= rows else jnp.pad(grad[order], (0, rows_hidden.shape[0] - rows))
    rows_grad = jnp.where(keep, rows_grad, 0.0)  # the rows left out get no gradient

    def tile_body(grad_hidden, xs):
        kernel_tile, start = xs

        def block_body(b, carry):
            grad_hidden, grad_tile = carry
            first = b * block
            h = jax.lax.dynamic_slice_in_dim(rows_hidden, first, block)
            logits = _tile_logits(h, kernel_tile, start, vocab, softcap, logit_scale)
            onehot = (start + jnp.arange(tile)) == jax.lax.dynamic_slice_in_dim(rows_target, first, block)[:, None]
            softmax = jnp.exp(logits - jax.lax.dynamic_slice_in_dim(lse, first, block)[:, None])
            g = jax.lax.dynamic_slice_in_dim(rows_grad, first, block)
            dlogits = g[:, None] * (onehot - softmax) * logit_scale
            if softcap:  # through the cap: d(c·tanh(z/c))/dz = 1 − tanh²(z/c) (0 on the padding columns)
                capped = logits / (logit_scale * softcap)
                dlogits = dlogits * jnp.where(jnp.isfinite(logits), 1 - jnp.square(capped), 0.0)
            dlogits = dlogits.astype(h.dtype)
            part = (jax.lax.dynamic_slice_in_dim(grad_hidden, first, block)
                    + jnp.dot(dlogits, kernel_tile.T, preferred_element_type=jnp.float32))
            grad_tile = grad_tile + jnp.dot(h.T, dlogits, preferred_element_type=jnp.float32)
            return jax.lax.dynamic_update_slice_in_dim(grad_hidden, part, first, 0), grad_tile

        init = (grad_hidden, jnp.zeros((rows_hidden.shape[1], tile), jnp.float32))
        return jax.lax.fori_loop(0, n_blocks, block_body, init)

    grad_sorted, grad_tiles = jax.lax.scan(tile_body, jnp.zeros(rows_hidden.shape, jnp.float32), tiles_and_starts)
    grad_hidden = _unsort(grad_sorted, order, block >= rows)
    grad_kernel = grad_tiles.transpose(1, 0, 2).reshape(kernel.shape[0], -1)[:, :vocab]
    return grad_hidden.astype(rows_hidden.dtype), grad_kernel.astype(kernel.dtype), None, None


fused_head_logps.defvjp(_fused_head_fwd, _fused_head_bwd)


def token_logps_from_hidden(hidden: jax.Array, head_kernel: jax.Array, tokens: jax.Array, loss_mask: jax.Array,
                            *, chunk_size: int = 512, softcap: float = 0.0, logit_scale: float = 1.0) -> jax.Array:
    """Memory-light, fused ``token_logps``: never builds the ``[B, T, V]`` logits, and (on one device) computes the
    head only at the positions whose next token is trained (``fused_head_logps``).

    Args:
      hidden: final (normed) hidden states ``[B, T, D]``.
      head_kernel: ``[D, V]`` unembedding (the transposed embedding table for tied models).
      tokens, loss_mask: as in ``token_logps``.
      chunk_size: vocabulary columns per tile; at most ``HEAD_BLOCK_ROWS * chunk_size`` logits exist at once.
      softcap: the model's final-logit soft-cap (``LlamaConfig.final_softcap``; 0 = none).
      logit_scale: a factor on the capped logits (1 / temperature).
    Returns:
      ``[B, T]`` float32, equal to ``token_logps(softcap(hidden @ head_kernel) * logit_scale, tokens, loss_mask)``.
    """
    batch, length, dim = hidden.shape
    targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1))).astype(jnp.int32)  # target of position t is token t+1
    tile = min(chunk_size, head_kernel.shape[1])
    valid = jnp.pad(loss_mask[:, 1:].astype(bool), ((0, 0), (0, 1)))  # position t carries token t+1's log-prob
    mesh = jax.sharding.get_abstract_mesh()
    # on a mesh of several devices the rows stay in one block, in place: gathering the valid rows of a sharded
    # batch would move them across devices
    block = batch * length if not mesh.empty and mesh.size > 1 else HEAD_BLOCK_ROWS
    logps = fused_head_logps(hidden.reshape(-1, dim), head_kernel, targets.reshape(-1), valid.reshape(-1), tile,
                             block, softcap, logit_scale)
    return jnp.pad(logps.reshape(batch, length)[:, : length - 1], ((0, 0), (1, 0)))


def greedy_from_hidden(hidden: jax.Array, head_kernel: jax.Array, *, chunk_size: int = 512) -> jax.Array:
    """``argmax(hidden @ head_kernel, -1)`` as ``[B, T]`` int32, over vocabulary tiles of ``chunk_size`` columns
    (ties go to the lowest id, as ``argmax``)."""
    batch, length, dim = hidden.shape
    vocab = head_kernel.shape[1]
    tile = min(chunk_size, vocab)
    flat = hidden.reshape(-1, dim)
    tiles_and_starts = _vocab_tiles(head_kernel, tile, hidden.dtype)

    def body(carry, xs):
        best_value, best_index = carry
        kernel_tile, start = xs
        logits = _tile_logits(flat, kernel_tile, start, vocab)
        value, index = logits.max(axis=-1), start + jnp.argmax(logits, axis=-1).astype(jnp.int32)
        better = value > best_value
        return (jnp.where(better, value, best_value), jnp.where(better, index, best_index)), None

    init = (jnp.full((flat.shape[0],), -jnp.inf, jnp.float32), jnp.zeros((flat.shape[0],), jnp.int32))
    (_, best), _ = jax.lax.scan(body, init, tiles_and_starts)
    return best.reshape(batch, length)


def log_sum_sq_probs(hidden: jax.Array, head_kernel: jax.Array, *, chunk_size: int = 0,
                     softcap: float = 0.0) -> jax.Array:
    """``log Σ_v p(v | tokens[<t])²`` at token positions ``[B, T]`` float32 (position 0, which nothing predicts,
    is 0), gradient-free: WPO's per-token normaliser (Zhou et al., 2024, arXiv 2406.11827, eq. 2, as TRL 1.16
    computes it). ``chunk_size > 0`` walks the vocabulary in tiles of that many columns (never holding
    ``[B, T, V]``); 0 forms the logits at once. ``softcap``: the model's final-logit cap (0 = none).

    ``log Σ p² = logsumexp(2z) − 2·logsumexp(z)`` of the logits ``z``."""
    batch, length, dim = hidden.shape
    hidden = jax.lax.stop_gradient(hidden[:, :-1].reshape(-1, dim))
    head_kernel = jax.lax.stop_gradient(head_kernel)
    vocab = head_kernel.shape[1]
    if chunk_size <= 0:
        logits = jnp.dot(hidden, head_kernel.astype(hidden.dtype), preferred_element_type=jnp.float32)
        logits = softcap * jnp.tanh(logits / softcap) if softcap else logits
        value = jax.nn.logsumexp(2 * logits, axis=-1) - 2 * jax.nn.logsumexp(logits, axis=-1)
    else:
        def body(carry, xs):
            lse, lse2 = carry
            logits = _tile_logits(hidden, *xs, vocab, softcap)
            return (jnp.logaddexp(lse, jax.nn.logsumexp(logits, axis=-1)),
                    jnp.logaddexp(lse2, jax.nn.logsumexp(2 * logits, axis=-1))), None

        start = jnp.full((hidden.shape[0],), -jnp.inf, jnp.float32)
        (lse, lse2), _ = jax.lax.scan(body, (start, start), _vocab_tiles(head_kernel, min(chunk_size, vocab),
                                                                         hidden.dtype))
        value = lse2 - 2 * lse
    return jnp.pad(value.reshape(batch, length - 1), ((0, 0), (1, 0)))
