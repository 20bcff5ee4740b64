"""Memory of the precomputed reference against the policy's DPO step, as XLA compiles them.

``reference.kind=precomputed`` runs the frozen reference over the training data before training
(``jaxalign.train.reference_cache.reference_fn``, one training micro-batch at a time); training then runs the policy
step with the reference log-probs as batch fields. Both take the same log-prob path (``logps_chunk_size=-1``: the
fused head on the CPU at this size), so the reference pass should need no more memory than the step. This prints the
``temp + argument`` bytes of both compiled programs (``memory_analysis()``), as ``benchmarks/cpu.py`` counts them.

    python benchmarks/reference_memory.py                  # the GPT-2-vocabulary shape of benchmarks/cpu.py
    python benchmarks/reference_memory.py --smoke --json
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from flax import nnx

from jaxalign.models import LlamaConfig, create_model
from jaxalign.objectives import DPOParams, get_objective
from jaxalign.train.reference_cache import reference_fn
from jaxalign.train.spec import OptimSpec
from jaxalign.train.step import init_state, make_optimizer, make_train_step

GPT2 = dict(vocab_size=50257, hidden_size=256, intermediate_size=640, num_layers=4, num_heads=8, num_kv_heads=4)
SMOKE = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)


def _bytes(compiled) -> dict[str, int]:
    memory = compiled.memory_analysis()
    return {"temp": memory.temp_size_in_bytes, "argument": memory.argument_size_in_bytes,
            "total": memory.temp_size_in_bytes + memory.argument_size_in_bytes}


def measure(shape: dict, pairs: int, length: int, chunk_size: int = -1) -> dict:
    """Compiled bytes of the reference pass and of the DPO step over ``pairs`` pairs of ``length`` tokens."""
    graphdef, params = nnx.split(create_model(LlamaConfig(**shape), seed=0))
    params = nnx.to_pure_dict(params)
    hparams = DPOParams(logps_chunk_size=chunk_size)
    ones = jnp.ones((pairs, length), jnp.int32)
    pair = {f"{side}_{field}": ones for side in ("chosen", "rejected")
            for field in ("tokens", "attention_mask", "loss_mask")}
    reference = jax.jit(reference_fn(graphdef, "preference", hparams)).lower(params, pair).compile()
    tx, _ = make_optimizer(OptimSpec(), 100)
    state = init_state(params, tx, 0, None)
    batch = {**pair, "ref_chosen_logps": jnp.zeros((pairs,)), "ref_rejected_logps": jnp.zeros((pairs,))}
    step = make_train_step(graphdef, get_objective("dpo").fn, hparams, tx).lower(state, batch).compile()
    return {"shape": shape, "pairs": pairs, "length": length, "backend": jax.default_backend(),
            "reference_pass": _bytes(reference), "policy_step": _bytes(step)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a small shape (seconds)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(SMOKE, 4, 64) if args.smoke else measure(GPT2, 8, 452)
    if args.json:
        print(json.dumps(result))
        return
    for name in ("reference_pass", "policy_step"):
        values = result[name]
        print(f"{name:15s} temp {values['temp'] / 1e6:9.1f} MB  arguments {values['argument'] / 1e6:9.1f} MB  "
              f"total {values['total'] / 1e6:9.1f} MB")


if __name__ == "__main__":
    main()
