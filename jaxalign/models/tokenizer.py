"""Tokenizers from local folders only (never a hub): ``transformers.AutoTokenizer`` on a directory.

Chat templates are rendered by transformers inside Jinja's ``ImmutableSandboxedEnvironment``.
"""

from __future__ import annotations

import os
from pathlib import Path


def load_tokenizer(path: str | os.PathLike):
    """``AutoTokenizer.from_pretrained`` on a local folder, offline, without remote code."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{path}: tokenizer folder not found (jaxalign loads tokenizers from local "
                                "folders only, never from a hub)")
    if not any((folder / name).exists() for name in ("tokenizer.json", "vocab.json", "tokenizer.model")):
        raise FileNotFoundError(f"{path}: no tokenizer.json, vocab.json or tokenizer.model in this folder")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
