"""Train-step throughput and MFU of jaxalign's objectives (the trainer's own jitted step), one device.

For SFT, IFT and DPO at a ~1B Llama shape (Llama-3.2-1B: 16 layers, d 2048, 32/8 heads, vocab 128,256, tied) with
sequence length 2048, bf16 compute and f32 parameters + AdamW, cuDNN attention. MFU = model FLOPs / time / the
measured bf16 matmul peak of the same device (a jitted 8192³ product).

Model FLOPs per trained-on token (PaLM formula, N = parameters except an untied input table, T = sequence length):
SFT 6N + 12·L·H·hd·T (forward + backward); IFT adds pass 1 (a forward: 2N + 4·L·H·hd·T); DPO runs the policy forward
+ backward on chosen and rejected and the frozen reference forward on both (same as IFT per token). "Useful" MFU
counts only the 6N + 12·L·H·hd·T that SFT would do; "hardware" MFU counts every pass.

    python benchmarks/train_step.py --out results.jsonl        # GPU (see benchmarks/gpu.sh)
    python benchmarks/train_step.py --smoke                     # tiny shapes on the CPU: checks the script
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

from jaxalign.models import LlamaConfig, create_model
from jaxalign.objectives import get_objective, make_params
from jaxalign.train.step import init_state, make_optimizer, make_train_step

SHAPES = {
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                     num_kv_heads=8, tie_word_embeddings=True, rope_theta=500000.0),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2),
}
OPTIM = ml_collections.ConfigDict(dict(name="adamw", lr=1e-5, schedule="constant", warmup_steps=0, min_lr_ratio=1.0,
                                       weight_decay=0.0, b1=0.9, b2=0.95, eps=1e-8, rmsprop_decay=0.9, clip_norm=1.0))


def matmul_peak(size: int, dtype=jnp.bfloat16) -> float:
    """FLOP/s of a jitted ``size``³ product in ``dtype`` (median of 10 after a warm-up call)."""
    a = jax.random.normal(jax.random.key(0), (size, size), dtype)
    b = jax.random.normal(jax.random.key(1), (size, size), dtype)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * size**3 / float(np.median(times))


def batch_for(name: str, sequences: int, length: int, vocab: int) -> dict:
    rng = np.random.default_rng(0)

    def block(n):
        tokens = rng.integers(3, vocab, (n, length)).astype(np.int32)
        loss_mask = np.zeros((n, length), np.int32)
        loss_mask[:, length // 4:] = 1  # the first quarter is the prompt
        return tokens, np.ones((n, length), np.int32), loss_mask

    if name in ("sft", "ift"):
        tokens, attention, loss_mask = block(sequences)
        return {"tokens": tokens, "attention_mask": attention, "loss_mask": loss_mask}
    out = {}
    for side in ("chosen", "rejected"):
        tokens, attention, loss_mask = block(sequences // 2)
        out.update({f"{side}_tokens": tokens, f"{side}_attention_mask": attention, f"{side}_loss_mask": loss_mask})
    return out


def train_setup(name: str, config: LlamaConfig, chunk: int):
    """``(step, state, reference_params or None)``: the trainer's jitted step for objective ``name`` (AdamW from
    ``OPTIM``) on a fresh model; the frozen reference is a copy of the initial parameters when the objective uses
    one."""
    model = create_model(config, seed=0)
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    tx, _ = make_optimizer(OPTIM, 100)
    state = init_state(params, tx, 0, None)
    objective = get_objective(name)
    reference = jax.tree.map(jnp.copy, params) if objective.uses_reference else None
    step = make_train_step(graphdef, objective.fn, make_params(name, {"logps_chunk_size": chunk}), tx)
    return step, state, reference


def measure(name: str, config: LlamaConfig, sequences: int, length: int, reps: int, chunk: int) -> dict:
    step, state, reference = train_setup(name, config, chunk)
    batch = {k: jnp.asarray(v) for k, v in batch_for(name, sequences, length, config.vocab_size).items()}
    args = (batch,) + ((reference,) if reference is not None else ())
    start = time.perf_counter()
    state, metrics = step(state, *args)
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        state, metrics = step(state, *args)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    seconds = float(np.median(times))
    tokens = sequences * length
    n = config.num_params() - (0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size)
    attention = config.num_layers * config.num_heads * config.head_dim * length
    useful = (6 * n + 12 * attention) * tokens
    hardware = useful + ((2 * n + 4 * attention) * tokens if name in ("ift", "dpo") else 0)
    memory = jax.devices()[0].memory_stats() or {}
    return {"objective": name, "sequences": sequences, "length": length, "step_s": seconds, "compile_s": compile_s,
            "tokens_per_s": tokens / seconds, "useful_tflops": useful / seconds / 1e12,
            "hardware_tflops": hardware / seconds / 1e12, "loss": float(metrics["loss"].total / metrics["loss"].count),
            "peak_memory_gb": memory.get("peak_bytes_in_use", 0) / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="train_step.jsonl")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--objectives", default="sft,ift,dpo")
    parser.add_argument("--chunk", type=int, default=0, help="logps_chunk_size (0 = full logits)")
    args = parser.parse_args()
    shape, dtype = ("tiny", "float32") if args.smoke else ("llama-1b", "bfloat16")
    sequences, length, reps = (4, 64, 2) if args.smoke else (8, 2048, 5)
    impl = "xla" if args.smoke else "cudnn"
    peak = matmul_peak(512 if args.smoke else 8192)
    header = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "peak_bf16_tflops": peak / 1e12,
              "shape": shape, "attention_impl": impl}
    print(json.dumps(header), flush=True)
    rows = []
    with open(args.out, "a") as handle:
        handle.write(json.dumps(header) + "\n")
        for name in args.objectives.split(","):
            config = LlamaConfig(**SHAPES[shape], dtype=dtype, param_dtype="float32", attention_impl=impl)
            try:
                row = measure(name, config, sequences, length, reps, args.chunk)
                row["useful_mfu"] = row["useful_tflops"] * 1e12 / peak
                row["hardware_mfu"] = row["hardware_tflops"] * 1e12 / peak
            except Exception as err:  # one failing objective must not lose the others
                row = {"objective": name, "error": f"{type(err).__name__}: {str(err)[:300]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
            handle.write(json.dumps(row) + "\n")
    print("\n| objective | step (s) | tokens/s | useful MFU | hardware MFU | peak memory (GB) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['objective']} | error: {row['error'][:60]} | | | | |")
        else:
            mfu = f"{100 * row['useful_mfu']:.1f} % | {100 * row['hardware_mfu']:.1f} %"
            print(f"| {row['objective']} | {row['step_s']:.3f} | {row['tokens_per_s']:,.0f} | {mfu} | "
                  f"{row['peak_memory_gb']:.1f} |")


if __name__ == "__main__":
    main()
