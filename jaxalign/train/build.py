"""The builder: a ``RunSpec`` becomes the model, tokenizer, reference, optimizer and shardings of a run.

This is the only module that makes a model from a config; ``train``, ``cpi``, ``plan``, ``export``, ``eval``,
``generate`` and ``route`` all come here (``tests/test_build.py`` greps for it). ``build(spec, mesh)`` gives an
``Engine``: the trained and frozen trees in their shardings, the fresh ``TrainState``, and the jitted train and
eval steps. The reference of DPO and MPO is decided here once:

* ``reference.kind="model"``: the initial policy's weights held once as the step's frozen tree (with LoRA: the
  base with the adapters off, the same arrays as the policy's base, no copy);
* ``reference.kind="precomputed"``: no reference on the devices while training; the data phase attaches cached
  log-probs computed from ``Engine.base_params`` (``jaxalign.train.reference_cache``);
* reference-free objectives: nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxalign.data.tokenize import Tokenizer, padding_id
from jaxalign.hub import resolve_model
from jaxalign.models import (
    LlamaConfig,
    RopeScaling,
    abstract_model,
    create_model,
    load_pretrained,
    load_tokenizer,
    lora,
    param_shardings,
)
from jaxalign.models.llama import layer_plan, other_layer_layout
from jaxalign.objectives import Objective
from jaxalign.parallel.mesh import Rules, batch_sharding, make_mesh, use_rules
from jaxalign.train.checkpoints import good_step, restore_in_layout
from jaxalign.train.evaluate import make_eval_step
from jaxalign.train.spec import ModelSpec, OptimSpec, RunSpec
from jaxalign.train.step import (
    ModelParts,
    TrainState,
    full_parts,
    init_state,
    lora_parts,
    make_optimizer,
    make_train_step,
    state_shardings,
    teacher_parts,
)

# Shapes of the large presets, so a plan needs no downloaded weights (values from the models' config.json).
ARCHITECTURES: dict[str, dict] = {
    "llama3_8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, rope_theta=500000.0, max_position_embeddings=8192),
    "qwen25_7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                      num_kv_heads=4, rope_theta=1000000.0, qkv_bias=True, architecture="qwen2",
                      max_position_embeddings=32768),
    "qwen3_8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                     num_kv_heads=8, head_dim=128, rope_theta=1000000.0, qk_norm=True, architecture="qwen3",
                     max_position_embeddings=40960),
    "qwen3_30b_a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
                          num_kv_heads=4, head_dim=128, rope_theta=1000000.0, qk_norm=True, architecture="qwen3_moe",
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          router_aux_loss_coef=0.001, max_position_embeddings=40960),
}


def _model_spec(spec) -> ModelSpec:
    """A ``ModelSpec`` from a spec, a run spec or a whole ml_collections config."""
    if isinstance(spec, ModelSpec):
        return spec
    if isinstance(spec, RunSpec):
        return spec.model
    return RunSpec.from_config(spec, check=False).model


def model_config(spec) -> LlamaConfig:
    """The architecture without any weights: from ``model.path`` (config.json or the GGUF header only), a known
    large preset, or the random model's ``model.shape``. Takes a ``ModelSpec``, ``RunSpec`` or config."""
    spec = _model_spec(spec)
    path = resolve_model(spec.path) if spec.path else None
    if path is not None and path.exists():
        if path.suffix == ".gguf":
            from jaxalign.models.gguf import read_gguf_config

            config = read_gguf_config(path)
        else:
            from jaxalign.models.hf import config_from_hf, read_hf_config

            config = config_from_hf(read_hf_config(path), source=str(path / "config.json"))
        return config.replace(dtype=spec.dtype, param_dtype=spec.dtype, **spec.overrides())
    if spec.preset in ARCHITECTURES:
        return LlamaConfig(**ARCHITECTURES[spec.preset], dtype=spec.dtype, param_dtype=spec.param_dtype,
                           **spec.overrides())
    if path is not None:
        raise FileNotFoundError(f"model.path={spec.path!r} does not exist (and model.preset={spec.preset!r} is not "
                                f"one of {', '.join(ARCHITECTURES)})")
    return LlamaConfig(**spec.shape, dtype=spec.dtype, param_dtype=spec.param_dtype, **spec.overrides())


def tokenizer_for(spec: ModelSpec, own=None):
    """The HF tokenizer a run uses: ``tokenizer`` ("toy", a folder) or the model's own (``own``)."""
    if spec.tokenizer == "toy":
        from jaxalign.data.toy import toy_tokenizer

        return toy_tokenizer()
    if spec.tokenizer:
        return load_tokenizer(spec.tokenizer)
    if own is None:
        raise ValueError("no tokenizer: the model folder has none; set tokenizer='toy' or a tokenizer folder")
    return own


def load_model(spec, *, seed: int = 0, mesh: Mesh | None = None, rules: Rules | None = None, head: str = "lm"):
    """(model, HF tokenizer) of a ``ModelSpec``: ``model.path`` loaded (straight into ``mesh``), or the random
    preset created from ``seed``. ``head="reward"``: as a reward model (``num_labels=1``; a causal LM's LM head is
    replaced by a new score head drawn from ``seed``); ``"lm"`` refuses a reward model."""
    spec = _model_spec(spec)
    labels = {"num_labels": 1} if head == "reward" else {}
    if spec.path:
        model, own = load_pretrained(spec.path, dtype=spec.dtype, mesh=mesh, rules=rules, seed=seed,
                                     config_overrides={**spec.overrides(), **labels})
        if spec.param_dtype != spec.dtype:
            import warnings

            warnings.warn("model.param_dtype differs from model.dtype: loaded weights keep model.dtype", stacklevel=2)
    else:
        model, own = create_model(model_config(spec).replace(**labels), seed=seed, mesh=mesh, rules=rules), None
    if head == "lm" and model.config.num_labels:
        raise ValueError(f"model.path={spec.path!r} is a reward model (a score head, no LM head); this objective "
                         "trains a causal LM: start from a causal LM checkpoint")
    tokenizer = tokenizer_for(spec, own)
    check_vocabulary(len(tokenizer), model.config.vocab_size, spec)
    if head == "reward" and model.config.pad_token_id is None:
        # scoring skips trailing pad tokens (transformers' rule): the id must be the one batches are padded with,
        # in training and in the exported config alike
        model.config = model.config.replace(pad_token_id=padding_id(tokenizer))
    return model, tokenizer


def check_vocabulary(tokens: int, rows: int, spec: ModelSpec) -> None:
    """A tokenizer must fit the embedding table, and a pretrained model's table must not be much larger than its
    tokenizer (padding rows aside: up to 1,024 or 1 %), which is what a wrong tokenizer (the toy one) looks like."""
    fix = ("leave tokenizer empty to use the model's own" if spec.path else "set model.shape.vocab_size")
    if tokens > rows:
        raise ValueError(f"the tokenizer has {tokens} tokens but the model's vocabulary is {rows}; {fix}")
    if spec.path and rows - tokens > max(1024, rows // 100):
        raise ValueError(f"tokenizer={spec.tokenizer!r} has {tokens} tokens but {spec.path} has {rows} embedding "
                         "rows: not this model's tokenizer; leave tokenizer empty to use the model's own")


def optimizer(optim: OptimSpec, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The run's optax chain and its learning-rate schedule (``jaxalign.train.step.make_optimizer``)."""
    return make_optimizer(optim, total_steps)


@dataclasses.dataclass
class Engine:
    """What a run trains with, built once by ``build``."""

    spec: RunSpec
    mesh: Mesh
    rules: Rules
    model_config: LlamaConfig
    graphdef: Any  # the plain decoder's
    base_params: Any  # the loaded / initial weights (pure dict), e.g. for a precomputed reference
    hf_tokenizer: Any
    tokenizer: Tokenizer  # with the run's chat template and lengths: the one prompt encoder
    objective: Objective
    hparams: Any
    parts: ModelParts
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    state: TrainState
    frozen: Any  # the step's frozen tree: the reference's weights, LoRA's base, or None
    shardings: TrainState
    frozen_shardings: Any
    batch_sharding: NamedSharding

    @functools.cached_property
    def train_step(self):
        """The jitted, sharded train step ``step(state, batch[, frozen]) -> (state, metrics)`` (built once)."""
        train = self.spec.train
        return make_train_step(self.parts, self.objective.fn, self.hparams, self.tx, grad_accum=train.grad_accum,
                               nan_guard=train.nan_guard, schedule=self.schedule, shardings=self.shardings,
                               batch_sharding=self.batch_sharding, frozen_shardings=self.frozen_shardings)

    @functools.cached_property
    def eval_step(self):
        """The jitted ``eval_step(params, batch, frozen, step) -> metrics`` (built once)."""
        return make_eval_step(self.parts, self.objective.fn, self.hparams)

    def policy(self, params=None):
        """The policy model on ``params`` (default: the current state's), adapters attached for LoRA."""
        return self.parts.policy(self.state.params if params is None else params, self.frozen, None)

    def rules_scope(self):
        return use_rules(self.rules)


def load_teacher(spec: RunSpec, hf_tokenizer, student: LlamaConfig, mesh: Mesh, rules: Rules, log):
    """(graphdef, weights, their shardings) of ``objective.params.teacher``, held once on ``mesh``: a Hugging Face
    folder, .gguf, Hub id or jaxalign run folder, in the student's dtype. It must use the student's tokenizer."""
    path = spec.objective.params.teacher
    with jax.set_mesh(mesh), use_rules(rules):
        if (Path(path) / "model_config.json").exists():  # a jaxalign run: restored, then laid out on the mesh
            model, own, _ = restore_model(path)
        else:
            model, own = load_model(dataclasses.replace(spec.model, path=path, tokenizer=""), seed=spec.seed,
                                    mesh=mesh, rules=rules)
    config = model.config
    same = own.get_vocab() == hf_tokenizer.get_vocab() if own is not None else config.vocab_size == student.vocab_size
    if not same or config.vocab_size != student.vocab_size:
        raise ValueError(f"objective.params.teacher={path!r}: the teacher's tokenizer or vocabulary "
                         f"({config.vocab_size} rows) differs from the student's ({student.vocab_size}); distillation "
                         "compares next-token distributions, so both need one tokenizer")
    graphdef, weights = nnx.split(model)
    shardings = nnx.to_pure_dict(param_shardings(abstract_model(config), mesh, rules))
    weights = jax.device_put(nnx.to_pure_dict(weights), shardings)
    log(f"teacher {path}: {config.num_params():,} parameters, {config.num_layers} layers x {config.hidden_size}")
    return graphdef, weights, shardings


def run_mesh(spec: RunSpec, devices=None) -> Mesh:
    return make_mesh(spec.mesh.shape, devices=devices)


def build(spec: RunSpec, mesh: Mesh, *, log=lambda message: None) -> Engine:
    """Model, tokenizer, reference, optimizer, shardings and the fresh state of a run on ``mesh``."""
    rules = spec.mesh.rules_table
    with jax.set_mesh(mesh), use_rules(rules):
        model, hf_tokenizer = load_model(spec.model, seed=spec.seed, mesh=mesh, rules=rules,
                                         head=spec.objective.entry.head)
    config = model.config
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    objective = spec.objective.entry
    tx, schedule = optimizer(spec.optim, spec.train.steps)
    reference_model = spec.objective.uses_reference and spec.reference.kind == "model"
    lora_config = spec.lora.config()
    if lora_config is not None:
        counts = lora.count_params(config, lora_config)
        log(f"LoRA r={lora_config.rank} on {','.join(lora_config.targets)}: {counts['adapter']:,} adapter parameters "
            f"train ({100 * counts['adapter'] / counts['base']:.2f}% of the {counts['base']:,} frozen base "
            "parameters)")
        parts = lora_parts(lora.lora_graphdef(config, lora_config), graphdef, with_reference=reference_model)
        shardings = state_shardings(lora.abstract_lora_model(config, lora_config), tx, mesh, rules,
                                    trained=nnx.LoRAParam)
        with jax.set_mesh(mesh):
            trained = lora.init_adapters(config, lora_config, seed=spec.seed, mesh=mesh, rules=rules)
        frozen = params  # the base: frozen, never copied
        frozen_shardings = nnx.to_pure_dict(param_shardings(abstract_model(config), mesh, rules))
    else:
        parts, trained = full_parts(graphdef), params
        shardings = state_shardings(abstract_model(config), tx, mesh, rules)
        frozen = jax.tree.map(jnp.copy, params) if reference_model else None  # the initial policy, held once
        frozen_shardings = shardings.params if frozen is not None else None
    if objective.uses_teacher:
        teacher_graphdef, teacher, teacher_shardings = load_teacher(spec, hf_tokenizer, config, mesh, rules, log)
        parts = teacher_parts(parts, teacher_graphdef)
        frozen = {"policy": frozen, "teacher": teacher}
        frozen_shardings = {"policy": frozen_shardings, "teacher": teacher_shardings}
    with jax.set_mesh(mesh):
        state = init_state(trained, tx, spec.seed, shardings)
    tokenizer = Tokenizer(hf_tokenizer, spec.data.tokenize_config())
    return Engine(spec=spec, mesh=mesh, rules=rules, model_config=config, graphdef=graphdef, base_params=params,
                  hf_tokenizer=hf_tokenizer, tokenizer=tokenizer, objective=objective,
                  hparams=spec.objective.params, parts=parts, tx=tx, schedule=schedule, state=state, frozen=frozen,
                  shardings=shardings, frozen_shardings=frozen_shardings,
                  batch_sharding=batch_sharding(mesh, 1, rules))


# ------------------------------------------------------------------------------------------------ run folders
def run_dir_of(checkpoint: str | Path) -> tuple[Path, int | None]:
    """(run folder, step or None for the latest) from a run folder, its checkpoints/ folder or a step folder."""
    path = Path(checkpoint).resolve()
    if (path / "model_config.json").exists():
        return path, None
    if (path.parent / "model_config.json").exists() and path.name == "checkpoints":
        return path.parent, None
    if path.name.isdigit() and (path.parent.parent / "model_config.json").exists():
        return path.parent.parent, int(path.name)
    raise FileNotFoundError(f"{checkpoint}: not a jaxalign run folder (expected model_config.json, written by "
                            "`jaxalign train`, in it or above it)")


def write_model_config(run_dir: Path, config: LlamaConfig) -> None:
    (run_dir / "model_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))


def read_model_config(run_dir: Path) -> LlamaConfig:
    values = json.loads((run_dir / "model_config.json").read_text())
    values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
    values["sliding_window_layers"] = tuple(values["sliding_window_layers"])
    if isinstance(values.get("eos_token_id"), list):
        values["eos_token_id"] = tuple(values["eos_token_id"])
    return LlamaConfig(**values)


def run_spec_of(run_dir: Path) -> RunSpec:
    """The spec a run folder's ``config.json`` records (unchecked: the run already passed validation)."""
    from jaxalign.train.config import load_config

    return RunSpec.from_config(load_config(str(run_dir / "config.json")), check=False)


def restore_model(checkpoint: str | Path, *, log=None):
    """(model, tokenizer, step) restored from a run's checkpoint (the newest that verifies against its manifest,
    broken ones passed over with a warning, unless a step folder is given),
    onto this process's first device whatever mesh or number of hosts wrote it. For a LoRA run the model is
    the base (``model.path`` again, or the random preset recreated from the seed) with the trained adapters.
    ``log`` (optional) is told which checkpoint was used."""
    import orbax.checkpoint as ocp

    run_dir, step = run_dir_of(checkpoint)
    config = read_model_config(run_dir)
    spec = run_spec_of(run_dir)
    lora_config = spec.lora.config()
    if lora_config is None:
        graphdef, state = nnx.split(abstract_model(config))
    else:
        graphdef, state, _ = nnx.split(lora.abstract_lora_model(config, lora_config), nnx.LoRAParam, ...)
    params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(state))
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    tx, _ = optimizer(spec.optim, spec.train.steps)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here),
                          jax.eval_shape(lambda p: init_state(p, tx, 0, None), params))
    step, skipped = good_step(run_dir / "checkpoints", step)
    for line in skipped:
        warnings.warn(f"{run_dir / 'checkpoints'}: passing over the broken checkpoint {line}", stacklevel=2)
    if log is not None:
        log(f"using checkpoint {step} of {run_dir}" + (" (the newest that verifies)" if skipped else ""))
    with ocp.CheckpointManager(run_dir / "checkpoints") as manager:  # closed: no Orbax threads outlive the read
        restored = TrainState(*restore_in_layout(manager, step, target, other_layer_layout(config),
                                                   other_first=bool(layer_plan(config)[2]))[0]).params
    if lora_config is None:
        model = nnx.merge(graphdef, restored)
    else:
        one = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.local_devices()[:1])
        with jax.set_mesh(one):  # jitted creation: any device count gives the same random base
            base, _ = load_model(spec.model, seed=spec.seed, mesh=None if spec.model.path else one)
        model = nnx.merge(graphdef, nnx.to_pure_dict(nnx.state(base)), restored)
    return model, load_tokenizer(run_dir / "tokenizer"), step


def load_any(path: str | Path, dtype: str = "float32", *, require_tokenizer: bool = True, log=None):
    """(model, HF tokenizer) from a jaxalign run folder, a Hugging Face folder or a .gguf file (``log``: as
    ``restore_model``)."""
    if (Path(path) / "model_config.json").exists():
        model, tokenizer, _ = restore_model(path, log=log)
        return model, tokenizer
    model, tokenizer = load_pretrained(path, dtype=dtype)
    if tokenizer is None and require_tokenizer:
        raise FileNotFoundError(f"{path}: the model folder has no tokenizer files")
    return model, tokenizer
