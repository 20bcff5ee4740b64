"""Distillation vs SFT on toy arithmetic: a small student trained on the same data, by SFT or by distilling a larger
teacher's next-token distributions (GKD's generalized JSD), same steps and batch.

The teacher (4 layers × 128) is trained once by SFT on the training questions. Each student (2 layers × 64) starts
from its seed's random initialisation. Each arm is tuned on a validation split (never the test questions): SFT over
the learning rate, distillation over the learning rate and β (0 = forward KL, 0.5 = GKD's default JSD); the test
accuracy at the chosen setting is reported for every seed, with a 95 % confidence interval (t distribution) for the
paired difference. Metric: held-out exact match of the greedy answer (the toy's own metric).
"""

from __future__ import annotations

import sys
import time

import numpy as np
from common import command_line, parser, pm, seeds_of, t_interval, table, toy_config, train_model, workdir_of, write

from jaxalign.data.toy import arithmetic, write_jsonl
from jaxalign.train.evaluate import exact_match

STUDY = "distill_toy"
ARMS = ("sft", "distill")
BETAS = (0.0, 0.5)  # distillation's second tuned setting


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser(__doc__).parse_args(argv)
    started = time.time()
    sizes = (dict(train=200, valid=8, test=8, teacher_steps=4, steps=4, teacher="smoke", student="smoke",
                  lrs=(3e-3,)) if args.smoke
             else dict(train=4000, valid=100, test=200, teacher_steps=1500, steps=800, teacher="tiny",
                       student="small", lrs=(3e-3, 1e-2)))
    seeds = seeds_of(args, (0, 1, 2))
    root = workdir_of(args, STUDY)
    test = arithmetic(sizes["test"], 20_000)
    valid = arithmetic(sizes["valid"], 30_000)
    held = {r["messages"][0]["content"] for r in [*test, *valid]}
    train_records = [r for r in arithmetic(sizes["train"], 7) if r["messages"][0]["content"] not in held]
    path = write_jsonl(train_records, root / "train.jsonl")
    teacher_cfg = toy_config(root / "teacher", path, steps=sizes["teacher_steps"], shape=sizes["teacher"], seed=100)
    teacher, tokenizer, _ = train_model(teacher_cfg)
    teacher_accuracy = exact_match(teacher, tokenizer, test)
    settings = {"sft": [(lr, None) for lr in sizes["lrs"]],
                "distill": [(lr, beta) for lr in sizes["lrs"] for beta in BETAS]}
    runs = {}
    for arm in ARMS:
        for lr, beta in settings[arm]:
            for seed in seeds:
                params = {"teacher": str(root / "teacher"), "beta": beta} if arm == "distill" else {}
                name = f"{arm}_lr{lr:g}" + (f"_beta{beta:g}" if beta is not None else "") + f"_seed{seed}"
                config = toy_config(root / name, path, objective=arm, steps=sizes["steps"], shape=sizes["student"],
                                    seed=seed, lr=lr, params=params)
                model, tok, summary = train_model(config)
                runs[(arm, lr, beta, seed)] = {"valid": exact_match(model, tok, valid),
                                               "test": exact_match(model, tok, test), "seconds": summary["seconds"]}

    def mean_valid(arm, setting):
        return np.mean([runs[(arm, *setting, s)]["valid"] for s in seeds])

    chosen = {arm: max(settings[arm], key=lambda setting, arm=arm: mean_valid(arm, setting)) for arm in ARMS}
    test_by_arm = {arm: [runs[(arm, *chosen[arm], s)]["test"] for s in seeds] for arm in ARMS}
    diff = np.asarray(test_by_arm["distill"]) - np.asarray(test_by_arm["sft"])
    mean, low, high = t_interval(diff * 100)
    sweep = [[arm, f"{lr:g}", "" if beta is None else f"{beta:g}",
              pm([runs[(arm, lr, beta, s)]["valid"] for s in seeds], 100),
              pm([runs[(arm, lr, beta, s)]["test"] for s in seeds], 100), "yes" if (lr, beta) == chosen[arm] else ""]
             for arm in ARMS for lr, beta in settings[arm]]
    markdown = table(["arm", "learning rate", "β", "validation accuracy %", "test accuracy %", "chosen"], sweep)
    markdown += (f"\n\nTeacher ({sizes['teacher']} shape, {sizes['teacher_steps']} SFT steps): test accuracy "
                 f"{100 * teacher_accuracy:.1f} %. Students: {sizes['student']} shape, {sizes['steps']} steps of batch "
                 f"32, seeds {', '.join(map(str, seeds))}; {sizes['test']} test and {sizes['valid']} validation "
                 f"questions.\n\nAt each arm's chosen rate: SFT {pm(test_by_arm['sft'], 100)} %, distillation "
                 f"{pm(test_by_arm['distill'], 100)} %; distillation − SFT = {mean:+.1f} points (95 % CI "
                 f"[{low:+.1f}, {high:+.1f}], paired by seed).")
    results = {"sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in sizes.items()}, "seeds": seeds,
               "teacher_test_accuracy": teacher_accuracy, "chosen": {arm: list(c) for arm, c in chosen.items()},
               "runs": {f"{arm}@lr={lr:g}@beta={beta}@seed={seed}": v for (arm, lr, beta, seed), v in runs.items()},
               "difference_points": {"mean": mean, "low": low, "high": high}}
    write(args.out, STUDY, command=command_line(STUDY, argv), results=results, markdown=markdown, started=started)
    plot(results, f"{args.out}/{STUDY}.png")
    return results


def plot(results: dict, path) -> None:
    """Test accuracy of each arm at its chosen setting: the mean, and each seed as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 3))
    for i, arm in enumerate(ARMS):
        lr, beta = results["chosen"][arm]
        values = [100 * results["runs"][f"{arm}@lr={lr:g}@beta={beta}@seed={s}"]["test"] for s in results["seeds"]]
        ax.bar(i, np.mean(values), color=["#999", "#3a7"][i], alpha=0.7)
        ax.scatter([i] * len(values), values, color="k", s=12, zorder=3)
    ax.axhline(100 * results["teacher_test_accuracy"], color="#c33", ls="--", lw=1, label="teacher")
    ax.set_xticks(range(len(ARMS)), ["SFT", "distillation"])
    ax.set_ylabel("held-out exact match %")
    ax.set_title("Small student, same data and steps", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
