"""Step time of the training loop with the host batch preparation overlapped (``Prefetcher``, no per-step device
reads) against the previous synchronous loop (prepare the batch, run the step, read ``state.step`` and
``state.skipped`` back), side by side in one process on the same engine, data and compiled step.

    python benchmarks/loop_overlap.py                 # dpo and sft at the default tiny shape, 40 timed steps each
    python benchmarks/loop_overlap.py --objectives sft --steps 20 --packing
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time

import jax
import numpy as np

from jaxalign.train import load_config, validate
from jaxalign.train.inputs import Prefetcher, device_batch
from jaxalign.train.loop import setup


def _synchronous(run, steps: int) -> float:
    engine, frozen = run.engine, (() if run.engine.frozen is None else (run.engine.frozen,))
    start = time.perf_counter()
    for _ in range(steps):
        batch = device_batch(engine.batch_sharding, next(run.inputs.pipeline))
        engine.state, _ = engine.train_step(engine.state, batch, *frozen)
        int(engine.state.step), int(engine.state.skipped)  # what the loop read every step before
    return (time.perf_counter() - start) / steps


def _asynchronous(run, steps: int) -> float:
    """The batch prepared inline, no device reads: JAX's asynchronous dispatch runs the step while Python
    prepares the next batch."""
    engine, frozen = run.engine, (() if run.engine.frozen is None else (run.engine.frozen,))
    start = time.perf_counter()
    for _ in range(steps):
        batch = device_batch(engine.batch_sharding, next(run.inputs.pipeline))
        engine.state, _ = engine.train_step(engine.state, batch, *frozen)
    jax.block_until_ready(engine.state)
    return (time.perf_counter() - start) / steps


def _overlapped(run, steps: int) -> float:
    engine, frozen = run.engine, (() if run.engine.frozen is None else (run.engine.frozen,))
    prefetch = Prefetcher(run.inputs.pipeline, engine.batch_sharding)
    start = time.perf_counter()
    for _ in range(steps):
        batch, _, _ = next(prefetch)
        engine.state, _ = engine.train_step(engine.state, batch, *frozen)
    jax.block_until_ready(engine.state)
    elapsed = (time.perf_counter() - start) / steps
    prefetch.close()
    return elapsed


def measure(objective: str, steps: int, rounds: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        config = load_config(objective, [f"--config.workdir={workdir}", "--config.logging.tensorboard=False", *extra])
        with contextlib.redirect_stdout(sys.stderr):  # the run's own log lines, away from --json output
            run = setup(config, validate(config))
        with jax.set_mesh(run.engine.mesh), run.engine.rules_scope():
            _synchronous(run, 3)  # compile every batch shape once
            _overlapped(run, 3)
            times = {"synchronous": [], "asynchronous": [], "overlapped": []}
            for _ in range(rounds):  # interleaved, so drift hits every mode alike
                times["synchronous"].append(_synchronous(run, steps))
                times["asynchronous"].append(_asynchronous(run, steps))
                times["overlapped"].append(_overlapped(run, steps))
    medians = {name: float(np.median(values)) for name, values in times.items()}
    return {"objective": objective, "steps_per_round": steps, "rounds": rounds, "extra": extra,
            "step_s": medians, "times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objectives", default="dpo,sft")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--packing", action="store_true", help="packed rows (more host work per batch)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    extra = ["--config.data.packing=True", "--config.data.row_length=256"] if args.packing else []
    results = [measure(name, args.steps, args.rounds, extra) for name in args.objectives.split(",")]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{jax.device_count()} {jax.default_backend()} device(s); median step time over {args.rounds} rounds")
    for r in results:
        base = r["step_s"]["synchronous"]
        print(f"{r['objective']:5s} " + "   ".join(f"{name} {1e3 * t:7.2f} ms ({base / t:.2f}x)"
                                                  for name, t in r["step_s"].items()))


if __name__ == "__main__":
    main()
