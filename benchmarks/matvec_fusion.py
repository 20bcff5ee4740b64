"""Batch-1 decode's products on the CPU: would fusing a layer's projections stream the weights faster?

A probe for the decode goal of docs/benchmarks.md (80 % of the bandwidth limit at batch 1): XLA:CPU runs each of a
SmolLM2 layer's seven matrix-vector products (q, k, v, o, gate, up, down) on one thread, while one large product
(the LM head) reaches the two-thread read rate. This times, in one process and in turns, a chain of 30
SmolLM2-shaped layers (576 wide, MLP 1,536, 3 KV heads of 64) at batch 1 written four ways: seven products per
layer (as the model runs them); q/k/v and gate/up fused into one product each (four per layer); and both with the
weights stored transposed (``[out, in]``, a row reduction). It also times single products of growing width, whose
weights fit in the cache, to show where a product starts to use both cores. All four chains compute the same
values (checked).

    python benchmarks/matvec_fusion.py [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

D, F, LAYERS, Q, KV = 576, 1536, 30, 576, 192


def _weights(layers: int) -> list[dict]:
    def mk(shape, i):
        return jax.random.normal(jax.random.key(i), shape, jnp.float32) * 0.02

    return [dict(q=mk((D, Q), 7 * i), k=mk((D, KV), 7 * i + 1), v=mk((D, KV), 7 * i + 2), o=mk((Q, D), 7 * i + 3),
                 g=mk((D, F), 7 * i + 4), u=mk((D, F), 7 * i + 5), d=mk((F, D), 7 * i + 6)) for i in range(layers)]


def _layer(x, qkv, o, gate_up, down):
    """One layer's products: ``qkv`` and ``gate_up`` map ``x`` to a tuple of outputs (separate or fused)."""
    q, k, v = qkv(x)
    x = x + o(q + jnp.tile(k, Q // KV) + jnp.tile(v, Q // KV)) * 0.01
    g, u = gate_up(x)
    return x + down(jax.nn.silu(g) * u) * 0.01


def chains(layers: int):
    separate = _weights(layers)
    fused = [dict(qkv=jnp.concatenate([p["q"], p["k"], p["v"]], 1), o=p["o"],
                  gu=jnp.concatenate([p["g"], p["u"]], 1), d=p["d"]) for p in separate]

    def run(transposed: bool, is_fused: bool):
        def product(a, w):
            return jnp.einsum("bd,fd->bf", a, w) if transposed else a @ w

        def fn(x, weights):
            for p in weights:
                if is_fused:
                    def qkv(a, p=p):
                        y = product(a, p["qkv"])
                        return y[:, :Q], y[:, Q:Q + KV], y[:, Q + KV:]

                    def gate_up(a, p=p):
                        y = product(a, p["gu"])
                        return y[:, :F], y[:, F:]
                else:
                    def qkv(a, p=p):
                        return product(a, p["q"]), product(a, p["k"]), product(a, p["v"])

                    def gate_up(a, p=p):
                        return product(a, p["g"]), product(a, p["u"])
                x = _layer(x, qkv, lambda a, p=p: product(a, p["o"]), gate_up, lambda a, p=p: product(a, p["d"]))
            return x

        weights = fused if is_fused else separate
        if transposed:
            weights = [{k: v.T.copy() for k, v in p.items()} for p in weights]
        return jax.jit(fn), weights

    return {"seven products": run(False, False), "fused q/k/v and gate/up": run(False, True),
            "seven products, transposed": run(True, False), "fused, transposed": run(True, True)}


def _median_time(fn, *args, calls: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--widths", default="1536,3072,6144,49152", help="single products' widths")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.widths = [int(w) for w in args.widths.split(",")]
    x = jnp.ones((1, D))
    arms = chains(args.layers)
    outputs = [fn(x, w) for fn, w in arms.values()]
    same = max(float(jnp.max(jnp.abs(o - outputs[0]))) for o in outputs)
    nbytes = sum(v.nbytes for p in _weights(args.layers) for v in p.values())
    rounds = {name: [] for name in arms}
    for _ in range(args.rounds):  # the arms in turns
        for name, (fn, weights) in arms.items():
            rounds[name].append(_median_time(fn, x, weights, calls=args.calls))
    result = {"backend": jax.default_backend(), "layers": args.layers, "weight_bytes": nbytes,
              "max_difference": same, "chains": {}, "single_products": {}}
    for name, seconds in rounds.items():
        best = min(seconds)
        result["chains"][name] = {"ms": [s * 1e3 for s in seconds], "best_gbs": nbytes / best / 1e9}
    for width in args.widths:
        w = jax.random.normal(jax.random.key(0), (D, width))
        seconds = _median_time(jax.jit(lambda a, w: a @ w), x, w, calls=50)
        result["single_products"][width] = {"us": seconds * 1e6, "gbs": w.nbytes / seconds / 1e9}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{args.layers} SmolLM2-shaped layers at batch 1, {nbytes / 1e6:.0f} MB of weights; the four chains agree "
          f"to {same:.1e}")
    for name, row in result["chains"].items():
        print(f"  {name:28s} " + " / ".join(f"{ms:.2f}" for ms in row["ms"]) + f" ms, best {row['best_gbs']:.1f} GB/s")
    for width, row in result["single_products"].items():
        print(f"  one 576 x {width:<6d} product (in cache): {row['us']:.0f} us, {row['gbs']:.1f} GB/s")


if __name__ == "__main__":
    main()
