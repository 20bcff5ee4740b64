"""Distillation vs SFT on toy arithmetic (fair-test protocol): a small student trained on the same data, by SFT or
by distilling a larger teacher's next-token distributions (GKD's generalized JSD), same start, steps, batch and data.

* Starts: the shared pretrained starts (`experiments/pretrained.py`) at both shapes. The teacher fine-tunes the
  tiny one (4 layers x 128) by SFT on the train pool, once. The student's start is the small one (2 layers x 64)
  after a short SFT warm-up on the same data, once (seed 0), as GKD's paper starts every student from a supervised
  fine-tuned checkpoint.
* Arms, each continuing from that student start and tuned over the learning rate on the validation pool (seeds 0
  and 1): SFT; off-policy KD (forward KL to the teacher on the data's completions, β = 0, the classic KD); GKD
  on-policy (half the steps on the student's own samples, λ = 0.5, 8 new tokens at temperature 1) with GKD's
  default β = 0.5.
* Metric: greedy exact match on the test pool (the toy's own metric); 5 seeds (the data order and the sampling);
  paired by seed: each distillation arm − SFT with its 95 % t interval, a paired t-test and a verdict on
  "distillation > SFT". On-policy steps also spend compute on sampling (seconds per run are reported).
* ``--train-records N``: the student (its warm-up and every arm) learns from the first N of the teacher's records
  only, Hinton et al.'s "soft targets as regularizers" setting (the student has little data, the teacher more).
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
    runs_note,
    seeds_of,
    sweep_seeds_of,
    sweep_summary,
    sweep_table,
    table,
    toy_config,
    tuned_arms,
    verdict,
    workdir_of,
    write,
)
from pretrained import pretrained_start

from jaxalign.data.toy import arithmetic, arithmetic_pool, write_jsonl
from jaxalign.train import train
from jaxalign.train.evaluate import exact_match
from jaxalign.train.export import export, restore_model

STUDY = "distill_toy"
# arm: (objective, objective parameters besides the teacher)
ARMS = {"sft": ("sft", {}), "kd": ("distill", {"beta": 0.0}), "gkd": ("distill", {"beta": 0.5, "lmbda": 0.5})}
LABELS = {"sft": "SFT", "kd": "KD (off-policy, β = 0)", "gkd": "GKD (on-policy λ = 0.5, β = 0.5)"}
LRS = (3e-4, 1e-3, 3e-3)
TEACHER_LR = 1e-3
WARMUP_LR = 3e-3  # the student's SFT warm-up (the rate SFT chose from the raw start)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    options = parser(__doc__)
    options.add_argument("--lrs", default="", help="comma-separated learning rates to tune over (default: "
                         + ",".join(f"{lr:g}" for lr in LRS) + ")")
    options.add_argument("--tune-seeds", type=int, default=2, help="how many of the first seeds choose each arm's "
                         "rate on the validation pool")
    options.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms of {tuple(ARMS)}; sft is "
                         "always one (the others are compared with it)")
    options.add_argument("--kd-temperature", type=float, default=1.0, help="the KD arm's temperature T: both "
                         "distributions at logits / T, Hinton's softened targets (default 1; other values keep their "
                         "runs apart, in <workdir>/seedS/kd_tT)")
    options.add_argument("--train-records", type=int, default=0, help="the student's data: the first N of the "
                         "teacher's training records (warm-up and every arm; Hinton et al.'s soft targets with "
                         "little data); default: all of them. The teacher is shared; the student's runs go in "
                         "<workdir>/nN")
    args = options.parse_args(argv)
    if unknown := set(args.arms.split(",")) - set(ARMS):
        options.error(f"--arms: unknown {sorted(unknown)}; choose from {tuple(ARMS)}")
    arms = {arm: ARMS[arm] for arm in ARMS if arm == "sft" or arm in args.arms.split(",")}
    if args.kd_temperature <= 0:
        options.error(f"--kd-temperature {args.kd_temperature}: must be > 0")
    if args.kd_temperature != 1.0 and "kd" not in arms:
        options.error(f"--kd-temperature {args.kd_temperature:g} sets the kd arm, which --arms {args.arms} leaves out")
    labels, folders = dict(LABELS), {arm: arm for arm in ARMS}
    if args.kd_temperature != 1.0:  # the kd arm is in arms (checked above)
        arms["kd"] = ("distill", {**ARMS["kd"][1], "temperature": args.kd_temperature})
        labels["kd"] = f"KD (off-policy, β = 0, T = {args.kd_temperature:g})"
        folders["kd"] = f"kd_t{args.kd_temperature:g}"
    lrs = tuple(float(lr) for lr in args.lrs.split(",")) if args.lrs else LRS
    started = time.time()
    sizes = (dict(train=200, validation=8, test=8, teacher_steps=4, warmup_steps=2, steps=4, teacher="smoke",
                  student="smoke", lrs=(3e-3,)) if args.smoke
             else dict(train=4000, validation=0, test=0, teacher_steps=1200, warmup_steps=150, steps=400,
                       teacher="tiny", student="small", lrs=lrs))
    if not 0 <= args.train_records <= sizes["train"]:
        options.error(f"--train-records {args.train_records}: need 1 to {sizes['train']} (the teacher's records), "
                      "or 0 for all of them")
    seeds = seeds_of(args, (0, 1, 2, 3, 4), smoke=(0, 1))
    if not 1 <= args.tune_seeds <= len(seeds):
        options.error(f"--tune-seeds {args.tune_seeds}: need 1 to {len(seeds)} (the number of seeds)")
    sweep_seeds = sweep_seeds_of(args, seeds, args.tune_seeds)  # --sweep-seeds, where given, replaces the count
    root = workdir_of(args, STUDY)
    students = root / f"n{args.train_records}" if args.train_records else root
    validation = arithmetic_pool("validation")[: sizes["validation"] or None]
    test = arithmetic_pool("test")[: sizes["test"] or None]
    teacher_start, student_start = pretrained_start(sizes["teacher"]), pretrained_start(sizes["student"])
    records = arithmetic(sizes["train"], 7, pool="train")
    data = write_jsonl(records, root / "train.jsonl")
    student_data = write_jsonl(records[: args.train_records], students / "train.jsonl") if args.train_records else data

    def config_for(workdir: Path, objective: str, params: dict, steps: int, lr: float, seed: int, shape: str,
                   start: Path, train_path: Path = student_data):
        return toy_config(workdir, train_path, objective=objective, steps=steps, shape=shape, seed=seed, lr=lr,
                          params=params, start=start)

    def sft_model(folder: Path, steps: int, lr: float, seed: int, shape: str, start: Path, train_path: Path) -> dict:
        """SFT from ``start`` on ``train_path`` into ``folder`` once, exported to ``folder/hf``; its exact match."""

        def fit() -> dict:
            train(config_for(folder / "run", "sft", {}, steps, lr, seed, shape, start, train_path))
            export(folder / "run", folder / "hf")
            model, tokenizer, _ = restore_model(folder / "run")
            return {"test": exact_match(model, tokenizer, test),
                    "validation": exact_match(model, tokenizer, validation)}

        return cached_run(folder / "result.json", fit)

    teacher = sft_model(root / "teacher", sizes["teacher_steps"], TEACHER_LR, 100, sizes["teacher"], teacher_start,
                        data)
    warm = sft_model(students / "student_start", sizes["warmup_steps"], WARMUP_LR, 0, sizes["student"],
                     student_start, student_data)

    def run_one(arm: str, lr: float, seed: int) -> dict:
        workdir = students / f"seed{seed}" / folders[arm] / f"lr{lr:g}"

        def fit() -> dict:
            objective, params = arms[arm]
            if objective == "distill":
                params = {"teacher": str(root / "teacher" / "hf"), "max_new_tokens": 8, **params}
            begun = time.time()
            train(config_for(workdir / "run", objective, params, sizes["steps"], lr, seed, sizes["student"],
                             students / "student_start" / "hf"))
            model, tokenizer, _ = restore_model(workdir / "run")
            return {"arm": arm, "lr": lr, "seed": seed, "validation": exact_match(model, tokenizer, validation),
                    "test": exact_match(model, tokenizer, test), "seconds": round(time.time() - begun, 1)}

        return cached_run(workdir / "result.json", fit)

    tuned = tuned_arms(arms, sizes["lrs"], seeds, sweep_seeds, run_one)
    tests = {arm: [r["test"] for r in tuned["runs"][arm]] for arm in arms}
    comparisons = {f"{labels[arm]} − SFT": paired_difference(tests[arm], tests["sft"]) for arm in arms
                   if arm != "sft"}
    results = {"sizes": {**sizes, "lrs": list(sizes["lrs"]), "validation": len(validation), "test": len(test),
                         "student_records": args.train_records or sizes["train"]},
               "seeds": seeds, "tune_seeds": sweep_seeds, "labels": {arm: labels[arm] for arm in arms},
               "starts": [teacher_start.name, student_start.name], "teacher": teacher,
               "student_start": warm,
               "chosen": tuned["chosen"], "sweep": sweep_summary(tuned), "runs": tuned["runs"],
               "comparisons": comparisons, "verdicts": {name: verdict(d) for name, d in comparisons.items()},
               "all_runs": tuned["every"]}
    write(args.out, STUDY, command=command_line(STUDY, argv), results=results, markdown=_markdown(results),
          started=started)
    plot(results, f"{args.out}/{STUDY}.png")
    return results


def _markdown(results: dict) -> str:
    sizes = results["sizes"]
    main = table(["arm", "learning rate", "test exact match, % (95 % CI)", "per seed, %", "seconds per run"],
                 [[results["labels"][arm], f"{results['chosen'][arm]:g}", ci_text([r["test"] for r in runs], 100),
                   ", ".join(f"{100 * r['test']:.1f}" for r in runs), f"{np.mean([r['seconds'] for r in runs]):.0f}"]
                  for arm, runs in results["runs"].items()])
    sweep = sweep_table(results, results["labels"])
    return (f"Learning-rate sweep (validation exact match %, mean of seeds {results['tune_seeds']}, "
            f"{sizes['validation']} questions):\n\n{sweep}\n\nTest pool ({sizes['test']} "
            f"questions), seeds {', '.join(map(str, results['seeds']))}; students: the {sizes['student']} start "
            f"after {sizes['warmup_steps']} SFT steps (test exact match {100 * results['student_start']['test']:.1f} "
            f"%), then {sizes['steps']} steps of batch 32, both on {sizes['student_records']} training records; "
            f"teacher: the {sizes['teacher']} start + {sizes['teacher_steps']} SFT steps on {sizes['train']} "
            f"records, test exact match {100 * results['teacher']['test']:.1f} %:"
            f"\n\n{main}\n\n"
            + differences_table(results["comparisons"], verdicts=True) + "\n\n" + runs_note(results["all_runs"]))


def plot(results: dict, path) -> None:
    """Test accuracy of each arm at its chosen rate: the mean, and each seed as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3))
    for i, (arm, runs) in enumerate(results["runs"].items()):
        values = [100 * r["test"] for r in runs]
        ax.bar(i, np.mean(values), color="#3a7" if arm != "sft" else "#999", alpha=0.7)
        ax.scatter([i] * len(values), values, color="k", s=12, zorder=3)
    ax.axhline(100 * results["teacher"]["test"], color="#c33", ls="--", lw=1, label="teacher")
    ax.set_xticks(range(len(results["runs"])), [results["labels"][a].split(" (")[0] for a in results["runs"]])
    ax.set_ylabel("test exact match %")
    ax.set_title("Small student, same start, data and steps", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
