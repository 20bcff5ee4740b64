"""Padded vs packed vs shared-prefix DPO training: real tokens per second over one epoch, side by side.

The same pairs, the same model and the trainer's own jitted step and data pipeline. Padded: 8 pairs per step, each
side padded to the smallest power-of-two bucket that fits the batch's longest sequence. Packed: rows of
``2 x max_length`` tokens holding whole pairs (``data.packing``); 4 rows per step. Shared prefix, packed: the same rows
with each pair's prompt written once (``data.shared_prefix``); 4 rows per step. Shared prefix, one pair per row
(``data.shared_prefix`` without packing): ``[prompt, chosen, rejected]`` rows in power-of-two buckets, 8 pairs per
step. The padded and the one-pair-per-row layouts also run with buckets every 32 tokens (``data.bucket_step``): a
shared row is longer than either of its pair's sequences, so power-of-two buckets round the two layouts
differently. Every bucket or row shape is compiled in a
first pass over the epoch; the second pass is timed. "Real tokens" are the pairs' own tokens (chosen + rejected,
prompt counted in both, no padding): the same count for every layout, so tokens/s compare the work done.

Two sets: ``heavy-tailed`` (completion lengths Pareto-distributed, most answers short and a few near
``max_length``, prompts 16-48 tokens: the shape of real preference data) and ``prompt-heavy`` (each sequence's
prompt three quarters of its tokens: long context, short answers).

    python benchmarks/packed_preference.py                 # 4 layers x 256, vocabulary 4,096, 128 pairs per set
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


def prompt_heavy_pairs(n: int, max_length: int, vocab: int, seed: int = 0) -> list[dict]:
    """Completions of 8-40 tokens; the prompt three times the pair's mean completion length."""
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(n):
        sizes = rng.integers(8, 41, 2)
        prompt = rng.integers(3, vocab, min(3 * int(sizes.mean()), max_length - int(sizes.max()))).tolist()
        example = {}
        for side, size in zip(("chosen", "rejected"), sizes, strict=True):
            example[f"{side}_tokens"] = np.asarray(prompt + rng.integers(3, vocab, size).tolist(), np.int32)
            example[f"{side}_loss_mask"] = np.asarray([0] * len(prompt) + [1] * int(size), np.int8)
        examples.append(example)
    return examples


SETS = {"heavy-tailed": heavy_tailed_pairs, "prompt-heavy": prompt_heavy_pairs}


def run_epoch(step, state, reference, pipeline: DataPipeline, timed: bool):
    start = time.perf_counter()
    pipeline.restore({**pipeline.state(), "epoch": 0, "step": 0})
    for _ in range(pipeline.steps_per_epoch):
        batch = next(pipeline)
        state, _ = step(state, {k: jnp.asarray(v) for k, v in batch.items()}, reference)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - start
    used = [i for row in pipeline._epoch_units(0)[:pipeline.steps_per_epoch * pipeline.config.batch_size]
            for i in row]
    tokens = sum(len(pipeline.examples[i]["chosen_tokens"]) + len(pipeline.examples[i]["rejected_tokens"])
                 for i in used)
    return state, {"seconds": seconds, "real_tokens": tokens, "tokens_per_s": tokens / seconds,
                   "steps": pipeline.steps_per_epoch, "pairs": len(used)} if timed else None


def measure(sets: str = "heavy-tailed,prompt-heavy", smoke: bool = False) -> dict:
    """Every layout on each of ``sets`` (comma-separated ``SETS`` names); prints the tables as it goes."""
    if smoke:
        shape = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
        n_pairs, max_length = 24, 160
    else:
        shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                     num_kv_heads=2)
        n_pairs, max_length = 128, 512
    config = LlamaConfig(**shape)
    graphdef, params = nnx.split(create_model(config, seed=0))
    params = nnx.to_pure_dict(params)
    reference = jax.tree.map(jnp.copy, params)
    tx, _ = make_optimizer(OPTIM, 100)
    step = make_train_step(graphdef, get_objective("dpo").fn, make_params("dpo"), tx)
    rows = dict(batch_size=4, seed=0, packing=True, row_length=2 * max_length, max_pairs_per_row=32)
    layouts = {
        "padded (8 pairs per step, power-of-two buckets)": PipelineConfig(batch_size=8, seed=0),
        f"packed (4 rows of {2 * max_length} tokens per step)": PipelineConfig(**rows),
        f"shared prefix, packed (4 rows of {2 * max_length} tokens per step)": PipelineConfig(**rows,
                                                                                             shared_prefix=True),
        "shared prefix, one pair per row (8 pairs per step, power-of-two buckets)": PipelineConfig(
            batch_size=8, seed=0, shared_prefix=True),
        "padded, 32-token buckets": PipelineConfig(batch_size=8, seed=0, bucket_step=32),
        "shared prefix, one pair per row, 32-token buckets": PipelineConfig(batch_size=8, seed=0, shared_prefix=True,
                                                                           bucket_step=32),
    }
    results = {"shape": shape, "pairs": n_pairs, "max_length": max_length, "jax": jax.__version__,
               "date": time.strftime("%Y-%m-%d"), "sets": {}}
    for set_name in sets.split(","):
        examples = SETS[set_name](n_pairs, max_length, config.vocab_size)
        lengths = np.array([len(e[f"{s}_tokens"]) for e in examples for s in ("chosen", "rejected")])
        prompt = np.mean([np.argmax(e[f"{s}_loss_mask"]) / len(e[f"{s}_tokens"]) for e in examples
                          for s in ("chosen", "rejected")])
        entry = {"length_percentiles": {p: float(np.percentile(lengths, p)) for p in (10, 50, 90, 99, 100)},
                 "prompt_share": float(prompt), "rows": {}}
        for name, pipeline_config in layouts.items():
            pipeline = DataPipeline([examples], "preference", pipeline_config)
            state = init_state(params, tx, 0, None)
            start = time.perf_counter()
            state, _ = run_epoch(step, state, reference, pipeline, timed=False)  # compiles every shape
            compile_pass = time.perf_counter() - start
            _, row = run_epoch(step, state, reference, pipeline, timed=True)
            row["first_pass_s"] = compile_pass
            entry["rows"][name] = row
            print(json.dumps({set_name: {name: row}}), flush=True)
        padded, packed, shared, per_row, padded_fine, per_row_fine = entry["rows"].values()
        best = max(padded["tokens_per_s"], packed["tokens_per_s"], padded_fine["tokens_per_s"])
        entry["packed_over_padded"] = packed["tokens_per_s"] / padded["tokens_per_s"]
        entry["shared_over_packed"] = shared["tokens_per_s"] / packed["tokens_per_s"]
        entry["shared_over_padded"] = shared["tokens_per_s"] / padded["tokens_per_s"]
        entry["per_row_over_padded"] = per_row["tokens_per_s"] / padded["tokens_per_s"]
        entry["per_row_over_padded_fine"] = per_row_fine["tokens_per_s"] / padded_fine["tokens_per_s"]
        # the fastest shared-prefix layout against the fastest without it
        entry["shared_over_unshared"] = max(shared["tokens_per_s"], per_row["tokens_per_s"],
                                            per_row_fine["tokens_per_s"]) / best
        results["sets"][set_name] = entry
        percentiles = entry["length_percentiles"]
        print(f"\n{set_name}: sequence lengths p50 {percentiles[50]:.0f}, p90 {percentiles[90]:.0f}, p99 "
              f"{percentiles[99]:.0f}, max {percentiles[100]:.0f}; prompt {100 * prompt:.0f} % of each sequence\n")
        print("| layout | steps | pairs | real tokens | epoch (s) | real tokens/s |")
        print("|---|---|---|---|---|---|")
        for name, row in entry["rows"].items():
            print(f"| {name} | {row['steps']} | {row['pairs']} | {row['real_tokens']:,} | {row['seconds']:.1f} | "
                  f"{row['tokens_per_s']:,.0f} |")
        print(f"\npacked / padded {entry['packed_over_padded']:.2f}x, shared prefix packed / packed "
              f"{entry['shared_over_packed']:.2f}x, shared prefix one pair per row / padded "
              f"{entry['per_row_over_padded']:.2f}x (32-token buckets: {entry['per_row_over_padded_fine']:.2f}x); "
              f"best shared / best unshared "
              f"{entry['shared_over_unshared']:.2f}x\n")
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--sets", default="heavy-tailed,prompt-heavy")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    results = measure(args.sets, args.smoke)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
