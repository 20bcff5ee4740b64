"""Loading a config file and applying ``--config.a.b=value`` overrides; validation is the run spec's
(``jaxalign.train.spec``).

``--config`` takes a file path or the name of a bundled config (``jaxalign/configs/NAME.py``), optionally
followed by ``:ARG`` for its ``get_config(arg)`` (model presets: ``dpo:smollm2``), or a run folder's
``config.json``: every effective value of that run, so the file alone reruns it.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import ml_collections

from jaxalign.train.spec import ConfigError, path_inside, validate

__all__ = ["CONFIG_DIR", "ConfigError", "apply_override", "load_config", "path_inside", "validate"]

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def _overlay(config: ml_collections.ConfigDict, values: Mapping, where: str = "") -> None:
    """Sets ``values`` (a nested dict read from JSON) over ``config``; sections the base does not have (``cpi``)
    and ``objective.params`` entries are added."""
    for key, value in values.items():
        field = f"{where}{key}"
        if isinstance(value, Mapping) and isinstance(config.get(key), ml_collections.ConfigDict):
            _overlay(config[key], value, f"{field}.")
        elif key in config and not (isinstance(config[key], ml_collections.ConfigDict) or isinstance(value, Mapping)):
            config[key] = type(config[key])(value) if isinstance(config[key], float) and isinstance(value, int) \
                else value
        elif key not in config and (where == "objective.params." or not where):
            with config.unlocked():
                config[key] = ml_collections.ConfigDict(value) if isinstance(value, Mapping) else value
        else:
            raise ConfigError(f"{field}: the config has no such field (or it is a section, not a value)")


def load_json_config(path: Path) -> ml_collections.ConfigDict:
    """A run folder's ``config.json`` over the base config's defaults."""
    from jaxalign.configs import base

    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a JSON object of config sections")
    config = base.get_config()
    _overlay(config, values)
    return config


def load_config(spec: str = "default", overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """``spec`` = ``PATH_OR_NAME[:ARG]``; ``overrides`` = ``["--config.optim.lr=1e-5", ...]`` (or without
    the leading ``--config.``)."""
    location, _, arg = spec.partition(":")
    path = Path(location)
    if path.suffix == ".json":
        if not path.exists():
            raise ConfigError(f"config {location!r} not found")
        config = load_json_config(path)
        for override in overrides:
            apply_override(config, override)
        return config
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
    from jaxalign.configs.presets import follow_user_data, for_pretrained

    user_fields = {_field_of(o) for o in overrides}
    for note in [*for_pretrained(config, user_fields), *follow_user_data(config, user_fields)]:
        print(note, flush=True)
    return config


def _field_of(override: str) -> str:
    return override.removeprefix("--").removeprefix("config.").split("=", 1)[0]


TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _expected(current, text: str) -> str:
    example = {int: " (e.g. 600)", float: " (e.g. 1e-5)"}.get(type(current), "")
    return f"expected {TYPE_NAMES.get(type(current), type(current).__name__)}{example}, got {text!r}"


def _parse_value(text: str, current):
    """``text`` as the type of the field's current value (strings stay strings)."""
    if isinstance(current, str):
        return text
    if isinstance(current, bool):
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ValueError(_expected(current, text))
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if current is None:
            return text
        raise ValueError(_expected(current, text)) from None
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if current is not None and not isinstance(value, type(current)):
        raise ValueError(_expected(current, text))
    return value


def did_you_mean(name: str, choices) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or ""."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def apply_override(config: ml_collections.ConfigDict, override: str) -> None:
    """Sets one ``[--config.]a.b.c=value``; new keys are allowed only inside ``objective.params``."""
    text = override.removeprefix("--").removeprefix("config.")
    if "=" not in text:
        raise ConfigError(f"override {override!r}: expected --config.FIELD=VALUE")
    key, value = text.split("=", 1)
    *parents, leaf = key.split(".")
    node = config
    for i, part in enumerate(parents):
        if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
            sections = [k for k, v in node.items() if isinstance(v, ml_collections.ConfigDict)]
            raise ConfigError(f"override {override!r}: no section {'.'.join(parents[: i + 1])!r} in the config"
                              f"{did_you_mean(part, sections)}")
        node = node[part]
    is_params = parents == ["objective", "params"]
    if leaf not in node and not is_params:
        siblings = ", ".join(sorted(node.keys()))
        raise ConfigError(f"override {override!r}: no field {key!r}{did_you_mean(leaf, node.keys())} (fields "
                          f"here: {siblings}; `jaxalign config show` lists them all)")
    try:
        parsed = _parse_value(value, node.get(leaf))
    except ValueError as err:
        raise ConfigError(f"override {override!r}: {err}") from None
    if is_params and leaf not in node:
        with node.unlocked():
            node[leaf] = parsed
    else:
        node[leaf] = parsed
