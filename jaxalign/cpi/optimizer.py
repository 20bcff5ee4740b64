"""Freezing parameter entries in an optax optimizer (CPI-FT stage 4: the cores of earlier groups stay fixed).

The gradient is zeroed on frozen entries before the inner optimizer (so its moments never see them) and the update
is zeroed after it (so weight decay, momentum left from before, or any other term cannot move them): frozen
entries stay bit-identical.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class FrozenEntries(NamedTuple):
    """Optimizer state of the freezing transform: the boolean tree of frozen entries."""

    frozen: Any


def _zero_where(frozen) -> optax.GradientTransformation:
    def init(params):
        return FrozenEntries(jax.tree.map(lambda f, p: jnp.broadcast_to(jnp.asarray(f, bool), jnp.shape(p)),
                                          frozen, params))

    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda u, f: jnp.where(f, jnp.zeros_like(u), u), updates, state.frozen), state

    return optax.GradientTransformation(init, update)


def freeze(tx: optax.GradientTransformation, frozen) -> optax.GradientTransformation:
    """``tx`` that leaves the entries where ``frozen`` (a boolean tree shaped like the parameters) is True alone.

    The mask is part of the optimizer state (set at ``init``), not of the update function, so one compiled
    train step serves every mask: ``freeze(tx, a)`` and ``freeze(tx, b)`` differ only in their initial state."""
    return optax.chain(_zero_where(frozen), tx, _zero_where(frozen))


def union(masks: list):
    """Entry-wise OR of boolean trees (all-False tree shaped like the first when the list holds only it)."""
    out = masks[0]
    for mask in masks[1:]:
        out = jax.tree.map(jnp.logical_or, out, mask)
    return out
