"""Building models: random initialisation straight into a sharding, and parameter shardings.

Shardings come from an abstract model (``nnx.eval_shape``): each parameter's logical axis names (Flax's standard
sharding metadata, ``out_sharding``) go through the rules table. Nothing is allocated
twice and no full copy lives on one device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import Mesh, NamedSharding

from jaxalign.models.config import LlamaConfig
from jaxalign.models.llama import LlamaForCausalLM, layer_paths
from jaxalign.parallel.mesh import DEFAULT_RULES, Rules, active_rules, logical_sharding


def eval_shape(make: Callable[[], nnx.Module]) -> nnx.Module:
    """``nnx.eval_shape(make)`` that works inside a ``jax.set_mesh`` block: Flax would turn the logical axis names
    into a sharding on that mesh; here every name maps to nothing (the shardings come from our rules table,
    ``param_shardings``, which also drops axes that do not divide a dimension)."""
    names = {name for name, _ in (*DEFAULT_RULES, *active_rules())}
    with flax_spmd.logical_axis_rules(tuple((name, None) for name in sorted(names))):
        return nnx.eval_shape(make)


def abstract_model(config: LlamaConfig) -> LlamaForCausalLM:
    """The model with ``ShapeDtypeStruct`` leaves (no memory)."""
    return eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axis names of a parameter (Flax's sharding metadata), ``None`` per dimension when it has none."""
    return tuple(variable.get_metadata().get("out_sharding") or (None,) * len(variable.get_value().shape))


def param_shardings(model: nnx.Module, mesh: Mesh, rules: Rules | None = None, *filters) -> nnx.State:
    """A state tree of ``NamedSharding`` matching ``nnx.state(model, *filters)`` (works on abstract models too)."""
    def sharding_of(variable: nnx.Variable) -> NamedSharding:
        return logical_sharding(logical_axes(variable), variable.get_value().shape, mesh, rules)

    return jax.tree.map(sharding_of, nnx.state(model, *filters), is_leaf=lambda x: isinstance(x, nnx.Variable))


def create_model(config: LlamaConfig, *, seed: int = 0, mesh: Mesh | None = None,
                 rules: Rules | None = None) -> LlamaForCausalLM:
    """Randomly initialised model; with ``mesh``, every parameter is created already sharded."""
    if mesh is None:
        return LlamaForCausalLM(config, rngs=nnx.Rngs(seed))
    graphdef, abstract_state = nnx.split(abstract_model(config))
    shardings = param_shardings(nnx.merge(graphdef, abstract_state), mesh, rules)

    def init():
        return nnx.state(LlamaForCausalLM(config, rngs=nnx.Rngs(seed)))

    state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def build_model(config: LlamaConfig, load_tensor: Callable[[tuple, tuple[int, ...]], np.ndarray], *,
                mesh: Mesh | None = None, rules: Rules | None = None) -> LlamaForCausalLM:
    """Model whose parameters come from ``load_tensor(path, shape) -> np.ndarray``, one tensor at a time.

    With ``mesh`` each tensor goes straight to its sharding (every device takes only its slice of the
    host array), so at most one full tensor is in host memory at once. ``path`` is always a per-layer path
    (``("layers", i, ...)``): a scanned model's stacked weight is filled one layer at a time, in place.
    """
    graphdef, state = nnx.split(abstract_model(config))
    for path, variable in nnx.to_flat_state(state):
        shape = tuple(variable.get_value().shape)
        dtype = variable.get_value().dtype
        sharding = None if mesh is None else logical_sharding(logical_axes(variable), shape, mesh, rules)
        parts = layer_paths(config, path)
        if parts[0][1] is None:  # one layer's own weight (or not a layer's): its per-layer path
            variable.set_value(_place(_loaded(load_tensor, parts[0][0], shape, dtype), shape, sharding))
            continue
        stacked = jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)()
        for layer_path, index in parts:
            layer = _loaded(load_tensor, layer_path, shape[1:], dtype)
            stacked = _write_layer(stacked, _place(layer[None], (1, *shape[1:]), sharding), index)
        variable.set_value(stacked)
    return nnx.merge(graphdef, state)


def _loaded(load_tensor, path: tuple, shape: tuple[int, ...], dtype) -> np.ndarray:
    array = np.asarray(load_tensor(path, shape))
    if array.shape != shape:
        raise ValueError(f"parameter {'.'.join(map(str, path))}: loaded shape {array.shape}, expected {shape}")
    return array.astype(dtype)


def _place(array: np.ndarray, shape: tuple[int, ...], sharding) -> jax.Array:
    if sharding is None:
        return jax.device_put(array)
    return jax.make_array_from_callback(shape, sharding, lambda index: array[index])


@functools.partial(jax.jit, donate_argnums=0)
def _write_layer(stacked: jax.Array, layer: jax.Array, index: int) -> jax.Array:
    """``stacked`` with ``layer`` ``[1, ...]`` written at ``index`` of its leading axis, in place (donated)."""
    return jax.lax.dynamic_update_slice_in_dim(stacked, layer, index, 0)
