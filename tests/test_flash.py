"""The Pallas attention kernels (``attention_impl="pallas"``, interpret mode on the CPU) against dense attention:
causal, padded, packed, shared-prefix and sliding-window masks with grouped-query heads, forward and gradients;
then whole models and a shared-prefix DPO step against the einsum path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_packed_preference import TINY, loss_and_grads, shared_pairs

from jaxalign.data.batching import pack_rows, packed_batch, pad_batch
from jaxalign.models import LlamaConfig, create_model
from jaxalign.models.flash import SegmentMask, flash_attention
from jaxalign.models.llama import _attention_mask

B, T, H, KV, HD = 2, 20, 4, 2, 16  # T = 20 in blocks of 8: three query and key blocks, the last one padded


def dense_attention(q, k, v, mask, scale):
    """Softmax attention with an explicit ``[B, T, S]`` mask, each query head reading kv head ``h // (H // KV)``."""
    groups = q.shape[2] // k.shape[1]
    k, v = jnp.repeat(k, groups, axis=1), jnp.repeat(v, groups, axis=1)
    scores = jnp.einsum("bthd,bhsd->bhts", q, k) * scale
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -1e30), axis=-1)
    return jnp.einsum("bhts,bhsd->bthd", probs, v)


def layouts():
    """``(valid, segment_ids, prefix_ids, positions)`` per mask kind (None: not used; shared-prefix rows' windows
    count positions, which restart after each prompt)."""
    right = np.ones((B, T), bool)
    right[0, 15:] = False
    left = np.ones((B, T), bool)
    left[1, :6] = False
    packed = np.zeros((B, T), np.int32)
    packed[0, :9], packed[0, 9:17] = 1, 2  # two sequences, then padding
    packed[1, :4], packed[1, 4:20] = 1, 2
    # shared prefix: a prompt (segment 1) read by two completions (2, 3), then a second pair (4; 5, 6)
    shared = np.asarray([[1] * 6 + [2] * 3 + [3] * 2 + [4] * 3 + [5] * 2 + [6] * 3 + [0],
                         [1] * 9 + [2] * 5 + [3] * 6], np.int32)
    prefixes = np.where(np.isin(shared, (2, 3)), 1, np.where(np.isin(shared, (5, 6)), 4, 0)).astype(np.int32)
    positions = np.stack([np.r_[np.arange(6), np.arange(6, 9), np.arange(6, 8), np.arange(3), np.arange(3, 5),
                                np.arange(3, 6), [0]], np.r_[np.arange(9), np.arange(9, 14), np.arange(9, 15)]])
    return {"causal": (np.ones((B, T), bool), None, None, None), "right-padded": (right, None, None, None),
            "left-padded": (left, None, None, None), "packed": (packed > 0, packed, None, None),
            "shared-prefix": (shared > 0, shared, prefixes, positions.astype(np.int32))}


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("kind", list(layouts()))
def test_kernel_equals_dense_attention(kind, window):
    valid, segments, prefixes, positions = (None if a is None else jnp.asarray(a) for a in layouts()[kind])
    slots = jnp.broadcast_to(jnp.arange(T), (B, T))
    mask = _attention_mask(slots, slots, valid, segments, segments, window, prefixes, positions)  # the einsum path's
    vectors = SegmentMask.build(valid, segments, prefixes, positions)
    np.testing.assert_array_equal(vectors.dense(window), mask)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((B, T, H, HD), (B, KV, T, HD),
                                                                             (B, KV, T, HD)))
    seen = mask.any(axis=-1)  # queries with no visible key (padding) get zeros here: no loss reads them
    weights = jnp.asarray(rng.normal(size=(B, T, H, HD)), jnp.float32) * seen[:, :, None, None]

    def kernel(q, k, v):
        return flash_attention(q, k, v, vectors, scale=0.3, window=window, block=8)

    def dense(q, k, v):
        return dense_attention(q, k, v, mask, 0.3)

    out = kernel(q, k, v)
    np.testing.assert_allclose(np.asarray(out)[np.asarray(seen)], np.asarray(dense(q, k, v))[np.asarray(seen)],
                               atol=1e-5)
    assert not np.asarray(out)[~np.asarray(seen)].any()
    grads = jax.grad(lambda *a: jnp.sum(kernel(*a) * weights), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(lambda *a: jnp.sum(dense(*a) * weights), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_kernel_rejects_mismatched_shapes():
    q = jnp.zeros((1, 8, 3, 4))
    with pytest.raises(ValueError, match="do not match"):
        flash_attention(q, jnp.zeros((1, 2, 8, 4)), jnp.zeros((1, 2, 8, 4)),
                        SegmentMask.build(jnp.ones((1, 8), bool)), scale=1.0)


@pytest.mark.parametrize("layout", ["window-sharded", "scanned-remat"])
def test_model_forward_and_gradients_equal_the_einsum_path(layout, mesh8):
    """Packed rows with shared prefixes through a whole model: a Mistral-like one (sliding window on one layer) on
    one device and sharded over 8 (rows over data x fsdp, heads over tensor: the kernel runs per shard), and a
    scanned, rematerialised one."""
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2)
    config = (LlamaConfig(**shape, num_layers=2, sliding_window=6, sliding_window_layers=(True, False))
              if layout == "window-sharded" else LlamaConfig(**shape, num_layers=3, scan_layers=True, remat=True))
    _, segments, prefixes, positions = (jnp.concatenate([jnp.asarray(a)] * 2) for a in layouts()["shared-prefix"])
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2 * B, T)), jnp.int32)
    targets, keep = jnp.roll(tokens, -1, axis=1), segments > 0  # any fixed targets: every position's gradient

    def loss_and_grads_of(config, mesh=None):
        graphdef, state = nnx.split(create_model(config, seed=3))

        def loss(state):
            logits = nnx.merge(graphdef, state)(tokens, positions=positions, segment_ids=segments,
                                                prefix_ids=prefixes)
            logps = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, :, None], axis=-1)[..., 0]
            return -jnp.sum(jnp.where(keep, logps, 0.0)) / jnp.sum(keep)

        if mesh is None:
            return jax.value_and_grad(loss)(state)
        with jax.set_mesh(mesh):
            assert "shard_map" in str(jax.make_jaxpr(loss)(state))  # the kernel runs on each shard
            return jax.jit(jax.value_and_grad(loss))(state)

    want = loss_and_grads_of(config)
    kernel = config.replace(attention_impl="pallas")
    for got in [loss_and_grads_of(kernel)] + ([loss_and_grads_of(kernel, mesh8)] if layout == "window-sharded"
                                              else []):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow  # 20 s a case in interpret mode; the default suite keeps the kernel and whole-model checks
@pytest.mark.parametrize("window", [0, 5])
def test_shared_prefix_dpo_on_the_kernel_equals_padded_dpo_on_the_einsum_path(window):
    """Also with a sliding window shorter than the rows: there a completion's distance to its prompt counts
    positions, not the slots of the other completion between them."""
    examples = shared_pairs(12, seed=4)
    length = max(max(len(e["chosen_tokens"]), len(e["rejected_tokens"])) for e in examples)
    padded = {k: jnp.asarray(v) for k, v in pad_batch(examples, "preference", length, 0).items()}
    rows = pack_rows(examples, 64, pairs=True, shared_prefix=True)
    shared = {k: jnp.asarray(v) for k, v in packed_batch(examples, rows, 64, 0, pairs=True, max_pairs_per_row=6,
                                                        shared_prefix=True).items()}
    config = TINY.replace(sliding_window=window)
    kernel = config.replace(attention_impl="pallas")
    want = loss_and_grads("dpo", padded, create_model(config, seed=1), create_model(config, seed=2))
    got = loss_and_grads("dpo", shared, create_model(kernel, seed=1), create_model(kernel, seed=2))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
