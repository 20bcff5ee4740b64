"""SFT vs IFT on toy arithmetic: held-out exact-match accuracy and calibration, same model, data, steps and seed.

A tiny Llama (4 layers × 128, toy byte tokenizer) learns "What is a ± b?" → the number. IFT uses the bundled
default's settings (λ warming up linearly from 0 to 0.2 over the first 20 % of steps, γ = 0.95); SFT is the same
run with the plain token-mean NLL. Calibration: the greedy answer's sequence probability as the confidence,
expected calibration error (10 bins) and Brier score against correctness.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from common import (
    command_line,
    expected_calibration_error,
    parser,
    pm,
    seeds_of,
    table,
    toy_config,
    train_model,
    workdir_of,
    write,
)

from jaxalign.data.sater import numeric_verifier
from jaxalign.data.toy import arithmetic, write_jsonl
from jaxalign.sampling.routing import answer

STUDY = "sft_vs_ift"
METHODS = ("sft", "ift")


def evaluate(model, tokenizer, records) -> dict:
    questions = [r["messages"][0]["content"] for r in records]
    out = answer(model, tokenizer, questions, max_new_tokens=8)
    correct = np.array([numeric_verifier(t[0], r["answer"]) for t, r in zip(out.texts, records, strict=True)])
    confidence = np.array([c[0] ** n[0] for c, n in zip(out.confidence, out.n_tokens, strict=True)])
    return {"accuracy": float(correct.mean()), "ece": expected_calibration_error(confidence, correct),
            "brier": float(((confidence - correct) ** 2).mean()), "mean_confidence": float(confidence.mean())}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser(__doc__).parse_args(argv)
    started = time.time()
    sizes = (dict(train=200, eval=16, steps=4, shape="smoke") if args.smoke
             else dict(train=4000, eval=200, steps=800, shape="tiny"))
    seeds = seeds_of(args, (0, 1))
    root = workdir_of(args, STUDY)
    per_seed = []
    for seed in seeds:
        held = arithmetic(sizes["eval"], 10_000 + seed)
        held_q = {r["messages"][0]["content"] for r in held}
        train_records = [r for r in arithmetic(sizes["train"], seed) if r["messages"][0]["content"] not in held_q]
        path = write_jsonl(train_records, root / f"seed{seed}" / "train.jsonl")
        row = {"seed": seed}
        for method in METHODS:
            params = ({"max_lambda": 0.2, "min_lambda": 0.0, "lambda_schedule": "linear",
                       "warmup_steps": sizes["steps"] // 5, "gamma": 0.95} if method == "ift" else {})
            config = toy_config(root / f"seed{seed}" / method, path, objective=method, steps=sizes["steps"],
                                shape=sizes["shape"], seed=seed, params=params)
            model, tokenizer, summary = train_model(config)
            row[method] = {**evaluate(model, tokenizer, held), "train_seconds": summary["seconds"]}
        per_seed.append(row)
    rows = [[m.upper(), pm([s[m]["accuracy"] for s in per_seed], 100), pm([s[m]["ece"] for s in per_seed], 1, 3),
             pm([s[m]["brier"] for s in per_seed], 1, 3), pm([s[m]["train_seconds"] for s in per_seed], 1, 0)]
            for m in METHODS]
    markdown = table(["objective", "held-out accuracy %", "ECE", "Brier", "training s"], rows)
    markdown += (f"\n\nSeeds: {', '.join(map(str, seeds))}; {sizes['steps']} steps of batch 32; {sizes['eval']} "
                 "held-out questions.")
    results = {"sizes": sizes, "seeds": seeds, "per_seed": per_seed}
    write(args.out, STUDY, command=command_line(STUDY, argv), results=results, markdown=markdown, started=started)
    _plot(per_seed, f"{args.out}/{STUDY}.png")
    return results


def _plot(per_seed, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(6, 3))
    for ax, key, label in ((axes[0], "accuracy", "held-out accuracy"), (axes[1], "ece", "calibration error")):
        values = [[s[m][key] for s in per_seed] for m in METHODS]
        ax.bar([m.upper() for m in METHODS], [np.mean(v) for v in values], yerr=[np.std(v) for v in values],
               color=["#999", "#3a7"])
        ax.set_title(label, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
