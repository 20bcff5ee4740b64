"""Hugging Face Hub names through the local Hugging Face cache (``huggingface_hub``).

``Org/Name[@revision]`` names a model repository; ``hf:Org/Name[@revision][:split]`` a dataset repository's data
files for one split (default ``train``). ``snapshot_download`` fetches what is missing when online and reads the
cache alone under ``HF_HUB_OFFLINE=1``. Only configs, safetensors, tokenizer files and data files are fetched:
never pickled weights, and nothing from a repository is ever run (no remote code).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


class HubError(FileNotFoundError):
    """A Hub name that cannot be resolved (not cached while offline, unknown repository or revision)."""


def is_repo_id(name: str | os.PathLike) -> bool:
    """True for ``Org/Name[@revision]`` that is not a local path."""
    return not Path(name).exists() and bool(REPO_ID.match(str(name)))


def _snapshot(name: str, repo_type: str, patterns: list[str]) -> Path:
    from huggingface_hub import constants, snapshot_download

    repo, _, revision = name.partition("@")
    try:
        return Path(snapshot_download(repo, revision=revision or None, repo_type=repo_type, allow_patterns=patterns,
                                      cache_dir=os.environ.get("HF_HUB_CACHE") or None))
    except Exception as err:  # offline cache misses, unknown repos or revisions, network failures
        where = "the Hugging Face cache (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else "the Hub"
        cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
        reason = str(err).splitlines()[0][:200] if str(err) else ""
        raise HubError(f"{name}: not a local path, and the {repo_type} could not be found in {where} "
                       f"({type(err).__name__}: {reason}); cache: {cache}") from None


def resolve_model(path: str | os.PathLike) -> Path:
    """A local model path as it is; a repository id as its cached snapshot folder."""
    return _snapshot(str(path), "model", MODEL_FILES) if is_repo_id(path) else Path(path)


def resolve_dataset(source: str) -> list[Path]:
    """The data files of ``hf:Org/Name[@revision][:split]`` (Parquet, JSONL or JSON files whose path names the
    split, in order)."""
    name, _, split = source.removeprefix("hf:").partition(":")
    split = split or "train"
    if not REPO_ID.match(name):
        raise HubError(f"{source}: expected hf:ORG/NAME[@REVISION][:SPLIT]")
    folder = _snapshot(name, "dataset", [f"*{suffix}" for suffix in DATA_SUFFIXES])
    pattern = re.compile(rf"(^|[/_.-]){re.escape(split)}([/_.-]|$)")
    files = sorted(p for p in folder.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file()
                   and pattern.search(str(p.relative_to(folder))))
    if not files:
        found = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.suffix in DATA_SUFFIXES)
        raise HubError(f"{source}: no {split!r} data file in {folder} (data files: {', '.join(found) or 'none'})")
    return files
