"""Turning tokenised examples into fixed-shape batches: padding to length buckets, and packing.

Padding: every sequence of a batch is right-padded to the smallest bucket that holds the longest one, so a
run compiles once per bucket, not once per length. Packing: several examples share a row; ``segment_ids``
(1, 2, ... per example, 0 = padding) keep attention inside an example and ``positions`` restart at 0. The
first token of every segment is never trained (nothing inside its segment predicts it). Pair-aware packing
puts the chosen and rejected sequence of a pair in consecutive segments of the same row (chosen = odd id
``2k+1``, rejected = ``2k+2`` for the row's k-th pair) so per-segment log-prob sums recover the pairs.

Shared-prefix packing (``shared_prefix``) writes a pair's prompt once: ``prompt, chosen completion, rejected
completion``. The prompt is segment ``2K+k+1`` (``K = max_pairs_per_row``); each completion keeps its segment
id, attends to its prompt through ``prefix_ids`` (the prompt's segment id, 0 elsewhere) and to itself, and
its positions continue from the prompt's length. ``predictor_index`` names, for every token, the position whose
output predicts it (the token before it, except at a completion's first token: the prompt's last).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PAIR_PREFIXES = {"preference": ("",), "mpo": ("target_", "dominant_")}


def default_buckets(max_length: int, smallest: int = 16, step: int = 0) -> tuple[int, ...]:
    """Powers of two from ``smallest`` up to ``max_length``, and ``max_length`` itself; with ``step`` > 0 the
    multiples of ``step`` instead (more shapes to compile, less padding)."""
    if step > 0:
        return (*range(step, max_length, step), max_length)
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


def shared_prompt_length(example: dict) -> int:
    """Tokens a pair's chosen and rejected sequence share at the start, up to the first trained token of either
    (the part shared-prefix packing writes once); each completion keeps at least one token."""
    chosen, rejected = np.asarray(example["chosen_tokens"]), np.asarray(example["rejected_tokens"])
    limit = min(len(chosen), len(rejected)) - 1
    for mask in (example["chosen_loss_mask"], example["rejected_loss_mask"]):
        trained = np.flatnonzero(np.asarray(mask))
        limit = min(limit, int(trained[0]) if trained.size else limit)
    differ = np.flatnonzero(chosen[:limit] != rejected[:limit])
    return max(int(differ[0]) if differ.size else limit, 0)


def packed_size(example: dict, *, pairs: bool = False, shared_prefix: bool = False) -> int:
    """Row tokens an example takes when packed."""
    if not pairs:
        return len(example["tokens"])
    size = len(example["chosen_tokens"]) + len(example["rejected_tokens"])
    return size - shared_prompt_length(example) if shared_prefix else size


def pack_rows(examples: Sequence[dict], row_length: int, *, pairs: bool = False,
              shared_prefix: bool = False) -> list[list[int]]:
    """Next-fit packing: consecutive examples fill a row until the next one does not fit. Returns the example
    indices of each row. With ``pairs``, an example's chosen and rejected sequences travel together (with
    ``shared_prefix``, their prompt counted once)."""
    rows: list[list[int]] = []
    used = row_length
    for index, example in enumerate(examples):
        size = packed_size(example, pairs=pairs, shared_prefix=shared_prefix)
        if size > row_length:
            raise ValueError(f"example {index} needs {size} tokens but rows hold {row_length}; raise the row length "
                             "or lower max_length")
        if used + size > row_length:
            rows.append([])
            used = 0
        rows[-1].append(index)
        used += size
    return rows


def _pieces(example: dict, k: int, pairs: bool, shared_prefix: bool, max_pairs: int) -> list[tuple]:
    """A packed example's pieces: (tokens, loss mask, segment id, first position, prefix segment id or 0)."""
    if not pairs:
        return [(example["tokens"], example["loss_mask"], k + 1, 0, 0)]
    shared = shared_prompt_length(example) if shared_prefix else 0
    pieces = [(example["chosen_tokens"][:shared], example["chosen_loss_mask"][:shared], 2 * max_pairs + k + 1,
               0, 0)] if shared else []
    prefix = 2 * max_pairs + k + 1 if shared else 0
    for side, segment in (("chosen", 2 * k + 1), ("rejected", 2 * k + 2)):
        pieces.append((example[f"{side}_tokens"][shared:], example[f"{side}_loss_mask"][shared:], segment, shared,
                       prefix))
    return pieces


def packed_batch(examples: Sequence[dict], rows: Sequence[Sequence[int]], row_length: int, pad_id: int, *,
                 pairs: bool = False, max_pairs_per_row: int = 0, shared_prefix: bool = False) -> dict[str, np.ndarray]:
    """``[R, row_length]`` arrays for the given rows: ``tokens``, ``attention_mask``, ``loss_mask``,
    ``segment_ids``, ``positions``; with ``pairs`` also ``pair_mask [R, max_pairs_per_row]``; with
    ``shared_prefix`` also ``prefix_ids`` and ``predictor_index`` (see the module's docstring)."""
    n_rows = len(rows)
    tokens = np.full((n_rows, row_length), pad_id, np.int32)
    loss_mask = np.zeros((n_rows, row_length), np.int32)
    segment_ids = np.zeros((n_rows, row_length), np.int32)
    positions = np.zeros((n_rows, row_length), np.int32)
    prefix_ids = np.zeros((n_rows, row_length), np.int32)
    predictor = np.maximum(np.arange(row_length, dtype=np.int32) - 1, 0)[None].repeat(n_rows, 0)
    pair_mask = np.zeros((n_rows, max_pairs_per_row), np.int32)
    for r, row in enumerate(rows):
        cursor = 0
        if pairs and len(row) > max_pairs_per_row:
            raise ValueError(f"a packed row holds {len(row)} pairs but max_pairs_per_row={max_pairs_per_row}")
        prompt_end = 0
        for k, index in enumerate(row):
            if pairs:
                pair_mask[r, k] = 1
            for seq, mask, segment, start, prefix in _pieces(examples[index], k, pairs, shared_prefix,
                                                             max_pairs_per_row):
                end = cursor + len(seq)
                tokens[r, cursor:end] = seq
                loss_mask[r, cursor:end] = mask
                if prefix:  # the first token is predicted by the prompt's last
                    predictor[r, cursor] = prompt_end - 1
                    prefix_ids[r, cursor:end] = prefix
                else:  # nothing in its own sequence predicts a sequence's first token
                    loss_mask[r, cursor] = 0
                segment_ids[r, cursor:end] = segment
                positions[r, cursor:end] = start + np.arange(len(seq))
                cursor = end
                if not prefix:  # a shared prompt (or a piece no later one attends to)
                    prompt_end = end
    batch = {"tokens": tokens, "attention_mask": (segment_ids > 0).astype(np.int32), "loss_mask": loss_mask,
             "segment_ids": segment_ids, "positions": positions}
    if shared_prefix:
        batch["prefix_ids"], batch["predictor_index"] = prefix_ids, predictor
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


def group_rows(tokens: np.ndarray, attention_mask: np.ndarray, loss_mask: np.ndarray, group_size: int,
               completion_length: int) -> dict[str, np.ndarray]:
    """A GRPO generation batch with each group's prompt written once: rows ``i·G ... i·G+G−1`` of ``tokens [N, P+C]``
    (the same left-padded prompt of ``P`` slots, then ``C = completion_length`` completion slots, right-padded) become
    one row ``[prompt, completion 1, ..., completion G]`` of ``P + G·C`` slots. The prompt is segment ``G+1``, the
    completions segments ``1..G`` whose ``prefix_ids`` name the prompt; a completion's positions continue from the
    prompt's length and its first token is predicted by the prompt's last slot (``predictor_index``). Returns
    ``group_{tokens, attention_mask, loss_mask, segment_ids, prefix_ids, positions, predictor_index}``
    ``[N/G, P+G·C]``."""
    rows, width = tokens.shape
    if rows % group_size:
        raise ValueError(f"{rows} completions do not form groups of {group_size}")
    groups, prompt = rows // group_size, width - completion_length
    if prompt < 1:
        raise ValueError("a shared-prefix group needs a prompt")
    first = np.arange(groups) * group_size

    def grouped(x):  # a group's completion slots, one after another
        return x[:, prompt:].reshape(groups, group_size * completion_length)

    prompt_mask = attention_mask[first, :prompt]
    completion_mask = attention_mask[:, prompt:].reshape(groups, group_size, completion_length)
    prompt_length = prompt_mask.sum(axis=1)
    segments = np.where(completion_mask > 0, np.arange(1, group_size + 1)[None, :, None], 0)
    positions = np.broadcast_to(prompt_length[:, None, None] + np.arange(completion_length)[None, None, :],
                                completion_mask.shape)
    predictor = np.arange(prompt, prompt + group_size * completion_length).reshape(group_size, completion_length) - 1
    predictor[:, 0] = prompt - 1  # each completion's first token: the prompt's last slot
    out = {"group_tokens": np.concatenate([tokens[first, :prompt], grouped(tokens)], 1),
           "group_attention_mask": np.concatenate([prompt_mask, grouped(attention_mask)], 1),
           "group_loss_mask": np.concatenate([np.zeros_like(prompt_mask), grouped(loss_mask)], 1),
           "group_segment_ids": np.concatenate([np.where(prompt_mask > 0, group_size + 1, 0),
                                                segments.reshape(groups, -1)], 1),
           "group_prefix_ids": np.concatenate([np.zeros_like(prompt_mask), np.where(
               segments > 0, group_size + 1, 0).reshape(groups, -1)], 1),
           "group_positions": np.concatenate([np.maximum(np.cumsum(prompt_mask, axis=1) - 1, 0),
                                              positions.reshape(groups, -1)], 1),
           "group_predictor_index": np.concatenate([np.maximum(np.arange(prompt) - 1, 0)[None].repeat(groups, 0),
                                                    predictor.reshape(1, -1).repeat(groups, 0)], 1)}
    return {name: value.astype(np.int32) for name, value in out.items()}


def group_rows_cost(config, group_size: int, prompt_slots: int, completion_length: int) -> tuple[float, float]:
    """Model FLOPs of training a group's ``group_size`` completions (``LlamaConfig.flops_per_token``'s terms): as
    ``group_size`` rows of ``P + C`` slots (``P = prompt_slots``, ``C = completion_length``), and as one
    ``group_rows`` row of ``P + G·C``. The grouped row skips the repeated prompts. Its attention, where the model
    runs it per block (``attention_impl="xla"``, no sliding window: ``GroupLayout``), scores ``P² + G·C·(P + C)``
    query-key pairs, never more than the separate rows' ``G·(P + C)²``; elsewhere (the Pallas kernel, sliding
    windows) it spans the whole row, ``(P + G·C)²``, which costs more than the separate rows when the completions
    are long next to the prompt."""
    weights = config.flops_per_token(0)  # per slot
    per_score = config.flops_per_token(1) - weights  # per query-key pair
    g, p, c = group_size, prompt_slots, completion_length
    blockwise = config.attention_impl == "xla" and not any(map(config.layer_window, range(config.num_layers)))
    scores = p * p + g * c * (p + c) if blockwise else (p + g * c) ** 2
    return g * ((p + c) * weights + (p + c) ** 2 * per_score), (p + g * c) * weights + scores * per_score
