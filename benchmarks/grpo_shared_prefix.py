"""GRPO training step with each group's prompt written once (``objective.params.shared_prefix``) vs the prompt
repeated in every completion's row, side by side in one invocation.

The trainer's own jitted step (``make_train_step`` with the GRPO objective: DAPO loss, ``old_logps`` given so the
ratio is live, fused LM head) on one generation batch of ``groups`` prompts x ``G = 8`` completions. Both arms see
the same tokens; the shared arm adds the ``group_rows`` layout (one row of ``P + G*C`` slots per group), the repeated
arm trains ``[G*groups, P + C]`` rows. Each arm is compiled, run once, then timed over ``reps`` steps (median).
"Real tokens" are the completions' rows as the repeated arm holds them (prompt counted in each, no padding): the
same count for both arms. Two prompt shares: 3/4 and 7/8 of each sequence.

    python benchmarks/grpo_shared_prefix.py            # 4 layers x 256, vocabulary 4,096; about 3 minutes on 2 cores
    python benchmarks/grpo_shared_prefix.py --smoke    # seconds: checks the script
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

from jaxalign.data.batching import group_rows
from jaxalign.models import LlamaConfig, create_model
from jaxalign.objectives import GRPOParams, get_objective
from jaxalign.train.step import init_state, make_optimizer, make_train_step

OPTIM = ml_collections.ConfigDict(dict(name="adamw", lr=1e-6, schedule="constant", warmup_steps=0, min_lr_ratio=1.0,
                                       weight_decay=0.0, b1=0.9, b2=0.95, eps=1e-8, rmsprop_decay=0.9, clip_norm=1.0))


def generation_batch(groups: int, size: int, prompt: int, completion: int, vocab: int, seed: int = 0) -> dict:
    """Left-padded prompts (each group's own length, 3/4 to all of ``prompt``), completions of 1/2 to all of
    ``completion`` tokens."""
    rng = np.random.default_rng(seed)
    rows = groups * size
    tokens = rng.integers(3, vocab, (rows, prompt + completion)).astype(np.int32)
    mask = np.zeros((rows, prompt + completion), np.int32)
    for g in range(groups):
        pad = int(rng.integers(0, prompt // 4 + 1))
        tokens[g * size:(g + 1) * size, :prompt] = tokens[g * size, :prompt]
        mask[g * size:(g + 1) * size, pad:prompt] = 1
    lengths = rng.integers(completion // 2, completion + 1, rows)
    valid = (np.arange(completion)[None] < lengths[:, None]).astype(np.int32)
    mask[:, prompt:] = valid
    loss_mask = np.concatenate([np.zeros((rows, prompt), np.int32), valid], 1)
    return {"tokens": tokens, "attention_mask": mask, "loss_mask": loss_mask,
            "advantages": rng.normal(size=rows).astype(np.float32),
            "old_logps": np.where(loss_mask > 0, rng.normal(-8.3, 0.1, loss_mask.shape), 0).astype(np.float32)}


def time_arm(step, state, params, batch, reps: int) -> tuple[float, float, float]:
    placed = {k: jnp.asarray(v) for k, v in batch.items()}
    start = time.perf_counter()
    compiled = step.lower(state, placed, params).compile()
    compile_s = time.perf_counter() - start
    state, metrics = compiled(state, placed, params)
    jax.block_until_ready(state)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        state, metrics = compiled(state, placed, params)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    return float(np.median(times)), compile_s, float(metrics["loss"].value / metrics["loss"].count)


def measure(smoke: bool = False) -> dict:
    """Both arms at both prompt shares; prints the table as it goes."""
    if smoke:
        shape = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
        groups, completion, reps = 2, 8, 2
    else:
        shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                     num_kv_heads=2)
        groups, completion, reps = 4, 64, 5
    size = 8
    config = LlamaConfig(**shape)
    graphdef, params = nnx.split(create_model(config, seed=0))
    params = nnx.to_pure_dict(params)
    tx, _ = make_optimizer(OPTIM, 100)
    hp = GRPOParams(num_generations=size, prompts_per_step=groups, max_completion_length=completion,
                    logps_chunk_size=-1)
    step = make_train_step(graphdef, get_objective("grpo").fn, hp, tx)
    results = {"shape": shape, "groups": groups, "num_generations": size, "completion": completion,
               "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"), "rows": []}
    print("| prompt share | P + C | real tokens | repeated step (s) | shared step (s) | repeated tok/s | shared tok/s "
          "| shared / repeated | loss (repeated, shared) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for share in (0.75, 0.875):
        prompt = round(completion * share / (1 - share))
        batch = generation_batch(groups, size, prompt, completion, config.vocab_size)
        shared = {**batch, **group_rows(batch["tokens"], batch["attention_mask"], batch["loss_mask"], size,
                                        completion)}
        real = int(batch["attention_mask"].sum())
        row = {"prompt_share": share, "prompt": prompt, "real_tokens": real,
               "shared_row_slots": int(shared["group_tokens"].shape[1])}
        for name, arm in (("repeated", batch), ("shared", shared)):
            seconds, compile_s, loss = time_arm(step, init_state(params, tx, 0, None), params, arm, reps)
            row[name] = {"step_s": seconds, "compile_s": compile_s, "tokens_per_s": real / seconds, "loss": loss}
        row["speedup"] = row["shared"]["tokens_per_s"] / row["repeated"]["tokens_per_s"]
        results["rows"].append(row)
        print(f"| {share:.3f} | {prompt} + {completion} | {real:,} | {row['repeated']['step_s']:.3f} | "
              f"{row['shared']['step_s']:.3f} | {row['repeated']['tokens_per_s']:,.0f} | "
              f"{row['shared']['tokens_per_s']:,.0f} | {row['speedup']:.2f}x | {row['repeated']['loss']:.6f}, "
              f"{row['shared']['loss']:.6f} |", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    results = measure(args.smoke)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
