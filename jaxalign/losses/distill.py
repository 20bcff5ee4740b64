"""Knowledge distillation: the generalized Jensen-Shannon divergence between a student's and a teacher's next-token
distributions (GKD, Agarwal et al., 2024, arXiv 2306.13649, Eq. 1), as TRL 1.16's ``generalized_jsd_loss``."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from jaxalign.parallel.mesh import constrain, logical_to_spec


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


def _capped(hidden: jax.Array, kernel: jax.Array, softcap: float) -> tuple[jax.Array, jax.Array | None]:
    """float32 logits ``hidden @ kernel`` (``softcap · tanh(· / softcap)`` with a cap) and, with a cap, its
    derivative ``1 − tanh²`` (None without)."""
    logits = jnp.einsum("btd,dv->btv", hidden, kernel.astype(hidden.dtype), preferred_element_type=jnp.float32)
    if not softcap:
        return logits, None
    squashed = jnp.tanh(logits / softcap)
    return softcap * squashed, 1.0 - jnp.square(squashed)


def _jsd_and_grad(student_logits, teacher_logits, beta: float, temperature: float):
    """Per position the generalized JSD (as ``generalized_jsd``) and its gradient with respect to the student's
    logits, in closed form. With ``a = z_s / τ``, ``β = 0``: ``∂/∂a = p_s − p_t``; ``β = 1``:
    ``p_s ⊙ (g − Σ p_s g)`` with ``g = log p_s − log p_t``; otherwise ``g = (1 − β)(log p_s − log m)`` in the same
    form (the terms through ``m`` cancel); the logits' gradient is ``∂/∂a / τ``."""
    student = jax.nn.log_softmax(student_logits / temperature, axis=-1)
    teacher = jax.nn.log_softmax(teacher_logits / temperature, axis=-1)
    p_student = jnp.exp(student)
    if beta == 0.0:
        p_teacher = jnp.exp(teacher)
        return jnp.sum(p_teacher * (teacher - student), axis=-1), (p_student - p_teacher) / temperature
    if beta == 1.0:
        g = student - teacher
    else:
        mixture = jnp.logaddexp(student + jnp.log1p(-beta), teacher + jnp.log(beta))
        g = (1 - beta) * (student - mixture)
    expected = jnp.sum(p_student * g, axis=-1, keepdims=True)
    if beta == 1.0:
        divergence = expected[..., 0]
    else:
        divergence = beta * jnp.sum(jnp.exp(teacher) * (teacher - mixture), axis=-1) + expected[..., 0]
    return divergence, p_student * (g - expected) / temperature


def _target_logp(logits: jax.Array, targets: jax.Array) -> jax.Array:
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def _batch_shards(batch: int) -> int:
    """How many ways the batch axis is split on the current mesh (1 outside one): the partial sums of the head's
    gradient are kept per shard inside the loop and reduced once after it."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return 1
    spec = logical_to_spec(("batch",), (batch,), mesh)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    return math.prod(dict(mesh.shape)[a] for a in axes)


def _blocked(student_hidden, student_kernel, teacher_hidden, teacher_kernel, targets, weights, beta, temperature,
             block, student_softcap, teacher_softcap, with_grads: bool):
    """The loop of ``blocked_generalized_jsd``: ``(sums, grads)``, grads ``None`` unless ``with_grads``."""
    batch, length, dim = student_hidden.shape
    n_blocks = -(-length // block)
    pad = n_blocks * block - length
    shards = _batch_shards(batch)
    # on a mesh: the heads gathered once here (not in every block), the vocabulary kept where the rules put it
    student_kernel = constrain(student_kernel, (None, "vocab"))
    teacher_kernel = constrain(teacher_kernel, (None, "vocab"))

    def padded(x):
        return jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))

    hs, ht, tg, wt = (padded(x) for x in (student_hidden, teacher_hidden, targets, weights))

    def body(j, carry):
        sums, grad_hidden, grad_kernel = carry
        first = j * block
        h = jax.lax.dynamic_slice_in_dim(hs, first, block, axis=1)
        w = jax.lax.dynamic_slice_in_dim(wt, first, block, axis=1)
        t = jax.lax.dynamic_slice_in_dim(tg, first, block, axis=1)

        def compute(_):
            z_s, dcap = _capped(h, student_kernel, student_softcap)
            z_t, _ = _capped(jax.lax.dynamic_slice_in_dim(ht, first, block, axis=1), teacher_kernel, teacher_softcap)
            divergence, dz = _jsd_and_grad(z_s, z_t, beta, temperature)
            part = jnp.stack([(divergence * w).sum(), -(_target_logp(z_s, t) * w).sum(),
                              -(_target_logp(z_t, t) * w).sum()])
            if not with_grads:
                return part, None, None
            dz = dz * w[..., None] if dcap is None else dz * dcap * w[..., None]
            dz = dz.astype(h.dtype)
            # the head's gradient per batch shard ([shards, D, V]): each device sums its own rows, no reduction here
            per_shard = jnp.einsum("sbtd,sbtv->sdv", h.reshape(shards, -1, *h.shape[1:]),
                                   dz.reshape(shards, -1, *dz.shape[1:]), preferred_element_type=jnp.float32)
            return (part,
                    jnp.einsum("btv,dv->btd", dz, student_kernel.astype(h.dtype), preferred_element_type=jnp.float32),
                    constrain(per_shard, ("batch", None, "vocab")))

        def skip(_):  # a block without trained positions in any row
            zeros = (jnp.zeros((batch, block, dim), jnp.float32),
                     jnp.zeros((shards, *student_kernel.shape), jnp.float32))
            return (jnp.zeros((3,), jnp.float32), *(zeros if with_grads else (None, None)))

        part, dh, dk = jax.lax.cond(jnp.any(w != 0), compute, skip, None)
        if not with_grads:
            return sums + part, None, None
        return (sums + part, jax.lax.dynamic_update_slice_in_dim(grad_hidden, dh, first, axis=1),
                grad_kernel + dk)

    init = (jnp.zeros((3,), jnp.float32),
            jnp.zeros((batch, length + pad, dim), jnp.float32) if with_grads else None,
            constrain(jnp.zeros((shards, *student_kernel.shape), jnp.float32), ("batch", None, "vocab"))
            if with_grads else None)
    sums, grad_hidden, grad_kernel = jax.lax.fori_loop(0, n_blocks, body, init)
    if not with_grads:
        return sums, None
    return sums, (grad_hidden[:, :length].astype(student_hidden.dtype),
                  grad_kernel.sum(axis=0).astype(student_kernel.dtype))


@partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def blocked_generalized_jsd(student_hidden: jax.Array, student_kernel: jax.Array, teacher_hidden: jax.Array,
                            teacher_kernel: jax.Array, targets: jax.Array, weights: jax.Array, beta: float = 0.5,
                            temperature: float = 1.0, block: int = 128, student_softcap: float = 0.0,
                            teacher_softcap: float = 0.0) -> jax.Array:
    """Memory-light distillation: ``[Σ w·JSD_β, Σ w·NLL_student, Σ w·NLL_teacher]`` (float32 ``[3]``) over
    positions, where the logits are ``hidden @ kernel`` (soft-capped with a cap), without holding the ``[B, T, V]``
    logits of either model.

    The positions are walked in blocks of ``block`` along the sequence (the batch axis stays whole, so a sharded
    batch stays where it is); a block whose weights are all 0 is skipped. The gradient with respect to the
    student's logits has a closed form (``_jsd_and_grad``), so each block's contribution to the gradients of the
    student's hidden states and head is formed in the forward pass and kept (``[B, T, D]`` and ``[D, V]``, the sizes
    of the gradients themselves): four ``[B, T] × D × V`` products in all, as many as the plain path's forward and
    backward, and at most ``B × block × V`` logits of each model at a time. Only the divergence is differentiated
    (the NLL sums are metrics; the teacher gets no gradient).

    Args:
      student_hidden, teacher_hidden: ``[B, T, D_s]``, ``[B, T, D_t]`` final (normed) hidden states; position ``t``
        predicts ``targets[:, t]``.
      student_kernel, teacher_kernel: ``[D_s, V]``, ``[D_t, V]`` unembeddings (one vocabulary).
      targets: ``[B, T]`` the next tokens (for the NLL metrics).
      weights: ``[B, T]`` float32 per-position weights (0 = not trained).
      beta, temperature: as ``generalized_jsd``.
      block: positions per block.
      student_softcap, teacher_softcap: the models' final-logit caps (0 = none).
    """
    return _blocked(student_hidden, student_kernel, teacher_hidden, teacher_kernel, targets, weights, beta,
                    temperature, block, student_softcap, teacher_softcap, with_grads=False)[0]


def _blocked_fwd(student_hidden, student_kernel, teacher_hidden, teacher_kernel, targets, weights, beta, temperature,
                 block, student_softcap, teacher_softcap):
    return _blocked(student_hidden, student_kernel, teacher_hidden, teacher_kernel, targets, weights, beta,
                    temperature, block, student_softcap, teacher_softcap, with_grads=True)


def _blocked_bwd(beta, temperature, block, student_softcap, teacher_softcap, residuals, cotangent):
    grad_hidden, grad_kernel = residuals
    scale = cotangent[0]  # the NLL sums are metrics: only the divergence carries a gradient
    return (grad_hidden * scale.astype(grad_hidden.dtype), grad_kernel * scale.astype(grad_kernel.dtype),
            None, None, None, None)


blocked_generalized_jsd.defvjp(_blocked_fwd, _blocked_bwd)
