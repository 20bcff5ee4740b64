"""The train state and the jitted, sharded train step (gradient accumulation, clipping, NaN guard).

Parameters are a pure dict of arrays (``nnx.to_pure_dict``) merged into the model inside the step, so the
state is a plain pytree that Orbax saves and ``jax.jit`` shards with explicit ``in_shardings`` /
``out_shardings`` (derived from ``eval_shape``, never by allocating twice) and donates.

What is trained and what is frozen is described by ``ModelParts``: full fine-tuning trains the whole parameter
dict (the frozen tree is the reference's weights, if any); LoRA trains the adapters only, so the state's
``params`` and optimizer moments cover just the adapters while the base weights are the frozen tree, passed to
the step as an argument and never updated, saved or copied (the reference is that base with the adapters off).

Accumulation: the batch is split into ``grad_accum`` micro-batches scanned in order; the gradients of the
objectives' loss *sums* and their denominators are added up and divided once, so an accumulated step equals the
full-batch step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxalign.models import lora, param_shardings
from jaxalign.models.llama import recording_router_stats, router_aux_loss
from jaxalign.objectives.common import Metric


class TrainState(NamedTuple):
    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    skipped: jax.Array  # updates skipped by the NaN/Inf guard


class ModelParts(NamedTuple):
    """How a step builds its models from the trained parameters and the frozen tree (its third argument).

    ``policy(params, frozen, rng)`` -> the model the loss differentiates (``rng``: the step's key for adapter
    dropout, None when evaluating); ``reference(frozen)`` -> the frozen reference model, or None.
    """

    policy: Callable[[Any, Any, jax.Array | None], nnx.Module]
    reference: Callable[[Any], nnx.Module | None]


def full_parts(graphdef) -> ModelParts:
    """Full fine-tuning: ``params`` is the whole model; ``frozen`` (when given) is the reference's weights."""
    return ModelParts(policy=lambda params, frozen, rng: nnx.merge(graphdef, params),
                      reference=lambda frozen: None if frozen is None else nnx.merge(graphdef, frozen))


def lora_parts(graphdef, base_graphdef, *, with_reference: bool) -> ModelParts:
    """LoRA: ``params`` is the adapters (``graphdef`` from ``lora.lora_graphdef``), ``frozen`` the base weights;
    the reference (``with_reference``) is the base with the adapters off, built on the same arrays."""
    def policy(adapters, base, rng):
        model = nnx.merge(graphdef, base, adapters)
        return model if rng is None else lora.set_dropout_key(model, rng)

    return ModelParts(policy=policy,
                      reference=lambda base: nnx.merge(base_graphdef, base) if with_reference else None)


def teacher_parts(parts: ModelParts, teacher_graphdef) -> ModelParts:
    """Distillation: the frozen tree is ``{"policy": <what parts takes>, "teacher": the teacher's weights}``; the
    policy is built as ``parts`` builds it, the teacher (its own graphdef: any size) takes the reference slot."""
    return ModelParts(policy=lambda params, frozen, rng: parts.policy(params, frozen["policy"], rng),
                      reference=lambda frozen: nnx.merge(teacher_graphdef, frozen["teacher"]))


def learning_rate_schedule(optim, total_steps: int) -> optax.Schedule:
    """Warm-up (linear from 0) then ``constant`` | ``linear`` decay | ``cosine`` decay to ``lr·min_lr_ratio``."""
    total = max(int(total_steps), 1)
    warmup = min(int(optim.warmup_steps), total - 1) if total > 1 else 0
    floor = optim.lr * optim.min_lr_ratio
    if optim.schedule == "constant":
        decay = optax.constant_schedule(optim.lr)
    elif optim.schedule == "linear":
        decay = optax.linear_schedule(optim.lr, floor, max(total - warmup, 1))
    else:
        decay = optax.cosine_decay_schedule(optim.lr, max(total - warmup, 1), alpha=optim.min_lr_ratio)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, optim.lr, warmup), decay], [warmup])


def make_optimizer(optim, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """optax chain: global-norm clipping, then AdamW | RMSprop (IFT paper) | SGD on the schedule."""
    schedule = learning_rate_schedule(optim, total_steps)
    if optim.name == "adamw":
        core = optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay)
    elif optim.name == "rmsprop":
        core = optax.chain(optax.rmsprop(schedule, decay=optim.rmsprop_decay, eps=optim.eps),
                           optax.add_decayed_weights(optim.weight_decay) if optim.weight_decay else optax.identity())
    else:
        core = optax.sgd(schedule)
    chain = [optax.clip_by_global_norm(optim.clip_norm)] if optim.clip_norm > 0 else []
    return optax.chain(*chain, core), schedule


def state_shardings(abstract_model, tx: optax.GradientTransformation, mesh: Mesh, rules=None, *,
                    trained=nnx.Param) -> TrainState:
    """``TrainState`` of ``NamedSharding``: the ``trained`` variables of ``abstract_model`` (``nnx.LoRAParam``
    for LoRA) by their logical axes, optimizer moments like the parameters they track, scalars replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    params = nnx.to_pure_dict(param_shardings(abstract_model, mesh, rules, trained))
    abstract_params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
                                   nnx.to_pure_dict(nnx.state(abstract_model, trained)))
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    opt = optax.tree_map_params(tx, lambda _, sharding: sharding, abstract_opt, params,
                                transform_non_params=lambda _: replicated,
                                is_leaf=lambda x: isinstance(x, NamedSharding))
    return TrainState(step=replicated, params=params, opt_state=opt, rng=replicated, skipped=replicated)


def init_state(params, tx: optax.GradientTransformation, seed: int, shardings: TrainState | None) -> TrainState:
    """A fresh ``TrainState`` around ``params`` (already placed), with the optimizer state created sharded."""
    def build(params):
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                          rng=jax.random.key_data(jax.random.key(seed)), skipped=jnp.zeros((), jnp.int32))

    if shardings is None:
        return jax.jit(build)(params)
    return jax.jit(build, in_shardings=(shardings.params,), out_shardings=shardings)(params)


def _split_micro(batch: dict, n: int) -> dict:
    return {k: v.reshape(n, v.shape[0] // n, *v.shape[1:]) for k, v in batch.items()}


def make_train_step(parts, objective: Callable, hparams, tx: optax.GradientTransformation, *, grad_accum: int = 1,
                    nan_guard: bool = True, schedule: optax.Schedule | None = None,
                    shardings: TrainState | None = None, batch_sharding=None, frozen_shardings=None):
    """``step(state, batch[, frozen]) -> (state, metrics)``, jitted with donated state.

    ``parts``: a ``ModelParts``, or a graphdef for full fine-tuning (``full_parts``). ``frozen``: the tree the
    models are built from besides ``state.params`` (the reference's weights, or LoRA's base); with
    ``shardings``, give its shardings as ``frozen_shardings``. ``metrics`` maps names to ``Metric(total, count)``
    (this step's), plus ``grad_norm``, ``lr``, ``skipped`` as ``Metric(value, 1)``.
    """
    parts = parts if isinstance(parts, ModelParts) else full_parts(parts)

    def loss_and_grads(params, frozen, micro, step, rng):
        def summed_loss(params):
            model = parts.policy(params, frozen, rng)
            with recording_router_stats() as routed:
                loss, metrics = objective(model, micro, hparams, reference=parts.reference(frozen), step=step,
                                          rng=rng)
            aux = router_aux_loss(routed, model)
            if aux is not None:  # a mixture of experts: its load-balancing loss, weighted as transformers adds it
                metrics = {**metrics, "moe/aux_loss": Metric(jax.lax.stop_gradient(aux), jnp.ones((), jnp.float32))}
                loss = loss + model.config.router_aux_loss_coef * aux
            return loss * metrics["loss"].count, metrics

        return jax.value_and_grad(summed_loss, has_aux=True)(params)

    def step_fn(state: TrainState, batch: dict, frozen=None):
        rng = jax.random.wrap_key_data(state.rng)
        if grad_accum == 1:
            (_, metrics), grads = loss_and_grads(state.params, frozen, batch, state.step, rng)
        else:
            def body(carry, micro):
                grads, metrics = carry
                (_, m), g = loss_and_grads(state.params, frozen, micro, state.step, rng)
                return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, metrics, m)), None

            first = _split_micro(batch, grad_accum)
            zero_grads = jax.tree.map(jnp.zeros_like, state.params)
            shapes = jax.eval_shape(lambda: loss_and_grads(state.params, frozen,
                                                           jax.tree.map(lambda x: x[0], first), state.step, rng))
            zero_metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[0][1])
            (grads, metrics), _ = jax.lax.scan(body, (zero_grads, zero_metrics), first)
        count = jnp.maximum(metrics["loss"].count, 1e-9)
        grads = jax.tree.map(lambda g: g / count, grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["loss"].total)
        if nan_guard:
            params = jax.tree.map(lambda new, old: jnp.where(finite, new, old), params, state.params)
            opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), opt_state, state.opt_state)
        skipped = state.skipped + (~finite).astype(jnp.int32) if nan_guard else state.skipped
        new_rng = jax.random.key_data(jax.random.split(rng)[0])
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=new_rng, skipped=skipped)
        one = jnp.ones((), jnp.float32)
        metrics = dict(metrics)
        metrics["grad_norm"] = Metric(grad_norm, one)
        metrics["skipped_updates"] = Metric(skipped.astype(jnp.float32), one)
        if schedule is not None:
            metrics["lr"] = Metric(jnp.asarray(schedule(state.step), jnp.float32), one)
        return new_state, metrics

    if shardings is None:
        return jax.jit(step_fn, donate_argnums=0)
    in_shardings = (shardings, batch_sharding) + ((frozen_shardings,) if frozen_shardings is not None else ())
    return jax.jit(step_fn, in_shardings=in_shardings, out_shardings=(shardings, None), donate_argnums=0)
