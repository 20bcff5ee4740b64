"""Blocked ("flash") attention as Pallas kernels, the mask computed inside the kernel from per-token vectors.

The training forward (no KV cache) of every row layout jaxalign builds needs one mask rule: key ``j`` is visible
from query ``i`` when ``j <= i`` (slots, causal), ``k_segments[j]`` equals ``q_segments[i]`` or
``q_prefixes[i]`` (padding, packing, shared-prefix rows) and, in a sliding-window layer, ``i - j < window`` (in
positions for shared-prefix rows, where other completions' slots lie between a completion and its prompt).
``SegmentMask`` carries the vectors (``[B, T]`` each); the kernels read them block by block, so no
``[B, T, S]`` mask exists and memory is linear in the row length. Grouped-query attention reads each query
head's key/value head through the block index map (no repeated keys).

Forward: one program per (row, query head, query block) runs the online softmax over the key blocks the block
can see (causal and window bounds skip the rest) and keeps the log-sum-exp. Backward: the usual two kernels
(``dq`` per query block over key blocks; ``dk``/``dv`` per key block over query blocks, summed over a kv head's
query heads after the kernel), from the saved log-sum-exp and ``sum(dO * O)``. A query with no visible key (a
padding token in a packed row, left padding) gets a zero output and no gradient, where the dense path averages
all values; no loss reads those positions.

On the CPU the kernels run in Pallas interpret mode (tests: equal to the dense XLA path, forward and gradients,
to float32 rounding); elsewhere ``pallas_call`` compiles them (Mosaic on a TPU, Triton on a GPU), which has not been
run here (no TPU or GPU on this machine). Under a mesh the call is a ``shard_map`` over the batch and head axes the
logical rules give, since XLA does not partition a kernel.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxalign.parallel.mesh import logical_to_spec

_NO_PREFIX = -2  # a query prefix that names no segment
_NO_KEY = -1  # the segment of a padding key: visible from no query
_NT = (((1,), (1,)), ((), ()))  # dot_general: a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


class SegmentMask(NamedTuple):
    """The mask of a forward without KV cache as ``[B, T]`` int32 vectors (see the module docstring):
    ``q_segments``, ``k_segments`` (``-1`` on padding keys), ``q_prefixes`` (``-2``: none) and ``positions``,
    or None: what sliding windows measure distance in (None: the slots; shared-prefix rows give positions)."""

    q_segments: jax.Array
    k_segments: jax.Array
    q_prefixes: jax.Array
    positions: jax.Array | None = None

    @classmethod
    def build(cls, valid: jax.Array, segment_ids: jax.Array | None = None, prefix_ids: jax.Array | None = None,
              positions: jax.Array | None = None) -> SegmentMask:
        """From the attention mask ``valid [B, T]`` and optional ``segment_ids`` / ``prefix_ids`` (>= 0) and
        window ``positions``: the same visibility as ``llama._attention_mask`` with key slots = query slots."""
        segments = jnp.zeros(valid.shape, jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
        prefixes = (jnp.full(valid.shape, _NO_PREFIX, jnp.int32) if prefix_ids is None
                    else prefix_ids.astype(jnp.int32))
        return cls(segments, jnp.where(valid.astype(bool), segments, _NO_KEY), prefixes,
                   None if positions is None else positions.astype(jnp.int32))

    def window_positions(self) -> jax.Array:
        """``positions``, or the slots."""
        if self.positions is not None:
            return self.positions
        return jnp.broadcast_to(jnp.arange(self.q_segments.shape[1], dtype=jnp.int32), self.q_segments.shape)

    def dense(self, window: int = 0) -> jax.Array:
        """The ``[B, T, T]`` boolean mask these vectors stand for."""
        slots, at = jnp.arange(self.q_segments.shape[1]), self.window_positions()
        return _visible(slots[:, None], slots[None, :], self.q_segments[:, :, None], self.q_prefixes[:, :, None],
                        self.k_segments[:, None, :], window, at[:, :, None], at[:, None, :])


def _visible(rows, cols, q_seg, q_pre, k_seg, window: int, q_pos, k_pos):
    seen = (cols <= rows) & ((k_seg == q_seg) | (k_seg == q_pre))
    if window:
        seen &= q_pos - k_pos < window
    return seen


def _key_blocks(qi, bq: int, bk: int, nk: int, window: int):
    """The key blocks ``[lo, hi)`` query block ``qi`` can see (``window``: 0 where windows are not in slots)."""
    hi = jnp.minimum(((qi + 1) * bq + bk - 1) // bk, nk)
    lo = jnp.maximum(qi * bq - window + 1, 0) // bk if window else 0
    return lo, hi


def _query_blocks(kj, bq: int, bk: int, nq: int, window: int):
    """The query blocks ``[lo, hi)`` that can see key block ``kj`` (``window`` as in ``_key_blocks``)."""
    lo = kj * bk // bq
    hi = jnp.minimum(((kj + 1) * bk - 1 + window - 1) // bq + 1, nq) if window else nq
    return lo, hi


def _iota(shape, dim, offset):
    return offset + jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _forward_kernel(qseg_ref, qpre_ref, qpos_ref, kseg_ref, kpos_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                    scale, window, bounds, bq, bk, nk):
    qi = pl.program_id(2)
    q = q_ref[...].astype(jnp.float32) * scale
    q_seg, q_pre, q_pos = qseg_ref[...][:, None], qpre_ref[...][:, None], qpos_ref[...][:, None]
    rows = _iota((bq, 1), 0, qi * bq)

    def body(kj, carry):
        m, total, acc = carry
        start = pl.multiple_of(kj * bk, bk)
        k = k_ref[pl.ds(start, bk), :].astype(jnp.float32)
        v = v_ref[pl.ds(start, bk), :].astype(jnp.float32)
        seen = _visible(rows, _iota((1, bk), 1, start), q_seg, q_pre, kseg_ref[pl.ds(start, bk)][None, :], window,
                        q_pos, kpos_ref[pl.ds(start, bk)][None, :])
        s = jnp.where(seen, jax.lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32), -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - shift)
        alpha = jnp.exp(m - shift)
        return m_new, alpha * total + p.sum(axis=1, keepdims=True), alpha * acc + jnp.dot(p, v)

    lo, hi = _key_blocks(qi, bq, bk, nk, bounds)
    init = (jnp.full((bq, 1), -jnp.inf, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    m, total, acc = jax.lax.fori_loop(lo, hi, body, init)
    some = total > 0
    total = jnp.where(some, total, 1.0)
    o_ref[...] = (acc / total).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(some, m + jnp.log(total), jnp.inf)[:, 0]


def _probs_and_score_grads(q, k, v, do, lse, delta, seen):
    """A block's probabilities ``exp(q k^T - lse)`` (0 where not ``seen``) and the scores' gradient
    ``p * (dO v^T - delta)``, from the saved log-sum-exp and ``delta = sum(dO * O)`` (``q`` already scaled)."""
    p = jnp.where(seen, jnp.exp(jax.lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) - lse), 0.0)
    return p, p * (jax.lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32) - delta)


def _dq_kernel(qseg_ref, qpre_ref, qpos_ref, kseg_ref, kpos_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               dq_ref, *, scale, window, bounds, bq, bk, nk):
    qi = pl.program_id(2)
    q = q_ref[...].astype(jnp.float32) * scale
    do = do_ref[...].astype(jnp.float32)
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
    q_seg, q_pre, q_pos = qseg_ref[...][:, None], qpre_ref[...][:, None], qpos_ref[...][:, None]
    rows = _iota((bq, 1), 0, qi * bq)

    def body(kj, dq):
        start = pl.multiple_of(kj * bk, bk)
        k = k_ref[pl.ds(start, bk), :].astype(jnp.float32)
        v = v_ref[pl.ds(start, bk), :].astype(jnp.float32)
        seen = _visible(rows, _iota((1, bk), 1, start), q_seg, q_pre, kseg_ref[pl.ds(start, bk)][None, :], window,
                        q_pos, kpos_ref[pl.ds(start, bk)][None, :])
        return dq + jnp.dot(_probs_and_score_grads(q, k, v, do, lse, delta, seen)[1], k)

    lo, hi = _key_blocks(qi, bq, bk, nk, bounds)
    dq_ref[...] = (jax.lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32)) * scale).astype(dq_ref.dtype)


def _dkv_kernel(qseg_ref, qpre_ref, qpos_ref, kseg_ref, kpos_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, *, scale, window, bounds, bq, bk, nq):
    kj = pl.program_id(2)
    k = k_ref[...].astype(jnp.float32)
    v = v_ref[...].astype(jnp.float32)
    k_seg, k_pos = kseg_ref[...][None, :], kpos_ref[...][None, :]
    cols = _iota((1, bk), 1, kj * bk)

    def body(qi, carry):
        dk, dv = carry
        start = pl.multiple_of(qi * bq, bq)
        q = q_ref[pl.ds(start, bq), :].astype(jnp.float32) * scale
        do = do_ref[pl.ds(start, bq), :].astype(jnp.float32)
        lse, delta = lse_ref[pl.ds(start, bq)][:, None], delta_ref[pl.ds(start, bq)][:, None]
        seen = _visible(_iota((bq, 1), 0, start), cols, qseg_ref[pl.ds(start, bq)][:, None],
                        qpre_ref[pl.ds(start, bq)][:, None], k_seg, window, qpos_ref[pl.ds(start, bq)][:, None],
                        k_pos)
        p, ds = _probs_and_score_grads(q, k, v, do, lse, delta, seen)
        return (dk + jax.lax.dot_general(ds, q, _TN, preferred_element_type=jnp.float32),
                dv + jax.lax.dot_general(p, do, _TN, preferred_element_type=jnp.float32))

    lo, hi = _query_blocks(kj, bq, bk, nq, bounds)
    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(lo, hi, body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


class _Static(NamedTuple):
    scale: float
    window: int
    bounds: int  # the window the block bounds may skip by: ``window`` when it counts slots, else 0
    bq: int
    bk: int
    interpret: bool


def _specs(groups: int, length: int, head_dim: int, block: int, by_query: bool):
    """BlockSpecs over the grid ``(row, query head, block)``: the blocked operand per program, the rest whole."""
    def q_like(blocked):
        if blocked:
            return pl.BlockSpec((None, None, block, head_dim), lambda b, h, i: (b, h, i, 0))
        return pl.BlockSpec((None, None, length, head_dim), lambda b, h, i: (b, h, 0, 0))

    def kv_like(blocked):
        if blocked:
            return pl.BlockSpec((None, None, block, head_dim), lambda b, h, i: (b, h // groups, i, 0))
        return pl.BlockSpec((None, None, length, head_dim), lambda b, h, i: (b, h // groups, 0, 0))

    def vector(blocked):
        if blocked:
            return pl.BlockSpec((None, block), lambda b, h, i: (b, i))
        return pl.BlockSpec((None, length), lambda b, h, i: (b, 0))

    def per_head(blocked):
        if blocked:
            return pl.BlockSpec((None, None, block), lambda b, h, i: (b, h, i))
        return pl.BlockSpec((None, None, length), lambda b, h, i: (b, h, 0))

    return q_like(by_query), kv_like(not by_query), vector(by_query), vector(not by_query), per_head(by_query)


def _knobs(static: _Static) -> dict:
    return {"scale": static.scale, "window": static.window, "bounds": static.bounds, "bq": static.bq,
            "bk": static.bk}


def _vectors(mask: SegmentMask) -> tuple[jax.Array, ...]:
    """The kernels' vector operands: the query side's segments, prefixes and positions, the key side's segments and
    positions (one array serves both sides' positions)."""
    return mask.q_segments, mask.q_prefixes, mask.positions, mask.k_segments, mask.positions


def _forward(q, k, v, mask: SegmentMask, static: _Static):
    batch, heads, length, head_dim = q.shape
    groups = heads // k.shape[1]
    q_spec, kv_spec, qvec, kvec, lse_spec = _specs(groups, length, head_dim, static.bq, by_query=True)
    return pl.pallas_call(
        functools.partial(_forward_kernel, **_knobs(static), nk=length // static.bk),
        grid=(batch, heads, length // static.bq),
        in_specs=[qvec, qvec, qvec, kvec, kvec, q_spec, kv_spec, kv_spec],
        out_specs=[q_spec, lse_spec],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)],
        interpret=static.interpret, name="jaxalign_flash_forward",
    )(*_vectors(mask), q, k, v)


def _backward(q, k, v, mask: SegmentMask, out, lse, do, static: _Static):
    batch, heads, length, head_dim = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    q_spec, kv_whole, qvec, kvec_whole, per_head = _specs(groups, length, head_dim, static.bq, by_query=True)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **_knobs(static), nk=length // static.bk),
        grid=(batch, heads, length // static.bq),
        in_specs=[qvec, qvec, qvec, kvec_whole, kvec_whole, q_spec, kv_whole, kv_whole, q_spec, per_head, per_head],
        out_specs=q_spec, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=static.interpret, name="jaxalign_flash_dq",
    )(*_vectors(mask), q, k, v, do, lse, delta)

    q_whole, kv_spec, qvec_whole, kvec, per_head_whole = _specs(groups, length, head_dim, static.bk, by_query=False)
    per_q_head = pl.BlockSpec((None, None, static.bk, head_dim), lambda b, h, i: (b, h, i, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, **_knobs(static), nq=length // static.bq),
        grid=(batch, heads, length // static.bk),
        in_specs=[qvec_whole, qvec_whole, qvec_whole, kvec, kvec, q_whole, kv_spec, kv_spec, q_whole, per_head_whole,
                  per_head_whole],
        out_specs=[per_q_head, per_q_head],
        out_shape=[jax.ShapeDtypeStruct(q.shape, jnp.float32)] * 2,
        interpret=static.interpret, name="jaxalign_flash_dkv",
    )(*_vectors(mask), q, k, v, do, lse, delta)

    def per_kv_head(grad, like):  # the query heads of a group share their key/value head
        return grad.reshape(batch, kv_heads, groups, length, head_dim).sum(axis=2).astype(like.dtype)

    return dq, per_kv_head(dk, k), per_kv_head(dv, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, mask, static):
    return _forward(q, k, v, mask, static)[0]


def _flash_fwd(q, k, v, mask, static):
    out, lse = _forward(q, k, v, mask, static)
    return out, (q, k, v, mask, out, lse)


def _flash_bwd(static, residuals, do):
    q, k, v, mask, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, mask, out, lse, do, static)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: SegmentMask, *, scale: float, window: int = 0,
                    block: int = 128, interpret: bool | None = None) -> jax.Array:
    """Attention ``[B, T, H, hd]`` of queries ``q [B, T, H, hd]`` over keys and values ``[B, KV, T, hd]`` (KV
    dividing H; query head ``h`` reads kv head ``h // (H // KV)``) under ``mask``, in blocks of ``block``
    positions (the row is padded up to a multiple; padding keys are invisible). ``interpret``: Pallas interpret
    mode (default: on the CPU)."""
    batch, length, heads, _ = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[2] != length or heads % k.shape[1]:
        raise ValueError(f"flash_attention: queries {q.shape} [B, T, H, hd] and keys/values {k.shape} "
                         f"[B, KV, T, hd] do not match")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    block = min(block, _round_up(length, 8))
    padded = _round_up(length, block)
    bounds = window if mask.positions is None else 0  # block bounds count slots: not for distances in positions
    mask = mask._replace(positions=mask.window_positions())
    q = q.transpose(0, 2, 1, 3)
    if padded != length:
        def pad(x, axis, value=0):
            widths = [(0, 0)] * x.ndim
            widths[axis] = (0, padded - length)
            return jnp.pad(x, widths, constant_values=value)

        q, k, v = pad(q, 2), pad(k, 2), pad(v, 2)
        mask = SegmentMask(pad(mask.q_segments, 1), pad(mask.k_segments, 1, _NO_KEY),
                           pad(mask.q_prefixes, 1, _NO_PREFIX), pad(mask.positions, 1))
    static = _Static(float(scale), int(window), int(bounds), block, block, bool(interpret))
    out = _sharded(functools.partial(_flash, static=static), q, k, v, mask)
    return out[:, :, :length].transpose(0, 2, 1, 3)


def _sharded(fn, q, k, v, mask: SegmentMask):
    """``fn`` per shard under the current mesh: rows split as ``batch``, heads as ``heads`` when both the query
    and the kv head counts divide (else whole); the row length and head dimension whole."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn(q, k, v, mask)
    rows, head_axes = logical_to_spec(("batch", "heads"), q.shape[:2], mesh)
    if logical_to_spec(("batch", "heads"), k.shape[:2], mesh)[1] != head_axes:  # kv heads split otherwise
        head_axes = None
    tensors = jax.sharding.PartitionSpec(rows, head_axes, None, None)
    vectors = jax.sharding.PartitionSpec(rows, None)
    return jax.shard_map(lambda q, k, v, *m: fn(q, k, v, SegmentMask(*m)), mesh=mesh,
                         in_specs=(tensors, tensors, tensors, *[vectors] * len(mask)), out_specs=tensors,
                         check_vma=False)(q, k, v, *mask)
