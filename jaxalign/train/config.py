"""Loading a config file, applying ``--config.a.b=value`` overrides, and validating the whole config once.

``--config`` takes a file path or the name of a bundled config (``jaxalign/configs/NAME.py``), optionally
followed by ``:ARG`` for its ``get_config(arg)`` (model presets: ``dpo:smollm2``).
"""

from __future__ import annotations

import ast
import importlib.util
import math
from collections.abc import Sequence
from pathlib import Path

import jax
import ml_collections

from jaxalign.data.dataset import OBJECTIVE_KINDS
from jaxalign.models.lora import TARGETS as LORA_TARGETS
from jaxalign.objectives import OBJECTIVES, make_params

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and the fix."""


def load_config(spec: str = "default", overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """``spec`` = ``PATH_OR_NAME[:ARG]``; ``overrides`` = ``["--config.optim.lr=1e-5", ...]`` (or without
    the leading ``--config.``)."""
    location, _, arg = spec.partition(":")
    path = Path(location)
    if not path.suffix:
        path = CONFIG_DIR / f"{location}.py"
    if not path.exists():
        bundled = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem not in ("__init__", "base", "presets"))
        raise ConfigError(f"config {location!r} not found (a .py file, or one of: {', '.join(bundled)})")
    module_spec = importlib.util.spec_from_file_location(f"jaxalign_config_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{path} has no get_config() function")
    config = module.get_config(arg or None)
    for override in overrides:
        apply_override(config, override)
    return config


def _parse_value(text: str, current):
    """``text`` as the type of the field's current value (strings stay strings)."""
    if isinstance(current, str):
        return text
    if isinstance(current, bool):
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"expected true or false, got {text!r}")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if current is None:
            return text
        raise ValueError(f"expected a {type(current).__name__}, got {text!r}") from None
    if isinstance(current, float) and isinstance(value, int):
        return float(value)
    if current is not None and not isinstance(value, type(current)):
        raise ValueError(f"expected a {type(current).__name__}, got {text!r}")
    return value


def apply_override(config: ml_collections.ConfigDict, override: str) -> None:
    """Sets one ``[--config.]a.b.c=value``; new keys are allowed only inside ``objective.params``."""
    text = override.removeprefix("--").removeprefix("config.")
    if "=" not in text:
        raise ConfigError(f"override {override!r}: expected --config.FIELD=VALUE")
    key, value = text.split("=", 1)
    *parents, leaf = key.split(".")
    node = config
    for i, part in enumerate(parents):
        if part not in node:
            raise ConfigError(f"override {override!r}: no field {'.'.join(parents[: i + 1])!r} in the config")
        node = node[part]
    is_params = parents == ["objective", "params"]
    if leaf not in node and not is_params:
        siblings = ", ".join(sorted(node.keys()))
        raise ConfigError(f"override {override!r}: no field {key!r} (fields here: {siblings})")
    try:
        parsed = _parse_value(value, node.get(leaf))
    except ValueError as err:
        raise ConfigError(f"override {override!r}: {err}") from None
    if is_params and leaf not in node:
        with node.unlocked():
            node[leaf] = parsed
    else:
        node[leaf] = parsed


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


def _lora_problems(lora) -> list[str]:
    problems = []
    if not isinstance(lora.rank, int) or lora.rank < 1:
        problems.append(f"lora.rank={lora.rank!r} must be an integer >= 1 (8 or 16 are common)")
    if not lora.alpha > 0:
        problems.append(f"lora.alpha={lora.alpha!r} must be > 0 (the update is scaled by alpha / rank)")
    if not 0 <= lora.dropout < 1:
        problems.append(f"lora.dropout={lora.dropout!r} must be in [0, 1)")
    targets = [t.strip() for t in lora.target_modules.split(",") if t.strip()]
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        what = f"unknown {', '.join(unknown)}" if unknown else "empty"
        problems.append(f"lora.target_modules={lora.target_modules!r}: {what}; use a comma-separated subset of "
                        f"{','.join(LORA_TARGETS)}")
    return problems


def validate(config: ml_collections.ConfigDict, *, num_devices: int | None = None) -> None:
    """Checks the whole config; raises ``ConfigError`` naming the field and the fix."""
    num_devices = jax.device_count() if num_devices is None else num_devices
    problems: list[str] = []
    name = config.objective.name
    if name not in OBJECTIVES:
        problems.append(f"objective.name={name!r} is unknown; choose one of {', '.join(OBJECTIVES)}")
    else:
        try:
            make_params(name, config.objective.params.to_dict())
        except ValueError as err:
            problems.append(f"objective.params: {err}")
        if OBJECTIVES[name].uses_reference and config.reference.kind not in ("model", "precomputed"):
            problems.append(f"reference.kind={config.reference.kind!r}: {name} needs a reference; use 'model' or "
                            "'precomputed' (or objective.params.reference_free=True for DPO)")
    mesh = dict(config.mesh)
    sizes = list(mesh.values())
    if sum(s == -1 for s in sizes) > 1 or any(s == 0 or s < -1 for s in sizes):
        problems.append(f"mesh={mesh}: sizes must be positive, with at most one -1 (fill)")
    else:
        fixed = math.prod(s for s in sizes if s != -1)
        if num_devices % fixed or (-1 not in sizes and fixed != num_devices):
            problems.append(f"mesh={mesh} needs {fixed} devices but {num_devices} are available; set one axis to -1")
        else:
            data_parallel = (num_devices // fixed if mesh.get("data") == -1 else mesh.get("data", 1)) * (
                num_devices // fixed if mesh.get("fsdp") == -1 else mesh.get("fsdp", 1))
            rows = config.train.batch_size // max(config.train.grad_accum, 1)
            if rows % data_parallel:
                problems.append(f"train.batch_size / train.grad_accum = {rows} rows per micro-batch is not divisible "
                                f"by the {data_parallel} data-parallel shards (mesh data x fsdp); change "
                                "train.batch_size or the mesh")
    if config.train.grad_accum < 1 or config.train.batch_size % config.train.grad_accum:
        problems.append(f"train.batch_size={config.train.batch_size} must be a multiple of "
                        f"train.grad_accum={config.train.grad_accum} (>= 1)")
    if config.train.steps < 1:
        problems.append(f"train.steps={config.train.steps} must be >= 1")
    if config.train.get("nan_policy", "skip") not in ("skip", "halt"):
        problems.append(f"train.nan_policy={config.train.nan_policy!r}; choose 'skip' (count and go on) or 'halt'")
    if config.train.get("nan_policy") == "halt" and not config.train.nan_guard:
        problems.append("train.nan_policy='halt' needs train.nan_guard=True (the guard detects the bad update)")
    if config.optim.name not in ("adamw", "rmsprop", "sgd"):
        problems.append(f"optim.name={config.optim.name!r}; choose adamw, rmsprop or sgd")
    if config.optim.schedule not in ("constant", "linear", "cosine"):
        problems.append(f"optim.schedule={config.optim.schedule!r}; choose constant, linear or cosine")
    if config.data.on_invalid not in ("error", "skip"):
        problems.append(f"data.on_invalid={config.data.on_invalid!r}; choose 'error' or 'skip'")
    kind = OBJECTIVE_KINDS.get(name)
    if config.data.packing and kind == "mpo":
        problems.append("data.packing is supported for sft, ift, dpo, simpo and orpo, not mpo (its preservation term "
                        "pools hidden states per sequence)")
    elif config.data.packing:
        needed = config.data.max_length * (2 if kind == "preference" else 1)
        if config.data.row_length < needed:
            problems.append(f"data.packing needs data.row_length >= {needed} ("
                            f"{'a whole pair: 2 x ' if kind == 'preference' else ''}data.max_length)")
    if config.reference.cache_dir:
        try:
            path_inside(config.workdir, config.reference.cache_dir, "reference.cache_dir")
        except ConfigError as err:
            problems.append(str(err))
    dist = config.get("distributed")
    if dist is not None:
        if dist.mode not in ("auto", "on", "off"):
            problems.append(f"distributed.mode={dist.mode!r}; choose auto, on or off")
        if dist.coordinator_address and ":" not in dist.coordinator_address:
            problems.append(f"distributed.coordinator_address={dist.coordinator_address!r} needs HOST:PORT")
        if dist.num_processes < 0 or (dist.num_processes and not -1 <= dist.process_id < dist.num_processes):
            problems.append(f"distributed.process_id={dist.process_id} must be in [0, distributed.num_processes="
                            f"{dist.num_processes})")
    if config.lora.enabled:
        problems += _lora_problems(config.lora)
    if not config.model.path and config.model.preset != "tiny":
        problems.append("model.path is empty: set it to a Hugging Face folder or .gguf file")
    if not config.model.path and not config.tokenizer:
        problems.append("a randomly initialised model needs tokenizer='toy' or a tokenizer folder")
    if config.model.path and not Path(config.model.path).exists():
        problems.append(f"model.path={config.model.path!r} does not exist")
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
