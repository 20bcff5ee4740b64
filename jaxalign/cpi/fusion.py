"""Fusion: transplant each task's core entries, blend the rest by SLERP (per tensor), as CPI-FT's stage 3.

The paper leaves open how several tasks are combined [NF]; jaxalign's rule (configurable ``omega``):

* core entries: an entry in several tasks' cores takes the value of the task whose update there was largest;
* non-core entries: start from the base and fold the tasks in order, ``fused ← SLERP(fused, θ_i, ω_i)`` with
  ``ω_i = 1 / (i + 1)`` (i = 1, 2, ...: a running spherical mean, each task weighted equally) unless a fixed
  ``omega`` is given. SLERP runs per tensor on the vector of its non-core entries; nearly collinear vectors
  (sin Ω < ``eps``) or a zero-norm vector fall back to linear interpolation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def slerp(a: jax.Array, b: jax.Array, omega: float | jax.Array, *, eps: float = 1e-6) -> jax.Array:
    """Spherical interpolation between two tensors (flattened as vectors): ``omega = 0`` gives ``a``, 1 gives
    ``b``; ``sin((1−ω)Ω)/sin Ω · a + sin(ωΩ)/sin Ω · b`` with ``cos Ω = ⟨a, b⟩ / (‖a‖ ‖b‖)``."""
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    norm_a, norm_b = jnp.linalg.norm(a32), jnp.linalg.norm(b32)
    cos = jnp.clip(jnp.sum(a32 * b32) / jnp.maximum(norm_a * norm_b, 1e-30), -1.0, 1.0)
    angle = jnp.arccos(cos)
    sin = jnp.sin(angle)
    degenerate = (sin < eps) | (norm_a < 1e-30) | (norm_b < 1e-30)
    safe_sin = jnp.where(degenerate, 1.0, sin)
    spherical = (jnp.sin((1 - omega) * angle) * a32 + jnp.sin(omega * angle) * b32) / safe_sin
    linear = (1 - omega) * a32 + omega * b32
    return jnp.where(degenerate, linear, spherical).astype(a.dtype)


def fuse(base, tuned: list, masks: list, *, omega: float | None = None, eps: float = 1e-6):
    """The fused parameter tree (see the module docstring for the rule)."""
    if len(tuned) != len(masks) or not tuned:
        raise ValueError("fuse needs one mask per task-tuned model (and at least one)")

    def per_tensor(base_leaf, *leaves):
        models, task_masks = leaves[: len(tuned)], leaves[len(tuned):]
        any_core = jnp.zeros(base_leaf.shape, bool)
        for m in task_masks:
            any_core |= m
        best_value = base_leaf
        best_delta = jnp.full(base_leaf.shape, -1.0, jnp.float32)
        for model, m in zip(models, task_masks, strict=True):
            delta = jnp.where(m, jnp.abs(model.astype(jnp.float32) - base_leaf.astype(jnp.float32)), -1.0)
            better = delta > best_delta
            best_value = jnp.where(better, model, best_value)
            best_delta = jnp.where(better, delta, best_delta)
        fused = base_leaf
        for i, model in enumerate(models, start=1):
            w = omega if omega is not None else 1.0 / (i + 1)
            blended = slerp(jnp.where(any_core, 0, fused), jnp.where(any_core, 0, model), w, eps=eps)
            fused = jnp.where(any_core, fused, blended)
        return jnp.where(any_core, best_value, fused)

    return jax.tree.map(per_tensor, base, *tuned, *masks)
