"""A GRPO step of jaxalign side by side with TRL's ``GRPOTrainer`` (transformers generation, no vLLM) on the CPU,
in one invocation: step time and its rollout / train split, at the ``tiny`` and ``4x256-v4096`` shapes of
``benchmarks/cpu.py``.

    python benchmarks/grpo_cpu.py            # writes docs/benchmarks/grpo_cpu.{json,md}
    python benchmarks/grpo_cpu.py --smoke    # seconds: checks the script (no file written)

Both sides, float32, one process, the same random-weight Llama (``torch.manual_seed`` / jaxalign seed differ, so
the weights are random on each side but the shapes, token counts and work are the same): ``PROMPTS`` prompts of
``PROMPT_LENGTH`` random token ids, ``GENERATIONS`` completions each of exactly ``COMPLETION_LENGTH`` tokens
(EOS never ends a completion: jaxalign samples with no EOS id, TRL with ``min_new_tokens`` = the length),
temperature 1, the DAPO loss (both sides' default), beta 0, one optimizer step per generation batch (AdamW,
clipping at 1.0), the reward = the share of even token ids in the completion (computed from the ids).

* jaxalign: what ``jaxalign.rl.trainer`` does per step: ``sampling.sample`` with ``num_samples`` = G (one prefill
  per prompt, the KV cache shared), rewards, ``losses.group_advantages``, then the trainer's jitted step
  (``make_train_step`` with the ``grpo`` objective). Rollout = sampling through advantages (the tokens read back
  to the host); train = the step until its outputs are ready. Median over ``reps`` steps after a warm-up step
  (the warm-up compiles). Two jaxalign arms: "a row per completion" (``objective.params.shared_prefix=false``)
  and "shared prefix" (``true``: each group's prompt once, ``data.batching.group_rows``; the same loss and
  gradients, tested), which TRL has no counterpart of. The default, ``"auto"``, takes the layout of fewer model
  FLOPs (``data.batching.group_rows_cost``); the table marks the one it takes at each shape.
* TRL 1.16 ``GRPOTrainer`` (``benchmarks/_torch_side.py``, task ``grpo``, in the torch virtualenv of
  ``benchmarks/cpu.py``): ``trainer.train()`` for reps + 1 steps; the step is timed from ``on_step_begin`` to
  ``on_step_end``, the rollout is the time inside ``_generate_and_score_completions`` (generation, decoding,
  rewards, advantages); train = step - rollout. ``GRPOConfig``: ``use_cpu``, no bf16, no gradient checkpointing,
  ``per_device_train_batch_size`` = P x G, ``num_generations`` = G, ``max_completion_length`` = the length.

``--rounds R`` (default 3) measures every side R times, in turn (the two jaxalign arms, TRL, then again),
so that a slow spell of a shared machine falls on every side alike: each side's times are the median over the
rounds of each round's median step, and each speed-up the median of the R per-round ratios (each round's sides
measured minutes apart at most), with the per-round ratios in the JSON.
"""

# ruff: noqa: E402  (the checkout's own jaxalign must come first on sys.path)

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np
from cpu import LLAMA_4X256, PEAK_SIZES, SMOKE_PEAK_SIZES, hf_config, jax_peak, machine, torch_python
from flax import nnx
from train_step import OPTIM
from train_step import SHAPES as STEP_SHAPES

from jaxalign.data.batching import group_rows, group_rows_cost
from jaxalign.losses import group_advantages
from jaxalign.models import LlamaConfig, create_model
from jaxalign.objectives import get_objective, make_params
from jaxalign.sampling import sample
from jaxalign.train.step import init_state, make_optimizer, make_train_step

SHAPES = {"tiny": STEP_SHAPES["tiny"], "4x256-v4096": {**LLAMA_4X256, "vocab_size": 4096}}
RUN = dict(prompts=4, generations=8, prompt_length=32, completion_length=64, reps=6)
SMOKE_RUN = dict(prompts=2, generations=2, prompt_length=8, completion_length=4, reps=1)
GOAL = 2.0  # the goal: a jaxalign GRPO step >= 2x as fast as TRL's at both shapes


def prompt_ids(run: dict, vocab: int) -> np.ndarray:
    return np.random.default_rng(0).integers(3, vocab, (run["prompts"], run["prompt_length"])).astype(np.int32)


def even_share(completions: np.ndarray) -> np.ndarray:
    """The benchmark's reward: the share of even token ids in each completion."""
    return (np.asarray(completions) % 2 == 0).mean(axis=1).astype(np.float32)


def jax_grpo(shape: str, run: dict, shared_prefix: bool = False) -> dict:
    config = LlamaConfig(**SHAPES[shape], dtype="float32", param_dtype="float32")
    graphdef, params = nnx.split(create_model(config, seed=0))
    tx, _ = make_optimizer(OPTIM, 100)
    state = init_state(nnx.to_pure_dict(params), tx, 0, None)
    g, length = run["generations"], run["completion_length"]
    hp = make_params("grpo", {"loss_type": "dapo", "num_generations": g, "prompts_per_step": run["prompts"],
                              "max_completion_length": length, "shared_prefix": shared_prefix})
    step = make_train_step(graphdef, get_objective("grpo").fn, hp, tx)
    prompts = prompt_ids(run, config.vocab_size)
    rows = len(prompts) * g
    fixed = {"attention_mask": np.ones((rows, prompts.shape[1] + length), np.int32),
             "loss_mask": np.concatenate([np.zeros((rows, prompts.shape[1]), np.int32),
                                          np.ones((rows, length), np.int32)], 1)}
    rollout_s, train_s = [], []
    for i in range(run["reps"] + 1):
        start = time.perf_counter()
        gen = sample(nnx.merge(graphdef, state.params), prompts, max_new_tokens=length, temperature=1.0, seed=i,
                     num_samples=g)
        completions = np.asarray(gen.tokens)
        advantages = np.asarray(group_advantages(jnp.asarray(even_share(completions)), g))
        batch = {"tokens": np.concatenate([np.repeat(prompts, g, 0), completions], 1), **fixed,
                 "advantages": advantages}
        if shared_prefix:
            batch.update(group_rows(batch["tokens"], batch["attention_mask"], batch["loss_mask"], g, length))
        middle = time.perf_counter()
        state, metrics = step(state, {k: jnp.asarray(v) for k, v in batch.items()})
        jax.block_until_ready((state, metrics))
        rollout_s.append(middle - start)
        train_s.append(time.perf_counter() - middle)
    return summary_row("jax-shared" if shared_prefix else "jax", shape, rollout_s, train_s)


def summary_row(side: str, shape: str, rollout_s: list[float], train_s: list[float]) -> dict:
    step_s = [r + t for r, t in zip(rollout_s, train_s, strict=True)]
    return {"side": side, "shape": shape, "step_s": float(np.median(step_s[1:])),
            "rollout_s": float(np.median(rollout_s[1:])), "train_s": float(np.median(train_s[1:])),
            "warmup_step_s": step_s[0], "step_times_s": step_s}


def trl_grpo(python: str, shape: str, run: dict) -> dict:
    config = hf_config(SHAPES[shape])
    spec = {"task": "grpo", "threads": len(os.sched_getaffinity(0)), "shape": shape, "config": config, **run,
            "prompt_ids": prompt_ids(run, config["vocab_size"]).tolist()}
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "spec.json"
        path.write_text(json.dumps(spec))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}
        done = subprocess.run([python, str(Path(__file__).resolve().parent / "_torch_side.py"), str(path)],
                              capture_output=True, text=True, env=env)
    rows = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not rows:
        return {"side": "torch", "shape": shape, "error": f"_torch_side.py exited with {done.returncode}: "
                                                           f"{done.stderr[-800:]}"}
    return rows[-1]


def pooled(measured: list[dict]) -> list[dict]:
    """One row per (shape, side): the median over rounds of each round's step, rollout and train medians (a side
    that failed in any round keeps that round's error), and for the jaxalign sides ``ratios``: TRL's time over
    theirs in each round, for step, rollout and train."""
    rows = []
    for shape in dict.fromkeys(r["shape"] for r in measured):
        torch_rows = {r["round"]: r for r in measured if r["shape"] == shape and r["side"] == "torch"}
        for side in dict.fromkeys(r["side"] for r in measured if r["shape"] == shape):
            rounds = [r for r in measured if r["shape"] == shape and r["side"] == side]
            failed = next((r for r in rounds if "error" in r), None)
            if failed:
                rows.append(failed)
                continue
            row = {"side": side, "shape": shape, "rounds": rounds,
                   **{k: float(np.median([r[k] for r in rounds])) for k in ("step_s", "rollout_s", "train_s")}}
            theirs = [(torch_rows.get(r["round"]), r) for r in rounds]
            if side != "torch" and all(t is not None and "step_s" in t for t, _ in theirs):
                row["ratios"] = {k: [t[f"{k}_s"] / r[f"{k}_s"] for t, r in theirs]
                                 for k in ("step", "rollout", "train")}
            rows.append(row)
    return rows


def auto_layout(shape: str, run: dict) -> dict:
    """The layout ``shared_prefix="auto"`` (the default) trains this shape's groups in, and the model GFLOP of each."""
    separate, grouped = group_rows_cost(LlamaConfig(**SHAPES[shape]), run["generations"], run["prompt_length"],
                                        run["completion_length"])
    return {"side": "jax-shared" if grouped < separate else "jax", "separate_gflop": separate / 1e9,
            "grouped_gflop": grouped / 1e9}


def model_gflop(shape: str, run: dict) -> dict:
    """Model FLOPs of one step (PaLM formula, as benchmarks/cpu.py): the update's forward + backward over every
    prompt + completion token, and the rollout's forward over each prompt once and every completion token."""
    config = LlamaConfig(**SHAPES[shape])
    length = run["prompt_length"] + run["completion_length"]
    rows = run["prompts"] * run["generations"]
    train = config.flops_per_token(length) * rows * length
    forward = config.flops_per_token(length) / 3
    rollout = forward * (run["prompts"] * run["prompt_length"] + rows * run["completion_length"])
    return {"train": train / 1e9, "rollout": rollout / 1e9}


def with_mfu(row: dict, gflop: dict, peak: float) -> dict:
    if "step_s" in row:
        row.update(train_mfu=gflop["train"] / row["train_s"] / peak,
                   rollout_mfu=gflop["rollout"] / row["rollout_s"] / peak, gflop=gflop)
    return row


def markdown(result: dict) -> str:
    run = result["run"]
    lines = [f"GRPO step, jaxalign vs TRL {result.get('trl_version') or ''} `GRPOTrainer` (no vLLM), "
             f"{result['date']}, {result['machine']['cpu']} ({result['machine']['cores']} cores), float32; "
             f"{run['prompts']} prompts x {run['generations']} completions, prompt {run['prompt_length']} + completion "
             f"{run['completion_length']} tokens; each side measured in {run['rounds']} rounds, in turn, a round's "
             f"time the median of {run['reps']} steps after a warm-up step, the table's the median over rounds.", "",
             f"Measured f32 matmul peak (JAX): {result['peak_gflops']:.1f} GFLOP/s.", "",
             "| shape | side | step (s) | rollout (s) | train (s) | rollout MFU | train MFU | jaxalign speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    for shape in result["shapes"]:
        ours = next(r for r in result["rows"] if r["shape"] == shape and r["side"] == "jax")
        shared = next((r for r in result["rows"] if r["shape"] == shape and r["side"] == "jax-shared"), None)
        theirs = next((r for r in result["rows"] if r["shape"] == shape and r["side"] == "torch"), None)
        default = result["auto"][shape]["side"]
        for row, name in ((ours, "jaxalign, a row per completion"), (shared, "jaxalign, shared prefix"),
                          (theirs, "TRL GRPOTrainer")):
            if row is None:
                continue
            if row["side"] == default:
                name += " (the default here)"
            if "error" in row:
                lines.append(f"| {shape} | {name} | error: {row['error'][:120]} | | | | | |")
                continue
            ratio = ""
            if "ratios" in row:  # the median of the per-round ratios; each round's step ratio in brackets
                median = {k: float(np.median(v)) for k, v in row["ratios"].items()}
                ratio = (f"step {median['step']:.2f}x ({', '.join(f'{x:.2f}' for x in row['ratios']['step'])}), "
                         f"rollout {median['rollout']:.2f}x, train {median['train']:.2f}x")
            lines.append(f"| {shape} | {name} | {row['step_s']:.3f} | {row['rollout_s']:.3f} | {row['train_s']:.3f} | "
                         f"{100 * row['rollout_mfu']:.1f} % | {100 * row['train_mfu']:.1f} % | {ratio} |")
        gflop = ours.get("gflop")
        if gflop and theirs and "step_s" in theirs:
            floor = (gflop["train"] + gflop["rollout"]) / result["peak_gflops"]
            lines.append(f"| {shape} | (the step's model FLOPs at the measured peak) | {floor:.3f} | "
                         f"{gflop['rollout'] / result['peak_gflops']:.3f} | "
                         f"{gflop['train'] / result['peak_gflops']:.3f} | 100 % | 100 % | "
                         f"at most {theirs['step_s'] / floor:.2f}x TRL |")
    lines += ["", "The default (`shared_prefix=\"auto\"`) trains a group as the layout of fewer model FLOPs: "
              + "; ".join(f"{shape}: {a['grouped_gflop']:.3g} GFLOP as one row, {a['separate_gflop']:.3g} as "
                          f"{run['generations']} rows" for shape, a in result["auto"].items()) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, tiny shape only; nothing written")
    parser.add_argument("--no-torch", action="store_true", help="the jaxalign side only")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    parser.add_argument("--rounds", type=int, default=3, help="times each side is measured, in turn")
    args = parser.parse_args()
    run = SMOKE_RUN if args.smoke else RUN
    shapes = ["tiny"] if args.smoke else list(SHAPES)
    python, how = (None, "skipped (--no-torch)") if args.no_torch else torch_python(args.smoke)
    measured = []
    for round_ in range(args.rounds):
        for shape in shapes:
            for shared_prefix in (False, True):
                measured.append({**jax_grpo(shape, run, shared_prefix), "round": round_})
                print(json.dumps(measured[-1]), flush=True)
            if python:
                measured.append({**trl_grpo(python, shape, run), "round": round_})
                print(json.dumps(measured[-1]), flush=True)
    rows = pooled(measured)
    # the matmul peak last: run first, its 4096^3 products slowed the jaxalign rollouts after it by 30 % (measured)
    peak = jax_peak(SMOKE_PEAK_SIZES if args.smoke else PEAK_SIZES)["gflops"]
    rows = [with_mfu(row, model_gflop(row["shape"], run), peak) for row in rows]
    result = {"date": datetime.date.today().isoformat(), "machine": machine(), "run": {**run, "rounds": args.rounds},
              "shapes": shapes, "auto": {shape: auto_layout(shape, run) for shape in shapes},
              "peak_gflops": peak,
              "torch_interpreter": how, "rows": rows,
              "trl_version": next((r.get("trl") for r in measured if r.get("trl")), None)}
    text = markdown(result)
    print(text)
    if not args.smoke:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "grpo_cpu.json").write_text(json.dumps(result, indent=1))
        (out / "grpo_cpu.md").write_text(text)


if __name__ == "__main__":
    main()
