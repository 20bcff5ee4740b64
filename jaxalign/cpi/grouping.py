"""Task grouping: Jaccard overlap of core masks, groups = connected components at a threshold τ."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def jaccard(a, b) -> float:
    """|A ∩ B| / |A ∪ B| over two boolean trees (1.0 for two empty masks)."""
    inter = sum(int(jnp.sum(x & y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    union = sum(int(jnp.sum(x | y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    return 1.0 if union == 0 else inter / union


def jaccard_matrix(masks: list) -> np.ndarray:
    n = len(masks)
    out = np.eye(n)
    for i in range(n):
        for j in range(i + 1, n):
            out[i, j] = out[j, i] = jaccard(masks[i], masks[j])
    return out


def group_tasks(similarity: np.ndarray, tau: float) -> list[list[int]]:
    """Connected components of the graph with an edge where similarity >= τ (τ ≤ 0 puts every task in one group).

    Deterministic: members sorted, groups ordered by their smallest member.
    """
    n = similarity.shape[0]
    parent = list(range(n))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(n):
        for j in range(i + 1, n):
            if similarity[i, j] >= tau:
                parent[max(find(i), find(j))] = min(find(i), find(j))
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(find(i), []).append(i)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])
