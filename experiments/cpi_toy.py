"""CPI-FT vs multi-task and sequential SFT on the four toy tasks (addition, subtraction, reversal, copy).

Runs `jaxalign.cpi.pipeline.run` (what `jaxalign cpi --config cpi` runs) at a size that fits the study budget:
the bundled config's method settings (p = 1 % cores, τ = 0.2, embeddings and norms included) with shorter probes
(250 steps per task) and stages (125 steps per task), and baselines with the same budget. The full-size run
(500-step probes, 22 minutes) is reported in docs/cpi.md. Scores: held-out exact match per task.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from common import command_line, parser, pm, seeds_of, table, workdir_of, write

from jaxalign.configs import cpi as cpi_config
from jaxalign.cpi.pipeline import run as run_cpi

STUDY = "cpi_toy"
ROWS = {"base": "base θ0", "fused": "fused (before staged SFT)", "cpi_ft": "**CPI-FT**",
        "sequential_sft": "sequential SFT", "multi_task_sft": "multi-task SFT"}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser(__doc__).parse_args(argv)
    started = time.time()
    seeds = seeds_of(args, (0,))
    per_seed = []
    for seed in seeds:
        config = cpi_config.get_config()
        config.seed = seed
        config.workdir = str(workdir_of(args, STUDY) / f"seed{seed}")
        config.logging.update(tensorboard=False, plot=False, progress=False)
        if args.smoke:
            config.model.shape.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                      num_kv_heads=1)
            config.cpi.update(train_per_task=64, eval_per_task=8, base_steps=3, probe_steps=3, sample_per_task=16,
                              stage_steps=2, tasks="add,reverse")
            config.train.batch_size = 8
        else:
            config.cpi.update(probe_steps=250, stage_steps=125, eval_per_task=100)
        per_seed.append(run_cpi(config))
    tasks = per_seed[0]["tasks"]
    probe_row = ["probe (each task's own fine-tune)"] + [
        pm([r["scores"][f"probe_{t}"][t] for r in per_seed], 100) for t in tasks]
    probe_row.append(pm([np.mean([r["scores"][f"probe_{t}"][t] for t in tasks]) for r in per_seed], 100))
    rows = [probe_row] + [[label] + [pm([r["scores"][key][t] for r in per_seed], 100) for t in tasks]
                          + [pm([np.mean(list(r["scores"][key].values())) for r in per_seed], 100)]
                          for key, label in ROWS.items()]
    markdown = table(["model", *tasks, "mean"], rows)
    markdown += ("\n\nGroups: " + "; ".join(str(r["groups"]) for r in per_seed) + ". Forgetting (mean drop from "
                 "each task's probe score, points): " + "; ".join(
                     ", ".join(f"{k} {100 * v:.1f}" for k, v in r["forgetting"].items()) for r in per_seed)
                 + f".\nSeeds: {', '.join(map(str, seeds))}; settings: {per_seed[0]['settings']}.")
    results = {"seeds": seeds, "per_seed": per_seed}
    write(args.out, STUDY, command=command_line(STUDY, argv), results=results, markdown=markdown, started=started)
    _plot(per_seed, tasks, f"{args.out}/{STUDY}.png")
    return results


def _plot(per_seed, tasks, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["cpi_ft", "sequential_sft", "multi_task_sft"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    x = np.arange(len(tasks))
    for i, key in enumerate(keys):
        ax.bar(x + (i - 1) * 0.27, [np.mean([r["scores"][key][t] * 100 for r in per_seed]) for t in tasks], 0.27,
               label=ROWS[key].strip("*"))
    ax.set_xticks(x, tasks)
    ax.set_ylabel("held-out exact match (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
