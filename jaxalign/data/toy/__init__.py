"""Toy data generators and the toy tokenizer (offline, deterministic)."""

from jaxalign.data.toy.generators import (
    GENERATORS,
    answer_text,
    arithmetic,
    arithmetic_preferences,
    encipher,
    mpo_records,
    multitask,
    write_jsonl,
)
from jaxalign.data.toy.tokenizer import toy_tokenizer

__all__ = [
    "GENERATORS",
    "answer_text",
    "arithmetic",
    "arithmetic_preferences",
    "encipher",
    "mpo_records",
    "multitask",
    "toy_tokenizer",
    "write_jsonl",
]
