"""Scanned vs unrolled decoder layers (``model.scan_layers``), side by side in one invocation.

    python benchmarks/scan_layers.py                 # about 6 minutes on 2 CPU cores; writes docs/benchmarks/
    python benchmarks/scan_layers.py --smoke         # tiny sizes: checks the script

For each shape, the same random model (the same seed: the weights do not depend on the layout) is built unrolled and
scanned, and measured in separate fresh processes run one after the other (so no compilation cache or warm allocator
is shared between the arms):

1. The trainer's own jitted SFT step (``make_train_step``: loss, gradients, clipping, AdamW, NaN guard) on 4 rows:
   the time of ``lower()`` (tracing) and of ``compile()``, the compiled step's ``temp + argument`` bytes
   (``memory_analysis``), and the median step time over ``reps`` steps after one warm-up step. The first step's loss
   is recorded in both arms (they must agree).
2. Greedy ``jaxalign.sampling.generate`` (KV cache, batch 1 and 8, 32-token prompts): the first call (compile + run)
   and the median of the following calls, and whether both arms choose the same tokens.

Shapes: ``tiny-32`` (32 layers, d 64; the issue's "32-layer tiny model"), ``smollm2`` (SmolLM2-135M's decoder: 30
layers, d 576, 9/3 heads, tied; vocabulary 4,096 so the decoder body, not the LM head, dominates) and ``gemma2-26``
(a 26-layer Gemma 2 pattern of alternating sliding / global layers, d 128: period-2 blocks).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "tiny-32": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=32, num_heads=4,
                    num_kv_heads=2),
    "smollm2": dict(vocab_size=4096, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                    num_kv_heads=3, tie_word_embeddings=True),
    "gemma2-26": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=26, num_heads=4,
                      num_kv_heads=2, head_dim=32, architecture="gemma2", norm_offset=1.0, embed_scale=True,
                      sandwich_norms=True, hidden_act="gelu_tanh", query_pre_attn_scalar=32, attn_softcap=50.0,
                      final_softcap=30.0, sliding_window=64, sliding_window_layers=(True, False) * 13,
                      tie_word_embeddings=True),
}
LENGTH = {"tiny-32": 64, "smollm2": 256, "gemma2-26": 128}


def measure(shape: str, scan: bool, smoke: bool) -> dict:
    """One arm, in this process."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_step import batch_for, train_setup

    from jaxalign.models import LlamaConfig, create_model
    from jaxalign.models.llama import layer_plan
    from jaxalign.sampling import generate

    values = dict(SHAPES[shape])
    if smoke:
        values.update(num_layers=6, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16)
        if "sliding_window_layers" in values:
            values["sliding_window_layers"] = (True, False) * 3
    config = LlamaConfig(**values, scan_layers=scan)
    length = 16 if smoke else LENGTH[shape]
    step, state, _ = train_setup("sft", config, -1)
    batch = {k: jnp.asarray(v) for k, v in batch_for("sft", 4, length, config.vocab_size).items()}
    start = time.perf_counter()
    lowered = step.lower(state, batch)
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    times, losses = [], []
    for _ in range((2 if smoke else 4) + 1):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
        losses.append(float(metrics["loss"].value))
    row = {"shape": shape, "scan": scan, "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
           "plan": list(layer_plan(config)), "length": length, "lower_s": lower_s,
           "compile_s": compile_s, "step_s": float(np.median(times[1:])), "step_times_s": times, "losses": losses,
           "memory_bytes": memory.temp_size_in_bytes + memory.argument_size_in_bytes}
    model = create_model(config, seed=0)
    row["decode"] = []
    for rows in (1, 8):
        prompts = np.random.default_rng(rows).integers(3, config.vocab_size, (rows, 32))
        new = 8 if smoke else 64
        start = time.perf_counter()
        tokens = np.asarray(generate(model, prompts, max_new_tokens=new))
        first = time.perf_counter() - start
        runs = []
        for _ in range(2 if smoke else 3):
            start = time.perf_counter()
            np.asarray(generate(model, prompts, max_new_tokens=new))
            runs.append(time.perf_counter() - start)
        seconds = float(np.median(runs))
        row["decode"].append({"batch": rows, "new_tokens": new, "first_call_s": first, "seconds": seconds,
                              "tokens_per_s": rows * new / seconds, "tokens": tokens.tolist()})
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # internal: "shape:scan" measured in this process
    args = parser.parse_args()
    if args.arm:
        shape, scan = args.arm.split(":")
        print(json.dumps(measure(shape, scan == "1", args.smoke)))
        return
    rows = []
    for shape in args.shapes.split(","):
        for scan in (False, True):
            command = [sys.executable, __file__, "--arm", f"{shape}:{int(scan)}"] + (["--smoke"] if args.smoke else [])
            done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
            if done.returncode:
                raise SystemExit(f"{shape} scan={scan} failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(summary(rows[-1]), flush=True)
    import jax

    result = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "jax": jax.__version__, "device": rows[0]["device"], "rows": rows}
    print(markdown(rows))
    if not args.smoke:
        out = Path(args.out) / f"scan-layers-{rows[0]['backend']}-{result['date']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")


def summary(row: dict) -> str:
    return (f"{row['shape']:10s} scan={row['scan']!s:5s} plan={row['plan']} lower {row['lower_s']:.2f}s compile "
            f"{row['compile_s']:.2f}s step {row['step_s']:.3f}s memory {row['memory_bytes'] / 2**20:.0f} MiB; decode "
            + ", ".join(f"b{d['batch']} first {d['first_call_s']:.2f}s then {d['tokens_per_s']:.1f} tok/s"
                        for d in row["decode"]))


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | train step: lower + compile, unrolled → scanned | ratio | step time | memory | "
             "decode b1 / b8 first call | decode b1 / b8 tok/s | same tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for unrolled, scanned in zip(rows[::2], rows[1::2], strict=True):
        u = unrolled["lower_s"] + unrolled["compile_s"]
        s = scanned["lower_s"] + scanned["compile_s"]
        same = all(a["tokens"] == b["tokens"] for a, b in zip(unrolled["decode"], scanned["decode"], strict=True))
        first = " / ".join(f"{a['first_call_s']:.1f} → {b['first_call_s']:.1f} s"
                           for a, b in zip(unrolled["decode"], scanned["decode"], strict=True))
        speed = " / ".join(f"{a['tokens_per_s']:.1f} → {b['tokens_per_s']:.1f}"
                           for a, b in zip(unrolled["decode"], scanned["decode"], strict=True))
        lines.append(f"| {unrolled['shape']} (plan {tuple(scanned['plan'])}) | {u:.2f} → {s:.2f} s | {u / s:.2f}x | "
                     f"{unrolled['step_s']:.3f} → {scanned['step_s']:.3f} s | "
                     f"{unrolled['memory_bytes'] / 2**20:.0f} → {scanned['memory_bytes'] / 2**20:.0f} MiB | {first} | "
                     f"{speed} | {same} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
