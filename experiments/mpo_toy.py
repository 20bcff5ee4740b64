"""MPO vs DPO-on-target on the two-"language" toy task (target language = the dominant one under a letter cipher).

A tiny Llama is first trained with SFT on many dominant-language answers and a few target-language ones, so its
reward gap RG = avg log p(chosen) − avg log p(rejected) (chosen: the right sum, rejected: off by one) is larger in
the dominant language than in the target one. From that model (also the frozen reference):

* MPO (β = 1, mean pooling, hidden-state preservation): pulls the target gap towards the reference's dominant gap;
* DPO on the target pairs (β = 0.1): the usual alternative, trained on the same target pairs for the same steps.

Measured on held-out records: the target gap and the target pair accuracy (RG > 0), the dominant gap (drift from
the reference), the mean absolute change of dominant-language average log-probs (how far the dominant language
moved), and the target-language gap's distance to the reference's dominant gap (what MPO optimises).
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

from jaxalign.data.toy import mpo_records, write_jsonl
from jaxalign.train.export import export

STUDY = "mpo_toy"
SIDES = ("source", "target")


def sft_records(records, side):
    return [{"messages": [{"role": "user", "content": r[f"{side}_conversations"][0]["value"]},
                          {"role": "assistant", "content": r[f"{side}_chosen"]["value"]}]} for r in records]


def target_pairs(records):
    return [{"prompt": [{"role": "user", "content": r["target_conversations"][0]["value"]}],
             "chosen": [{"role": "assistant", "content": r["target_chosen"]["value"]}],
             "rejected": [{"role": "assistant", "content": r["target_rejected"]["value"]}]} for r in records]


def avg_logps(model, tokenizer, records) -> dict:
    out = {}
    for side in SIDES:
        prompts = [r[f"{side}_conversations"][0]["value"] for r in records]
        for kind in ("chosen", "rejected"):
            texts = [r[f"{side}_{kind}"]["value"] for r in records]
            total, n_tokens = completion_logps(model, tokenizer, prompts, texts)
            out[f"{side}_{kind}"] = total / n_tokens
    return out


def measures(logps: dict, reference: dict) -> dict:
    gap = {side: logps[f"{side}_chosen"] - logps[f"{side}_rejected"] for side in SIDES}
    ref_dominant = reference["source_chosen"] - reference["source_rejected"]
    drift = np.mean([np.abs(logps[f"source_{k}"] - reference[f"source_{k}"]).mean() for k in ("chosen", "rejected")])
    return {"target_gap": float(gap["target"].mean()), "target_pair_accuracy": float((gap["target"] > 0).mean()),
            "dominant_gap": float(gap["source"].mean()), "dominant_drift": float(drift),
            "target_vs_dominant_ref": float(np.abs(gap["target"] - ref_dominant).mean())}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser(__doc__).parse_args(argv)
    started = time.time()
    sizes = (dict(dominant=200, target=40, pairs=60, eval=16, sft_steps=4, steps=3, shape="smoke") if args.smoke
             else dict(dominant=4000, target=400, pairs=2000, eval=200, sft_steps=500, steps=150, shape="tiny"))
    seeds = seeds_of(args, (0, 1))
    root = workdir_of(args, STUDY)
    per_seed = []
    for seed in seeds:
        held = mpo_records(sizes["eval"], 10_000 + seed)
        held_q = {r["source_conversations"][0]["value"] for r in held}
        # only 441 distinct sums exist: draw three times what is needed, so enough remain after holding out
        pool = [r for r in mpo_records(3 * (sizes["dominant"] + sizes["pairs"]), seed)
                if r["source_conversations"][0]["value"] not in held_q]
        sft_pool, pair_pool = pool[: sizes["dominant"]], pool[sizes["dominant"]:]
        sft = sft_records(sft_pool, "source") + sft_records(sft_pool[: sizes["target"]], "target")
        base_dir = root / f"seed{seed}"
        sft_model, tokenizer, _ = train_model(toy_config(base_dir / "sft", write_jsonl(sft, base_dir / "sft.jsonl"),
                                                         steps=sizes["sft_steps"], shape=sizes["shape"], seed=seed,
                                                         max_length=96))
        export(base_dir / "sft", base_dir / "sft_hf")
        reference = avg_logps(sft_model, tokenizer, held)
        row = {"seed": seed, "sft": measures(reference, reference)}
        runs = {"mpo": (write_jsonl(pair_pool, base_dir / "mpo.jsonl"), {"beta": 1.0, "pooling": "mean"}),
                "dpo": (write_jsonl(target_pairs(pair_pool), base_dir / "dpo.jsonl"), {"beta": 0.1})}
        for method, (path, params) in runs.items():
            config = toy_config(base_dir / method, path, objective=method, steps=sizes["steps"], shape=sizes["shape"],
                                seed=seed, lr=5e-4, params=params, max_length=96)
            config.model.path = str(base_dir / "sft_hf")
            model, _, summary = train_model(config)
            row[method] = {**measures(avg_logps(model, tokenizer, held), reference),
                           "train_seconds": summary["seconds"]}
        per_seed.append(row)
    names = {"sft": "SFT (start = reference)", "mpo": "MPO", "dpo": "DPO on target"}
    keys = ("target_gap", "target_pair_accuracy", "dominant_gap", "dominant_drift", "target_vs_dominant_ref")
    rows = [[label] + [pm([s[m][k] for s in per_seed], 100 if k == "target_pair_accuracy" else 1,
                          1 if k == "target_pair_accuracy" else 3) for k in keys] for m, label in names.items()]
    markdown = table(["model", "target gap", "target pair accuracy %", "dominant gap", "dominant drift",
                      "|target gap − reference dominant gap|"], rows)
    markdown += (f"\n\nGaps are in nats per token (average log-prob of the right answer minus the off-by-one one). "
                 f"Seeds: {', '.join(map(str, seeds))}; SFT {sizes['sft_steps']} steps, then {sizes['steps']} steps "
                 f"of each objective at lr 5e-4; {sizes['eval']} held-out records.")
    results = {"sizes": sizes, "seeds": seeds, "per_seed": per_seed}
    write(args.out, STUDY, command=command_line(STUDY, argv), results=results, markdown=markdown, started=started)
    _plot(per_seed, names, f"{args.out}/{STUDY}.png")
    return results


def _plot(per_seed, names, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    x = np.arange(len(names))
    for offset, key, label in ((-0.2, "target_gap", "target gap"), (0.2, "dominant_gap", "dominant gap")):
        values = [[s[m][key] for s in per_seed] for m in names]
        ax.bar(x + offset, [np.mean(v) for v in values], 0.4, yerr=[np.std(v) for v in values], label=label)
    ax.set_xticks(x, list(names.values()), fontsize=8)
    ax.set_ylabel("reward gap (nats / token)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
