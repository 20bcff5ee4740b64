"""CPI-FT vs multi-task and sequential SFT on four toy tasks (addition, subtraction, reversal, copy), with its
ablations and the A -> B forgetting test, from the shared pretrained start.

The CPI-FT paper's claim (Wang, Liang & Peng, EMNLP 2025): isolating each task's core parameters (the top p = 1 %
of its probe fine-tune's updates), fusing the probes and training the fused model in a short pipelined multi-task
stage with earlier groups' cores frozen beats multi-task SFT and multi-stage (sequential) SFT, and forgets less.

Runs ``jaxalign.cpi.pipeline.run`` (what ``jaxalign cpi --config cpi`` runs) per seed, from the shared pretrained
start (``experiments/pretrained.py``: it has read the four tasks' wordings, "Add 3 and 4. 7", "Reverse abcde.
edcba", on train-pool operations only) as θ0, as the paper described it: low-rate probes (``PROBE_LR``), p = 1 %,
τ = 0.2, the pipelined stages on a balanced sample of every task (``stage_data="mixed"``) with earlier groups'
cores frozen, and both baselines at CPI-FT's total steps (probes and stages). Ablations from the same probes:
CPI-FT without fusion (the stages start from θ0) and without freezing. The forgetting test: task A's probe then
task B's data (add -> reverse), with A's core frozen or not; A's retention.

Scores: held-out exact match per task (the arithmetic questions from the test pool), the mean over tasks. Paired
differences over seeds for: CPI-FT − multi-task SFT, CPI-FT − sequential SFT (the claim), CPI-FT − no fusion and
CPI-FT − no freezing (what each part adds), and A's retention with the core frozen − without. The probes (and the
forgetting test) run at ``PROBE_LR``, part of the method. The stages and the baselines run at ``LR`` by default;
``--lrs`` with several rates tunes them per arm instead, as the fair-test protocol asks: every rate's run on the
validation pool over ``--sweep-seeds``, each arm (CPI-FT, each ablation, each baseline) takes the rate with its best
mean validation score, and each evaluation seed runs the pipeline once per chosen rate, with only the parts that
rate serves (a study interrupted and started again reuses finished runs, which live in
``<workdir>/<pool>-lr<rate>/seed<seed>-<parts>``).
"""

from __future__ import annotations

import sys
import time

import numpy as np
from common import (
    cached_run,
    ci_text,
    command_line,
    differences_table,
    paired_difference,
    parser,
    seeds_of,
    sweep_seeds_of,
    sweep_table,
    table,
    verdict,
    workdir_of,
    write,
)
from pretrained import pretrained_start

from jaxalign.configs import cpi as cpi_config
from jaxalign.cpi.pipeline import run as run_cpi

STUDY = "cpi_toy"
ROWS = {"base": "θ0 (the pretrained start)", "fused": "fused (before the stages)", "cpi_ft": "**CPI-FT**",
        "cpi_ft_no_fusion": "CPI-FT without fusion", "cpi_ft_no_freezing": "CPI-FT without freezing",
        "sequential_sft": "sequential SFT", "multi_task_sft": "multi-task SFT"}
CLAIMS = {"CPI-FT − multi-task SFT": ("cpi_ft", "multi_task_sft"),
          "CPI-FT − sequential SFT": ("cpi_ft", "sequential_sft"),
          "CPI-FT − without fusion": ("cpi_ft", "cpi_ft_no_fusion"),
          "CPI-FT − without freezing": ("cpi_ft", "cpi_ft_no_freezing")}
PROBE_LR, LR = 3e-4, 1e-3
FORGETTING = "add,reverse"
# which arms each part of the pipeline trains (CPI-FT itself is always trained: the stages follow the probes)
ARMS = {"cpi_ft": "", "cpi_ft_no_fusion": "ablations", "cpi_ft_no_freezing": "ablations",
        "multi_task_sft": "baselines", "sequential_sft": "baselines"}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = parser(__doc__)
    p.add_argument("--full", action="store_true", help="2x the probe and stage steps")
    p.add_argument("--lrs", default=f"{LR:g}", help="comma-separated learning rates of the stages and the baselines "
                   f"(default {LR:g}, fixed); with several, each arm's rate is chosen on the validation pool over "
                   "--sweep-seeds (default: the first two seeds), and the arms run at their own rates (the probes "
                   f"and the forgetting test stay at {PROBE_LR:g})")
    args = p.parse_args(argv)
    try:
        lrs = sorted({float(lr) for lr in args.lrs.split(",")})
    except ValueError:
        p.error(f"--lrs {args.lrs!r}: expected comma-separated numbers, e.g. 3e-4,1e-3,3e-3")
    if min(lrs) <= 0:
        p.error(f"--lrs {args.lrs}: every rate must be > 0")
    started = time.time()
    seeds = seeds_of(args, (0, 1, 2, 3, 4), smoke=(0, 1))
    sweep_seeds = sweep_seeds_of(args, seeds) if len(lrs) > 1 else []
    start = pretrained_start("smoke" if args.smoke else "tiny")
    root = workdir_of(args, STUDY)
    scale = 2 if args.full else 1

    def one_run(seed: int, lr: float, pool: str, parts: set[str]) -> dict:
        """The pipeline at one seed and stage rate, scored on ``pool``, with ``parts`` (of ablations, baselines,
        forgetting); a finished run with more parts at the same seed, rate and pool serves as well."""
        folder = root / f"{pool}-lr{lr:g}"
        for done in sorted(folder.glob(f"seed{seed}-*/result.json")):
            if parts <= set(done.parent.name.removeprefix(f"seed{seed}-").split("+")):
                return cached_run(done, None)
        workdir = folder / f"seed{seed}-{'+'.join(sorted(parts)) or 'cpi_ft'}"
        config = cpi_config.get_config()
        config.seed = seed
        config.workdir = str(workdir)
        config.model.path, config.tokenizer = str(start), ""
        config.optim.lr = lr
        config.logging.update(tensorboard=False, plot=False, progress=False)
        config.cpi.update(base_steps=0, probe_lr=PROBE_LR, stage_data="mixed", eval_pool=pool,
                          ablations="ablations" in parts, baselines="baselines" in parts,
                          forgetting=FORGETTING if "forgetting" in parts else "")
        if args.smoke:
            config.cpi.update(train_per_task=64, eval_per_task=8, probe_steps=3, sample_per_task=16, stage_steps=2)
            config.train.batch_size = 8
        else:
            config.cpi.update(probe_steps=150 * scale, stage_steps=60 * scale, eval_per_task=100,
                              sample_per_task=300)
        return cached_run(workdir / "result.json", lambda: run_cpi(config))

    def mean_score(run: dict, key: str) -> float:
        return float(np.mean([run["scores"][key][t] for t in run["tasks"]]))

    sweep = {arm: {f"{lr:g}": [] for lr in lrs} for arm in ARMS}  # validation means per sweep seed
    for lr in lrs:
        for seed in sweep_seeds:
            run = one_run(seed, lr, "validation", {"ablations", "baselines"})
            for arm in ARMS:
                sweep[arm][f"{lr:g}"].append(mean_score(run, arm))
    chosen = {arm: max(lrs, key=lambda lr, arm=arm: np.mean(sweep[arm][f"{lr:g}"])) if sweep_seeds else lrs[0]
              for arm in ARMS}

    def one_seed(seed: int) -> dict:
        """The seed's scores on the test pool, each arm from the run at its own rate; the probes, the fused model and
        the forgetting test (which the stage rate does not touch) from CPI-FT's run."""
        runs = {lr: one_run(seed, lr, "test", {part for arm, part in ARMS.items() if part and chosen[arm] == lr}
                            | ({"forgetting"} if chosen["cpi_ft"] == lr else set()))
                for lr in sorted(set(chosen.values()))}
        merged = dict(runs[chosen["cpi_ft"]])
        merged["scores"] = {**merged["scores"], **{arm: runs[chosen[arm]]["scores"][arm] for arm in ARMS}}
        return merged

    per_seed = [one_seed(seed) for seed in seeds]
    tasks = per_seed[0]["tasks"]
    means = {key: [float(np.mean([r["scores"][key][t] for t in tasks])) for r in per_seed] for key in ROWS}
    means["probes"] = [float(np.mean([r["scores"][f"probe_{t}"][t] for t in tasks])) for r in per_seed]
    comparisons = {name: paired_difference(means[a], means[b]) for name, (a, b) in CLAIMS.items()}
    a, b = FORGETTING.split(",")
    retention = {k: [r["forgetting_test"][f"after_b_{k}"][a] for r in per_seed] for k in ("plain", "core_frozen")}
    comparisons[f"{a} kept after {b}: core frozen − not"] = paired_difference(retention["core_frozen"],
                                                                               retention["plain"])
    results = {"seeds": seeds, "start": start.name, "tasks": tasks, "probe_lr": PROBE_LR, "lrs": lrs,
               "sweep_seeds": sweep_seeds, "sweep": sweep if sweep_seeds else {}, "chosen": chosen,
               "settings": per_seed[0]["settings"], "means": means, "retention": retention,
               "comparisons": comparisons, "verdicts": {name: verdict(d) for name, d in comparisons.items()},
               "per_seed": per_seed}
    markdown = _markdown(results)
    write(args.out, STUDY, command=command_line(STUDY, argv), results=results, markdown=markdown, started=started)
    _plot(results, f"{args.out}/{STUDY}.png")
    return results


def _markdown(results: dict) -> str:
    tasks, per_seed = results["tasks"], results["per_seed"]
    probe = ["each task's own probe", *[ci_text([r["scores"][f"probe_{t}"][t] for r in per_seed], 100) for t in tasks],
             ci_text(results["means"]["probes"], 100)]
    rows = [probe] + [[label, *[ci_text([r["scores"][key][t] for r in per_seed], 100) for t in tasks],
                       ci_text(results["means"][key], 100)] for key, label in ROWS.items()]
    a, b = FORGETTING.split(",")
    settings = results["settings"]
    after_a = [r["forgetting_test"]["after_a"][a] for r in per_seed]
    forgetting = table(["model", f"{a} exact match, %", f"{b} exact match, %"],
                       [[f"{a}'s probe", ci_text(after_a, 100),
                         ci_text([r["forgetting_test"]["after_a"][b] for r in per_seed], 100)]]
                       + [[f"then {b}, {label}", ci_text(results["retention"][k], 100),
                           ci_text([r["forgetting_test"][f"after_b_{k}"][b] for r in per_seed], 100)]
                          for k, label in (("plain", "nothing frozen"), ("core_frozen", f"{a}'s core frozen"))])
    groups = "; ".join(str(r["groups"]) for r in per_seed)
    chosen = results["chosen"]
    rates = ("Stage and baseline rate: " + ", ".join(f"{ROWS[arm].strip('*')} {lr:g}" for arm, lr in chosen.items())
             + (f" (each chosen on the validation pool, mean of seeds {', '.join(map(str, results['sweep_seeds']))})."
                if results["sweep"] else " (fixed)."))
    sweep = ""
    if results["sweep"]:
        sweep = ("\n\nLearning-rate sweep (validation exact match, mean over the four tasks and the sweep seeds, %):"
                 "\n\n" + sweep_table({**results, "sizes": {"lrs": results["lrs"]}},
                                        {arm: ROWS[arm].strip("*") for arm in chosen}))
    return (table(["model", *tasks, "mean"], rows)
            + f"\n\nHeld-out exact match, % (95 % CI over seeds {', '.join(map(str, results['seeds']))}). Groups: "
              f"{groups}. Probes {settings['probe_steps']} steps at lr {results['probe_lr']:g}; stages "
              f"{settings['stage_steps']} steps per task on {settings['sample_per_task']} records of every task; "
              f"baselines at the same total steps; p = {settings['fraction']}, τ = {settings['tau']}. {rates}"
              f"\n\nThe forgetting test ({a} -> {b}, {settings['probe_steps']} steps of {b} at lr "
              f"{results['probe_lr']:g}):\n\n" + forgetting + "\n\n"
            + differences_table(results["comparisons"], verdicts=True) + sweep)


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["cpi_ft", "cpi_ft_no_fusion", "cpi_ft_no_freezing", "sequential_sft", "multi_task_sft"]
    tasks = results["tasks"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    x = np.arange(len(tasks))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        values = [np.mean([r["scores"][key][t] * 100 for r in results["per_seed"]]) for t in tasks]
        ax.bar(x + (i - len(keys) / 2 + 0.5) * width, values, width, label=ROWS[key].strip("*"))
    ax.set_xticks(x, tasks)
    ax.set_ylabel("held-out exact match (%)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
