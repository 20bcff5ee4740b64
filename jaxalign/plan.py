"""Memory plan of a training config on any number of devices, without allocating anything.

``jax.eval_shape`` gives the parameter and optimizer-state shapes; the mesh rules (``jaxalign.parallel``) give
each array's sharding on an abstract mesh of the requested size, so the per-device bytes of parameters, optimizer
state, gradients and the frozen reference are exact. Activations are an estimate from the model shape (saved
tensors per layer, attention scores, logits), checked against XLA's own figure for small models in
``tests/test_plan.py``.

    jaxalign plan --config dpo:llama3_8b --devices 64 --hardware v5p
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh

from jaxalign.losses.logps import HEAD_BLOCK_ROWS
from jaxalign.models import LlamaConfig, abstract_model, lora, param_shardings
from jaxalign.models.llama import causal_blocks
from jaxalign.objectives.common import resolve_chunk_size
from jaxalign.parallel.mesh import mesh_sizes
from jaxalign.sampling.generate import cache_bucket
from jaxalign.train.build import model_config, optimizer
from jaxalign.train.spec import ConfigError, ObjectiveSpec, RunSpec
from jaxalign.train.step import state_shardings

GB = 1e9

# Accelerator memory per device, in GB (vendor figures).
HARDWARE: dict[str, float] = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32, "a100-40gb": 40, "a100": 80, "h100": 80,
                              "h200": 141, "b200": 192}

# f32 [rows, length, vocab] buffers live at the head's peak in a training step: logits, log-softmax, softmax and
# their gradients (read from XLA's buffer assignment of our train step on CPU; see tests/test_plan.py).
LOGIT_COPIES = 6
# The fused path (``token_logps_from_hidden``) holds about three f32 tiles of ``[block, tile]`` at once (logits,
# their exp or gradient, the next tile's), plus a float32 gradient accumulator for the hidden states and the
# kernel gradient's tiles.
FUSED_TILE_COPIES = 3
# Self-attention in causal query blocks (``models.llama.causal_blocks``, 256+ tokens) keeps no ``[T, S]`` arrays for
# the backward (``causal_block_attention`` computes them again); about two f32 ``[rows, S]`` arrays of its largest
# block are live at once (calibrated against XLA's buffer assignment at 256 and 512 tokens; tests/test_plan.py).
BLOCK_COPIES = 2

@dataclasses.dataclass
class Plan:
    mesh: dict[str, int]
    num_params: int
    trainable_params: int
    bytes: dict[str, float]  # per device
    rows_per_device: int
    sequence_length: int
    notes: list[str]

    @property
    def total(self) -> float:
        return sum(self.bytes.values())

    def table(self, hardware: str | None = None, memory_gb: float | None = None) -> str:
        lines = [f"mesh {self.mesh} ({math.prod(self.mesh.values())} devices); {_count(self.num_params)} "
                 f"parameters, {_count(self.trainable_params)} trained; {self.rows_per_device} sequences of "
                 f"{self.sequence_length} tokens per device per micro-batch", "",
                 f"{'per device':<26}{'GB':>10}"]
        lines += [f"{name:<26}{value / GB:>10.3f}" for name, value in self.bytes.items()]
        lines.append(f"{'total':<26}{self.total / GB:>10.3f}")
        capacity = memory_gb if memory_gb else HARDWARE.get((hardware or "").lower())
        if capacity:
            usable = 0.9 * capacity  # leave ~10 % to the runtime, compiler scratch and fragmentation
            verdict = "fits" if self.total / GB <= usable else "does NOT fit"
            lines += ["", f"{verdict} in {capacity:g} GB per device ({hardware or 'given'}; 90 % usable = "
                          f"{usable:.1f} GB)"]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total}


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def teacher_config(path: str, spec: RunSpec) -> LlamaConfig | None:
    """The teacher's architecture from its config.json, GGUF header or run folder (None if it is not here)."""
    from pathlib import Path

    from jaxalign.train.build import read_model_config

    if (Path(path) / "model_config.json").exists():
        return read_model_config(Path(path)).replace(dtype=spec.model.dtype, param_dtype=spec.model.dtype)
    try:
        return model_config(dataclasses.replace(spec.model, path=path))
    except (FileNotFoundError, ValueError):
        return None


def _device_bytes(shapes, shardings) -> float:
    def one(shape, sharding):
        return math.prod(sharding.shard_shape(shape.shape)) * jnp.dtype(shape.dtype).itemsize

    return float(sum(jax.tree.leaves(jax.tree.map(one, shapes, shardings))))


def activation_bytes(model: LlamaConfig, rows: int, length: int, tensor: int, *, chunk_size: int = 0,
                     grad: bool = True) -> float:
    """Estimated activation memory of one forward (+ backward) pass on one device.

    Without remat every layer keeps its inputs, norms, q/k/v, attention output, the MLP's gate/up/product, and
    (XLA attention as one dense product, below 256 tokens) the f32 score and probability matrices, or (in causal
    query blocks) each row's max and log-normaliser, with one block's arrays live at a time; with remat each layer
    keeps only its input and one layer's set is live during the backward pass. The head adds ``LOGIT_COPIES`` f32
    logit-sized buffers, or with the fused path (``chunk_size`` vocabulary columns per tile) ``FUSED_TILE_COPIES``
    tiles and its accumulators.
    """
    act = jnp.dtype(model.dtype).itemsize
    # the MLP's width per token: a mixture of experts runs num_experts_per_tok experts per token (dense layers of a
    # partly sparse model may be wider: the larger of the two)
    routed = model.num_experts_per_tok * model.moe_intermediate_size if model.num_experts else 0
    h, inter = model.hidden_size, max(model.intermediate_size, routed) / tensor
    heads, kv = model.num_heads / tensor, model.num_kv_heads / tensor
    per_token = act * (4 * h + (2 * heads + 2 * kv) * model.head_dim + 4 * inter)
    blocks = causal_blocks(length, length) if model.attention_impl == "xla" else 1
    scores = model.attention_impl == "xla" and blocks == 1  # the dense product keeps its f32 scores and probabilities
    if scores:
        per_token += 2 * 4 * heads * length
    elif blocks > 1:  # query blocks keep each row's max and log-normaliser; one block's f32 [rows, S] arrays are live
        per_token += 2 * 4 * heads
    tokens = rows * length
    transient = BLOCK_COPIES * 4 * heads * rows * -(-length // blocks) * length if blocks > 1 else 0
    # kept per token per layer under each remat policy: the layer input, plus every matmul output ("dots": the
    # projections and, with XLA attention, the score matrix) or the projections only ("dots_no_batch")
    projections = act * (2 * h + (2 * heads + 2 * kv) * model.head_dim + 3 * inter)
    kept = {"nothing": act * h, "dots_no_batch": projections,
            "dots": projections + (4 * heads * length if scores else 0)}
    if not grad:
        layers = per_token * tokens  # one layer live at a time
    elif model.remat:
        layers = kept[model.remat_policy] * tokens * model.num_layers + per_token * tokens
    else:
        layers = per_token * tokens * model.num_layers
    return layers + transient + head_bytes(tokens, model.vocab_size / tensor, h, chunk_size=chunk_size, grad=grad)


def backend_of(hardware: str | None) -> str:
    """The JAX backend a ``--hardware`` name runs on (TPU generations start with "v"); JAX's own without one."""
    if not hardware:
        return jax.default_backend()
    return "tpu" if hardware.lower().startswith("v") else "gpu"


def head_bytes(tokens: int, vocab: float, hidden: int, *, chunk_size: int = 0, grad: bool = True) -> float:
    """Estimated bytes at the head's peak for ``tokens`` positions: ``LOGIT_COPIES`` f32 ``[tokens, vocab]``
    buffers on the plain path; on the fused path (``chunk_size`` vocabulary columns per tile, blocks of
    ``HEAD_BLOCK_ROWS`` rows) a few f32 ``[block, tile]`` tiles plus the
    hidden-state gradient accumulator and the kernel gradient."""
    if not chunk_size:
        return tokens * vocab * 4 * (LOGIT_COPIES if grad else 2)
    tile = min(chunk_size, vocab)
    if not grad:
        return min(tokens, HEAD_BLOCK_ROWS) * tile * 4 * 2
    block = min(tokens, HEAD_BLOCK_ROWS)
    copies = 2 if tile >= vocab and block >= tokens else FUSED_TILE_COPIES  # one tile, rows in place
    return block * tile * 4 * copies + tokens * hidden * 4 + hidden * vocab * 4


def plan(config: ml_collections.ConfigDict, num_devices: int, *, backend: str | None = None) -> Plan:
    """Per-device memory of training ``config`` on ``num_devices`` devices with the config's mesh, on ``backend``
    ("cpu", "gpu", "tpu"; default: JAX's), which picks the automatic log-prob path."""
    spec = RunSpec.from_config(config, check=False)
    if spec.objective.params is None:  # an unknown objective or hyper-parameter: nothing to plan
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(ObjectiveSpec.read(config.objective)[1]))
    sizes = mesh_sizes(spec.mesh.shape, num_devices)
    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes))
    rules = spec.mesh.rules_table
    arch = model_config(spec)
    model = abstract_model(arch)
    tx, _ = optimizer(spec.optim, spec.train.steps)
    shardings = state_shardings(model, tx, mesh, rules)
    params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(nnx.state(model)))
    objective, hparams = spec.objective.entry, spec.objective.params
    notes: list[str] = []
    num_params = int(sum(np.prod(p.shape) for p in jax.tree.leaves(params)))

    out: dict[str, float] = {}
    lora_config = spec.lora.config()
    if lora_config is not None:  # the base is frozen and held once; adapters are what trains, has moments and grads
        lora_model = lora.abstract_lora_model(arch, lora_config)
        trained_shardings = state_shardings(lora_model, tx, mesh, rules, trained=nnx.LoRAParam)
        trained = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
                               nnx.to_pure_dict(nnx.state(lora_model, nnx.LoRAParam)))
        out["base parameters (frozen)"] = _device_bytes(params, shardings.params)
        out["LoRA adapters"] = _device_bytes(trained, trained_shardings.params)
        trainable = lora.count_params(arch, lora_config)["adapter"]
        full_state = _device_bytes(jax.eval_shape(tx.init, params), shardings.opt_state)
        shardings, params = trained_shardings, trained
    else:
        out["parameters"] = _device_bytes(params, shardings.params)
        trainable = num_params
    trained_bytes = _device_bytes(params, shardings.params)
    out["optimizer state"] = _device_bytes(jax.eval_shape(tx.init, params), shardings.opt_state)
    out["gradients"] = trained_bytes * (2 if spec.train.grad_accum > 1 else 1)
    if spec.train.grad_accum > 1:
        notes.append("gradients counted twice: the accumulator and one micro-batch's gradients")
    uses_reference = spec.objective.uses_reference
    reference_kind = spec.reference.kind

    data_parallel = sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("expert", 1)  # the batch's split
    micro = spec.train.batch_size // max(spec.train.grad_accum, 1)
    rows = max(micro // data_parallel, 1) * objective.rows_per_example
    length = spec.data.row_length if spec.data.packing and spec.data.row_length else spec.data.max_length
    if spec.objective.name == "grpo":
        length += hparams.max_completion_length
    tensor = sizes.get("tensor", 1)
    chunk_setting = int(hparams.logps_chunk_size)
    chunk = resolve_chunk_size(chunk_setting, rows, length, arch.vocab_size, backend)
    out["activations (estimate)"] = activation_bytes(arch, rows, length, tensor, chunk_size=chunk)
    if uses_reference and reference_kind == "model" and lora_config is not None:
        notes.append("LoRA: the reference is the base with the adapters off (no second copy of the weights)")
    elif uses_reference and reference_kind == "model":
        out["reference model"] = out["parameters"]
    elif uses_reference:
        # computed before training, one training micro-batch at a time, rows split like the step's, on the same
        # log-prob path (forward only)
        ref_chunk = resolve_chunk_size(chunk_setting, rows, spec.data.max_length, arch.vocab_size, backend)
        ref_peak = activation_bytes(arch, rows, spec.data.max_length, tensor, chunk_size=ref_chunk, grad=False)
        notes.append(f"reference.kind=precomputed: no reference weights on the devices during training; computing "
                     f"the reference log-probs first (forward passes over the training micro-batches) peaks at "
                     f"about {ref_peak / GB:.3f} GB of activations per device, below the step's")
    if objective.uses_teacher and hparams.teacher:
        teacher = teacher_config(hparams.teacher, spec)
        if teacher is None:
            notes.append(f"teacher {hparams.teacher!r} not found here: its weights are not counted")
        else:
            teacher_params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
                                          nnx.to_pure_dict(nnx.state(abstract_model(teacher), nnx.Param)))
            out["teacher model"] = _device_bytes(teacher_params, nnx.to_pure_dict(
                param_shardings(abstract_model(teacher), mesh, rules)))
            logits = 2 * rows * length * arch.vocab_size * 4 // max(tensor, 1)
            out["distillation logits (student + teacher)"] = logits
            notes.append("distillation forms the student's and the teacher's [rows, T, V] float32 logits whole")
    if spec.objective.name == "ift":
        notes.append("IFT adds a no-gradient forward pass for the greedy tokens; its peak is below the training pass")
    if spec.objective.name == "grpo":
        completions = hparams.prompts_per_step * hparams.num_generations
        cache_length = cache_bucket(spec.data.max_length + hparams.max_completion_length)
        itemsize = jnp.dtype(arch.dtype).itemsize
        out["rollout KV cache"] = (2 * arch.num_layers * completions * cache_length * arch.num_kv_heads
                                   * arch.head_dim * itemsize)
        if hparams.recompute_old_logps:
            buffers = 2 if hparams.sampling_correction != "none" else 1  # and the sampler's own
            out["old log-probs"] = buffers * completions * (spec.data.max_length + hparams.max_completion_length) * 4
        notes.append(f"GRPO: sequences = prompt (up to data.max_length={spec.data.max_length}) + "
                     f"{hparams.max_completion_length} completion tokens; the rollout KV cache holds all "
                     f"{completions} completions x {cache_length} positions on every device (the sampler does not "
                     "split the generation batch); it is freed before the update, so the total is an upper bound")
    if not arch.remat:
        notes.append("model.remat=False: every layer's activations are kept for the backward pass")
    if lora_config is not None:
        with_ref = uses_reference and reference_kind == "model"
        full = (3 if with_ref else 2) * out["base parameters (frozen)"] + full_state
        notes.append(f"LoRA saves {(full - sum(v for k, v in out.items() if not k.startswith('activations'))) / GB:.2f}"
                     " GB per device against full fine-tuning (parameters, gradients, optimizer state"
                     f"{', reference' if with_ref else ''})")
    return Plan(mesh=sizes, num_params=num_params, trainable_params=trainable, bytes=out, rows_per_device=rows,
                sequence_length=length, notes=notes)
