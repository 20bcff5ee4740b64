"""Turning tokenised examples into fixed-shape batches: padding to length buckets, and packing.

Padding: every sequence of a batch is right-padded to the smallest bucket that holds the longest one, so a
run compiles once per bucket, not once per length. Packing: several examples share a row; ``segment_ids``
(1, 2, ... per example, 0 = padding) keep attention inside an example and ``positions`` restart at 0. The
first token of every segment is never trained (nothing inside its segment predicts it). Pair-aware packing
puts the chosen and rejected sequence of a pair in consecutive segments of the same row (chosen = odd id
``2k+1``, rejected = ``2k+2`` for the row's k-th pair) so per-segment log-prob sums recover the pairs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PAIR_PREFIXES = {"preference": ("",), "mpo": ("target_", "dominant_")}


def default_buckets(max_length: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from ``smallest`` up to ``max_length``, and ``max_length`` itself."""
    buckets = []
    size = smallest
    while size < max_length:
        buckets.append(size)
        size *= 2
    return (*buckets, max_length)


def bucket_length(length: int, buckets: Sequence[int]) -> int:
    for size in sorted(buckets):
        if size >= length:
            return size
    raise ValueError(f"a sequence of {length} tokens is longer than the largest bucket {max(buckets)}")


def _pad(arrays: Sequence[np.ndarray], length: int, value: int, dtype) -> np.ndarray:
    out = np.full((len(arrays), length), value, dtype)
    for row, array in enumerate(arrays):
        out[row, : len(array)] = array
    return out


def sequence_fields(kind: str) -> list[str]:
    """Names of the token sequences an example of ``kind`` holds (``tokens`` or ``{prefix}{side}_tokens``)."""
    if kind in ("lm", "sft", "unpaired"):
        return ["tokens"]
    return [f"{prefix}{side}_tokens" for prefix in PAIR_PREFIXES[kind] for side in ("chosen", "rejected")]


def max_sequence_length(examples: Sequence[dict], kind: str) -> int:
    return max(len(example[field]) for example in examples for field in sequence_fields(kind))


def pad_batch(examples: Sequence[dict], kind: str, length: int, pad_id: int) -> dict[str, np.ndarray]:
    """Right-padded ``[B, length]`` arrays: for each sequence field its tokens, ``attention_mask`` and
    ``loss_mask`` (named ``tokens``/``attention_mask``/``loss_mask`` or ``{prefix}{side}_...``); per-example
    ``ref_*`` values (precomputed reference log-probs) are stacked."""
    batch = {}
    for field in sequence_fields(kind):
        stem = field.removesuffix("tokens")
        tokens = [example[field] for example in examples]
        batch[field] = _pad(tokens, length, pad_id, np.int32)
        batch[f"{stem}attention_mask"] = _pad([np.ones(len(t), np.int32) for t in tokens], length, 0, np.int32)
        batch[f"{stem}loss_mask"] = _pad([example[f"{stem}loss_mask"] for example in examples], length, 0, np.int32)
    for field in examples[0]:
        if field.startswith("ref_"):  # precomputed reference quantities ride along, one value per example
            batch[field] = np.stack([example[field] for example in examples])
    if "margin" in examples[0]:  # reward-model margins (every example has one: DataPipeline checks)
        batch["margin"] = np.asarray([example["margin"] for example in examples], np.float32)
    if kind == "unpaired":
        batch["label"] = np.asarray([example["label"] for example in examples], np.int32)
        batch.update(kl_rows(examples, length, pad_id))
    return batch


def kl_rows(examples: Sequence[dict], length: int, pad_id: int) -> dict[str, np.ndarray]:
    """KTO's mismatched sequences: example ``i``'s prompt with example ``i−1``'s completion (the first takes the
    last's), TRL's rotation by one within the batch; completions cut to ``length`` tokens in all (the batch's
    padded length). ``kl_{tokens,attention_mask,loss_mask}`` ``[B, length]``."""
    def split(example):
        trained = np.flatnonzero(example["loss_mask"])
        start = int(trained[0]) if trained.size else len(example["tokens"])
        return example["tokens"][:start], example["tokens"][start:], example["loss_mask"][start:]

    parts = [split(example) for example in examples]
    tokens, masks = [], []
    for i, (prompt, _, _) in enumerate(parts):
        _, completion, completion_mask = parts[i - 1]
        tokens.append(np.concatenate([prompt, completion])[:length])
        masks.append(np.concatenate([np.zeros(len(prompt), np.int8), completion_mask])[:length])
    return {"kl_tokens": _pad(tokens, length, pad_id, np.int32),
            "kl_attention_mask": _pad([np.ones(len(t), np.int32) for t in tokens], length, 0, np.int32),
            "kl_loss_mask": _pad(masks, length, 0, np.int32)}


def pack_rows(examples: Sequence[dict], row_length: int, *, pairs: bool = False) -> list[list[int]]:
    """Next-fit packing: consecutive examples fill a row until the next one does not fit. Returns the example
    indices of each row. With ``pairs``, an example's chosen and rejected sequences travel together."""
    rows: list[list[int]] = []
    used = row_length
    for index, example in enumerate(examples):
        size = (len(example["chosen_tokens"]) + len(example["rejected_tokens"])) if pairs else len(example["tokens"])
        if size > row_length:
            raise ValueError(f"example {index} needs {size} tokens but rows hold {row_length}; raise the row length "
                             "or lower max_length")
        if used + size > row_length:
            rows.append([])
            used = 0
        rows[-1].append(index)
        used += size
    return rows


def packed_batch(examples: Sequence[dict], rows: Sequence[Sequence[int]], row_length: int, pad_id: int, *,
                 pairs: bool = False, max_pairs_per_row: int = 0) -> dict[str, np.ndarray]:
    """``[R, row_length]`` arrays for the given rows: ``tokens``, ``attention_mask``, ``loss_mask``,
    ``segment_ids``, ``positions``; with ``pairs`` also ``pair_mask [R, max_pairs_per_row]``."""
    n_rows = len(rows)
    tokens = np.full((n_rows, row_length), pad_id, np.int32)
    loss_mask = np.zeros((n_rows, row_length), np.int32)
    segment_ids = np.zeros((n_rows, row_length), np.int32)
    positions = np.zeros((n_rows, row_length), np.int32)
    pair_mask = np.zeros((n_rows, max_pairs_per_row), np.int32)
    for r, row in enumerate(rows):
        cursor = 0
        if pairs and len(row) > max_pairs_per_row:
            raise ValueError(f"a packed row holds {len(row)} pairs but max_pairs_per_row={max_pairs_per_row}")
        pieces = []
        for k, index in enumerate(row):
            example = examples[index]
            if pairs:
                pieces += [(example["chosen_tokens"], example["chosen_loss_mask"], 2 * k + 1),
                           (example["rejected_tokens"], example["rejected_loss_mask"], 2 * k + 2)]
                pair_mask[r, k] = 1
            else:
                pieces.append((example["tokens"], example["loss_mask"], k + 1))
        for seq, mask, segment in pieces:
            end = cursor + len(seq)
            tokens[r, cursor:end] = seq
            loss_mask[r, cursor:end] = mask
            loss_mask[r, cursor] = 0
            segment_ids[r, cursor:end] = segment
            positions[r, cursor:end] = np.arange(len(seq))
            cursor = end
    batch = {"tokens": tokens, "attention_mask": (segment_ids > 0).astype(np.int32), "loss_mask": loss_mask,
             "segment_ids": segment_ids, "positions": positions}
    if pairs:
        batch["pair_mask"] = pair_mask
        for field in examples[rows[0][0]] if rows and rows[0] else ():
            if field.startswith("ref_"):  # precomputed reference values, one per pair slot
                values = np.zeros((n_rows, max_pairs_per_row), np.float32)
                for r, row in enumerate(rows):
                    for k, index in enumerate(row):
                        values[r, k] = examples[index][field]
                batch[field] = values
    return batch
