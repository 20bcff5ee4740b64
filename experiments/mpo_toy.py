"""MPO vs DPO and SFT on the target "language" of a two-language toy task: tuned arms, 5 seeds, paired tests.

The MPO paper's claim (Zhao et al., ACL 2025): matching each target-language reward gap to the frozen model's
dominant-language gap (with a hidden-state preservation term on the dominant language) improves the target
language's behaviour more than DPO on the same target-language pairs, without degrading the dominant language
(the paper: attack success rate in the target languages and utility; here: greedy exact match in each language).

The two languages are the same addition questions, the target one under a fixed letter cipher ("What is 3 + 4?" /
"The answer is 7." and their enciphered copies; the digits are not enciphered). Per seed, the shared pretrained
start (``experiments/pretrained.py``, which has read English arithmetic but never the cipher) is fine-tuned by SFT
on many dominant-language answers and a few target-language ones (train pool), so the target language is the weak
one; that *SFT model* is every arm's start and MPO's and DPO's frozen reference. Arms, each on the same
train-pool records for the same steps:

* ``mpo``: β = 1, mean pooling, hidden-state preservation (the official code's settings);
* ``dpo``: DPO (β = 0.1) on the target-language pairs;
* ``sft``: SFT on the target-language chosen answers.

Each arm's learning rate from ``LRS`` by mean target-language exact match on the validation pool (addition
questions, 58) over seeds 100 and 101, which no evaluation set uses; every seed then runs at it. That sweep's choice
is recorded here (``RECORDED``) and the default size runs at it (``--tune`` or ``--sweep-seeds`` sweeps again).
Reported on the test pool (137 addition questions; the generator has no more): greedy exact match in each language,
the target pair accuracy (the right answer's average log-prob above the off-by-one one's) and the dominant-language
drift (mean absolute change of its answers' average log-probs from the SFT model). Paired differences: target exact
match MPO − DPO and MPO − SFT (the claim), and dominant exact match MPO − DPO and MPO − the SFT model (the "without
degrading" part).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from common import (
    cached_run,
    ci_text,
    command_line,
    completion_logps,
    differences_table,
    paired_difference,
    parser,
    rate_options,
    rates_or_sweep,
    runs_note,
    seeds_of,
    sweep_section,
    sweep_summary,
    table,
    toy_config,
    tuned_arms,
    verdict,
    workdir_of,
    write,
)
from pretrained import pretrained_start

from jaxalign.data.sater import numeric_verifier
from jaxalign.data.toy import arithmetic_pool, mpo_record, mpo_records, write_jsonl
from jaxalign.sampling.routing import answer
from jaxalign.train import train
from jaxalign.train.export import export, restore_model

STUDY = "mpo_toy"
SIDES = ("source", "target")
ARMS = {"mpo": ("mpo", {"beta": 1.0, "pooling": "mean"}), "dpo": ("dpo", {"beta": 0.1}), "sft": ("sft", {})}
LABELS = {"start": "SFT model (the start and reference)", "mpo": "MPO", "dpo": "DPO on target pairs",
          "sft": "SFT on target answers"}
# (metric, method, baseline, is a claim of the paper)
COMPARISONS = {"target exact match: MPO − DPO": ("target_em", "mpo", "dpo"),
               "target exact match: MPO − SFT": ("target_em", "mpo", "sft"),
               "dominant exact match: MPO − DPO": ("source_em", "mpo", "dpo"),
               "dominant exact match: MPO − SFT model": ("source_em", "mpo", "start")}
LRS = (1e-4, 3e-4, 1e-3)
# the choice of the published sweep (seeds 100-101, 2026-12-07; docs/results.md): the default size runs at it
RECORDED = {"mpo": 1e-4, "dpo": 1e-4, "sft": 1e-4}
SFT_LR = 1e-3


def pool_records(pool: str) -> list[dict]:
    """One MPO record per addition question of ``pool`` (the rejected answer off by one, fixed)."""
    rng = np.random.default_rng(98)
    return [mpo_record(r["messages"][0]["content"], int(r["answer"]), int(r["answer"]) + int(rng.choice([-1, 1])))
            for r in arithmetic_pool(pool, ops="+")]


def sft_records(records, side):
    return [{"messages": [{"role": "user", "content": r[f"{side}_conversations"][0]["value"]},
                          {"role": "assistant", "content": r[f"{side}_chosen"]["value"]}]} for r in records]


def target_pairs(records):
    return [{"prompt": [{"role": "user", "content": r["target_conversations"][0]["value"]}],
             "chosen": [{"role": "assistant", "content": r["target_chosen"]["value"]}],
             "rejected": [{"role": "assistant", "content": r["target_rejected"]["value"]}]} for r in records]


def exact_match(model, tokenizer, records, side: str) -> float:
    questions = [r[f"{side}_conversations"][0]["value"] for r in records]
    out = answer(model, tokenizer, questions, max_new_tokens=24)
    return float(np.mean([numeric_verifier(t[0], r["answer"]) for t, r in zip(out.texts, records, strict=True)]))


def avg_logps(model, tokenizer, records) -> dict:
    out = {}
    for side in SIDES:
        prompts = [r[f"{side}_conversations"][0]["value"] for r in records]
        for kind in ("chosen", "rejected"):
            texts = [r[f"{side}_{kind}"]["value"] for r in records]
            total, n_tokens = completion_logps(model, tokenizer, prompts, texts)
            out[f"{side}_{kind}"] = total / n_tokens
    return out


def measures(model, tokenizer, records, reference: dict | None) -> dict:
    logps = avg_logps(model, tokenizer, records)
    reference = reference or logps
    gap = logps["target_chosen"] - logps["target_rejected"]
    drift = np.mean([np.abs(logps[f"source_{k}"] - reference[f"source_{k}"]).mean() for k in ("chosen", "rejected")])
    return {"target_em": exact_match(model, tokenizer, records, "target"),
            "source_em": exact_match(model, tokenizer, records, "source"),
            "target_pairs": float((gap > 0).mean()), "dominant_drift": float(drift),
            "logps": {k: v.tolist() for k, v in logps.items()}}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = parser(__doc__)
    p.add_argument("--full", action="store_true", help="3x the SFT and fine-tuning steps (sweeps: no rate is "
                   "recorded at that size)")
    rate_options(p, RECORDED, "seeds 100-101")
    args = p.parse_args(argv)
    started = time.time()
    if args.smoke:
        sizes = dict(shape="smoke", dominant=200, target=40, pairs=60, sft_steps=4, steps=3, lrs=(3e-4, 1e-3),
                     validation=8, test=8)
    else:
        scale = 3 if args.full else 1
        sizes = dict(shape="tiny", dominant=4000, target=400, pairs=2000, sft_steps=200 * scale, steps=100 * scale,
                     lrs=LRS, validation=0, test=0)
    seeds = seeds_of(args, (0, 1, 2, 3, 4), smoke=(0, 1))
    recorded, sweep_seeds = rates_or_sweep(args, seeds, None if args.full else RECORDED)
    start = pretrained_start(sizes["shape"])
    root = workdir_of(args, STUDY)
    validation = pool_records("validation")[: sizes["validation"] or None]
    test = pool_records("test")[: sizes["test"] or None]

    def config_for(workdir: Path, data: Path, objective: str, params: dict, steps: int, lr: float, seed: int,
                   model_path: Path):
        return toy_config(workdir, data, objective=objective, steps=steps, seed=seed, lr=lr, params=params,
                          shape=sizes["shape"], max_length=96, start=model_path)

    def seed_data(seed: int) -> tuple[list[dict], list[dict]]:
        records = mpo_records(sizes["dominant"] + sizes["pairs"], seed, pool="train")
        return records[: sizes["dominant"]], records[sizes["dominant"]:]

    def sft_model(seed: int) -> tuple[Path, dict]:
        """The seed's SFT model (trained once; every arm's start) and its measures on the test pool."""
        folder = root / f"seed{seed}" / "sft_model"

        def fit() -> dict:
            sft_pool, _ = seed_data(seed)
            data = write_jsonl(sft_records(sft_pool, "source") + sft_records(sft_pool[: sizes["target"]], "target"),
                               folder / "train.jsonl")
            train(config_for(folder / "run", data, "sft", {}, sizes["sft_steps"], SFT_LR, seed, start))
            export(folder / "run", folder / "hf")
            model, tokenizer, _ = restore_model(folder / "run")
            return {"arm": "start", "seed": seed, **measures(model, tokenizer, test, None)}

        return folder / "hf", cached_run(folder / "result.json", fit)

    def run_one(arm: str, lr: float, seed: int) -> dict:
        workdir = root / f"seed{seed}" / arm / f"lr{lr:g}"

        def fit() -> dict:
            model_path, start_measures = sft_model(seed)
            _, pairs = seed_data(seed)
            objective, params = ARMS[arm]
            records = {"mpo": pairs, "dpo": target_pairs(pairs), "sft": sft_records(pairs, "target")}[arm]
            data = write_jsonl(records, workdir / "train.jsonl")
            begun = time.time()
            train(config_for(workdir / "run", data, objective, params, sizes["steps"], lr, seed, model_path))
            model, tokenizer, _ = restore_model(workdir / "run")
            reference = {k: np.asarray(v) for k, v in start_measures["logps"].items()}
            return {"arm": arm, "lr": lr, "seed": seed,
                    "validation": exact_match(model, tokenizer, validation, "target"),
                    **measures(model, tokenizer, test, reference), "seconds": round(time.time() - begun, 1)}

        return cached_run(workdir / "result.json", fit)

    tuned = tuned_arms(ARMS, sizes["lrs"], seeds, sweep_seeds, run_one, recorded=recorded)
    runs = {"start": [sft_model(seed)[1] for seed in seeds], **tuned["runs"]}
    comparisons = {name: paired_difference([r[metric] for r in runs[a]], [r[metric] for r in runs[b]])
                   for name, (metric, a, b) in COMPARISONS.items()}
    slim = {arm: [{k: v for k, v in r.items() if k != "logps"} for r in rs] for arm, rs in runs.items()}
    results = {"sizes": {**sizes, "lrs": list(sizes["lrs"]), "validation": len(validation), "test": len(test)},
               "seeds": seeds, "sweep_seeds": sweep_seeds, "start": start.name, "chosen": tuned["chosen"],
               "sweep": sweep_summary(tuned),
               "runs": slim, "comparisons": comparisons,
               "verdicts": {name: verdict(d) for name, d in comparisons.items()},
               "all_runs": [{k: v for k, v in r.items() if k != "logps"} for r in tuned["every"]]}
    markdown = _markdown(results)
    write(args.out, STUDY, command=command_line(STUDY, argv), results=results, markdown=markdown, started=started)
    _plot(results, Path(args.out) / f"{STUDY}.png")
    return results


def _markdown(results: dict) -> str:
    sizes = results["sizes"]
    rows = [[LABELS[arm], f"{results['chosen'].get(arm, SFT_LR):g}", ci_text([r["target_em"] for r in rs], 100),
             ci_text([r["source_em"] for r in rs], 100), ci_text([r["target_pairs"] for r in rs], 100),
             ci_text([r["dominant_drift"] for r in rs], 1, 3)] for arm, rs in results["runs"].items()]
    main = table(["model", "learning rate", "target exact match, %", "dominant exact match, %",
                  "target pairs ranked right, %", "dominant drift (nats/token)"], rows)
    sweep = sweep_section(results, LABELS, "validation target-language exact match %")
    return (f"{sweep}\n\nTest pool ({sizes['test']} addition questions), seeds "
            f"{', '.join(map(str, results['seeds']))}; SFT model: {sizes['sft_steps']} SFT steps from the pretrained "
            f"start `{results['start']}` on {sizes['dominant']} dominant and {sizes['target']} target answers; then "
            f"{sizes['steps']} steps per arm on {sizes['pairs']} records; 95 % CIs:\n\n{main}\n\n"
            + differences_table(results["comparisons"], verdicts=True) + "\n\n" + runs_note(results["all_runs"]))


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    arms = list(results["runs"])
    for offset, key, label in ((-0.2, "target_em", "target exact match"), (0.2, "source_em", "dominant exact match")):
        values = [[100 * r[key] for r in results["runs"][arm]] for arm in arms]
        ax.bar(np.arange(len(arms)) + offset, [np.mean(v) for v in values], 0.4,
               yerr=[np.std(v, ddof=1) if len(v) > 1 else 0 for v in values], label=label)
    ax.set_xticks(range(len(arms)), [LABELS[a] for a in arms], fontsize=6)
    ax.set_ylabel("%")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
