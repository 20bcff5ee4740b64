"""The distillation loss with whole logits against the blocked, memory-light one, side by side in one process.

``objective.params.logits_block``: 0 forms the student's and the teacher's ``[B, T, V]`` logits whole (and their
log-softmaxes, the mixture, the gradient); ``n > 0`` walks the positions ``n`` at a time with a closed-form
gradient (``jaxalign.losses.blocked_generalized_jsd``); -1, the default, chooses by size. This compiles the
gradient of the distillation objective (a student and a teacher with one decoder layer each, so the heads and the
loss dominate) for each setting, and the same two decoders without heads or loss ("decoders only": their
attention and activations), and reports the compiled ``temp`` bytes (``memory_analysis()``), and on the
shapes small enough to run here the step's time (median of ``--repeats`` calls, the settings in turns).

    python benchmarks/distill_logits.py              # SmolLM2's head (V 49,152) at 4 x 512, timed, and two larger
                                                     # shapes compiled only (a Qwen3 vocabulary at 8 x 2,048)
    python benchmarks/distill_logits.py --smoke --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxalign.models import LlamaConfig, create_model
from jaxalign.objectives import DistillParams, get_objective
from jaxalign.objectives.distill import resolve_logits_block

# name: (student width, teacher width, vocabulary, rows, length, run it here)
SHAPES = {
    "smoke": (32, 64, 512, 2, 64, True),
    "smollm2-4x512": (576, 960, 49152, 4, 512, True),   # SmolLM2-135M's head, SmolLM2-360M's as the teacher
    "smollm2-8x2048": (576, 960, 49152, 8, 2048, False),
    "qwen3-8x2048": (1024, 2560, 151936, 8, 2048, False),  # Qwen3-0.6B's width and vocabulary, Qwen3-4B's teacher
}


def _model(width: int, vocab: int, seed: int):
    heads = max(width // 64, 1)
    config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_layers=1,
                         num_heads=heads, num_kv_heads=heads, tie_word_embeddings=True)
    return create_model(config, seed=seed)


def measure(name: str, blocks: list[int], repeats: int) -> dict:
    student_width, teacher_width, vocab, rows, length, run = SHAPES[name]
    student, teacher = _model(student_width, vocab, 0), _model(teacher_width, vocab, 1)
    graphdef, params = nnx.split(student)
    teacher_graphdef, teacher_params = nnx.split(teacher)  # an argument, not a constant folded into the program
    fn = get_objective("distill").fn
    tokens = jax.random.randint(jax.random.key(0), (rows, length), 0, vocab)
    loss_mask = jnp.ones((rows, length), jnp.int32).at[:, : length // 4].set(0)  # a quarter prompt
    batch = {"tokens": tokens, "attention_mask": jnp.ones_like(tokens), "loss_mask": loss_mask}
    out = {"shape": name, "student_width": student_width, "teacher_width": teacher_width, "vocab": vocab,
           "rows": rows, "length": length, "backend": jax.default_backend(), "settings": {}}
    steps = {}
    for block in [None, *blocks]:  # None: the decoders alone, for the share of the bytes the loss adds
        hparams = DistillParams(teacher="t", beta=0.5, logits_block=block or 0)

        def grad_fn(p, t, b, hparams=hparams, block=block):
            teacher = nnx.merge(teacher_graphdef, t)

            def loss(p):
                model = nnx.merge(graphdef, p)
                if block is None:
                    hidden = model.hidden_states(b["tokens"], b["attention_mask"])[0]
                    other = jax.lax.stop_gradient(teacher.hidden_states(b["tokens"], b["attention_mask"])[0])
                    return jnp.mean(hidden) * jnp.mean(other)
                return fn(model, b, hparams, reference=teacher)[0]
            return jax.value_and_grad(loss)(p)

        began = time.perf_counter()
        compiled = jax.jit(grad_fn).lower(params, teacher_params, batch).compile()
        memory = compiled.memory_analysis()
        label = "decoders only" if block is None else f"logits_block={block}"
        resolved = -1 if block is None else resolve_logits_block(block, rows, length - 1, vocab)
        out["settings"][label] = {
            "block": resolved, "compile_s": time.perf_counter() - began, "temp_bytes": memory.temp_size_in_bytes,
            "argument_bytes": memory.argument_size_in_bytes}
        steps[label] = compiled
    if run:
        times = {label: [] for label in steps}
        for _ in range(repeats):  # the settings in turns, so drift in the machine's speed hits each alike
            for label, compiled in steps.items():
                began = time.perf_counter()
                jax.block_until_ready(compiled(params, teacher_params, batch))
                times[label].append(time.perf_counter() - began)
        for label, seconds in times.items():
            out["settings"][label]["step_s"] = statistics.median(seconds[1:] or seconds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the smoke shape only (seconds)")
    parser.add_argument("--shapes", default="smollm2-4x512,smollm2-8x2048,qwen3-8x2048")
    parser.add_argument("--blocks", default="0,-1,64", help="logits_block settings to compare")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    shapes = ["smoke"] if args.smoke else args.shapes.split(",")
    blocks = [int(b) for b in args.blocks.split(",")]
    results = [measure(name, blocks, 3 if args.smoke else args.repeats) for name in shapes]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for result in results:
        print(f"{result['shape']}: student {result['student_width']}, teacher {result['teacher_width']}, "
              f"V {result['vocab']:,}, {result['rows']} x {result['length']} ({result['backend']})")
        for label, row in result["settings"].items():
            timed = f", step {row['step_s']:.3f} s" if "step_s" in row else ""
            print(f"  {label:18s} (block {row['block']:4d}): temp {row['temp_bytes'] / 2**20:9.1f} MiB, "
                  f"compile {row['compile_s']:.1f} s{timed}")


if __name__ == "__main__":
    main()
