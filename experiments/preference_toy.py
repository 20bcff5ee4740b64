"""DPO vs SimPO vs ORPO on toy preferences, from the same SFT model.

A tiny Llama is first trained briefly with SFT on toy arithmetic (so it answers in the right format but often
wrongly); each preference objective then trains from that model on pairs whose chosen answer is correct and whose
rejected answer is off by one or ten. Measured on held-out questions: exact-match accuracy of greedy answers, and
pairwise preference accuracy (share of held-out pairs where the model gives the chosen answer a higher summed
log-probability), with the mean log-probability margin. Defaults: DPO β = 0.1; SimPO β = 2, γ/β = 0.5 (the
toy answers are a few tokens); ORPO λ = 0.1.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from common import (
    command_line,
    completion_logps,
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
from jaxalign.data.toy import arithmetic, arithmetic_preferences, write_jsonl
from jaxalign.sampling.routing import answer
from jaxalign.train.export import export

STUDY = "preference_toy"
METHODS = {"dpo": {"beta": 0.1}, "simpo": {"beta": 2.0, "gamma_beta_ratio": 0.5}, "orpo": {"lam": 0.1}}


def evaluate(model, tokenizer, held: list[dict]) -> dict:
    questions = [r["prompt"][0]["content"] for r in held]
    out = answer(model, tokenizer, questions, max_new_tokens=8)
    accuracy = float(np.mean([numeric_verifier(t[0], r["answer"]) for t, r in zip(out.texts, held, strict=True)]))
    chosen, _ = completion_logps(model, tokenizer, questions, [r["chosen"][0]["content"] for r in held])
    rejected, _ = completion_logps(model, tokenizer, questions, [r["rejected"][0]["content"] for r in held])
    return {"accuracy": accuracy, "pair_accuracy": float((chosen > rejected).mean()),
            "margin": float((chosen - rejected).mean())}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser(__doc__).parse_args(argv)
    started = time.time()
    sizes = (dict(sft=200, pairs=100, eval=16, sft_steps=4, steps=3, shape="smoke") if args.smoke
             else dict(sft=4000, pairs=3000, eval=200, sft_steps=300, steps=200, shape="tiny"))
    seeds = seeds_of(args, (0, 1))
    root = workdir_of(args, STUDY)
    per_seed = []
    for seed in seeds:
        held = arithmetic_preferences(sizes["eval"], 10_000 + seed)
        held_q = {r["prompt"][0]["content"] for r in held}
        sft_records = [r for r in arithmetic(sizes["sft"], seed) if r["messages"][0]["content"] not in held_q]
        pairs = [r for r in arithmetic_preferences(sizes["pairs"], seed + 500) if r["prompt"][0]["content"] not in
                 held_q]
        base_dir = root / f"seed{seed}"
        sft_path = write_jsonl(sft_records, base_dir / "sft.jsonl")
        sft_model, tokenizer, _ = train_model(toy_config(base_dir / "sft", sft_path, steps=sizes["sft_steps"],
                                                         shape=sizes["shape"], seed=seed))
        export(base_dir / "sft", base_dir / "sft_hf")
        row = {"seed": seed, "sft": evaluate(sft_model, tokenizer, held)}
        pairs_path = write_jsonl(pairs, base_dir / "pairs.jsonl")
        for method, params in METHODS.items():
            config = toy_config(base_dir / method, pairs_path, objective=method, steps=sizes["steps"],
                                shape=sizes["shape"], seed=seed, lr=5e-4, params=params, batch_size=32)
            config.model.path = str(base_dir / "sft_hf")
            model, _, summary = train_model(config)
            row[method] = {**evaluate(model, tokenizer, held), "train_seconds": summary["seconds"]}
        per_seed.append(row)
    names = ("sft", *METHODS)
    rows = [[("SFT (start)" if m == "sft" else m.upper()), pm([s[m]["accuracy"] for s in per_seed], 100),
             pm([s[m]["pair_accuracy"] for s in per_seed], 100), pm([s[m]["margin"] for s in per_seed], 1, 2)]
            for m in names]
    markdown = table(["model", "held-out accuracy %", "held-out pair accuracy %", "log-prob margin (nats)"], rows)
    markdown += (f"\n\nSeeds: {', '.join(map(str, seeds))}; SFT {sizes['sft_steps']} steps, then {sizes['steps']} "
                 f"steps of each objective at lr 5e-4, batch 32; {sizes['eval']} held-out pairs.")
    results = {"sizes": sizes, "seeds": seeds, "hparams": METHODS, "per_seed": per_seed}
    write(args.out, STUDY, command=command_line(STUDY, argv), results=results, markdown=markdown, started=started)
    _plot(per_seed, names, f"{args.out}/{STUDY}.png")
    return results


def _plot(per_seed, names, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(7, 3))
    for ax, key, label in ((axes[0], "accuracy", "held-out accuracy"), (axes[1], "pair_accuracy", "pair accuracy")):
        values = [[s[m][key] * 100 for s in per_seed] for m in names]
        ax.bar([m.upper() for m in names], [np.mean(v) for v in values], yerr=[np.std(v) for v in values])
        ax.set_title(label + " (%)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
