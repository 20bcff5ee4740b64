"""The default job (`jaxalign train`, IFT from random weights) against SFT at equal steps, with the ablations that
say where the difference comes from.

`jaxalign train` trains a tiny random Llama with IFT on toy arithmetic for 1,500 steps (λ ramping 0 → 0.2 over 300
steps, γ = 0.95, the input table trained, the loss averaged per token as `--config sft` averages it). Arms, each the
bundled config with only the seed and the named setting changed:

* ``default``: ``jaxalign train`` (``--config default``).
* ``sft``: ``jaxalign train --config sft`` at the default job's steps and evaluation (same lr, schedule, batch, data).
* ``default_sequence`` (``--arms``): the default job averaged per sequence (the official IFT code's averaging and
  this job's default before 2026-12-03).
* From ``default_sequence``, one ingredient changed each (``--arms``): ``default_frozen_table`` (the official frozen
  input table, ``embedding_grad="none"``), ``default_zero`` (λ = γ = 0: SFT averaged per sequence),
  ``default_lambda_only`` (γ = 0: λ's temporal-residual mixing alone) and ``default_gamma_only`` (λ = 0: γ's
  relation-propagation weights alone).

Metric: the job's own closing evaluation, exact match on its 200 held-out questions (greedy, 8 new tokens).
Reported: mean with the 95 % t interval over seeds and the paired differences against SFT and between the
ablations. No learning rate is tuned: the question is how the job a user runs first compares with SFT run the same
way.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from common import (
    cached_run,
    ci_text,
    command_line,
    differences_table,
    paired_difference,
    parser,
    runs_note,
    seeds_of,
    table,
    workdir_of,
    write,
)

from jaxalign.configs import default, sft
from jaxalign.train import train

STUDY = "default_job"
LABELS = {"default": "`jaxalign train` (IFT, averaged per token)", "sft": "`--config sft`, same steps",
          "default_sequence": "IFT averaged per sequence (the old default)",
          "default_frozen_table": "… and the input table frozen",
          "default_zero": "… at λ = γ = 0 (SFT averaged per sequence)",
          "default_lambda_only": "… at γ = 0 (λ's mixing alone)",
          "default_gamma_only": "… at λ = 0 (γ's weights alone)"}
# (method, baseline): the differences reported
COMPARISONS = (("default", "sft"), ("default_sequence", "sft"), ("default_zero", "sft"),
               ("default", "default_sequence"), ("default_sequence", "default_zero"),
               ("default_lambda_only", "default_zero"), ("default_gamma_only", "default_zero"),
               ("default_frozen_table", "default_sequence"))


def config_of(arm: str, seed: int, workdir: Path, smoke: bool):
    config = default.get_config()
    if arm == "sft":
        steps, evals = config.train.steps, config.train.eval_every
        config = sft.get_config()
        config.train.update(steps=steps, eval_every=evals, save_every=evals)
    elif arm != "default":
        config.objective.params.normalization = "sequence"
    if arm == "default_frozen_table":
        config.objective.params.embedding_grad = "none"
    if arm == "default_zero":
        config.objective.params.update(max_lambda=0.0, min_lambda=0.0, gamma=0.0)
    if arm == "default_lambda_only":
        config.objective.params.gamma = 0.0
    if arm == "default_gamma_only":
        config.objective.params.update(max_lambda=0.0, min_lambda=0.0)
    config.seed = seed
    config.workdir = str(workdir)
    config.train.resume = False
    config.logging.update(tensorboard=False, plot=False, progress=False)
    if smoke:
        config.model.shape.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
        config.data.update(toy_size=200, toy_eval_size=16)
        config.train.update(steps=4, eval_every=4, save_every=4, batch_size=8)
    return config


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = parser(__doc__)
    p.add_argument("--arms", default="default,sft", help="comma-separated arms (also "
                   "default_sequence, default_frozen_table, default_zero, default_lambda_only, default_gamma_only)")
    args = p.parse_args(argv)
    started = time.time()
    seeds = seeds_of(args, (0, 1, 2, 3, 4), smoke=(0, 1))
    arms = args.arms.split(",")
    root = workdir_of(args, STUDY)

    def run_one(arm: str, seed: int) -> dict:
        workdir = root / f"seed{seed}" / arm

        def fit() -> dict:
            begun = time.time()
            train(config_of(arm, seed, workdir, args.smoke))
            evals = [r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
                     if r.get("split") == "eval" and "accuracy" in r]
            return {"arm": arm, "seed": seed, "accuracy": evals[-1]["accuracy"], "step": evals[-1]["step"],
                    "curve": [[r["step"], r["accuracy"]] for r in evals], "seconds": round(time.time() - begun, 1)}

        return cached_run(workdir / "result.json", fit)

    runs = {arm: [run_one(arm, seed) for seed in seeds] for arm in arms}
    accuracy = {arm: [r["accuracy"] for r in rs] for arm, rs in runs.items()}
    comparisons = {f"{a} − {b}": paired_difference(accuracy[a], accuracy[b]) for a, b in COMPARISONS
                   if a in arms and b in arms}
    results = {"seeds": seeds, "runs": runs, "comparisons": comparisons}
    rows = [[LABELS[arm], ci_text(accuracy[arm], 100), ", ".join(f"{100 * a:.1f}" for a in accuracy[arm])]
            for arm in arms]
    markdown = table(["arm", "held-out exact match, % (95 % CI)", "per seed, %"], rows)
    markdown += "\n\n" + differences_table(comparisons) + "\n\n" + runs_note(r for rs in runs.values() for r in rs)
    write(args.out, STUDY, command=command_line(STUDY, argv), results=results, markdown=markdown, started=started)
    _plot(accuracy, Path(args.out) / f"{STUDY}.png")
    return results


def _plot(accuracy: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    for i, values in enumerate(accuracy.values()):
        ax.scatter([i] * len(values), [100 * v for v in values], s=14, color="#3a7")
    ax.set_xticks(range(len(accuracy)), list(accuracy), fontsize=8)
    ax.set_ylabel("held-out exact match, %")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
