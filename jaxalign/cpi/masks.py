"""Core masks: the top ``p`` share of |θ_task − θ_0| over all (selected) parameters of a model.

The global threshold is found without gathering the model: the k-th largest magnitude is located by bisection
on the IEEE-754 bit pattern of non-negative float32 values (monotone in the value), counting ``>= t`` per tensor
and summing — exact, 32 passes of per-shard reductions, no sort and no host copy of the parameters. Ties at the
threshold are broken deterministically: tensors in path order, then flat index, lowest first, so exactly
``k = floor(p · D)`` entries are selected.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

Tree = dict


def path_name(path) -> str:
    return ".".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path)


def default_include(name: str, *, embeddings: bool = True, norms: bool = True) -> bool:
    if not embeddings and ("embed_tokens" in name or "lm_head" in name):
        return False
    return norms or "norm" not in name


def update_magnitudes(base: Tree, tuned: Tree) -> Tree:
    """|θ_task − θ_0| per entry, float32."""
    return jax.tree.map(lambda a, b: jnp.abs(b.astype(jnp.float32) - a.astype(jnp.float32)), base, tuned)


def _selected(tree: Tree, include: Callable[[str], bool]) -> list[tuple[str, jax.Array]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return sorted(((path_name(p), leaf) for p, leaf in leaves if include(path_name(p))), key=lambda x: x[0])


@jax.jit
def _counts_at_least(values: list[jax.Array], bits: jax.Array) -> list[jax.Array]:
    threshold = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return [jnp.sum(v >= threshold) for v in values]


def kth_largest(values: list[jax.Array], k: int) -> jax.Array:
    """The k-th largest entry (1-based) over several non-negative float32 arrays, by bisection on the bits.

    Per-tensor counts are added on the host in Python integers (no overflow past 2^31 entries)."""
    lo, hi = 0, 0x7F800000  # +0.0 .. +inf as int32 patterns
    while lo < hi:  # the largest t with count(>= t) >= k
        mid = (lo + hi + 1) // 2
        if sum(int(c) for c in _counts_at_least(values, jnp.asarray(mid, jnp.int32))) >= k:
            lo = mid
        else:
            hi = mid - 1
    return jax.lax.bitcast_convert_type(jnp.asarray(lo, jnp.int32), jnp.float32)


def core_mask(base: Tree, tuned: Tree, fraction: float, *, include: Callable[[str], bool] | None = None) -> Tree:
    """Boolean tree (same structure as the parameters): True on the task's core entries.

    ``fraction`` = p (0.01 for the paper's p = 1 %) of the D entries in tensors ``include`` accepts (default:
    all); excluded tensors get all-False masks.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction} must be in (0, 1]")
    include = include or (lambda name: True)
    magnitudes = update_magnitudes(base, tuned)
    selected = _selected(magnitudes, include)
    total = sum(int(np.prod(v.shape)) for _, v in selected)
    k = int(np.floor(fraction * total))
    names = {name for name, _ in selected}
    if k == 0:
        return jax.tree.map(lambda m: jnp.zeros(m.shape, bool), magnitudes)
    values = [v for _, v in selected]
    threshold = kth_largest(values, k)
    above = sum(int(jnp.sum(v > threshold)) for v in values)
    ties_left = k - above
    chosen: dict[str, jax.Array] = {}
    for name, value in selected:  # path order: the deterministic tie-break
        ties = (value == threshold).reshape(-1)
        rank = jnp.cumsum(ties.astype(jnp.int32)) * ties
        take = ties & (rank <= ties_left) & (rank > 0)
        ties_left -= int(jnp.sum(take))
        chosen[name] = (value > threshold) | take.reshape(value.shape)

    def build(path, magnitude):
        name = path_name(path)
        return chosen[name] if name in names else jnp.zeros(magnitude.shape, bool)

    return jax.tree_util.tree_map_with_path(build, magnitudes)


def mask_size(mask: Tree) -> int:
    return int(sum(int(jnp.sum(m)) for m in jax.tree.leaves(mask)))
