"""Knowledge distillation: the generalized Jensen-Shannon divergence between a student's and a teacher's next-token
distributions (GKD, Agarwal et al., 2024, arXiv 2306.13649, Eq. 1), as TRL 1.16's ``generalized_jsd_loss``."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def generalized_jsd(student_logits: jax.Array, teacher_logits: jax.Array, *, beta: float = 0.5,
                    temperature: float = 1.0) -> jax.Array:
    """Per position ``[...]`` (the leading dims of ``[..., V]`` logits, float32): with ``p_s``, ``p_t`` the
    softmaxes of ``logits / temperature`` and ``m = (1 − β)·p_s + β·p_t``,
    ``JSD_β = β·KL(p_t ‖ m) + (1 − β)·KL(p_s ‖ m)``; ``β = 0`` is the forward KL ``KL(p_t ‖ p_s)`` (classic KD),
    ``β = 1`` the reverse KL ``KL(p_s ‖ p_t)`` (TRL's conventions, ``F.kl_div`` with its arguments swapped)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta} must be in [0, 1]")
    student = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    teacher = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)

    def kl(log_p, log_q):  # KL(p ‖ q), p = exp(log_p)
        return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)

    if beta == 0.0:
        return kl(teacher, student)
    if beta == 1.0:
        return kl(student, teacher)
    mixture = jnp.logaddexp(student + jnp.log1p(-beta), teacher + jnp.log(beta))
    return beta * kl(teacher, mixture) + (1 - beta) * kl(student, mixture)
