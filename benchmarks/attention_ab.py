"""The causal query blocks' backward, A/B inside the train step on the CPU.

The trainer's step (``make_train_step``, as ``benchmarks/cpu.py`` builds it) at one shape, compiled three ways in one
process and then timed in rounds, each round calling every variant once in a shuffled order:

* ``hand-written``: the default, ``jaxalign.models.llama.causal_block_attention`` (the forward keeps each row's
  maximum and log-normaliser; the backward computes the probabilities again);
* ``xla-derivative``: the same query blocks with XLA's derivative of the masked softmax (the default before
  2026-12-08; restated below);
* ``dense``: one dense product over every key (``causal_blocks`` returning 1).

Reported: each variant's median step time, its per-round time ratio against ``xla-derivative`` (median, with a
bootstrap 95 % interval over the rounds) and the compiled step's temporary memory (``memory_analysis()``). One
process and interleaved rounds, because this 2-core machine's step time drifts by about 10 % between invocations.

    python benchmarks/attention_ab.py                                  # SFT at 4x256, V 4,096 (about 2 minutes)
    python benchmarks/attention_ab.py --shape 4x256-gpt2 --rounds 12   # the GPT-2 vocabulary (about 3 minutes)
    python benchmarks/attention_ab.py --shape tiny --blocks 2 --rounds 3   # seconds: checks the script
"""

# ruff: noqa: E402  (this checkout's jaxalign first on sys.path)

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]

import jax
import jax.numpy as jnp
import numpy as np

from jaxalign.models import llama


def xla_derivative_block(q, k, v, mask, scale: float, cap: float) -> jax.Array:
    """``causal_block_attention``'s forward as plain JAX (softmax of the masked, scaled, soft-capped scores), so
    that XLA derives its backward: what the query blocks ran before the hand-written backward."""
    batch, kv, groups, rows, hd = q.shape
    scores = jnp.einsum("bkqd,bksd->bkqs", q.reshape(batch, kv, groups * rows, hd), k,
                        preferred_element_type=jnp.float32)
    scores = llama.softcap(scores.reshape(batch, kv, groups, rows, k.shape[2]) * scale, cap)
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, llama._MASK_VALUE), axis=-1)
    out = jnp.einsum("bkqs,bksd->bkqd", probs.astype(q.dtype).reshape(batch, kv, groups * rows, -1), v)
    return out.reshape(q.shape)


def bootstrap_median(ratios: np.ndarray, draws: int = 2000) -> tuple[float, float, float]:
    """The median of ``ratios`` and a percentile-bootstrap 95 % interval for it."""
    rng = np.random.default_rng(0)
    medians = [np.median(rng.choice(ratios, len(ratios))) for _ in range(draws)]
    return float(np.median(ratios)), float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="4x256-v4096", help="a shape of benchmarks/cpu.py (or tiny)")
    p.add_argument("--objective", default="sft", help="the train step's objective (sft, dpo, ...)")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds (each variant once per round)")
    p.add_argument("--blocks", type=int, default=0, help="force this many query blocks (0: causal_blocks' rule)")
    p.add_argument("--out", default="", help="a JSON file for the raw times")
    args = p.parse_args(argv)

    import cpu
    from step_profile import shape_of
    from train_step import train_setup

    defaults = rule, block_fn = llama.causal_blocks, llama.causal_block_attention
    if args.blocks:
        rule = lambda length, slots: args.blocks if length == slots else 1
    variants = {"hand-written": (rule, block_fn), "xla-derivative": (rule, xla_derivative_block),
                "dense": (lambda length, slots: 1, block_fn)}
    shape = shape_of(args.shape)
    config, batch = cpu.shape_batch(shape, args.objective)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    runs = {}
    try:
        for name, (blocks, fn) in variants.items():  # each variant traced and compiled with its own functions
            llama.causal_blocks, llama.causal_block_attention = blocks, fn
            step, state, reference = train_setup(args.objective, config, -1)
            extra = () if reference is None else (reference,)  # the frozen reference of dpo and the like
            compiled = step.lower(state, batch, *extra).compile()
            state, _ = compiled(state, batch, *extra)
            memory = compiled.memory_analysis()
            runs[name] = {"compiled": compiled, "extra": extra, "state": jax.block_until_ready(state),
                          "seconds": [], "temp_mb": memory.temp_size_in_bytes / 2**20 if memory else None}
    finally:
        llama.causal_blocks, llama.causal_block_attention = defaults
    order = list(runs)
    shuffle = random.Random(0)
    for _ in range(args.rounds):
        shuffle.shuffle(order)
        for name in order:
            run = runs[name]
            start = time.perf_counter()
            state, _ = run["compiled"](run["state"], batch, *run["extra"])
            run["state"] = jax.block_until_ready(state)
            run["seconds"].append(time.perf_counter() - start)
    base = np.asarray(runs["xla-derivative"]["seconds"])
    result = {"shape": args.shape, "objective": args.objective, "rounds": args.rounds,
              "length": shape.length, "blocks": rule(shape.length, shape.length),
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "jax": jax.__version__,
              "variants": {}}
    print(f"{args.objective} step at {args.shape} ({result['blocks']} query blocks of the {shape.length} tokens), "
          f"{args.rounds} interleaved rounds\n")
    print("| attention | median step (ms) | time ÷ xla-derivative, median [95 % interval] | compiled temporaries (MB) |"
          "\n|---|---|---|---|")
    for name, run in runs.items():
        seconds = np.asarray(run["seconds"])
        ratio = bootstrap_median(seconds / base)
        result["variants"][name] = {"seconds": run["seconds"], "median_ms": 1e3 * float(np.median(seconds)),
                                    "ratio_to_xla_derivative": ratio, "temp_mb": run["temp_mb"]}
        print(f"| {name} | {1e3 * np.median(seconds):.1f} | {ratio[0]:.3f} [{ratio[1]:.3f}, {ratio[2]:.3f}] | "
              f"{run['temp_mb']:.0f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
