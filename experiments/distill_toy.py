"""Distillation vs SFT on toy arithmetic: a small student trained on the same data, by SFT or by distilling a larger
teacher's next-token distributions (GKD's generalized JSD), same optimizer steps, batch and data.

The teacher (4 layers × 128) is trained once by SFT on the training questions. Each student (2 layers × 64) starts
from its seed's random initialisation. Each arm is tuned on a validation split (never the test questions): SFT over
the learning rate; distillation over the learning rate and the method: off-policy forward KL (β = 0, the classic
KD), and GKD's on-policy mix (half the steps on the student's own samples, λ = 0.5) with β = 0 and with GKD's default
β = 0.5. The test accuracy at the chosen setting is reported for every seed, with a 95 % confidence interval (t
distribution) for the paired difference. Metric: held-out exact match of the greedy answer (the toy's own metric).
On-policy steps also spend compute on sampling (reported as seconds per run).
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
# distillation's methods (the second tuned setting): objective parameters besides the teacher
METHODS = {"kd": {"beta": 0.0}, "gkd_fkl": {"beta": 0.0, "lmbda": 0.5}, "gkd_jsd": {"beta": 0.5, "lmbda": 0.5}}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser(__doc__).parse_args(argv)
    started = time.time()
    sizes = (dict(train=200, valid=8, test=8, teacher_steps=4, steps=4, teacher="smoke", student="smoke",
                  lrs=(3e-3,)) if args.smoke
             else dict(train=4000, valid=100, test=200, teacher_steps=1500, steps=800, teacher="tiny",
                       student="small", lrs=(1e-3, 3e-3)))
    seeds = seeds_of(args, (0, 1, 2, 3, 4))
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
                "distill": [(lr, method) for lr in sizes["lrs"] for method in METHODS]}
    runs = {}
    for arm in ARMS:
        for lr, method in settings[arm]:
            for seed in seeds:
                params = ({"teacher": str(root / "teacher"), "max_new_tokens": 8, **METHODS[method]}
                          if arm == "distill" else {})
                name = f"{arm}_lr{lr:g}" + (f"_{method}" if method is not None else "") + f"_seed{seed}"
                config = toy_config(root / name, path, objective=arm, steps=sizes["steps"], shape=sizes["student"],
                                    seed=seed, lr=lr, params=params)
                model, tok, summary = train_model(config)
                runs[(arm, lr, method, seed)] = {"valid": exact_match(model, tok, valid),
                                                 "test": exact_match(model, tok, test), "seconds": summary["seconds"]}

    def mean_valid(arm, setting):
        return np.mean([runs[(arm, *setting, s)]["valid"] for s in seeds])

    chosen = {arm: max(settings[arm], key=lambda setting, arm=arm: mean_valid(arm, setting)) for arm in ARMS}
    test_by_arm = {arm: [runs[(arm, *chosen[arm], s)]["test"] for s in seeds] for arm in ARMS}
    diff = np.asarray(test_by_arm["distill"]) - np.asarray(test_by_arm["sft"])
    mean, low, high = t_interval(diff * 100)
    sweep = [[arm, f"{lr:g}", "" if method is None else describe(method),
              pm([runs[(arm, lr, method, s)]["valid"] for s in seeds], 100),
              pm([runs[(arm, lr, method, s)]["test"] for s in seeds], 100),
              f"{np.mean([runs[(arm, lr, method, s)]['seconds'] for s in seeds]):.0f}",
              "yes" if (lr, method) == chosen[arm] else ""]
             for arm in ARMS for lr, method in settings[arm]]
    markdown = table(["arm", "learning rate", "method", "validation accuracy %", "test accuracy %", "seconds per run",
                      "chosen"], sweep)
    markdown += (f"\n\nTeacher ({sizes['teacher']} shape, {sizes['teacher_steps']} SFT steps): test accuracy "
                 f"{100 * teacher_accuracy:.1f} %. Students: {sizes['student']} shape, {sizes['steps']} steps of batch "
                 f"32, seeds {', '.join(map(str, seeds))}; {sizes['test']} test and {sizes['valid']} validation "
                 f"questions.\n\nAt each arm's chosen rate: SFT {pm(test_by_arm['sft'], 100)} %, distillation "
                 f"{pm(test_by_arm['distill'], 100)} %; distillation − SFT = {mean:+.1f} points (95 % CI "
                 f"[{low:+.1f}, {high:+.1f}], paired by seed).")
    results = {"sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in sizes.items()}, "seeds": seeds,
               "teacher_test_accuracy": teacher_accuracy, "chosen": {arm: list(c) for arm, c in chosen.items()},
               "methods": METHODS,
               "runs": {f"{arm}@lr={lr:g}@method={method}@seed={seed}": v
                        for (arm, lr, method, seed), v in runs.items()},
               "difference_points": {"mean": mean, "low": low, "high": high}}
    write(args.out, STUDY, command=command_line(STUDY, argv), results=results, markdown=markdown, started=started)
    plot(results, f"{args.out}/{STUDY}.png")
    return results


def describe(method: str) -> str:
    params = METHODS[method]
    on = f"on-policy λ = {params['lmbda']:g}" if params.get("lmbda") else "off-policy"
    return f"{on}, β = {params['beta']:g}"


def plot(results: dict, path) -> None:
    """Test accuracy of each arm at its chosen setting: the mean, and each seed as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 3))
    for i, arm in enumerate(ARMS):
        lr, method = results["chosen"][arm]
        values = [100 * results["runs"][f"{arm}@lr={lr:g}@method={method}@seed={s}"]["test"]
                  for s in results["seeds"]]
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
