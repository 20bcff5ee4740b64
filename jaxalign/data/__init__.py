"""Data: record schemas and validation, chat-template tokenisation with assistant masks, padding and packing,
a checkpointable batch pipeline, SATER data conventions, and toy generators (``jaxalign.data.toy``)."""

from jaxalign.data.batching import default_buckets, pack_rows, packed_batch, pad_batch
from jaxalign.data.dataset import DataError, DataReport, load_examples, load_sources
from jaxalign.data.pipeline import DataPipeline, PipelineConfig
from jaxalign.data.schema import RecordError, detect_kind, validate_record
from jaxalign.data.sources import read_records
from jaxalign.data.tokenize import TokenizeConfig, Tokenizer, chat_segments, tokenize_record

__all__ = [
    "DataError",
    "DataPipeline",
    "DataReport",
    "PipelineConfig",
    "RecordError",
    "TokenizeConfig",
    "Tokenizer",
    "chat_segments",
    "default_buckets",
    "detect_kind",
    "load_examples",
    "load_sources",
    "pack_rows",
    "packed_batch",
    "pad_batch",
    "read_records",
    "tokenize_record",
    "validate_record",
]
