"""Where a train step's time goes on the CPU: jaxalign's SFT step against PyTorch's, operation by operation.

The step and batch of ``benchmarks/cpu.py`` at one shape (default ``4x256-v4096``: 4 layers x 256, vocabulary 4,096,
8 sequences of 256 tokens, float32): jaxalign's trainer step (``make_train_step``: loss, gradients, clipping, AdamW)
and the PyTorch SFT step of ``benchmarks/_torch_side.py`` (transformers ``LlamaForCausalLM``, SDPA attention, the
same tokens and masks), each in a fresh process, ``--reps`` steps traced after two warm-up steps.

* jaxalign: ``jax.profiler``'s Perfetto trace; XLA:CPU's operations on its worker threads. Each operation is put in
  a category from the compiled program's HLO: what its fusion computes (a ``dot``, a ``reduce``, only data
  movement, or only elementwise arithmetic), and as attention where any of its instructions ran under the
  model's ``attention_core`` name scope (the scores, mask, softmax and weighted sum; forward and backward).
* PyTorch: ``torch.profiler``'s self CPU time per ``aten`` operation (self time, so a ``linear`` is not counted
  again in its ``addmm``), put in the same categories by name.

The categories: *matmuls* (projections, MLP, LM head; forward and backward), *attention* (the T x T scores,
softmax and weighted sums; PyTorch's fused SDPA kernels), *reductions* (norms, loss, softmax sums, gradient norm),
*data movement* (copies, transposes, slices, gathers, concatenation), *elementwise* (activations, residuals,
rotary, the optimizer's update), *optimizer* (PyTorch's ``_foreach`` kernels; jaxalign's update is fused into
elementwise operations). "Summed" is the sum of the operations' durations per step; it can exceed the step's wall
time where operations run on both cores at once, or fall below it where the threads wait.

    python benchmarks/step_profile.py                       # 4x256, V 4,096 (about 2 minutes)
    python benchmarks/step_profile.py --shape tiny --reps 2 # seconds: checks the script
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CATEGORIES = ("matmuls", "attention", "reductions", "data movement", "elementwise", "optimizer", "other")
MOVEMENT = {"copy", "transpose", "bitcast", "reshape", "slice", "dynamic-slice", "dynamic-update-slice", "concatenate",
            "pad", "broadcast", "gather", "scatter", "iota", "parameter", "constant", "tuple", "get-tuple-element",
            "reverse", "copy-start", "copy-done"}
SKIP_EVENTS = ("ThunkExecutor", "end:", "Slinky", "ThreadpoolListener")


# ---- jaxalign -----------------------------------------------------------------------------------------------------

def hlo_categories(hlo: str) -> dict[str, str]:
    """``{instruction name: category}`` for every instruction of the compiled module's text: a fusion or call is
    judged by the instructions of the computations it calls (transitively); attention is whatever the model ran
    under its ``attention_core`` name scope (in the instructions' ``op_name``, forward and backward)."""
    computations: dict[str, list[tuple[str, str, bool, list[str]]]] = {}
    current = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line.strip())
        if head and not line.startswith(" "):
            current = computations.setdefault(head.group(1), [])
            continue
        inst = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$", line)
        if inst and current is not None:
            calls = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line)
            scoped = bool(re.search(r'op_name="[^"]*attention_core', line))
            current.append((inst.group(1), inst.group(3), scoped, calls))

    cache: dict[str, tuple[set[str], bool]] = {}

    def traits(name: str, seen: frozenset = frozenset()) -> tuple[set[str], bool]:
        if name in cache:
            return cache[name]
        ops, attention = set(), False
        for _, opcode, scoped, calls in computations.get(name, []):
            ops.add(opcode)
            attention |= scoped
            for callee in calls:
                if callee not in seen:
                    inner, inner_attention = traits(callee, seen | {name})
                    ops |= inner
                    attention |= inner_attention
        cache[name] = ops, attention
        return cache[name]

    out = {}
    for instructions in computations.values():
        for name, opcode, scoped, calls in instructions:
            ops, attention = {opcode}, scoped
            for callee in calls:
                inner, inner_attention = traits(callee)
                ops |= inner
                attention |= inner_attention
            out[name] = categorize(ops, attention)
    return out


def categorize(ops: set[str], attention: bool) -> str:
    if attention:
        return "attention"
    if ops & {"dot", "convolution"}:
        return "matmuls"
    if "custom-call" in ops:
        return "other"
    if ops & {"reduce", "reduce-window", "all-reduce"}:
        return "reductions"
    if ops <= MOVEMENT | {"fusion", "call"}:
        return "data movement"
    return "elementwise"


def shape_of(name: str):
    """A ``benchmarks/cpu.py`` shape by name (``tiny``: its smoke shape)."""
    import cpu

    return (cpu.SMOKE_SHAPES if name == "tiny" else cpu.SHAPES)[name]


def xla_cpu_operations(run) -> tuple[float, list[dict], set]:
    """``(wall seconds, operations, worker thread ids)`` of one call of ``run`` (compiled beforehand) under
    ``jax.profiler``: XLA:CPU's per-operation events (Perfetto ``X`` events on its ``tf_XLA`` worker threads,
    without the executor's and profiler's own spans). Also used by ``benchmarks/decode.py --profile``."""
    import jax

    with tempfile.TemporaryDirectory() as logdir:
        jax.profiler.start_trace(logdir, create_perfetto_trace=True)
        start = time.perf_counter()
        jax.block_until_ready(run())
        wall = time.perf_counter() - start
        jax.profiler.stop_trace()
        [trace] = Path(logdir).rglob("*.trace.json.gz")
        events = json.loads(gzip.decompress(trace.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    workers = {e["tid"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
               and e["args"]["name"].startswith("tf_XLA")}
    ops = [e for e in events if e.get("ph") == "X" and e.get("tid") in workers and e.get("dur")
           and not e["name"].startswith(SKIP_EVENTS)]
    return wall, ops, workers


def jax_profile(shape_name: str, reps: int, dense: bool = False) -> dict:
    """The jaxalign side; ``dense``: the self-attention as one dense product over every key (``causal_blocks``
    returning 1), the path before query blocks."""
    import cpu
    import jax
    import jax.numpy as jnp
    from train_step import train_setup

    from jaxalign.models import llama

    if dense:
        llama.causal_blocks = lambda length, slots: 1
    # compiled here, not read back from a persistent cache, whose executables' HLO text lacks the op_name metadata
    # the categories read
    jax.config.update("jax_enable_compilation_cache", False)

    shape = shape_of(shape_name)
    config, batch = cpu.shape_batch(shape, "sft")
    step, state, _ = train_setup("sft", config, -1)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    compiled = step.lower(state, batch).compile()
    kinds = hlo_categories(compiled.as_text())
    for _ in range(2):
        state, _ = compiled(state, batch)
    jax.block_until_ready(state)
    def run():
        nonlocal state
        for _ in range(reps):
            state, _ = compiled(state, batch)
        return state

    wall, ops, workers = xla_cpu_operations(run)
    if not ops:
        raise SystemExit("step_profile: the trace holds no XLA:CPU operations (this script is for the CPU)")
    by_category, by_op, unknown = collections.Counter(), collections.Counter(), set()
    for e in ops:
        category = kinds.get(e["name"])
        if category is None:
            unknown.add(e["name"])
            category = "other"
        by_category[category] += e["dur"] / 1e3 / reps
        by_op[f"{e['name']} ({category})"] += e["dur"] / 1e3 / reps
    return {"side": "jaxalign, dense attention" if dense else "jaxalign", "wall_ms_per_step": 1e3 * wall / reps,
            "summed_ms_per_step": sum(by_category.values()),
            "categories": dict(by_category), "top": by_op.most_common(15), "unmatched_events": sorted(unknown)[:20],
            "worker_threads": len(workers)}


# ---- PyTorch ------------------------------------------------------------------------------------------------------

TORCH_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}
TORCH_REDUCTIONS = {"sum", "mean", "norm", "linalg_vector_norm", "_log_softmax", "_log_softmax_backward_data",
                    "_softmax", "_softmax_backward_data", "nll_loss_forward", "nll_loss_backward", "nll_loss",
                    "nll_loss_nd", "cross_entropy_loss", "log_softmax", "max", "min", "amax", "pow"}
TORCH_MOVEMENT = {"copy_", "clone", "contiguous", "cat", "index", "index_select", "index_put_", "embedding",
                  "embedding_backward", "embedding_dense_backward", "transpose", "view", "reshape", "_reshape_alias",
                  "expand", "slice", "select", "permute", "unsqueeze", "squeeze", "stack", "t", "as_strided",
                  "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "zero_", "fill_", "split",
                  "chunk", "gather", "scatter", "scatter_add_", "narrow", "detach", "detach_", "to", "_to_copy",
                  "flatten", "unbind", "alias", "resolve_conj", "resolve_neg", "new_zeros", "new_empty",
                  "_unsafe_view", "unflatten", "masked_fill", "masked_fill_", "where", "arange", "ones", "full",
                  "lift_fresh", "result_type"}


def torch_category(name: str) -> str:
    """The category of a PyTorch profiler key (``aten::<op>``)."""
    op = name.removeprefix("aten::")
    if "scaled_dot_product" in op or "flash_attention" in op:
        return "attention"
    if op in TORCH_MATMULS:
        return "matmuls"
    if op.startswith("_foreach") or op in ("addcdiv_", "addcmul_", "lerp_", "_fused_adamw_"):
        return "optimizer"
    if op in TORCH_REDUCTIONS:
        return "reductions"
    if op in TORCH_MOVEMENT:
        return "data movement"
    if name.startswith("aten::"):
        return "elementwise"
    return "other"


def torch_profile(shape_name: str, reps: int) -> dict:
    import cpu
    import torch
    from _torch_side import sft_step

    torch.set_num_threads(os.cpu_count() or 1)
    shape = shape_of(shape_name)
    examples = cpu.preference_examples(shape.examples, shape.length, shape.model["vocab_size"], seed=0)
    config = cpu.hf_config(shape.model)
    step = sft_step(config, examples, shape.length)

    for _ in range(2):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(reps):
            step()
        wall = time.perf_counter() - start
    by_category, by_op = collections.Counter(), collections.Counter()
    for event in prof.key_averages():
        if not event.key.startswith("aten::") and "scaled_dot_product" not in event.key:
            continue  # the profiler's own spans and autograd nodes: their aten children carry the time
        ms = event.self_cpu_time_total / 1e3 / reps
        category = torch_category(event.key)
        by_category[category] += ms
        by_op[f"{event.key} ({category})"] += ms
    return {"side": "PyTorch", "wall_ms_per_step": 1e3 * wall / reps, "summed_ms_per_step": sum(by_category.values()),
            "categories": dict(by_category), "top": by_op.most_common(15), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


# ---- report -------------------------------------------------------------------------------------------------------

def markdown(sides: list[dict], shape: str) -> str:
    lines = [f"SFT step at {shape}, ms per step (wall; the categories summed over operations)", "",
             "| category | " + " | ".join(s["side"] for s in sides) + " |", "|---|" + "---|" * len(sides)]
    for category in CATEGORIES:
        if any(s["categories"].get(category) for s in sides):
            lines.append(f"| {category} | " + " | ".join(f"{s['categories'].get(category, 0.0):.1f}" for s in sides)
                         + " |")
    lines.append("| **summed** | " + " | ".join(f"{s['summed_ms_per_step']:.1f}" for s in sides) + " |")
    lines.append("| **wall** | " + " | ".join(f"{s['wall_ms_per_step']:.1f}" for s in sides) + " |")
    for s in sides:
        lines += ["", f"{s['side']}, the largest operations (ms per step):", ""]
        lines += [f"* {name}: {ms:.2f}" for name, ms in s["top"]]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="4x256-v4096", help="a shape of benchmarks/cpu.py (or tiny)")
    p.add_argument("--reps", type=int, default=5, help="traced steps per side")
    p.add_argument("--side", choices=("jax", "jax-dense", "torch"), help=argparse.SUPPRESS)  # one side per process
    p.add_argument("--out", default="", help="a JSON file for the raw numbers")
    p.add_argument("--no-torch", action="store_true", help="the jaxalign side only")
    p.add_argument("--dense", action="store_true", help="also jaxalign with the self-attention as one dense product "
                   "(no causal query blocks), in its own process")
    args = p.parse_args()
    sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]  # this checkout's jaxalign, not an installed one
    if args.side:
        if args.side == "torch":
            result = torch_profile(args.shape, args.reps)
        else:
            result = jax_profile(args.shape, args.reps, dense=args.side == "jax-dense")
        print("RESULT " + json.dumps(result), flush=True)
        return
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    sides = []
    for side in ("jax", *(("jax-dense",) if args.dense else ()), *(() if args.no_torch else ("torch",))):
        done = subprocess.run([sys.executable, __file__, "--side", side, "--shape", args.shape, "--reps",
                               str(args.reps)], capture_output=True, text=True, timeout=1800)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            raise SystemExit(f"step_profile: the {side} side failed ({done.returncode}):\n{done.stderr[-3000:]}")
        sides.append(json.loads(lines[-1].removeprefix("RESULT ")))
    print(markdown(sides, args.shape))
    if args.out:
        import jax

        Path(args.out).write_text(json.dumps({"started": started, "shape": args.shape, "reps": args.reps,
                                              "jax": jax.__version__, "cpu_count": os.cpu_count(),
                                              "sides": sides}, indent=1) + "\n")


if __name__ == "__main__":
    main()
