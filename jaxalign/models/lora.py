"""LoRA adapters on the decoder's projections: attach, initialise sharded, split, fold in, PEFT export.

A LoRA adapter adds a trained low-rank update to a frozen kernel ``W``::

    y = x·W + (α / r) · dropout(x)·A·B,      A [in..., r],  B [r, out...]

(Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"). The adapter is a small module
attached next to its kernel (``layers.i.self_attn.q_proj_lora``); the decoder adds its output to the kernel's,
so the base weights are used as they are, never copied. Adapter weights are ``nnx.LoRAParam`` variables, which
separates them from the base with one filter: ``nnx.split(model, nnx.LoRAParam, ...)``.

Initialisation follows PEFT: ``A`` Kaiming-uniform (``U(±1/√fan_in)``), ``B`` zero, so a fresh adapter leaves
the model's output exactly unchanged. Adapters are float32 whatever the base dtype (their Adam updates are
small); the forward pass casts them to the compute dtype. ``A`` shards like its kernel's input axes and ``B``
like its output axes; the rank axis (logical name ``lora_rank``) is replicated.

Dropout (on the adapter's input, as PEFT does) needs a key: ``set_dropout_key(model, rng)`` gives every adapter
its own (the train step does this with the step's key). Without one (evaluation, generation) there is no dropout.
The key is a data attribute of the adapter, so it reaches rematerialised layers as an input.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxalign.models.config import LlamaConfig
from jaxalign.models.factory import abstract_model, eval_shape, logical_axes, param_shardings
from jaxalign.models.hf import fused_rows, hf_layout, to_hf
from jaxalign.models.llama import LlamaForCausalLM, layer_plan, stack_layers, stack_modules, unstack_layers
from jaxalign.parallel.mesh import Rules

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
_INPUT_DIMS = {"o_proj": 2}  # o_proj's kernel is [heads, head_dim, embed]; every other kernel has one input dim

@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """``rank`` r, ``alpha`` α (the update is scaled by α / r), ``dropout`` on the adapter input, ``targets``:
    the projections that get an adapter (any of ``TARGETS``)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"rank={self.rank} must be >= 1")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise ValueError(f"targets={list(self.targets)}: choose one or more of {', '.join(TARGETS)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, lora) -> LoRAConfig:
        """From the ``lora`` section of a training config (``target_modules`` is a comma-separated string)."""
        targets = tuple(t.strip() for t in lora["target_modules"].split(",") if t.strip())
        return cls(rank=int(lora["rank"]), alpha=float(lora["alpha"]), dropout=float(lora["dropout"]),
                   targets=targets)


class LoRA(nnx.Module):
    """The low-rank update of one kernel: ``x [..., *in] -> (α/r)·dropout(x)·A·B  [..., *out]``."""

    def __init__(self, in_shape, in_axes, out_shape, out_axes, lora: LoRAConfig, rngs: nnx.Rngs):
        fan_in = math.prod(in_shape)
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(rngs.params(), (*in_shape, lora.rank), jnp.float32, -bound, bound)
        self.lora_a = nnx.LoRAParam(a, out_sharding=(*in_axes, "lora_rank"), eager_sharding=False)
        self.lora_b = nnx.LoRAParam(jnp.zeros((lora.rank, *out_shape), jnp.float32),
                                    out_sharding=("lora_rank", *out_axes), eager_sharding=False)
        self.scale = lora.scale
        self.dropout = lora.dropout
        self.dropout_key = nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.dropout > 0 and self.dropout_key is not None:
            keep = jax.random.bernoulli(self.dropout_key, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)
        a = self.lora_a[...].astype(x.dtype)
        low = jnp.tensordot(x, a, axes=a.ndim - 1)
        return jnp.tensordot(low, self.lora_b[...].astype(x.dtype), axes=1) * jnp.asarray(self.scale, x.dtype)


def _owner(layer, name: str):
    return layer.self_attn if name in ATTENTION_TARGETS else layer.mlp


def attach(model: LlamaForCausalLM, lora: LoRAConfig, rngs: nnx.Rngs) -> LlamaForCausalLM:
    """Adds a fresh adapter (``A`` random, ``B`` zero) next to every target kernel, in place; returns ``model``.

    Works on abstract models (``nnx.eval_shape``) too. MLP targets on a mixture-of-experts layer are an error (the
    experts are not adapted).
    """
    sparse = [i for i in range(model.config.num_layers) if model.config.is_moe(i)]
    mlp_targets = [t for t in lora.targets if t not in ATTENTION_TARGETS]
    if sparse and mlp_targets:
        raise ValueError(f"LoRA targets {', '.join(mlp_targets)} cannot adapt the experts of the mixture-of-experts "
                         f"layers ({len(sparse)} of {model.config.num_layers}); set lora.target_modules to attention "
                         f"projections ({','.join(ATTENTION_TARGETS)})")
    made = {}  # (layer, target) -> adapter, drawn in layer order (the same adapters scanned or not)
    for i in range(model.config.num_layers):
        for name in lora.targets:
            layer = _layer_module(model, i)
            kernel = getattr(_owner(layer, name), name)
            shape, axes = kernel.get_value().shape, logical_axes(kernel)
            if _is_stacked(model, i):  # the block's stacked kernel: one layer's shape
                shape, axes = shape[1:], axes[1:]
            n_in = _INPUT_DIMS.get(name, 1)
            made[i, name] = LoRA(shape[:n_in], axes[:n_in], shape[n_in:], axes[n_in:], lora, rngs)
    for owner_layer, layer_indices in _layer_groups(model):
        for name in lora.targets:
            adapters = [made[i, name] for i in layer_indices]
            adapter = stack_modules(adapters) if len(adapters) > 1 else adapters[0]  # a stacked block has >= 2
            setattr(_owner(owner_layer, name), f"{name}_lora", adapter)
    return model


def _is_stacked(model: LlamaForCausalLM, layer: int) -> bool:
    prefix, period, blocks = layer_plan(model.config)
    return prefix <= layer < prefix + period * blocks


def _layer_module(model: LlamaForCausalLM, layer: int):
    """The module holding ``layer``'s weights: its own, or its stacked block's (``scan_layers``)."""
    if _is_stacked(model, layer):
        prefix, period, _ = layer_plan(model.config)
        return model.layers.blocks[(layer - prefix) % period]
    return model.layer(layer)


def _layer_groups(model: LlamaForCausalLM) -> list[tuple[Any, list[int]]]:
    """``(module, layers it holds)`` for every layer module of ``model``: one layer each, or a stacked block's
    layers in stacking order."""
    prefix, period, blocks = layer_plan(model.config)
    return [(_layer_module(model, i), [i]) for i in range(model.config.num_layers) if not _is_stacked(model, i)] + \
        [(model.layers.blocks[j], [prefix + b * period + j for b in range(blocks)]) for j in range(period)]


def abstract_lora_model(config: LlamaConfig, lora: LoRAConfig) -> LlamaForCausalLM:
    """The decoder with adapters, as ``ShapeDtypeStruct`` leaves (no memory)."""
    return eval_shape(lambda: attach(LlamaForCausalLM(config, rngs=nnx.Rngs(0)), lora, nnx.Rngs(0)))


def lora_graphdef(config: LlamaConfig, lora: LoRAConfig):
    """Graph definition of the decoder with adapters, to merge as ``nnx.merge(graphdef, base, adapters)``."""
    return nnx.split(abstract_lora_model(config, lora), nnx.LoRAParam, ...)[0]


def adapter_shapes(config: LlamaConfig, lora: LoRAConfig) -> dict:
    """The adapters' pure dict of ``ShapeDtypeStruct`` (e.g. to size memory without allocating)."""
    state = nnx.state(abstract_lora_model(config, lora), nnx.LoRAParam)
    return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(state))


def adapter_shardings(config: LlamaConfig, lora: LoRAConfig, mesh: Mesh, rules: Rules | None = None) -> dict:
    """``NamedSharding`` of every adapter weight (pure dict), from the logical axes."""
    return nnx.to_pure_dict(param_shardings(abstract_lora_model(config, lora), mesh, rules, nnx.LoRAParam))


def count_params(config: LlamaConfig, lora: LoRAConfig) -> dict[str, int]:
    """``{"adapter": trained adapter parameters, "base": frozen base parameters}``."""
    base = nnx.state(abstract_model(config))
    return {"adapter": sum(math.prod(s.shape) for s in jax.tree.leaves(adapter_shapes(config, lora))),
            "base": sum(math.prod(v.shape) for v in jax.tree.leaves(base))}


def init_adapters(config: LlamaConfig, lora: LoRAConfig, *, seed: int = 0, mesh: Mesh | None = None,
                  rules: Rules | None = None) -> dict:
    """Fresh adapters (pure dict); with ``mesh`` each weight is created directly in its sharding."""
    def init():
        skeleton = attach(abstract_model(config), lora, nnx.Rngs(seed))
        return nnx.to_pure_dict(nnx.state(skeleton, nnx.LoRAParam))

    if mesh is None:
        return jax.jit(init)()
    return jax.jit(init, out_shardings=adapter_shardings(config, lora, mesh, rules))()


def with_adapters(model: LlamaForCausalLM, lora: LoRAConfig, adapters: dict | None = None, *,
                  seed: int = 0) -> LlamaForCausalLM:
    """A model that shares ``model``'s weights and adds ``adapters`` (fresh ones when None)."""
    base = nnx.to_pure_dict(nnx.state(model))
    adapters = init_adapters(model.config, lora, seed=seed) if adapters is None else adapters
    return nnx.merge(lora_graphdef(model.config, lora), base, adapters)


def split(model: LlamaForCausalLM) -> tuple[Any, dict, dict]:
    """(graphdef, adapters, base weights) of a model with adapters, as pure dicts."""
    graphdef, adapters, base = nnx.split(model, nnx.LoRAParam, ...)
    return graphdef, nnx.to_pure_dict(adapters), nnx.to_pure_dict(base)


def _adapters_of(model: LlamaForCausalLM) -> Iterator[tuple[list[int], str, str, LoRA]]:
    """(layers, owner module name, target name, adapter) for every adapter module of ``model``: one layer's, or a
    stacked block's (its variables ``[blocks, ...]``, ``layers`` in stacking order)."""
    for module, layers in _layer_groups(model):
        for name in TARGETS:
            owner_name = "self_attn" if name in ATTENTION_TARGETS else "mlp"
            adapter = getattr(getattr(module, owner_name), f"{name}_lora", None)
            if adapter is not None:
                yield layers, owner_name, name, adapter


def _per_layer_adapters(model: LlamaForCausalLM) -> Iterator[tuple[int, str, str, dict]]:
    """(layer, owner module name, target name, ``{"lora_a", "lora_b"}`` arrays) for every adapted kernel."""
    adapters = unstack_layers(model.config, nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam)))
    for i, layer in sorted(adapters.get("layers", {}).items()):
        for owner, modules in layer.items():
            for key, adapter in modules.items():
                yield i, owner, key.removesuffix("_lora"), adapter


def set_dropout_key(model: LlamaForCausalLM, key: jax.Array) -> LlamaForCausalLM:
    """Turns on adapter dropout for ``model``'s forward passes (in place; no-op for adapters with dropout 0):
    each adapter draws its masks from ``fold_in(key, layer · len(TARGETS) + target's index in TARGETS)``. The index
    is not stored in the adapter, so the adapters of every layer share one module structure (``scan_layers``).
    Returns ``model``."""
    for layers, _, name, adapter in _adapters_of(model):
        if adapter.dropout > 0:
            keys = [jax.random.fold_in(key, i * len(TARGETS) + TARGETS.index(name)) for i in layers]
            adapter.dropout_key = jnp.stack(keys) if len(layers) > 1 else keys[0]  # a stacked block: one per layer
    return model


def without_adapters(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The base model (no adapters), sharing ``model``'s weights."""
    return nnx.merge(nnx.split(abstract_model(model.config))[0], split(model)[2])


def merge_weights(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A plain model (no adapters) whose target kernels are ``W + (α/r)·A·B``, in the base's dtype."""
    config = model.config
    base = unstack_layers(config, nnx.to_pure_dict(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))))
    scales = {name: adapter.scale for _, _, name, adapter in _adapters_of(model)}
    for i, owner, name, adapter in _per_layer_adapters(model):
        kernel = base["layers"][i][owner][name]
        delta = jnp.tensordot(adapter["lora_a"], adapter["lora_b"], axes=1) * scales[name]
        base["layers"][i][owner][name] = (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)
    return nnx.merge(nnx.split(abstract_model(config))[0], stack_layers(config, base))


def peft_config(lora: LoRAConfig, base_model: str = "") -> dict[str, Any]:
    """``adapter_config.json`` contents for PEFT's ``LoraConfig``."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": list(lora.targets), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "init_lora_weights": True, "modules_to_save": None, "inference_mode": True}


def save_peft(model: LlamaForCausalLM, lora: LoRAConfig, path: str | os.PathLike, *, base_model: str = "",
              tokenizer=None) -> Path:
    """Writes a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) that
    ``peft.PeftModel.from_pretrained(hf_base_model, path)`` loads on top of the base saved by ``save_hf``.

    PEFT names ``base_model.model.<HF module>.lora_A.weight`` ``[r, in]`` and ``lora_B.weight`` ``[out, r]``;
    our ``A [in..., r]`` and ``B [r, out...]`` go through the same layout rule as the kernel they adapt.
    """
    from safetensors.numpy import save_file

    fused = sorted({name for _, owner, name, _ in _adapters_of(model)
                    if fused_rows(model.config, f"model.layers.0.{owner}.{name}.weight")})
    if fused:
        raise ValueError(f"{model.config.architecture} checkpoints fuse {', '.join(fused)} into one module, which a "
                         "PEFT adapter of separate q/k/v or gate/up adapters cannot target; export the merged model "
                         "instead (without --adapter)")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for i, owner, name, adapter in _per_layer_adapters(model):
        module = hf_layout(("layers", i, owner, name))[0].removesuffix(".weight")
        n_in = _INPUT_DIMS.get(name, 1)
        tensors[f"base_model.model.{module}.lora_A.weight"] = to_hf(
            f"linear:{n_in}", np.asarray(jax.device_get(adapter["lora_a"]), np.float32))
        tensors[f"base_model.model.{module}.lora_B.weight"] = to_hf(
            "linear:1", np.asarray(jax.device_get(adapter["lora_b"]), np.float32))
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps(peft_config(lora, base_model), indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return folder
