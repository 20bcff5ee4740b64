"""Precomputed reference quantities, cached on disk under a content hash.

DPO needs the frozen reference's summed log-probs of every chosen and rejected sequence; MPO needs its reward gap
and pooled hidden states on every dominant-language pair. They depend only on the reference weights, the
tokenizer, the lengths and the data, so they are computed once before training, stored as ``<hash>.npz`` and
attached to the examples (the batches then carry ``ref_*`` fields and no reference forward runs while training).
The key hashes the reference parameters' bytes, the tokenizer's vocabulary and template, the data files' bytes,
the length settings and the objective settings that change the quantities.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxalign.data.batching import bucket_length, default_buckets, max_sequence_length, pad_batch

BATCH_SIZE = 16  # examples per reference forward pass when called directly (training: its micro-batch)


@jax.jit
def _fingerprint(leaf: jax.Array) -> jax.Array:
    """Two position-weighted sums of the leaf's bits, in wrapping uint32 arithmetic: computed where the shards
    live (no gathering to one host) and equal on every process and for every mesh."""
    bits = jax.lax.bitcast_convert_type(leaf.astype(jnp.float32), jnp.uint32).reshape(-1)
    position = jnp.arange(bits.size, dtype=jnp.uint32)
    weighted = jnp.sum(bits * (position % jnp.uint32(65521) + 1))
    mixed = jnp.sum(bits ^ (position * jnp.uint32(2654435761)))
    return jnp.stack([weighted, mixed])


def _mesh_of(params):
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
    return sharding.mesh if isinstance(sharding, NamedSharding) else None


def _replicated(fn, leaf):
    """``fn`` jitted to return a replicated result when ``leaf`` lives on a mesh (readable on every process)."""
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return jax.jit(fn, out_shardings=NamedSharding(sharding.mesh, PartitionSpec()))
    return fn


def content_key(params, tokenizer, key_parts: dict, extra: dict) -> str:
    """``tokenizer``: the run's ``data.Tokenizer`` (its effective chat template counts, override included)."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        digest.update(f"{leaf.shape}{leaf.dtype}".encode())
        digest.update(np.asarray(_replicated(_fingerprint, leaf)(leaf)).tobytes())
    digest.update(json.dumps(tokenizer.hf.get_vocab(), sort_keys=True).encode())
    digest.update((tokenizer.chat_template or "").encode())
    for path in key_parts.get("paths", ()):
        digest.update(Path(path).read_bytes())
    settings = {k: v for k, v in key_parts.items() if k != "paths"}  # files count by content, not by name
    digest.update(json.dumps({**settings, **extra}, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:24]


def reference_fn(graphdef, kind: str, hparams):
    """``fn(params, batch) -> {ref_*: values}``: the frozen reference's quantities for one batch, on the same
    log-prob path as training (``hparams.logps_chunk_size``; the fused head never holds the ``[rows, T, V]``
    logits), so computing them needs no more memory than the forward half of a training step."""
    from jaxalign.objectives.mpo import dominant_pass
    from jaxalign.objectives.preference import pair_sums

    def fn(params, batch):
        reference = nnx.merge(graphdef, params)
        if kind == "preference":
            sums = pair_sums(reference, batch, "dpo", chunk_size=hparams.logps_chunk_size, scope="reference",
                             ld_alpha=getattr(hparams, "ld_alpha", 1.0))
            return {"ref_chosen_logps": sums["chosen"], "ref_rejected_logps": sums["rejected"]}
        gap, hidden = dominant_pass(reference, batch, hparams, "reference")
        return {"ref_dominant_gap": gap, "ref_dominant_hidden": hidden}

    return fn


def compute(examples: list[dict], graphdef, params, kind: str, hparams, batch_size: int = BATCH_SIZE,
            batch_sharding: NamedSharding | None = None) -> dict[str, np.ndarray]:
    """Reference quantities for every example, in order (``reference_fn`` over batches of ``batch_size``).

    With ``batch_sharding`` (the train step's; ``batch_size`` a multiple of its data-parallel size) each device
    computes only its rows, as in training; every process builds the whole (small) batch and gets the whole result
    back, so this works with parameters sharded across hosts."""
    buckets = default_buckets(max_sequence_length(examples, kind))
    mesh = _mesh_of(params) if batch_sharding is None else batch_sharding.mesh
    whole = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None
    rows = batch_sharding or whole
    run = jax.jit(reference_fn(graphdef, kind, hparams), out_shardings=whole)

    def place(params, batch):
        if mesh is None:
            return run(params, {k: jnp.asarray(v) for k, v in batch.items()})
        return run(params, {k: jax.make_array_from_callback(v.shape, rows, lambda index, v=v: v[index])
                            for k, v in batch.items()})

    outputs: dict[str, list] = {}
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        filled = chunk + [chunk[-1]] * (batch_size - len(chunk))
        batch = pad_batch(filled, kind, bucket_length(max_sequence_length(filled, kind), buckets), 0)
        result = place(params, batch)
        for name, value in result.items():
            outputs.setdefault(name, []).append(np.asarray(value)[: len(chunk)])
    return {name: np.concatenate(parts) for name, parts in outputs.items()}


def attach(sources: list[list[dict]], graphdef, params, tokenizer, kind: str, hparams, cache_dir: Path,
           key_parts: dict, *, batch_size: int = BATCH_SIZE, batch_sharding: NamedSharding | None = None,
           ) -> tuple[list[list[dict]], dict]:
    """(``sources`` with ``ref_*`` fields added to every example, ``{"status": "computed" | "reused", "path"}``):
    from the cache when the key matches."""
    if kind not in ("preference", "mpo"):
        raise ValueError(f"precomputed references exist for preference and MPO data, not {kind!r}")
    extra = {"kind": kind, "pooling": getattr(hparams, "pooling", None), "sizes": [len(s) for s in sources]}
    if getattr(hparams, "ld_alpha", 1.0) != 1.0:  # LD-DPO weights the reference's sums too
        extra["ld_alpha"] = hparams.ld_alpha
    key = content_key(params, tokenizer, key_parts, extra)
    path = Path(cache_dir) / f"{key}.npz"
    examples = [example for source in sources for example in source]
    if path.exists():
        values = dict(np.load(path))
        status = {"status": "reused", "path": str(path)}
    else:
        values = compute(examples, graphdef, params, kind, hparams, batch_size, batch_sharding)
        if jax.process_index() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp.npz")
            np.savez(tmp, **values)
            tmp.replace(path)
        status = {"status": "computed", "path": str(path)}
    if any(len(v) != len(examples) for v in values.values()):
        raise ValueError(f"{path}: cached reference values do not match the {len(examples)} examples; delete it")
    flat = iter(range(len(examples)))
    out = []
    for source in sources:
        enriched = []
        for example in source:
            i = next(flat)
            enriched.append({**example, **{name: value[i] for name, value in values.items()}})
        out.append(enriched)
    return out, status
