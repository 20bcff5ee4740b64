"""Reading records from local files: JSONL, JSON (a list, or ``{"data": [...]}``), Parquet, and folders
written by ``datasets.Dataset.save_to_disk``. Never a hub."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxalign.data.schema import RecordError

SUFFIXES = (".jsonl", ".json", ".parquet")


def read_records(path: str | os.PathLike, *, max_record_chars: int | None = None) -> Iterator[tuple[int, Any]]:
    """Yields ``(index, record)``. A JSONL line that cannot be decoded or parsed is yielded as a ``RecordError``
    in place of the record (so the caller can skip it); a whole file that cannot be read raises. Indices count
    records from 0 (JSONL: non-empty lines). With ``max_record_chars``, a JSONL line over 4 bytes per allowed
    character is an error without being decoded or held whole (the caller checks the parsed record's characters)."""
    location = Path(path)
    if not location.exists():
        raise FileNotFoundError(f"{path}: data file not found")
    if location.is_dir():
        yield from _read_saved_dataset(location)
    elif location.suffix == ".jsonl":
        yield from _read_jsonl(location, None if max_record_chars is None else 4 * max_record_chars + 4096)
    elif location.suffix == ".json":
        yield from _read_json(location)
    elif location.suffix == ".parquet":
        yield from _read_parquet(location)
    else:
        raise ValueError(f"{path}: unsupported data file type {location.suffix!r} (expected {', '.join(SUFFIXES)} "
                         "or a saved datasets folder)")


def _lines(handle, max_bytes: int | None) -> Iterator[tuple[bytes, int]]:
    """(line, length in bytes); a line longer than ``max_bytes`` comes back empty-handed (``b""``) with its length,
    read past in 1 MiB pieces so it is never held whole."""
    while True:
        line = handle.readline() if max_bytes is None else handle.readline(max_bytes + 1)
        if not line:
            return
        if max_bytes is None or len(line) <= max_bytes or line.endswith(b"\n"):
            yield line, len(line)
            continue
        length = len(line)
        while not line.endswith(b"\n"):
            line = handle.readline(2**20)
            if not line:
                break
            length += len(line)
        yield b"", length


def _read_jsonl(path: Path, max_bytes: int | None = None) -> Iterator[tuple[int, Any]]:
    index = 0
    with path.open("rb") as handle:
        for line_no, (raw, length) in enumerate(_lines(handle, max_bytes), 1):
            if max_bytes is not None and length > max_bytes:
                yield index, RecordError(str(path), index, "<record>", f"line {line_no} has {length} bytes, over "
                                         f"data.max_record_chars={(max_bytes - 4096) // 4} characters")
                index += 1
                continue
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                record = RecordError(str(path), index, "<record>", f"line {line_no} is not valid UTF-8 ({err.reason} "
                                                                   f"at byte {err.start})")
            except json.JSONDecodeError as err:
                record = RecordError(str(path), index, "<record>", f"line {line_no} is not valid JSON ({err.msg}, "
                                                                   f"column {err.colno})")
            yield index, record
            index += 1


def _read_json(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise RecordError(str(path), 0, "<file>", f"not valid UTF-8 ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise RecordError(str(path), 0, "<file>", f"not valid JSON ({err.msg}, line {err.lineno})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise RecordError(str(path), 0, "<file>", "expected a JSON list of records (or {\"data\": [...]})")
    yield from enumerate(data)


def _read_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    yield from enumerate(table.to_pylist())


def _read_saved_dataset(path: Path) -> Iterator[tuple[int, Any]]:
    if not (path / "dataset_info.json").exists() and not (path / "dataset_dict.json").exists():
        raise ValueError(f"{path}: a folder must be a dataset saved with datasets' save_to_disk")
    from datasets import DatasetDict, load_from_disk

    dataset = load_from_disk(str(path))
    if isinstance(dataset, DatasetDict):
        if "train" not in dataset:
            raise ValueError(f"{path}: a saved DatasetDict needs a 'train' split (has {list(dataset)})")
        dataset = dataset["train"]
    for index in range(len(dataset)):
        yield index, dataset[index]
