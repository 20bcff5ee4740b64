"""Toy data generators and the toy tokenizer (offline, deterministic)."""

from jaxalign.data.toy.generators import (
    GENERATORS,
    POOLS,
    answer_text,
    arithmetic,
    arithmetic_pool,
    arithmetic_preferences,
    encipher,
    mpo_record,
    mpo_records,
    multitask,
    pool_of,
    write_jsonl,
)
from jaxalign.data.toy.tokenizer import toy_tokenizer

__all__ = [
    "GENERATORS",
    "POOLS",
    "answer_text",
    "arithmetic",
    "arithmetic_pool",
    "arithmetic_preferences",
    "encipher",
    "mpo_record",
    "mpo_records",
    "multitask",
    "pool_of",
    "toy_tokenizer",
    "write_jsonl",
]
