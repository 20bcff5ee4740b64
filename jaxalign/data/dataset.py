"""Loading, validating and tokenising whole data files up front, with precise errors or a skipped count."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from jaxalign.data import sater
from jaxalign.data.schema import RecordError, detect_kind, validate_record
from jaxalign.data.sources import read_records
from jaxalign.data.tokenize import Tokenizer, tokenize_record

ON_INVALID = ("error", "skip")


class DataError(ValueError):
    """Invalid records were found with ``on_invalid="error"``; the message lists them."""


@dataclasses.dataclass
class DataReport:
    """What loading found: record counts, and the error message of every skipped record."""

    source: str
    total: int = 0
    valid: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)
    degenerate: int = 0  # SATER stage-I questions without a usable pair
    held_out: int = 0  # records set aside for evaluation (``exclude``)

    @property
    def skipped(self) -> int:
        return len(self.errors)

    def summary(self) -> str:
        text = f"{self.source}: {self.valid} of {self.total} records usable"
        if self.errors:
            text += f", {self.skipped} invalid skipped"
        if self.held_out:
            text += f", {self.held_out} held out for evaluation"
        if self.degenerate:
            text += f", {self.degenerate} SATER questions without a correct and an incorrect sample"
        return text


def _as_kind(record: dict[str, Any], kind: str, tok: Tokenizer) -> dict[str, Any] | None:
    """Converts SATER records to the kind the objective trains on (None: no usable pair)."""
    if record["kind"] != "sater":
        return record
    if record["stage"] == 1 and kind == "preference":
        return sater.stage1_pair(record, lambda text: len(tok.encode(text)))
    if record["stage"] == 2 and kind == "sft":
        return sater.stage2_example(record)
    raise ValueError(f"SATER stage-{record['stage']} records cannot train a {kind} objective")


def unpair(example: dict[str, Any]) -> list[dict[str, Any]]:
    """A tokenised preference pair as two unpaired (KTO) examples: chosen with label 1, rejected with label 0
    (TRL's ``unpair_preference_dataset``)."""
    return [{"tokens": example[f"{side}_tokens"], "loss_mask": example[f"{side}_loss_mask"], "label": np.int8(label)}
            for side, label in (("chosen", 1), ("rejected", 0))]


def _requested_kind(raw: Any, kind: str) -> str | None:
    """The kind to validate a raw record as: SFT objectives also take plain ``text`` (all tokens trained),
    preference files (``chosen`` as the completion) and SATER stage-II records."""
    detected = detect_kind(raw) if isinstance(raw, dict) else "unknown"
    if kind == "sft" and detected in ("lm", "sater"):
        return detected
    if kind == "preference" and detected == "sater":
        return "sater"
    return kind


def count_chars(value: Any, limit: int) -> int:
    """Characters in the strings (keys too) of a parsed record, counted until they pass ``limit``."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple)):
            stack += item
    return total


def load_examples(path: str | os.PathLike, tok: Tokenizer, *, kind: str, on_invalid: str = "error",
                  max_listed: int = 20, exclude: Collection[int] = ()) -> tuple[list[dict], DataReport]:
    """Validates and tokenises every record of ``path`` for an objective needing ``kind`` examples, except the
    record indices in ``exclude`` (held out for evaluation; errors still name the record's index in ``path``).

    ``on_invalid="error"`` reads the whole file, then raises ``DataError`` listing the first ``max_listed``
    problems (file, record index, field) and their total; ``"skip"`` drops them and counts them in the report.
    """
    if on_invalid not in ON_INVALID:
        raise ValueError(f"on_invalid={on_invalid!r}; expected one of {ON_INVALID}")
    source = str(path)
    report = DataReport(source)
    examples = []
    limit = tok.config.max_record_chars
    for index, raw in read_records(path, max_record_chars=limit):
        report.total += 1
        if index in exclude:
            report.held_out += 1
            continue
        try:
            if isinstance(raw, RecordError):
                raise raw
            if (chars := count_chars(raw, limit)) > limit:
                raise RecordError(source, index, "<record>", f"at least {chars} characters, over "
                                  f"data.max_record_chars={limit}")
            record = validate_record(raw, source=source, index=index, kind=_requested_kind(raw, kind))
            record = _as_kind(record, kind, tok)
            if record is None:
                report.degenerate += 1
                continue
            example = tokenize_record(tok, record, source=source, index=index)
            examples.extend(unpair(example) if kind == "unpaired" and record["kind"] == "preference" else [example])
            report.valid += 1
        except RecordError as err:
            report.errors.append(str(err))
        except ValueError as err:
            report.errors.append(str(RecordError(source, index, "<record>", str(err))))
    listed = "\n  ".join(report.errors[:max_listed])
    if report.skipped > max_listed:
        listed += f"\n  ... and {report.skipped - max_listed} more"
    if report.errors and on_invalid == "error":
        raise DataError(f"{report.skipped} invalid record(s) in {source} (set data.on_invalid='skip' to drop "
                        f"them):\n  {listed}")
    if not examples:
        raise DataError(f"{source}: no usable records ({report.summary()})" + (f":\n  {listed}" if listed else ""))
    return examples, report


def load_sources(paths: Sequence[str | os.PathLike], tok: Tokenizer, *, kind: str, on_invalid: str = "error",
                 exclude: Sequence[Collection[int]] | None = None) -> tuple[list[list[dict]], list[DataReport]]:
    """``load_examples`` for several files (``exclude``: held-out indices per file): one example list and one
    report per file."""
    exclude = exclude or [()] * len(paths)
    loaded = [load_examples(path, tok, kind=kind, on_invalid=on_invalid, exclude=skip)
              for path, skip in zip(paths, exclude, strict=True)]
    return [examples for examples, _ in loaded], [report for _, report in loaded]
