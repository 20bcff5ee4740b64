"""Packed (padding-free) vs padded DPO training on heavy-tailed lengths: real tokens per second over one epoch.

The same pairs, the same model and the trainer's own jitted step and data pipeline. Padded: 8 pairs per step, each
side padded to the smallest power-of-two bucket that fits the batch's longest sequence. Packed: rows of
``2 x max_length`` tokens holding whole pairs (``data.packing``); 4 rows per step. Completion lengths follow a
Pareto distribution (most answers short, a few near ``max_length``), the shape of real preference data. Every bucket
or row shape is compiled in a first pass over the epoch; the second pass is timed. "Real tokens" excludes padding.

    python benchmarks/packed_preference.py                 # 4 layers x 256, vocabulary 4,096, 128 pairs
    python benchmarks/packed_preference.py --smoke         # seconds: checks the script
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from jaxalign.data import DataPipeline, PipelineConfig
from jaxalign.models import LlamaConfig, create_model
from jaxalign.objectives import get_objective, make_params
from jaxalign.train.step import init_state, make_optimizer, make_train_step

OPTIM = ml_collections.ConfigDict(dict(name="adamw", lr=1e-5, schedule="constant", warmup_steps=0, min_lr_ratio=1.0,
                                       weight_decay=0.0, b1=0.9, b2=0.95, eps=1e-8, rmsprop_decay=0.9, clip_norm=1.0))


def heavy_tailed_pairs(n: int, max_length: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(n):
        prompt = rng.integers(3, vocab, rng.integers(16, 48)).tolist()
        example = {}
        for side in ("chosen", "rejected"):
            size = int(min(8 + rng.pareto(1.2) * 24, max_length - len(prompt)))
            example[f"{side}_tokens"] = np.asarray(prompt + rng.integers(3, vocab, size).tolist(), np.int32)
            example[f"{side}_loss_mask"] = np.asarray([0] * len(prompt) + [1] * size, np.int8)
        examples.append(example)
    return examples


def real_tokens(batch: dict) -> int:
    return int(sum(v.sum() for k, v in batch.items() if k.endswith("attention_mask")))


def run_epoch(step, state, reference, pipeline: DataPipeline, timed: bool):
    tokens, start = 0, time.perf_counter()
    pipeline.restore({**pipeline.state(), "epoch": 0, "step": 0})
    for _ in range(pipeline.steps_per_epoch):
        batch = next(pipeline)
        tokens += real_tokens(batch)
        state, _ = step(state, {k: jnp.asarray(v) for k, v in batch.items()}, reference)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - start
    return state, {"seconds": seconds, "real_tokens": tokens, "tokens_per_s": tokens / seconds,
                   "steps": pipeline.steps_per_epoch} if timed else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.smoke:
        shape = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
        n_pairs, max_length = 24, 64
    else:
        shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                     num_kv_heads=2)
        n_pairs, max_length = 128, 512
    config = LlamaConfig(**shape)
    examples = heavy_tailed_pairs(n_pairs, max_length, config.vocab_size)
    lengths = np.array([len(e[f"{s}_tokens"]) for e in examples for s in ("chosen", "rejected")])
    graphdef, params = nnx.split(create_model(config, seed=0))
    params = nnx.to_pure_dict(params)
    reference = jax.tree.map(jnp.copy, params)
    tx, _ = make_optimizer(OPTIM, 100)
    step = make_train_step(graphdef, get_objective("dpo").fn, make_params("dpo"), tx)
    layouts = {
        "padded (8 pairs per step, power-of-two buckets)": PipelineConfig(batch_size=8, seed=0),
        f"packed (4 rows of {2 * max_length} tokens per step)": PipelineConfig(
            batch_size=4, seed=0, packing=True, row_length=2 * max_length, max_pairs_per_row=32),
    }
    results = {"shape": shape, "pairs": n_pairs, "max_length": max_length,
               "length_percentiles": {p: float(np.percentile(lengths, p)) for p in (10, 50, 90, 99, 100)},
               "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"), "rows": {}}
    for name, pipeline_config in layouts.items():
        pipeline = DataPipeline([examples], "preference", pipeline_config)
        state = init_state(params, tx, 0, None)
        start = time.perf_counter()
        state, _ = run_epoch(step, state, reference, pipeline, timed=False)  # compiles every shape
        compile_pass = time.perf_counter() - start
        _, row = run_epoch(step, state, reference, pipeline, timed=True)
        row["first_pass_s"] = compile_pass
        results["rows"][name] = row
        print(json.dumps({name: row}), flush=True)
    padded, packed = results["rows"].values()
    results["speedup"] = packed["tokens_per_s"] / padded["tokens_per_s"]
    print(f"\nsequence lengths: p50 {results['length_percentiles'][50]:.0f}, p90 "
          f"{results['length_percentiles'][90]:.0f}, p99 {results['length_percentiles'][99]:.0f}, max "
          f"{results['length_percentiles'][100]:.0f}\n")
    print("| layout | steps | real tokens | epoch (s) | real tokens/s |")
    print("|---|---|---|---|---|")
    for name, row in results["rows"].items():
        print(f"| {name} | {row['steps']} | {row['real_tokens']:,} | {row['seconds']:.1f} | "
              f"{row['tokens_per_s']:,.0f} |")
    print(f"\npacked / padded real tokens/s: {results['speedup']:.2f}x")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
