"""CPU benchmarks of jaxalign side by side with PyTorch, TRL and transformers, in one invocation.

    python benchmarks/cpu.py                       # full run (about 20 minutes on 2 cores), writes docs/benchmarks/
    python benchmarks/cpu.py --smoke               # tiny sizes, under 2 minutes: checks the script
    python benchmarks/cpu.py --smoke --no-torch    # the jaxalign side only (tests/test_benchmarks.py)

What it measures, all in float32:

1. The machine's matmul peak: jitted square f32 products in JAX (1024, 2048, 4096; median of 10 calls each, the best
   size counts) and ``torch.mm`` at the same sizes. MFU everywhere is divided by the JAX figure.
2. jaxalign train steps: the trainer's own jitted step (``make_train_step``: objective, gradients, global-norm
   clipping, AdamW, NaN guard) for sft, dpo, simpo, orpo, ift and mpo at four shapes (``SHAPES``). The compile time
   is ``lower().compile()``; the memory is ``temp + argument`` bytes of the compiled step's ``memory_analysis()``;
   the step time is the median over ``reps`` steps after one warm-up step. The rows run the default log-prob path
   (``logps_chunk_size=-1``: on the CPU the fused head, ``jaxalign.losses.fused_head_logps``); where the vocabulary
   is large the plain path (``logps_chunk_size=0``: the whole ``[B, T, V]`` logits) is measured as well.
3. The same steps in PyTorch (``benchmarks/_torch_side.py``, run as a subprocess with the interpreter of a separate
   virtualenv, ``benchmarks/.venv-torch``, created on first use; a fresh process for every measurement): TRL's
   ``DPOTrainer``, a hand-written PyTorch DPO step and a PyTorch SFT step, on a transformers ``LlamaForCausalLM``
   with the same config, tokens and masks, with torch using as many threads as JAX has cores. See that file for
   exactly what is timed.
4. Greedy sampling at the SmolLM2-135M shape, batch 1 and 8, 64-token prompts, 64 new tokens: ``jaxalign.sampling
   .generate`` against transformers ``generate(do_sample=False)`` on the same random weights (``save_hf``, then
   ``from_pretrained``), and whether both choose the same tokens.
5. ``--extras`` (default all three, after the rows above): ``bandwidth``, the machine's memory bandwidth
   (``benchmarks/decode.py``'s passes over a 1 GiB array: jitted sum, jitted matrix-vector product, numpy copy),
   and the greedy decoding rows of 4. as a fraction of its best read rate (``decode_fraction``: decode steps per
   second times the bytes a step reads at least, every weight once and the KV cache at its final length);
   ``grpo``, a GRPO step (rollout + update) of jaxalign against TRL's ``GRPOTrainer`` at the 4x256, V 4,096 shape
   (``benchmarks/grpo_cpu.py``); ``shared-prefix``, shared-prefix DPO against packing and padding on the
   prompt-heavy set (``benchmarks/packed_preference.py``) and the shared-prefix GRPO step against repeated
   prompts (``benchmarks/grpo_shared_prefix.py``). Each script's docstring says what it times.

Data: ``examples`` random preference pairs per shape. Each pair has a prompt of a quarter of the padded length and
chosen / rejected completions that end in EOS (id 2); each sequence's total length is drawn from [0.9·S, S] and the
first chosen sequence is exactly S long, so every batch pads to S. SFT and IFT train on the chosen sequences (one
row per pair); the preference objectives on chosen + rejected; MPO on a target pair and a second, "dominant" pair
per example. Padding is on the right; the prompt is not trained on.

Throughput counts real tokens only: the non-padding tokens of every sequence the policy processes (reference passes
are not counted as tokens). MFU = model FLOPs / step time / measured JAX f32 matmul peak, with model FLOPs counted
on the same real tokens (PaLM formula; N = every parameter except an untied input-embedding table, so the LM-head
matmul counts, and a tied table counts once; T = the padded length S):

    policy forward + backward, per token   6·N + 12·L·H·hd·T
    forward only (DPO reference, IFT pass 1, MPO reference on the dominant pair)   2·N + 4·L·H·hd·T
    MPO policy on the dominant pair (only its hidden states are used, so no LM head)   6·(N − V·D) + 12·L·H·hd·T

"MFU" counts every pass; "policy MFU" counts only the policy forward + backward (what SFT on the same tokens needs).
"""

# ruff: noqa: E402  (the checkout's own jaxalign must come first on sys.path, before it is imported)

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python benchmarks/cpu.py` would otherwise import whichever jaxalign is installed

import flax
import jax
import jax.numpy as jnp
import numpy as np
from model_gpu import SHAPES as GPU_SHAPES
from train_step import SHAPES as STEP_SHAPES
from train_step import matmul_peak, train_setup

import jaxalign
from jaxalign.models import LlamaConfig, create_model, save_hf
from jaxalign.sampling import generate

OBJECTIVES = ("sft", "dpo", "simpo", "orpo", "ift", "mpo")
PAIR_OBJECTIVES = ("dpo", "simpo", "orpo")
EOS_ID, PAD_ID = 2, 0
LLAMA_4X256 = dict(hidden_size=256, intermediate_size=640, num_layers=4, num_heads=8, num_kv_heads=4)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model shape, a batch of ``examples`` pairs padded to ``length``, timed ``reps`` steps, and the objectives
    also measured on the plain log-prob path (``logps_chunk_size=0``)."""

    model: dict
    examples: int
    length: int
    reps: int
    plain: tuple[str, ...] = ()


SHAPES = {
    "tiny": Shape(STEP_SHAPES["tiny"], 8, 64, 5),
    "4x256-v4096": Shape({**LLAMA_4X256, "vocab_size": 4096}, 8, 256, 3),
    "4x256-gpt2": Shape({**LLAMA_4X256, "vocab_size": 50257}, 8, 452, 2, ("sft", "dpo")),
    "smollm2-135m": Shape(GPU_SHAPES["smollm2-135m"], 2, 256, 3, ("dpo",)),
}
SMOKE_SHAPES = {"tiny": Shape(STEP_SHAPES["tiny"], 2, 32, 2, ("sft", "dpo"))}
PEAK_SIZES, SMOKE_PEAK_SIZES = (1024, 2048, 4096), (128, 256)
TORCH_ROWS = (("sft", "PyTorch"), ("dpo", "PyTorch"), ("dpo", "TRL DPOTrainer"))  # (objective, implementation)
SAMPLING = dict(shape="smollm2-135m", batches=(1, 8), prompt=64, new=64, reps=2)
SMOKE_SAMPLING = dict(shape="tiny", batches=(1, 8), prompt=8, new=8, reps=1)
TORCH_PIN = ("torch==2.13.0", "trl==1.16.0")
VENV = Path(__file__).resolve().parent / ".venv-torch"


# ---- data ---------------------------------------------------------------------------------------------------------

def preference_examples(count: int, length: int, vocab: int, seed: int) -> list[dict]:
    """``count`` random pairs ``{"prompt", "chosen", "rejected"}`` of token-id lists (see the module docstring)."""
    rng = np.random.default_rng(seed)
    prompt_len = length // 4
    examples = []
    for i in range(count):
        totals = rng.integers(int(0.9 * length), length + 1, 2)
        if i == 0:
            totals[0] = length

        def completion(total):
            return [*rng.integers(3, vocab, total - prompt_len - 1).tolist(), EOS_ID]

        examples.append({"prompt": rng.integers(3, vocab, prompt_len).tolist(), "chosen": completion(totals[0]),
                         "rejected": completion(totals[1])})
    return examples


def sequence_arrays(examples: list[dict], side: str, length: int) -> dict[str, np.ndarray]:
    """``tokens``, ``attention_mask``, ``loss_mask`` ``[n, length]`` of prompt + ``side``, right-padded."""
    n = len(examples)
    tokens = np.full((n, length), PAD_ID, np.int32)
    attention = np.zeros((n, length), np.int32)
    loss = np.zeros((n, length), np.int32)
    for row, example in enumerate(examples):
        prompt, completion = example["prompt"], example[side]
        end = len(prompt) + len(completion)
        tokens[row, :end] = prompt + completion
        attention[row, :end] = 1
        loss[row, len(prompt):end] = 1
    return {"tokens": tokens, "attention_mask": attention, "loss_mask": loss}


def objective_batch(name: str, examples: list[dict], dominant: list[dict], length: int) -> dict[str, np.ndarray]:
    """The batch fields objective ``name`` reads (``example_weight`` included)."""
    weight = {"example_weight": np.ones(len(examples), np.float32)}
    if name in ("sft", "ift"):
        return {**sequence_arrays(examples, "chosen", length), **weight}
    prefixes = {"": examples} if name in PAIR_OBJECTIVES else {"target_": examples, "dominant_": dominant}
    batch = dict(weight)
    for prefix, pairs in prefixes.items():
        for side in ("chosen", "rejected"):
            for field, array in sequence_arrays(pairs, side, length).items():
                batch[f"{prefix}{side}_{field}"] = array
    return batch


# ---- FLOPs --------------------------------------------------------------------------------------------------------

def step_flops(name: str, config: LlamaConfig, batch: dict, length: int) -> tuple[float, float]:
    """``(all passes, policy forward + backward)`` model FLOPs of one step on ``batch``'s real tokens."""
    def tokens(prefix: str) -> int:
        return int(sum(batch[f"{prefix}{side}attention_mask"].sum() for side in ("chosen_", "rejected_")))

    train = config.flops_per_token(length)  # 6N + 12·L·H·hd·T
    forward = train / 3  # 2N + 4·L·H·hd·T
    if name in ("sft", "ift"):
        real = int(batch["attention_mask"].sum())
        return train * real + (forward * real if name == "ift" else 0), train * real
    if name in PAIR_OBJECTIVES:
        real = tokens("")
        return train * real + (forward * real if name == "dpo" else 0), train * real
    target, dominant = tokens("target_"), tokens("dominant_")
    body = train - 6 * config.vocab_size * config.hidden_size
    policy = train * target + body * dominant
    return policy + forward * dominant, policy


def real_tokens(batch: dict) -> int:
    """Non-padding tokens of every sequence in the batch."""
    return int(sum(v.sum() for k, v in batch.items() if k.endswith("attention_mask")))


# ---- the jaxalign side --------------------------------------------------------------------------------------------

def jax_peak(sizes) -> dict:
    """GFLOP/s of jitted f32 square products per size, and the best."""
    by_size = {str(size): matmul_peak(size, jnp.float32) / 1e9 for size in sizes}
    return {"gflops_by_size": by_size, "gflops": max(by_size.values())}


def shape_batch(shape: Shape, name: str) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """The model config and objective ``name``'s batch at ``shape`` (the same tokens on both sides)."""
    config = LlamaConfig(**shape.model)
    examples = preference_examples(shape.examples, shape.length, config.vocab_size, seed=0)
    dominant = preference_examples(shape.examples, shape.length, config.vocab_size, seed=1)
    return config, objective_batch(name, examples, dominant, shape.length)


def throughput(row: dict, shape: Shape, peak_gflops: float) -> dict:
    """Real tokens, tokens/s, model FLOPs and MFU of a timed row (``step_s``) of ``row["objective"]``."""
    config, batch = shape_batch(shape, row["objective"])
    flops, policy_flops = step_flops(row["objective"], config, batch, shape.length)
    tokens = real_tokens(batch)
    seconds = row["step_s"]
    return {"examples": shape.examples, "length": shape.length, "real_tokens": tokens,
            "padded_tokens": int(sum(v.size for k, v in batch.items() if k.endswith("attention_mask"))),
            "tokens_per_s": tokens / seconds, "model_gflop": flops / 1e9, "policy_gflop": policy_flops / 1e9,
            "mfu": flops / seconds / (peak_gflops * 1e9), "policy_mfu": policy_flops / seconds / (peak_gflops * 1e9),
            "params": config.num_params()}


def jax_train_row(shape_name: str, shape: Shape, name: str, chunk: int, peak_gflops: float) -> dict:
    """Compile time, memory, step times, throughput and MFU of the trainer's step for objective ``name``."""
    config, batch = shape_batch(shape, name)
    step, state, reference = train_setup(name, config, chunk)
    args = ({k: jnp.asarray(v) for k, v in batch.items()},) + ((reference,) if reference is not None else ())
    start = time.perf_counter()
    compiled = step.lower(state, *args).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    times, losses = [], []
    for _ in range(shape.reps + 1):  # the first is the warm-up
        start = time.perf_counter()
        state, metrics = compiled(state, *args)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
        losses.append(float(metrics["loss"].value))
    row = {"side": "jaxalign", "shape": shape_name, "objective": name, "implementation": "jaxalign",
           "logps_chunk_size": chunk, "step_s": float(np.median(times[1:])), "step_times_s": times,
           "compile_s": compile_s, "memory_bytes": memory.temp_size_in_bytes + memory.argument_size_in_bytes,
           "memory_analysis": {k: getattr(memory, k) for k in dir(memory) if k.endswith("_in_bytes")},
           "losses": losses}
    return {**row, **throughput(row, shape, peak_gflops)}


def jax_sampling(config: LlamaConfig, batches, prompt_len: int, new: int, reps: int, folder: Path) -> list[dict]:
    """Greedy ``generate`` timings per batch size; the model is saved to ``folder`` for transformers."""
    from decode import step_bytes

    model = create_model(config, seed=0)
    save_hf(model, folder)
    rows = []
    for batch in batches:
        prompts = np.random.default_rng(batch).integers(3, config.vocab_size, (batch, prompt_len))
        start = time.perf_counter()
        tokens = np.asarray(generate(model, prompts, max_new_tokens=new))
        first_s = time.perf_counter() - start
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            tokens = np.asarray(generate(model, prompts, max_new_tokens=new))
            times.append(time.perf_counter() - start)
        seconds = float(np.median(times))
        rows.append({"side": "jaxalign", "batch": batch, "prompt_len": prompt_len, "new_tokens": new,
                     "seconds": seconds, "first_call_s": first_s, "tokens_per_s": batch * new / seconds,
                     # bytes a decode step reads at least: every weight once, and the KV cache at its final length
                     "step_bytes": step_bytes(model, batch, prompt_len + new),
                     "prompts": prompts.tolist(), "tokens": tokens.tolist()})
    return rows


# ---- the PyTorch side ---------------------------------------------------------------------------------------------

def torch_python(smoke: bool) -> tuple[str | None, str]:
    """The interpreter for ``_torch_side.py`` and how it was chosen. Creates ``VENV`` when needed (not in smoke
    mode, where the current interpreter serves if it has torch and transformers; TRL rows then need ``trl``)."""
    venv_python = VENV / "bin" / "python"
    check = "import torch, transformers, trl"
    if venv_python.exists() and subprocess.run([venv_python, "-c", check], capture_output=True).returncode == 0:
        return str(venv_python), f"virtualenv {VENV.relative_to(ROOT)}"
    if smoke:
        ok = subprocess.run([sys.executable, "-c", "import torch, transformers"], capture_output=True).returncode == 0
        if ok:
            return sys.executable, "the current interpreter (smoke mode; no virtualenv yet)"
        return None, "skipped: no torch in this interpreter and no virtualenv (run once without --smoke to create it)"
    print(f"creating {VENV} with {' '.join(TORCH_PIN)} (a minute or two, once)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([venv_python, "-m", "pip", "install", "--quiet", *TORCH_PIN], check=True)
    return str(venv_python), f"virtualenv {VENV.relative_to(ROOT)} (created by this run)"


def hf_config(model: dict) -> dict:
    """transformers ``LlamaConfig`` keyword arguments for a jaxalign shape."""
    config = LlamaConfig(**model)
    return dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                head_dim=config.head_dim, tie_word_embeddings=config.tie_word_embeddings,
                rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps,
                max_position_embeddings=config.max_position_embeddings)


def torch_tasks(shapes: dict[str, Shape], peak_sizes, sampling: list[dict], spec: dict, folder: Path) -> list[dict]:
    """The PyTorch side's tasks, one process each: the matmul peak, every (shape, row) of ``TORCH_ROWS``, and
    greedy sampling on ``sampling``'s prompts."""
    tasks = [{"task": "peak", "peak_sizes": list(peak_sizes)}]
    for name, shape in shapes.items():
        examples = preference_examples(shape.examples, shape.length, shape.model["vocab_size"], seed=0)
        tasks += [{"task": "train", "shape": name, "objective": objective, "implementation": implementation,
                   "config": hf_config(shape.model), "length": shape.length, "reps": shape.reps, "examples": examples}
                  for objective, implementation in TORCH_ROWS]
    if sampling:
        tasks.append({"task": "sampling", "folder": str(folder), "new_tokens": spec["new"], "reps": spec["reps"],
                      "prompts": [r["prompts"] for r in sampling]})
    return tasks


def run_torch_side(python: str, spec: dict, work: Path, shapes: dict[str, Shape], peak_gflops: float) -> list[dict]:
    """Runs ``_torch_side.py`` on one task; its ``RESULT {json}`` lines, in order (its stderr passes through), train
    rows with their throughput and MFU (against the JAX peak)."""
    spec_path = work / "torch_spec.json"
    spec_path.write_text(json.dumps(spec))
    script = Path(__file__).resolve().parent / "_torch_side.py"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONWARNINGS": "ignore::FutureWarning"}
    process = subprocess.Popen([python, str(script), str(spec_path)], stdout=subprocess.PIPE, text=True, env=env)
    rows = []
    for line in process.stdout:
        if line.startswith("RESULT "):
            row = json.loads(line[len("RESULT "):])
            if "step_s" in row:
                row.update(throughput(row, shapes[row["shape"]], peak_gflops))
            rows.append(row)
            print(summary_line(row), flush=True)
    if process.wait() != 0:
        rows.append({"side": "torch", **{k: spec[k] for k in ("shape", "objective", "implementation") if k in spec},
                     "error": f"_torch_side.py exited with {process.returncode}"})
    return rows


# ---- reporting ----------------------------------------------------------------------------------------------------

def summary_line(row: dict) -> str:
    if "error" in row:
        return f"  {row.get('side')} {row.get('shape', '')} {row.get('objective', '')}: ERROR {row['error'][:200]}"
    if "step_s" in row:
        chunk = " (plain logits)" if row.get("logps_chunk_size") == 0 and row["side"] == "jaxalign" else ""
        return (f"  {row['shape']:>13} {row['objective']:>5} {row['implementation']}{chunk}: "
                f"{row['step_s']:.3f} s/step, {row['tokens_per_s']:,.0f} tokens/s")
    if "gflops" in row:
        return f"  {row['side']} matmul peak {row['gflops']:.1f} GFLOP/s {row['gflops_by_size']}"
    return f"  {row['side']} generate batch {row['batch']}: {row['tokens_per_s']:,.1f} tokens/s"


def attach_ratios(train: list[dict]) -> None:
    """``vs_jaxalign`` on every PyTorch row: jaxalign's tokens/s (default path; ``vs_jaxalign_plain``: the plain
    logits path, where measured) over that row's."""
    jax_rows = {(r["shape"], r["objective"], r["logps_chunk_size"]): r for r in train
                if r["side"] == "jaxalign" and "error" not in r}
    for row in train:
        if row["side"] != "torch" or "error" in row:
            continue
        for (shape, objective, chunk), ours in jax_rows.items():
            if shape == row["shape"] and objective == row["objective"]:
                key = "vs_jaxalign" if chunk == -1 else "vs_jaxalign_plain"
                row[key] = ours["tokens_per_s"] / row["tokens_per_s"]


def find(rows: list[dict], **match) -> dict | None:
    return next((r for r in rows if "error" not in r and all(r.get(k) == v for k, v in match.items())), None)


def targets(train: list[dict], sampling: list[dict], shape_names) -> list[tuple[str, str, bool | None]]:
    """(goal, measured, met) for the targets of issue 11 that this run measures."""
    out = []

    def ratio_goal(goal, shape, implementation, minimum):
        row = find(train, shape=shape, objective="dpo", implementation=implementation)
        if row is None or "vs_jaxalign" not in row:
            return
        text = f"{row['vs_jaxalign']:.2f}×" + (f" (plain logits {row['vs_jaxalign_plain']:.2f}×)"
                                              if "vs_jaxalign_plain" in row else "")
        out.append((goal, text, row["vs_jaxalign"] >= minimum))

    ratio_goal("DPO ≥ 4× TRL, GPT-2 vocabulary", "4x256-gpt2", "TRL DPOTrainer", 4.0)
    ratio_goal("DPO ≥ 2× plain PyTorch, GPT-2 vocabulary", "4x256-gpt2", "PyTorch", 2.0)
    ratio_goal("DPO ≥ 1.3× plain PyTorch, V = 4,096", "4x256-v4096", "PyTorch", 1.3)
    ratio_goal("DPO ahead of TRL, SmolLM2-135M shape", "smollm2-135m", "TRL DPOTrainer", 1.0)
    for shape in shape_names:
        sft = find(train, shape=shape, objective="sft", side="jaxalign", logps_chunk_size=-1)
        ift = find(train, shape=shape, objective="ift", side="jaxalign", logps_chunk_size=-1)
        if sft and ift:
            ratio = ift["step_s"] / sft["step_s"]
            out.append((f"IFT step ≤ 1.6× SFT step, {shape}", f"{ratio:.2f}×", ratio <= 1.6))
    for shape in ("4x256-v4096", "4x256-gpt2"):
        rows = [r for r in train if r["side"] == "jaxalign" and r["shape"] == shape and "error" not in r
                and r["logps_chunk_size"] == -1]
        if rows:
            best = max(rows, key=lambda r: r["mfu"])
            out.append((f"CPU MFU ≥ 50 %, {shape}", f"best {100 * best['mfu']:.1f} % ({best['objective']})",
                        best["mfu"] >= 0.5))
    batch8 = find(sampling, batch=8, side="jaxalign")
    torch8 = find(sampling, batch=8, side="torch")
    if batch8 and torch8:
        ratio = batch8["tokens_per_s"] / torch8["tokens_per_s"]
        out.append(("greedy ≥ 3× transformers, batch 8", f"{ratio:.2f}×", ratio >= 3.0))
    return out


def markdown(result: dict) -> str:
    lines = []
    peaks = result["peak"]
    lines += ["| matmul (f32, square) | " + " | ".join(peaks["jaxalign"]["gflops_by_size"]) + " | best |",
              "|---|" + "---|" * (len(peaks["jaxalign"]["gflops_by_size"]) + 1)]
    for side, label in (("jaxalign", "JAX (jit)"), ("torch", "PyTorch (torch.mm)")):
        if side in peaks and "gflops_by_size" in peaks[side]:
            sizes = peaks[side]["gflops_by_size"]
            lines.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in sizes.values())
                         + f" | **{peaks[side]['gflops']:.1f} GFLOP/s** |")
    train = result["train"]
    for shape in result["shapes"]:
        rows = [r for r in train if r.get("shape") == shape]
        if not rows:
            continue
        first = next((r for r in rows if "examples" in r), None)
        params = next((r["params"] for r in rows if "params" in r), 0)
        title = f"{shape}: {params / 1e6:.2f}M parameters"
        if first:
            title += f", {first['examples']} examples padded to {first['length']}"
        lines += ["", f"**{title}**", "",
                  "| objective | implementation | step (s) | real tokens/s | MFU (all passes) | policy MFU "
                  "| compile (s) | memory (MB) | jaxalign ÷ this |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r.get('objective', '')} | {r.get('implementation', '')} | error: "
                             f"{r['error'][:80]} | | | | | | |")
                continue
            impl = r["implementation"] + (", plain logits" if r["side"] == "jaxalign" and r.get("logps_chunk_size") == 0
                                          else "")
            compile_s = f"{r['compile_s']:.1f}" if "compile_s" in r else ""
            memory = f"{r['memory_bytes'] / 2**20:,.0f}" if "memory_bytes" in r else ""
            ratio = f"{r['vs_jaxalign']:.2f}×" if "vs_jaxalign" in r else ""
            if "vs_jaxalign_plain" in r:
                ratio += f" (plain logits {r['vs_jaxalign_plain']:.2f}×)"
            lines.append(f"| {r['objective']} | {impl} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                         f"{100 * r['mfu']:.1f} % | {100 * r['policy_mfu']:.1f} % | {compile_s} | {memory} | {ratio} |")
    sampling = result["sampling"]
    if sampling:
        lines += ["", "| greedy, batch | jaxalign tokens/s | transformers tokens/s | jaxalign ÷ transformers "
                  "| same tokens (row 0) | rows identical | jaxalign first call (s) |", "|---|---|---|---|---|---|---|"]
        for ours in (r for r in sampling if r.get("side") == "jaxalign"):
            theirs = find(sampling, side="torch", batch=ours["batch"])
            if theirs is None:
                lines.append(f"| {ours['batch']} | {ours['tokens_per_s']:,.1f} | | | | | {ours['first_call_s']:.1f} |")
                continue
            same = ours["matching_prefix"]
            lines.append(f"| {ours['batch']} | {ours['tokens_per_s']:,.1f} | {theirs['tokens_per_s']:,.1f} | "
                         f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}× | {same[0]}/{ours['new_tokens']} | "
                         f"{sum(m == ours['new_tokens'] for m in same)}/{len(same)} | {ours['first_call_s']:.1f} |")
    lines += extras_markdown(result)
    if result["targets"]:
        lines += ["", "| target (issue 11) | measured | met |", "|---|---|---|"]
        for goal, measured, met in result["targets"]:
            lines.append(f"| {goal} | {measured} | {'yes' if met else 'no'} |")
    return "\n".join(lines)


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    return {"cpu": model or platform.processor(), "cores": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__,
            "numpy": np.__version__,
            "jaxalign_path": str(Path(jaxalign.__file__).parent),
            "jax_compilation_cache": jax.config.jax_compilation_cache_dir or None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (under 2 minutes): checks the script")
    parser.add_argument("--no-torch", action="store_true", help="the jaxalign side only")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"), help="folder for cpu-<date>.json")
    parser.add_argument("--shapes", default="", help="comma list of train-step shapes to run (default: all)")
    parser.add_argument("--no-sampling", action="store_true", help="skip the greedy-sampling comparison")
    parser.add_argument("--extras", default=",".join(EXTRAS),
                        help=f"comma list of extra sections ({', '.join(EXTRAS)}); '' for none")
    args = parser.parse_args()
    extras = [name for name in args.extras.split(",") if name]
    if set(extras) - set(EXTRAS):
        parser.error(f"--extras: unknown {sorted(set(extras) - set(EXTRAS))} (known: {', '.join(EXTRAS)})")
    started = datetime.datetime.now(datetime.UTC)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        shapes = {name: shapes[name] for name in args.shapes.split(",")}
    sampling_spec = SMOKE_SAMPLING if args.smoke else SAMPLING
    info = machine()
    result = {"started_utc": started.isoformat(timespec="seconds"), "command": " ".join(["python", *sys.argv]),
              "machine": info, "shapes": list(shapes), "peak": {}, "train": [], "sampling": [], "targets": []}
    print(json.dumps(info), flush=True)

    result["peak"]["jaxalign"] = {"side": "jaxalign", **jax_peak(SMOKE_PEAK_SIZES if args.smoke else PEAK_SIZES)}
    print(summary_line(result["peak"]["jaxalign"]), flush=True)
    peak = result["peak"]["jaxalign"]["gflops"]
    for shape_name, shape in shapes.items():
        variants = [(name, -1) for name in OBJECTIVES] + [(name, 0) for name in shape.plain]
        for name, chunk in variants:
            try:
                row = jax_train_row(shape_name, shape, name, chunk, peak)
            except Exception as err:  # one failing row must not lose the others
                row = {"side": "jaxalign", "shape": shape_name, "objective": name, "implementation": "jaxalign",
                       "logps_chunk_size": chunk, "error": f"{type(err).__name__}: {str(err)[:300]}"}
            result["train"].append(row)
            print(summary_line(row), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        gen_config = LlamaConfig(**(SHAPES | SMOKE_SHAPES)[sampling_spec["shape"]].model)
        if not args.no_sampling:
            result["sampling"] = jax_sampling(gen_config, sampling_spec["batches"], sampling_spec["prompt"],
                                              sampling_spec["new"], sampling_spec["reps"], work / "model")
        for row in result["sampling"]:
            print(summary_line(row), flush=True)
        python, how = (None, "skipped: --no-torch") if args.no_torch else torch_python(args.smoke)
        result["torch_interpreter"] = how
        print(f"PyTorch side: {how}", flush=True)
        tasks = torch_tasks(shapes, SMOKE_PEAK_SIZES if args.smoke else PEAK_SIZES, result["sampling"],
                            sampling_spec, work / "model") if python else []
        for task in tasks:
            for row in run_torch_side(python, {"threads": info["cores"], **task}, work, shapes, peak):
                if "gflops" in row:
                    result["peak"]["torch"] = row
                elif "batch" in row:
                    result["sampling"].append(row)
                else:
                    result["train"].append(row)
        result.update(run_extras(extras, args.smoke, python, peak))
    finish(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cpu-{started.date().isoformat()}{'-smoke' if args.smoke else ''}.json"
    result["wall_s"] = (datetime.datetime.now(datetime.UTC) - started).total_seconds()
    path.write_text(json.dumps(result, indent=1) + "\n")
    print("\n" + markdown(result) + "\n")
    print(f"raw results: {path} ({result['wall_s'] / 60:.1f} min)")


EXTRAS = ("bandwidth", "grpo", "shared-prefix")


def run_extras(extras: list[str], smoke: bool, python: str | None, peak: float) -> dict:
    """The ``--extras`` sections, measured by the functions of their own benchmark scripts."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    out = {}
    if "bandwidth" in extras:
        from decode import bandwidth

        out["bandwidth"] = bandwidth(0.125 if smoke else 1.0)
        print(f"  bandwidth {json.dumps(out['bandwidth'])}", flush=True)
    if "grpo" in extras:
        import grpo_cpu

        run, shape = (grpo_cpu.SMOKE_RUN, "tiny") if smoke else (grpo_cpu.RUN, "4x256-v4096")
        rows = [grpo_cpu.jax_grpo(shape, run), grpo_cpu.jax_grpo(shape, run, shared_prefix=True)]
        rows += [grpo_cpu.trl_grpo(python, shape, run)] if python else []
        gflop = grpo_cpu.model_gflop(shape, run)
        out["grpo"] = {"shape": shape, "run": run, "rows": [grpo_cpu.with_mfu(row, gflop, peak) for row in rows]}
        for row in out["grpo"]["rows"]:
            print(f"  grpo {row['side']}: " + (f"{row['step_s']:.3f} s/step" if "step_s" in row else row["error"]),
                  flush=True)
    if "shared-prefix" in extras:
        import grpo_shared_prefix
        import packed_preference

        out["shared_prefix"] = {"dpo": packed_preference.measure("prompt-heavy", smoke),
                                "grpo": grpo_shared_prefix.measure(smoke)}
    return out


def decode_against_bandwidth(result: dict) -> list[dict]:
    """jaxalign's greedy decoding rows as a fraction of the measured bandwidth limit: decode steps per second times
    the bytes a step reads at least, over the best read rate of the same invocation."""
    if "bandwidth" not in result:
        return []
    rows = []
    for r in result.get("sampling") or []:
        if r.get("side") == "jaxalign" and "step_bytes" in r:
            steps_per_s = r["tokens_per_s"] / r["batch"]
            read_gbs = steps_per_s * r["step_bytes"] / 1e9
            rows.append({"batch": r["batch"], "steps_per_s": steps_per_s, "step_bytes": r["step_bytes"],
                         "read_gbs": read_gbs, "fraction": read_gbs / result["bandwidth"]["limit_gbs"]})
    result["decode_fraction"] = rows
    return rows


def extras_markdown(result: dict) -> list[str]:
    lines = []
    if "bandwidth" in result:
        rates = result["bandwidth"]
        lines += ["", f"Memory bandwidth ({rates['array_bytes'] / 2**30:.2f} GiB arrays, best of 5): jitted sum "
                      f"{rates['jax_sum_read_gbs']:.1f} GB/s, jitted matrix-vector product "
                      f"{rates['jax_matvec_read_gbs']:.1f} GB/s, numpy copy {rates['numpy_copy_read_write_gbs']:.1f} "
                      "GB/s read + write."]
        for row in result.get("decode_fraction", []):
            lines.append(f"Greedy decoding at batch {row['batch']}: {row['steps_per_s']:.1f} steps/s x "
                         f"{row['step_bytes'] / 1e6:.1f} MB per step = {row['read_gbs']:.1f} GB/s, "
                         f"**{100 * row['fraction']:.0f} % of the measured limit** ({rates['limit_gbs']:.1f} GB/s; "
                         "the bytes count every weight once and the KV cache at its final length, a lower bound).")
    if "grpo" in result:
        rows = {r["side"]: r for r in result["grpo"]["rows"]}
        lines += ["", f"**GRPO step, {result['grpo']['shape']}** ({result['grpo']['run']['prompts']} prompts x "
                      f"{result['grpo']['run']['generations']} completions of "
                      f"{result['grpo']['run']['completion_length']} tokens)", "",
                  "| side | step (s) | rollout (s) | train (s) | train MFU | speed-up over TRL |",
                  "|---|---|---|---|---|---|"]
        trl = rows.get("torch")
        for side, label in (("jax", "jaxalign"), ("jax-shared", "jaxalign, shared prefix (`shared_prefix`)"),
                            ("torch", "TRL GRPOTrainer")):
            row = rows.get(side)
            if row is None or "step_s" not in row:
                lines.append(f"| {label} | {row['error'][:100] if row else 'not run'} | | | | |")
                continue
            ratio = f"{trl['step_s'] / row['step_s']:.2f}×" if side != "torch" and trl and "step_s" in trl else ""
            lines.append(f"| {label} | {row['step_s']:.3f} | {row['rollout_s']:.3f} | {row['train_s']:.3f} | "
                         f"{100 * row['train_mfu']:.1f} % | {ratio} |")
    if "shared_prefix" in result:
        dpo = result["shared_prefix"]["dpo"]["sets"]["prompt-heavy"]
        lines += ["", "**Shared prefix** (real tokens/s)", "",
                  "| objective | set | baseline | shared prefix | shared ÷ baseline |", "|---|---|---|---|---|"]
        padded, packed, shared, per_row, padded_fine, per_row_fine = dpo["rows"].values()
        lines.append(f"| DPO | prompt-heavy ({100 * dpo['prompt_share']:.0f} % prompt) | padded "
                     f"{padded['tokens_per_s']:,.0f} (32-token buckets {padded_fine['tokens_per_s']:,.0f}), packed "
                     f"{packed['tokens_per_s']:,.0f} | one pair per row {per_row['tokens_per_s']:,.0f} (32-token "
                     f"buckets {per_row_fine['tokens_per_s']:,.0f}), packed {shared['tokens_per_s']:,.0f} | "
                     f"{dpo['shared_over_unshared']:.2f}× (best of each) |")
        for row in result["shared_prefix"]["grpo"]["rows"]:
            lines.append(f"| GRPO, G = 8 | prompt share {row['prompt_share']:.3f} | repeated prompts "
                         f"{row['repeated']['tokens_per_s']:,.0f} | {row['shared']['tokens_per_s']:,.0f} | "
                         f"{row['speedup']:.2f}× |")
    return lines


def finish(result: dict) -> None:
    """Ratios, token agreement of sampling, targets."""
    attach_ratios(result["train"])
    for ours in (r for r in result["sampling"] if r["side"] == "jaxalign"):
        theirs = find(result["sampling"], side="torch", batch=ours["batch"])
        if theirs:
            ours["matching_prefix"] = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                                       for x, y in zip(ours["tokens"], theirs["tokens"], strict=True)]
    result["targets"] = targets(result["train"], result["sampling"], result["shapes"])
    decode_against_bandwidth(result)


if __name__ == "__main__":
    main()
