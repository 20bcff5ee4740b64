"""The run spec: a training config read once into small typed sections, each validating its own fields.

``RunSpec.from_config(config)`` reads every section of an ml_collections config (``base.get_config()`` lists
them) into a frozen dataclass; a field the section does not know is an error, and every section's
``problems(run, num_devices)`` names what cannot work and how to fix it. ``validate`` only collects those
messages. ``effective_config(config)`` is the config with every default filled in (the objective's
hyper-parameters included): what a run folder's ``config.json`` records, so that file alone reruns the run.

The path of a run: config -> ``RunSpec`` (here) -> ``jaxalign.train.build`` (model, tokenizer, reference,
optimizer, shardings) -> ``jaxalign.train.step`` (the jitted step) -> ``jaxalign.train.loop``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import ml_collections

from jaxalign.data.tokenize import TRUNCATIONS, TokenizeConfig
from jaxalign.data.toy import GENERATORS
from jaxalign.hub import is_repo_id
from jaxalign.models.config import SCAN_MIN_LAYERS
from jaxalign.models.lora import TARGETS as LORA_TARGETS
from jaxalign.models.lora import LoRAConfig
from jaxalign.objectives import OBJECTIVES, Objective, make_params
from jaxalign.parallel.mesh import MESH_AXES, Rules, format_rules, parse_rules


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and the fix."""


def path_inside(workdir: str | Path, relative: str, field: str) -> Path:
    """``relative`` resolved inside the run folder; a path that leaves it (``..``, links) is a ``ConfigError``.
    Absolute paths are taken as given (e.g. a reference cache shared by several runs)."""
    if Path(relative).is_absolute():
        return Path(relative)
    root = Path(workdir).resolve()
    path = (root / relative).resolve()
    if not path.is_relative_to(root):
        raise ConfigError(f"{field}={relative!r} leaves the run folder {root}; give a path inside it (or an "
                          "absolute path)")
    return path


def _read(cls, node, section: str):
    """An instance of the dataclass ``cls`` from the config section ``node``; missing fields keep their default."""
    values = dict(node.to_dict() if isinstance(node, ml_collections.ConfigDict) else node or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"{section} has no field(s) {', '.join(unknown)}; its fields: {', '.join(sorted(names))}")
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The policy: a Hugging Face folder or .gguf (``path``), or a random ``preset`` of ``shape``; ``tokenizer``
    is the top-level ``config.tokenizer`` ("" = the model's own, "toy", or a tokenizer folder)."""

    path: str = ""
    preset: str = "tiny"
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention_impl: str = "xla"
    remat: bool = False
    remat_policy: str = "nothing"
    scan_layers: str = "auto"
    shape: dict = dataclasses.field(default_factory=dict)
    tokenizer: str = ""

    def overrides(self) -> dict[str, Any]:
        """The fields that change how the architecture runs (not what it is)."""
        scan = {"auto": None, "true": True, "false": False}.get(str(self.scan_layers).lower())
        return {"attention_impl": self.attention_impl, "remat": self.remat, "remat_policy": self.remat_policy,
                "scan_layers": scan}

    def problems(self, run: RunSpec, num_devices: int) -> list[str]:
        from jaxalign.train.build import ARCHITECTURES

        problems = []
        if not self.path and self.preset not in ("tiny", *ARCHITECTURES):
            problems.append("model.path is empty: set it to a Hugging Face folder or .gguf file")
        elif not self.path and self.preset != "tiny":
            problems.append(f"model.path is empty: model.preset={self.preset!r} gives the shape only (for "
                            "`jaxalign plan`); set model.path to the downloaded Hugging Face folder to train")
        if not self.path and not self.tokenizer:
            problems.append("a randomly initialised model needs tokenizer='toy' or a tokenizer folder")
        if self.path and not Path(self.path).exists() and not is_repo_id(self.path):
            problems.append(f"model.path={self.path!r} does not exist (give a local folder or .gguf file, or a "
                            "Hugging Face Hub id ORG/NAME[@REVISION])")
        if self.remat_policy not in ("nothing", "dots", "dots_no_batch"):
            problems.append(f"model.remat_policy={self.remat_policy!r}; choose nothing, dots or dots_no_batch")
        if str(self.scan_layers).lower() not in ("auto", "true", "false"):
            problems.append(f"model.scan_layers={self.scan_layers!r}; choose auto (scan more than "
                            f"{SCAN_MIN_LAYERS} layers), true or false")
        return problems


@dataclasses.dataclass(frozen=True)
class DataSpec:
    train: str = "toy:arithmetic"
    eval: str = "toy:arithmetic"
    eval_fraction: float = 0.0
    weights: str = ""
    toy_size: int = 4000
    toy_eval_size: int = 200
    toy_style: str = "short"
    max_length: int = 64
    max_prompt_length: int = 0
    truncation: str = "keep_end"
    chat_template: str = ""
    on_invalid: str = "error"
    max_record_chars: int = 1_000_000
    template_timeout: float = 2.0
    packing: bool = False
    row_length: int = 0
    max_pairs_per_row: int = 8
    shared_prefix: bool = False
    bucket_step: int = 0
    shuffle: bool = True

    def tokenize_config(self) -> TokenizeConfig:
        return TokenizeConfig(max_length=self.max_length, max_prompt_length=self.max_prompt_length,
                              truncation=self.truncation, chat_template=self.chat_template or None,
                              max_record_chars=self.max_record_chars, template_timeout=self.template_timeout)

    def mixture_weights(self) -> tuple[float, ...] | None:
        return tuple(float(w) for w in self.weights.split(",")) if self.weights else None

    def problems(self, run: RunSpec, num_devices: int) -> list[str]:
        problems = []
        if self.on_invalid not in ("error", "skip"):
            problems.append(f"data.on_invalid={self.on_invalid!r}; choose 'error' or 'skip'")
        if self.max_record_chars < 1:
            problems.append(f"data.max_record_chars={self.max_record_chars} must be >= 1")
        if not self.template_timeout > 0:
            problems.append(f"data.template_timeout={self.template_timeout} must be > 0 seconds")
        if self.truncation not in TRUNCATIONS:
            problems.append(f"data.truncation={self.truncation!r}; choose one of {', '.join(TRUNCATIONS)}")
        if not 0 <= self.eval_fraction < 0.5:
            problems.append(f"data.eval_fraction={self.eval_fraction} must be in [0, 0.5) (0 = no held-out split)")
        if self.max_length < 2:
            problems.append(f"data.max_length={self.max_length} must be at least 2")
        if self.bucket_step < 0:
            problems.append(f"data.bucket_step={self.bucket_step} must be >= 0 (0 = powers of two)")
        if not any(self.train.split(",")):
            problems.append("data.train is empty: give one or more files (comma-separated) or toy:NAME")
        for field, value in (("data.train", self.train), ("data.eval", self.eval)):
            for source in filter(None, value.split(",")):
                if source.startswith("toy:") and source[4:] not in GENERATORS:
                    problems.append(f"{field}: data source {source} is unknown; choose one of "
                                    f"{', '.join(f'toy:{n}' for n in GENERATORS)}")
                elif not source.startswith(("toy:", "hf:")) and not Path(source).exists():
                    problems.append(f"{field}: {source}: data file not found")
        if self.weights:
            try:
                weights = self.mixture_weights()
            except ValueError:
                weights = None
            if weights is None or len(weights) != len(self.train.split(",")) or min(weights) < 0:
                problems.append(f"data.weights={self.weights!r} needs one non-negative number per data.train file")
        entry = run.objective.entry
        if entry is not None and self.packing and not entry.packing:
            *most, last = [n for n, o in OBJECTIVES.items() if o.packing]
            supported = f"{', '.join(most)} and {last}" if most else last
            problems.append(f"data.packing is supported for {supported}, not {run.objective.name} "
                            f"({entry.packing_note})")
        elif self.packing and getattr(run.objective.params, "samples_completions", False):
            problems.append("data.packing cannot serve objective.params.lmbda > 0 or seq_kd=True: the sampled "
                            "completions replace each row's own; set data.packing=False")
        elif entry is not None and self.shared_prefix and not (entry.packing and entry.data_kind == "preference"):
            pairs = [n for n, o in OBJECTIVES.items() if o.packing and o.data_kind == "preference"]
            problems.append(f"data.shared_prefix writes each preference pair's prompt once: it needs a pair "
                            f"objective ({', '.join(pairs)}), not {run.objective.name}")
        elif entry is not None and self.packing:
            rows = entry.rows_per_example
            needed = self.max_length * rows
            if self.row_length < needed:
                whole = f"a whole pair: {rows} x " if rows > 1 else ""
                problems.append(f"data.packing needs data.row_length >= {needed} ({whole}data.max_length)")
        return problems


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
    """The objective's name and its hyper-parameters (the registry's ``Params`` class, every field filled)."""

    name: str = "sft"
    params: Any = None

    @property
    def entry(self) -> Objective | None:
        return OBJECTIVES.get(self.name)

    @property
    def uses_reference(self) -> bool:
        entry = self.entry
        return bool(entry and entry.uses_reference and not getattr(self.params, "reference_free", False))

    @classmethod
    def read(cls, node) -> tuple[ObjectiveSpec, list[str]]:
        name = node.get("name", "sft")
        if name not in OBJECTIVES:
            return cls(name, None), [f"objective.name={name!r} is unknown; choose one of {', '.join(OBJECTIVES)}"]
        values = node.get("params", {})
        values = values.to_dict() if isinstance(values, ml_collections.ConfigDict) else dict(values)
        try:
            return cls(name, make_params(name, values)), []
        except (ValueError, TypeError) as err:
            return cls(name, None), [f"objective.params: {err}"]

    def problems(self, run: RunSpec, num_devices: int) -> list[str]:
        entry = self.entry
        if entry is not None and entry.uses_teacher and self.params is not None:
            teacher = self.params.teacher
            if not teacher:
                return [f"objective.params.teacher is empty: {self.name} needs a teacher model (a Hugging Face folder, "
                        ".gguf, Hub id or jaxalign run folder) with the student's tokenizer"]
            if not Path(teacher).exists() and not is_repo_id(teacher):
                return [f"objective.params.teacher={teacher!r} does not exist (give a local folder, .gguf, run "
                        "folder, or a Hugging Face Hub id ORG/NAME[@REVISION])"]
        if self.name == "kto" and getattr(self.params, "uses_kl", False) and \
                run.train.batch_size // max(run.train.grad_accum, 1) < 2:
            return [f"objective kto needs at least 2 examples per micro-batch (train.batch_size="
                    f"{run.train.batch_size}, train.grad_accum={run.train.grad_accum}): its KL reference point pairs "
                    "each prompt with another example's completion"]
        return []


@dataclasses.dataclass(frozen=True)
class ReferenceSpec:
    """The frozen reference of DPO and MPO: ``model`` (held once) or ``precomputed`` (cached log-probs)."""

    kind: str = "model"
    cache_dir: str = ""

    def problems(self, run: RunSpec, num_devices: int) -> list[str]:
        problems = []
        if run.objective.uses_reference and self.kind not in ("model", "precomputed"):
            problems.append(f"reference.kind={self.kind!r}: {run.objective.name} needs a reference; use 'model' or "
                            "'precomputed' (or objective.params.reference_free=True for DPO)")
        if run.objective.name == "kto" and self.kind == "precomputed":
            problems.append("reference.kind='precomputed' cannot serve KTO: its KL reference point pairs each prompt "
                            "with another example's completion, which changes with the batch order; use "
                            "reference.kind='model'")
        if run.objective.name == "grpo" and self.kind == "precomputed":
            problems.append("reference.kind='precomputed' cannot serve GRPO: its completions are sampled during "
                            "training; use reference.kind='model'")
        if self.cache_dir:
            try:
                path_inside(run.workdir, self.cache_dir, "reference.cache_dir")
            except ConfigError as err:
                problems.append(str(err))
        return problems


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: str = ",".join(LORA_TARGETS)

    def config(self) -> LoRAConfig | None:
        """The adapters' ``LoRAConfig``, or None when LoRA is off."""
        return LoRAConfig.from_config(dataclasses.asdict(self)) if self.enabled else None

    def problems(self, run: RunSpec, num_devices: int) -> list[str]:
        if not self.enabled:
            return []
        problems = []
        entry = run.objective.entry
        if entry is not None and entry.head == "reward":
            problems.append("lora.enabled with the reward objective: LoRA trains the adapters only, so the new score "
                            "head would stay at its random initialisation; train the reward model without LoRA")
        if not isinstance(self.rank, int) or self.rank < 1:
            problems.append(f"lora.rank={self.rank!r} must be an integer >= 1 (8 or 16 are common)")
        if not self.alpha > 0:
            problems.append(f"lora.alpha={self.alpha!r} must be > 0 (the update is scaled by alpha / rank)")
        if not 0 <= self.dropout < 1:
            problems.append(f"lora.dropout={self.dropout!r} must be in [0, 1)")
        targets = [t.strip() for t in self.target_modules.split(",") if t.strip()]
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets:
            what = f"unknown {', '.join(unknown)}" if unknown else "empty"
            problems.append(f"lora.target_modules={self.target_modules!r}: {what}; use a comma-separated subset of "
                            f"{','.join(LORA_TARGETS)}")
        return problems


@dataclasses.dataclass(frozen=True)
class OptimSpec:
    name: str = "adamw"
    lr: float = 3e-3
    schedule: str = "cosine"
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    rmsprop_decay: float = 0.9
    clip_norm: float = 1.0

    def problems(self, run: RunSpec, num_devices: int) -> list[str]:
        problems = []
        if self.name not in ("adamw", "rmsprop", "sgd"):
            problems.append(f"optim.name={self.name!r}; choose adamw, rmsprop or sgd")
        if self.schedule not in ("constant", "linear", "cosine"):
            problems.append(f"optim.schedule={self.schedule!r}; choose constant, linear or cosine")
        return problems


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    steps: int = 600
    batch_size: int = 32
    grad_accum: int = 1
    log_every: int = 25
    eval_every: int = 200
    save_every: int = 200
    keep_checkpoints: int = 2
    checkpoint_layout: str = "per_layer"
    nan_guard: bool = True
    nan_policy: str = "skip"
    max_skip_streak: int = 10
    max_skip_fraction: float = 0.1
    resume: bool = True

    def problems(self, run: RunSpec, num_devices: int) -> list[str]:
        problems = []
        if self.grad_accum < 1 or self.batch_size % self.grad_accum:
            problems.append(f"train.batch_size={self.batch_size} must be a multiple of "
                            f"train.grad_accum={self.grad_accum} (>= 1)")
        if self.steps < 1:
            problems.append(f"train.steps={self.steps} must be >= 1")
        if self.log_every < 1:
            problems.append(f"train.log_every={self.log_every} must be >= 1")
        if self.checkpoint_layout not in ("per_layer", "as_run"):
            problems.append(f"train.checkpoint_layout={self.checkpoint_layout!r}; choose 'per_layer' (a scanned "
                            "model's checkpoints hold one array per layer) or 'as_run' (its stacked arrays)")
        if self.nan_policy not in ("skip", "halt"):
            problems.append(f"train.nan_policy={self.nan_policy!r}; choose 'skip' (count and go on) or 'halt'")
        if self.nan_policy == "halt" and not self.nan_guard:
            problems.append("train.nan_policy='halt' needs train.nan_guard=True (the guard detects the bad update)")
        params = run.objective.params
        if run.objective.name == "grpo" and params is not None:
            rows = params.prompts_per_step * params.num_generations // params.steps_per_generation
            if self.batch_size != rows:
                problems.append(f"train.batch_size={self.batch_size}: a GRPO step trains on prompts_per_step x "
                                f"num_generations / steps_per_generation = {rows} completions; set "
                                f"train.batch_size={rows}")
            if run.lora.enabled and not run.model.path:
                problems.append("GRPO with LoRA needs a base model: set model.path (e.g. an exported SFT run); the "
                                "SFT start (objective.params.sft_steps) trains a full model")
            if run.lora.enabled and params.rollout_weights == "int8":
                problems.append("objective.params.rollout_weights='int8' decodes merged weights; with LoRA adapters "
                                "use 'bfloat16' or 'model'")
        if self.max_skip_streak < 0:
            problems.append(f"train.max_skip_streak={self.max_skip_streak} must be >= 0 (0 = no limit)")
        if not 0 <= self.max_skip_fraction <= 1:
            problems.append(f"train.max_skip_fraction={self.max_skip_fraction} must be in [0, 1] (0 = no limit)")
        return problems


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Axis sizes (``-1`` = fill the remaining devices) and ``rules``: the logical-axis -> mesh-axis table
    (``"batch=data+fsdp,embed=fsdp,head_dim=,..."``; ``jaxalign.parallel.mesh.DEFAULT_RULES`` by default)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    rules: str = ""

    @property
    def shape(self) -> dict[str, int]:
        """The axes and their sizes; ``expert`` only when it is not 1 (a dense run's mesh keeps three axes)."""
        return {axis: int(getattr(self, axis)) for axis in MESH_AXES if axis != "expert" or self.expert != 1}

    @property
    def rules_table(self) -> Rules:
        return parse_rules(self.rules)

    def data_parallel(self, num_devices: int) -> int:
        fixed = math.prod(s for s in self.shape.values() if s != -1)
        size = lambda axis: num_devices // fixed if getattr(self, axis) == -1 else getattr(self, axis)
        return size("data") * size("fsdp") * size("expert")

    def problems(self, run: RunSpec, num_devices: int) -> list[str]:
        mesh = self.shape
        sizes = list(mesh.values())
        problems = []
        try:
            parse_rules(self.rules)
        except ValueError as err:
            problems.append(f"mesh.rules={self.rules!r}: {err}")
        if sum(s == -1 for s in sizes) > 1 or any(s == 0 or s < -1 for s in sizes):
            return [*problems, f"mesh={mesh}: sizes must be positive, with at most one -1 (fill)"]
        fixed = math.prod(s for s in sizes if s != -1)
        if num_devices % fixed or (-1 not in sizes and fixed != num_devices):
            return [*problems, f"mesh={mesh} needs {fixed} devices but {num_devices} are available; set one axis "
                               "to -1"]
        train = run.train
        rows = train.batch_size // max(train.grad_accum, 1)
        if rows % self.data_parallel(num_devices):
            problems.append(f"train.batch_size / train.grad_accum = {rows} rows per micro-batch is not divisible "
                            f"by the {self.data_parallel(num_devices)} data-parallel shards (mesh data x fsdp x "
                            "expert); "
                            "change train.batch_size or the mesh")
        if run.objective.name == "grpo" and getattr(run.objective.params, "shared_prefix", None) is True:
            problems.extend(whole_group_problems(run, num_devices))
        return problems


def whole_group_problems(run: RunSpec, num_devices: int, processes: int = 1) -> list[str]:
    """Why GRPO's ``objective.params.shared_prefix`` (one row per group) cannot run in this layout: every
    micro-batch, data-parallel shard, optimizer step and process must hold whole groups. Empty when it can."""
    params, train = run.objective.params, run.train
    g, rows = params.num_generations, train.batch_size // max(train.grad_accum, 1)
    shards = run.mesh.data_parallel(num_devices)
    problems = []
    if params.prompts_per_step % params.steps_per_generation:
        problems.append(f"prompts_per_step={params.prompts_per_step} must be a multiple of "
                        f"steps_per_generation={params.steps_per_generation}")
    if rows % g or (rows // g) % shards:
        problems.append(f"objective.params.shared_prefix trains one row per group: the {rows} completions of a "
                        f"micro-batch make {rows / g:g} groups of num_generations={g}, which must be a whole number "
                        f"divisible by the {shards} data-parallel shards; change train.grad_accum or the mesh")
    step_groups = params.prompts_per_step // params.steps_per_generation
    if processes > 1 and step_groups % processes:
        problems.append(f"objective.params.shared_prefix trains whole groups: the {step_groups} groups per "
                        f"optimizer step do not split over {processes} processes")
    return problems


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    """Several processes (TPU pod hosts, SLURM tasks): see ``jaxalign.parallel.distributed``."""

    mode: str = "auto"
    coordinator_address: str = ""
    num_processes: int = 0
    process_id: int = -1
    local_device_ids: str = ""
    initialization_timeout: int = 300

    def get(self, name: str, default=None):  # read like a ConfigDict by ``distributed.initialize``
        return getattr(self, name, default)

    def problems(self, run: RunSpec, num_devices: int) -> list[str]:
        problems = []
        if self.mode not in ("auto", "on", "off"):
            problems.append(f"distributed.mode={self.mode!r}; choose auto, on or off")
        if self.coordinator_address and ":" not in self.coordinator_address:
            problems.append(f"distributed.coordinator_address={self.coordinator_address!r} needs HOST:PORT")
        if self.num_processes < 0 or (self.num_processes and not -1 <= self.process_id < self.num_processes):
            problems.append(f"distributed.process_id={self.process_id} must be in [0, distributed.num_processes="
                            f"{self.num_processes})")
        return problems


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    batches: int = 4
    generate: int = 200
    max_new_tokens: int = 8

    def problems(self, run: RunSpec, num_devices: int) -> list[str]:
        return []


@dataclasses.dataclass(frozen=True)
class LoggingSpec:
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "jaxalign"
    plot: bool = True
    progress: bool = True

    def problems(self, run: RunSpec, num_devices: int) -> list[str]:
        return []


SECTIONS = {"data": DataSpec, "reference": ReferenceSpec, "lora": LoRASpec, "optim": OptimSpec,
            "train": TrainSpec, "mesh": MeshSpec, "distributed": DistributedSpec, "eval": EvalSpec,
            "logging": LoggingSpec}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    seed: int
    workdir: str
    model: ModelSpec
    data: DataSpec
    objective: ObjectiveSpec
    reference: ReferenceSpec
    lora: LoRASpec
    optim: OptimSpec
    train: TrainSpec
    mesh: MeshSpec
    distributed: DistributedSpec
    eval: EvalSpec
    logging: LoggingSpec

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict, *, num_devices: int | None = None,
                    check: bool = True) -> RunSpec:
        """Reads ``config`` (extra top-level sections such as ``cpi`` are left to their owners); with ``check``,
        raises one ``ConfigError`` listing every problem."""
        problems: list[str] = []
        sections: dict[str, Any] = {}
        for name, section_cls in SECTIONS.items():
            try:
                sections[name] = _read(section_cls, config.get(name), name)
            except (ConfigError, TypeError) as err:
                problems.append(str(err))
                sections[name] = section_cls()
        model = config.get("model", ml_collections.ConfigDict())
        model_values = {**(model.to_dict() if model else {}), "tokenizer": config.get("tokenizer", "")}
        try:
            sections["model"] = _read(ModelSpec, model_values, "model")
        except (ConfigError, TypeError) as err:
            problems.append(str(err))
            sections["model"] = ModelSpec(tokenizer=model_values["tokenizer"])
        sections["objective"], objective_problems = ObjectiveSpec.read(config.get("objective", {}))
        problems += objective_problems
        spec = cls(seed=int(config.get("seed", 0)), workdir=str(config.get("workdir", "runs/default")), **sections)
        if check:
            num_devices = jax.device_count() if num_devices is None else num_devices
            for name in ("objective", "model", *SECTIONS):
                problems += getattr(spec, name).problems(spec, num_devices)
            if problems:
                raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
        return spec


def validate(config: ml_collections.ConfigDict, *, num_devices: int | None = None) -> RunSpec:
    """Checks the whole config; raises ``ConfigError`` naming every wrong field and its fix. Returns the spec."""
    return RunSpec.from_config(config, num_devices=num_devices)


def effective_config(config: ml_collections.ConfigDict, spec: RunSpec) -> dict:
    """``config`` as a plain dict with every effective value: the objective's hyper-parameters with their
    defaults and the mesh's rules table written out."""
    values = config.to_dict()
    values["objective"]["params"] = dataclasses.asdict(spec.objective.params)
    values["mesh"]["rules"] = format_rules(spec.mesh.rules_table)
    return values
