"""SFT vs IFT on toy arithmetic, from a shared pretrained start: held-out exact match, tuned arms, 5 seeds.

The IFT paper's claim (Hua et al., ACL 2025): fine-tuning a pretrained model with IFT's temporal-residual inputs and
relation-propagation weights beats SFT on the same data and steps. Here both arms fine-tune the shared pretrained
start (``experiments/pretrained.py``: a tiny Llama pretrained on raw toy transcripts, never the chat format, never
a validation or test question) on the same chat records ("What is 12 + 7?" -> "19", questions of the "train"
pool), for the same steps and batch, with the same per-sequence loss averaging (IFT's; ``normalization="sequence"``
for SFT too).

Arms:
* ``sft``: the plain NLL, every parameter trained.
* ``ift``: the official code's settings, λ = 0.2 constant, γ = 0.95, the input-embedding table frozen
  (``embedding_grad="none"``: the official code feeds the policy embeddings from a frozen copy of its table, which
  suits a pretrained table, the paper's regime).
* ``ift_zero``: the ablation, IFT with λ = γ = 0: IFT's code path and its frozen input table with no IFT
  ingredient on. ``ift`` − ``ift_zero`` is the effect of λ and γ alone; ``ift_zero`` − ``sft`` the effect of
  freezing the input table.

Protocol: each arm's learning rate is picked from ``LRS`` by mean exact match on the validation pool over the first
two seeds; then every seed runs at the chosen rate. The published sweeps' choices (seeds 0-1, at each size) are
recorded here (``RECORDED``) and the study runs at them without sweeping again (``--tune`` or ``--sweep-seeds``
sweeps), so that the default size stays within 15 minutes and a rerun with other ``--seeds`` differs from the
published set in its evaluation seeds alone. Reported: exact match on the whole test pool (greedy, 8 new
tokens), mean with the 95 % t interval over seeds, and the paired difference IFT − SFT with its interval, paired
t-test and verdict. ``--full`` trains 3x the steps.
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
from jaxalign.data.toy import arithmetic, arithmetic_pool, write_jsonl
from jaxalign.sampling.routing import answer
from jaxalign.train import train
from jaxalign.train.export import restore_model

STUDY = "sft_vs_ift"
ARMS = {
    "sft": ("sft", {"normalization": "sequence"}),
    "ift": ("ift", {"max_lambda": 0.2, "lambda_schedule": "constant", "gamma": 0.95, "embedding_grad": "none"}),
    "ift_zero": ("ift", {"max_lambda": 0.0, "lambda_schedule": "constant", "gamma": 0.0, "embedding_grad": "none"}),
}
COMPARISONS = {"ift − sft": ("ift", "sft"), "ift − ift_zero (λ, γ alone)": ("ift", "ift_zero"),
               "ift_zero − sft (frozen input table)": ("ift_zero", "sft")}
LABELS = {"sft": "SFT", "ift": "IFT (λ 0.2, γ 0.95)", "ift_zero": "IFT ablation (λ = γ = 0)"}
LRS = (3e-4, 1e-3, 3e-3)
# the choices of the published sweeps (seeds 0-1, 2026-12-03; docs/results.md), at 200 steps and at --full's 600
RECORDED = {200: {"sft": 1e-3, "ift": 3e-3, "ift_zero": 1e-3}, 600: {"sft": 1e-3, "ift": 1e-3, "ift_zero": 3e-3}}


def exact_match(model, tokenizer, records) -> float:
    questions = [r["messages"][0]["content"] for r in records]
    out = answer(model, tokenizer, questions, max_new_tokens=8)
    return float(np.mean([numeric_verifier(t[0], r["answer"]) for t, r in zip(out.texts, records, strict=True)]))


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = parser(__doc__)
    p.add_argument("--full", action="store_true", help="3x the fine-tuning steps")
    rate_options(p, RECORDED[200], "seeds 0-1; at 600 steps sft 0.001, ift 0.001, ift_zero 0.003; at 200 steps")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of the arms (finished runs are "
                   "kept, so two processes may each run some arms and a last call with every arm reports)")
    args = p.parse_args(argv)
    arms = {arm: ARMS[arm] for arm in args.arms.split(",")}
    started = time.time()
    if args.smoke:
        sizes = dict(shape="smoke", train=200, steps=4, lrs=(1e-3, 3e-3), validation=16, test=16)
    else:
        sizes = dict(shape="tiny", train=4000, steps=600 if args.full else 200, lrs=LRS, validation=0, test=0)
    seeds = seeds_of(args, (0, 1, 2, 3, 4), smoke=(0, 1))
    recorded, sweep_seeds = rates_or_sweep(args, seeds, RECORDED.get(sizes["steps"]), sweep_seeds=None)
    if recorded:
        recorded = {arm: recorded[arm] for arm in arms}
    start = pretrained_start(sizes["shape"])
    root = workdir_of(args, STUDY)
    validation = arithmetic_pool("validation")[: sizes["validation"] or None]
    test = arithmetic_pool("test")[: sizes["test"] or None]

    def run_one(arm: str, lr: float, seed: int) -> dict:
        workdir = root / f"seed{seed}" / arm / f"lr{lr:g}"

        def fit() -> dict:
            data = root / f"seed{seed}" / "train.jsonl"  # one file per seed, shared by its arms and rates
            if not data.exists():
                write_jsonl(arithmetic(sizes["train"], seed, pool="train"), data)
            objective, params = ARMS[arm]
            config = toy_config(workdir, data, objective=objective, steps=sizes["steps"], seed=seed, lr=lr,
                                params=params, shape=sizes["shape"], start=start)
            begun = time.time()
            train(config)
            model, tokenizer, _ = restore_model(workdir)
            return {"arm": arm, "lr": lr, "seed": seed, "validation": exact_match(model, tokenizer, validation),
                    "test": exact_match(model, tokenizer, test), "seconds": round(time.time() - begun, 1)}

        return cached_run(workdir / "result.json", fit)

    tuned = tuned_arms(arms, sizes["lrs"], seeds, sweep_seeds, run_one, recorded=recorded)
    tests = {arm: [r["test"] for r in tuned["runs"][arm]] for arm in arms}
    comparisons = {name: paired_difference(tests[a], tests[b]) for name, (a, b) in COMPARISONS.items()
                   if a in arms and b in arms}
    results = {"sizes": {**sizes, "lrs": list(sizes["lrs"]), "validation": len(validation), "test": len(test)},
               "seeds": seeds, "sweep_seeds": sweep_seeds, "start": start.name, "chosen": tuned["chosen"],
               "sweep": sweep_summary(tuned),
               "runs": tuned["runs"], "comparisons": comparisons,
               "all_runs": tuned["every"],
               "verdict": verdict(comparisons["ift − sft"]) if "ift − sft" in comparisons else None}
    markdown = _markdown(results)
    write(args.out, STUDY, command=command_line(STUDY, argv), results=results, markdown=markdown, started=started)
    _plot(results, Path(args.out) / f"{STUDY}.png")
    return results


def _markdown(results: dict) -> str:
    sizes = results["sizes"]
    sweep = sweep_section(results, LABELS)
    main = table(["arm", "learning rate", "test exact match, % (95 % CI)", "per seed, %"],
                 [[LABELS[arm], f"{results['chosen'][arm]:g}", ci_text([r["test"] for r in results["runs"][arm]], 100),
                   ", ".join(f"{100 * r['test']:.1f}" for r in results["runs"][arm])] for arm in results["runs"]])
    diffs = differences_table(results["comparisons"])
    return (f"{sweep}\n\nTest pool ({sizes['test']} questions), seeds "
            f"{', '.join(map(str, results['seeds']))}, {sizes['steps']} steps of batch 32 from the pretrained start "
            f"`{results['start']}`:\n\n{main}\n\n{diffs}\n\n"
            f"Verdict (IFT > SFT): **{results['verdict'] or 'not run'}**.\n\n"
            + runs_note(results["all_runs"]))


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    for i, arm in enumerate(results["runs"]):
        values = np.array([r["test"] for r in results["runs"][arm]]) * 100
        ax.scatter(np.full(len(values), i) + np.linspace(-0.1, 0.1, len(values)), values, s=12, color="#3a7")
        ax.errorbar(i + 0.25, values.mean(), yerr=values.std(ddof=1) if len(values) > 1 else 0, fmt="o", color="k")
    ax.set_xticks(range(len(results["runs"])), [LABELS[a] for a in results["runs"]], fontsize=7)
    ax.set_ylabel("test exact match, %")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
