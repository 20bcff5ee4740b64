"""GRPO on toy arithmetic from an SFT start: does RL with a verifiable reward raise held-out exact match?

The default is the fair-test version (``tuned_study``; docs/results.md, "GRPO on the protocol"): the shared
pretrained start, one SFT start from it, then GRPO, matched SFT and SFT on the short answers alone (the style
ablation) at equal steps, each at the rate its sweep chose, 5 seeds, on the whole test pool.

The first version (``--bundled``): each seed runs the bundled default job, `jaxalign train --config grpo
--config.seed=S`: 600 SFT steps of the tiny random model on toy arithmetic whose answers mix two styles
(`data.toy_style=mixed`: "28" or "16 + 12 = 28. The answer is 28."), then 150 GRPO steps (DAPO loss, 16 prompts x 8
completions of at most 8 tokens, exact-number reward, lr 1.5e-4) on the same training questions. Held-out exact
match: greedy, 8 new tokens, the run's 200 held-out questions (none of them in the training data), at step 0 (the
SFT start) and every 25 steps.

The matched baseline (`--baseline`): from the same SFT start, 150 more SFT steps of 128 sequences (as many
sequences as GRPO's completions) on the same training data at the same learning rate.

What the gain is made of: the verbose style does not fit the 8-token budget (its final number within 8 tokens is an
operand), so the study also reports the share of held-out greedy answers in the short style and the exact match
among those.

    python experiments/grpo_toy.py                 # the fair-test version (docs/results.md): the shared pretrained
                                                   # start, a short-answer SFT ablation, each arm at its tuned rate
    python experiments/grpo_toy.py --tune          # the same, its learning-rate sweep run again (seeds 100-101)
    python experiments/grpo_toy.py --smoke         # seconds: checks the script
    python experiments/grpo_toy.py --bundled       # the first version, described above: 5 seeds of the bundled job
                                                   # (about 30 minutes on 2 cores), docs/results/grpo_toy.*
    python experiments/grpo_toy.py --bundled --baseline   # and the matched SFT arm (about 6 minutes more)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    cached_run,
    ci_text,
    command_line,
    differences_table,
    paired_difference,
    parser,
    pm,
    rate_options,
    rates_or_sweep,
    runs_note,
    seeds_of,
    sweep_section,
    sweep_summary,
    t_interval,
    table,
    toy_config,
    tuned_arms,
    verdict,
    workdir_of,
    write,
)
from pretrained import pretrained_start

from jaxalign.data.sources import read_records
from jaxalign.data.toy import arithmetic, arithmetic_pool, write_jsonl
from jaxalign.train import load_config, train
from jaxalign.train.evaluate import extract_answer, greedy_answers, prompt_of
from jaxalign.train.export import export, restore_model

SMOKE = ["--config.objective.params.sft_steps=20", "--config.train.steps=4", "--config.train.eval_every=2",
         "--config.eval.generate=16", "--config.objective.params.prompts_per_step=4",
         "--config.train.batch_size=32", "--config.train.save_every=4"]


def evaluations(workdir: Path) -> list[dict]:
    return [r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines()) if r["split"] == "eval"]


def answer_styles(workdir: Path, eval_file: Path, max_new_tokens: int = 8) -> dict:
    """Share of held-out greedy answers in the short style (a bare number) and the exact match among them."""
    model, tokenizer, _ = restore_model(workdir)
    return styles_of(model, tokenizer, [r for _, r in read_records(eval_file)], max_new_tokens)


def styles_of(model, tokenizer, records: list[dict], max_new_tokens: int = 8) -> dict:
    """``answer_styles`` for a loaded model and records: exact match, short-style share, exact match among short."""
    texts = [t.strip() for t in greedy_answers(model, tokenizer, [prompt_of(r) for r in records],
                                               max_new_tokens=max_new_tokens)]
    short = [t.lstrip("-").isdigit() for t in texts]
    right = [extract_answer(t) == str(r["answer"]) for t, r in zip(texts, records, strict=True)]
    n_short = sum(short)
    return {"short_share": n_short / len(texts), "accuracy": sum(right) / len(texts),
            "short_accuracy": sum(r for r, s in zip(right, short, strict=True) if s) / max(n_short, 1)}


def plot(runs: list[dict], path: Path) -> None:
    """Held-out exact match and the sampled reward against the GRPO step, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for run in runs:
        steps, values = zip(*run["curve"], strict=True)
        axes[0].plot(steps, [100 * v for v in values], marker="o", label=f"seed {run['seed']}")
        steps, values = zip(*run["reward_curve"], strict=True)
        axes[1].plot(steps, values, label=f"seed {run['seed']}")
        if run.get("sft_more") is not None:
            axes[0].scatter([steps[-1]], [100 * run["sft_more"]], marker="x", color="k")
    axes[0].set(title="held-out exact match, % (x: 150 more SFT steps)", xlabel="GRPO step")
    axes[1].set(title="sampled reward (training prompts)", xlabel="GRPO step")
    for ax in axes:
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


TUNED_ARMS = ("grpo", "sft", "sft_short")
TUNED_LABELS = {"grpo": "GRPO", "sft": "matched SFT (both styles)", "sft_short": "SFT on short answers only"}
TUNED_LRS = {"grpo": (5e-5, 1.5e-4, 5e-4), "sft": (1e-4, 3e-4, 1e-3), "sft_short": (1e-4, 3e-4, 1e-3)}
START_LR = 1e-3  # the SFT start's rate (the rate SFT chose from the pretrained start in the SFT vs IFT study)
# the choice of the published sweep (seeds 100-101, 2026-12-07; docs/results.md): the study runs at it by default
TUNED_RECORDED = {"grpo": 1.5e-4, "sft": 1e-3, "sft_short": 1e-4}


def tuned_study(args, argv: list[str], started: float) -> dict:
    """The fair-test version (``--tuned``): the shared pretrained start, one SFT start from it on mixed-style answers
    of the train pool, then three arms from that start at equal steps (GRPO; SFT on the same mixed data; SFT on the
    same questions' short answers, the style ablation), each arm's rate chosen on the validation pool
    (``--sweep-seeds``, by default 100 and 101; that choice is recorded in ``TUNED_RECORDED`` and used unless
    ``--tune`` or ``--sweep-seeds`` asks for the sweep), scored on the whole test pool (greedy, 8 new tokens: GRPO's
    completion budget)."""
    if args.smoke:
        sizes = dict(shape="smoke", train=200, start_steps=10, steps=3, prompts=4, validation=16, test=16,
                     lrs={arm: (1e-3, 3e-3) for arm in TUNED_ARMS})
    else:
        sizes = dict(shape="tiny", train=4000, start_steps=300, steps=150, prompts=16, validation=0, test=0,
                     lrs=TUNED_LRS)
    generations = 8
    seeds = seeds_of(args, (0, 1, 2, 3, 4), smoke=(0, 1))
    # the published rate choice's seeds by default, so that a rerun with other --seeds differs in those alone
    recorded, sweep_seeds = rates_or_sweep(args, seeds, TUNED_RECORDED)
    pretrained = pretrained_start(sizes["shape"])
    root = workdir_of(args, "grpo_toy_tuned")
    validation = arithmetic_pool("validation")[: sizes["validation"] or None]
    test = arithmetic_pool("test")[: sizes["test"] or None]

    def data(seed: int, style: str) -> Path:
        """The seed's training questions (train pool) with ``style`` answers: the same questions in either style."""
        path = root / "data" / f"train_{style}_seed{seed}.jsonl"
        if not path.exists():
            write_jsonl(arithmetic(sizes["train"], seed, style=style, pool="train"), path)
        return path

    def scores(workdir: Path) -> dict:
        model, tokenizer, _ = restore_model(workdir)
        valid, tested = styles_of(model, tokenizer, validation), styles_of(model, tokenizer, test)
        return {"validation": valid["accuracy"], "test": tested["accuracy"], "test_styles": tested}

    def make_start() -> dict:
        folder = root / "sft_start"
        config = toy_config(folder / "run", data(0, "mixed"), steps=sizes["start_steps"], seed=0, lr=START_LR,
                            shape=sizes["shape"], start=pretrained)
        begun = time.time()
        train(config)
        export(folder / "run", folder / "hf")
        return {**scores(folder / "run"), "seconds": round(time.time() - begun, 1)}

    start_record = cached_run(root / "sft_start" / "result.json", make_start)
    start = root / "sft_start" / "hf"
    if not (start / "config.json").exists():  # its record kept without the model (docs/results/...): train it again
        again = make_start()
        if (again["validation"], again["test"]) != (start_record["validation"], start_record["test"]):
            raise SystemExit(f"{root / 'sft_start'}: trained again, the SFT start scores {again['validation']:.4f} / "
                             f"{again['test']:.4f} (validation / test) where its record says "
                             f"{start_record['validation']:.4f} / {start_record['test']:.4f}; not the same start, so "
                             "the recorded runs cannot be continued from it")

    def run_one(arm: str, lr: float, seed: int) -> dict:
        workdir = root / f"seed{seed}" / arm / f"lr{lr:g}"

        def fit() -> dict:
            batch = sizes["prompts"] * generations  # GRPO's completions per step = the SFT arms' sequences per step
            if arm == "grpo":
                config = load_config("grpo", [
                    f"--config.seed={seed}", f"--config.workdir={workdir}", f"--config.model.path={start}",
                    "--config.tokenizer=", f"--config.data.train={data(seed, 'mixed')}", "--config.data.eval=",
                    "--config.eval.generate=0", "--config.train.eval_every=0", "--config.objective.params.sft_steps=0",
                    f"--config.objective.params.prompts_per_step={sizes['prompts']}",
                    f"--config.objective.params.num_generations={generations}",
                    f"--config.train.batch_size={batch}", f"--config.train.steps={sizes['steps']}",
                    f"--config.train.save_every={sizes['steps']}", "--config.train.keep_checkpoints=1",
                    f"--config.optim.lr={lr}", "--config.logging.progress=False", "--config.logging.plot=False",
                    "--config.logging.tensorboard=False"])
            else:
                config = toy_config(workdir, data(seed, "mixed" if arm == "sft" else "short"), steps=sizes["steps"],
                                    seed=seed, batch_size=batch, lr=lr, shape=sizes["shape"], start=start)
                config.optim.update(schedule="constant", warmup_steps=0)  # as the GRPO config
            begun = time.time()
            train(config)
            return {"arm": arm, "lr": lr, "seed": seed, **scores(workdir), "seconds": round(time.time() - begun, 1)}

        return cached_run(workdir / "result.json", fit)

    tuned = tuned_arms(TUNED_ARMS, sizes["lrs"], seeds, sweep_seeds, run_one, recorded=recorded)
    tests = {arm: [r["test"] for r in tuned["runs"][arm]] for arm in TUNED_ARMS}
    comparisons = {"GRPO − matched SFT": paired_difference(tests["grpo"], tests["sft"]),
                   "GRPO − SFT on short answers (the style ablation)": paired_difference(tests["grpo"],
                                                                                        tests["sft_short"]),
                   "GRPO − the SFT start": paired_difference(tests["grpo"], [start_record["test"]] * len(seeds))}
    results = {"sizes": {**sizes, "lrs": {a: list(v) for a, v in sizes["lrs"].items()},
                         "validation": len(validation), "test": len(test), "generations": generations},
               "seeds": seeds, "sweep_seeds": sweep_seeds, "pretrained": pretrained.name, "start": start_record,
               "chosen": tuned["chosen"], "sweep": sweep_summary(tuned), "runs": tuned["runs"],
               "comparisons": comparisons, "verdicts": {name: verdict(d) for name, d in comparisons.items()}}

    def style_cells(runs: list[dict]) -> list[str]:
        return [pm([r["test_styles"]["short_share"] for r in runs], 100),
                pm([r["test_styles"]["short_accuracy"] for r in runs], 100)]

    rows = [["the SFT start", "-", f"{100 * start_record['test']:.1f}", "-",
             f"{100 * start_record['test_styles']['short_share']:.1f}",
             f"{100 * start_record['test_styles']['short_accuracy']:.1f}"]]
    for arm in TUNED_ARMS:
        runs = tuned["runs"][arm]
        rows.append([TUNED_LABELS[arm], f"{tuned['chosen'][arm]:g}", ci_text(tests[arm], 100),
                     ", ".join(f"{100 * v:.1f}" for v in tests[arm]), *style_cells(runs)])
    text = (f"Test pool ({len(test)} questions, greedy, 8 new tokens), seeds {', '.join(map(str, seeds))}; the SFT "
            f"start: the pretrained start `{pretrained.name}` + {sizes['start_steps']} SFT steps on mixed-style "
            f"answers; each arm {sizes['steps']} steps of {sizes['prompts'] * generations} sequences from it.\n\n")
    text += table(["arm", "learning rate", "test exact match, % (95 % CI)", "per seed, %", "short-style answers, %",
                   "exact match among short, %"], rows)
    text += "\n\n" + differences_table(comparisons, verdicts=True)
    text += "\n\n" + sweep_section(results, TUNED_LABELS) + "\n\n" + runs_note(tuned["every"])
    write(args.out, "grpo_toy_tuned", command=command_line("grpo_toy", argv), results=results, markdown=text,
          started=started)
    plot_tuned(results, Path(args.out) / "grpo_toy_tuned.png")
    return results


def plot_tuned(results: dict, path: Path) -> None:
    """Test exact match per arm (a bar: the mean; dots: the seeds) against the SFT start (a line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3))
    for i, arm in enumerate(TUNED_ARMS):
        values = [100 * r["test"] for r in results["runs"][arm]]
        ax.bar(i, np.mean(values), color="0.8")
        ax.scatter([i] * len(values), values, color="k", s=10, zorder=3)
    ax.axhline(100 * results["start"]["test"], color="tab:red", linestyle="--", label="the SFT start")
    ax.set_xticks(range(len(TUNED_ARMS)), [f"{TUNED_LABELS[a]}\nlr {results['chosen'][a]:g}" for a in TUNED_ARMS],
                  fontsize=7)
    ax.set_ylabel("test exact match, %")
    ax.set_title("GRPO against SFT from one start, each arm's rate tuned", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser(__doc__)
    args.add_argument("--bundled", action="store_true", help="the first version: each seed runs the bundled "
                      "`jaxalign train --config grpo` job (default: the fair-test version, docs/results.md)")
    args.add_argument("--baseline", action="store_true", help="with --bundled: also the matched SFT-continuation arm")
    args.add_argument("--tuned", action="store_true", help="the fair-test version, the default (kept so that the "
                      "commands published before it became the default still run)")
    rate_options(args, TUNED_RECORDED, "seeds 100-101")
    args = args.parse_args(argv)
    started = time.time()
    if args.bundled and args.tuned:
        raise SystemExit("grpo_toy.py: --bundled and --tuned name two different studies; give one")
    if args.baseline and not args.bundled:
        raise SystemExit("grpo_toy.py: --baseline adds the matched SFT arm to the --bundled study (the default study "
                         "has it already)")
    if not args.bundled:
        return tuned_study(args, argv, started)
    root = workdir_of(args, "grpo_toy")
    seeds = seeds_of(args, (0, 1, 2, 3, 4))
    runs = []
    for seed in seeds:
        workdir = root / f"seed{seed}" / "grpo"
        flags = [f"--config.seed={seed}", f"--config.workdir={workdir}", "--config.logging.progress=False",
                 *(SMOKE if args.smoke else [])]
        config = load_config("grpo", flags)
        summary = train(config)
        evals = evaluations(workdir)
        rewards = [(r["step"], r["reward"]) for r in map(json.loads, (workdir / "metrics.jsonl").read_text()
                                                          .splitlines()) if r["split"] == "train"]
        eval_file = workdir / "data" / "eval_arithmetic.jsonl"
        run = {"seed": seed, "start": evals[0]["accuracy"], "final": evals[-1]["accuracy"],
               "curve": [(r["step"], r["accuracy"]) for r in evals], "reward_curve": rewards,
               "seconds": summary.get("seconds"), "styles_start": answer_styles(workdir / "sft", eval_file),
               "styles_final": answer_styles(workdir, eval_file)}
        if args.baseline:
            sft_dir = root / f"seed{seed}" / "sft_more"
            sft = load_config("sft", [f"--config.seed={seed}", f"--config.workdir={sft_dir}",
                                      f"--config.model.path={workdir / 'sft' / 'hf'}", "--config.tokenizer=",
                                      f"--config.data.train={workdir / 'sft' / 'data' / 'train_arithmetic.jsonl'}",
                                      f"--config.data.eval={eval_file}", f"--config.train.steps={config.train.steps}",
                                      f"--config.train.batch_size={config.train.batch_size}",
                                      f"--config.optim.lr={config.optim.lr}", "--config.optim.schedule=constant",
                                      "--config.optim.warmup_steps=0", "--config.train.eval_every=0",
                                      f"--config.eval.generate={config.eval.generate}",
                                      "--config.eval.max_new_tokens=8", "--config.logging.progress=False",
                                      "--config.logging.plot=False",
                                      f"--config.data.max_length={config.data.max_length}"])
            sft_summary = train(sft)
            run["sft_more"] = (sft_summary.get("final_eval") or {}).get("accuracy")
            run["styles_sft_more"] = answer_styles(sft_dir, eval_file)
        runs.append(run)
        print(json.dumps({k: v for k, v in run.items() if "curve" not in k}), flush=True)

    def col(key, runs=runs):
        return [r[key] for r in runs]

    gains = [r["final"] - r["start"] for r in runs]
    rows = [["SFT start (600 steps)", pm(col("start"), 100), pm([r["styles_start"]["short_share"] for r in runs], 100),
             pm([r["styles_start"]["short_accuracy"] for r in runs], 100)],
            ["+ 150 GRPO steps", pm(col("final"), 100), pm([r["styles_final"]["short_share"] for r in runs], 100),
             pm([r["styles_final"]["short_accuracy"] for r in runs], 100)]]
    if args.baseline:
        rows.append(["+ 150 SFT steps (matched)", pm(col("sft_more"), 100),
                     pm([r["styles_sft_more"]["short_share"] for r in runs], 100),
                     pm([r["styles_sft_more"]["short_accuracy"] for r in runs], 100)])
    text = table(["arm", "held-out exact match, %", "short-style answers, %", "exact match among short, %"], rows)
    n = len(runs)
    mean, low, _ = t_interval(np.asarray(gains) * 100)
    text += (f"\n\nGRPO gain over the SFT start: {pm(gains, 100)} points (mean ± sample std over {n} seeds; "
             f"per seed {', '.join(f'{100 * g:+.1f}' for g in gains)}; 95 % t-interval half-width "
             f"{mean - low:.1f}).\n")
    comparisons = {"GRPO − SFT start": paired_difference(col("final"), col("start"))}
    if args.baseline:
        comparisons["GRPO − matched SFT"] = paired_difference(col("final"), col("sft_more"))
    text += "\n" + differences_table(comparisons, verdicts=True) + "\n"
    results = {"runs": runs, "gains": gains, "comparisons": comparisons,
               "verdicts": {name: verdict(d) for name, d in comparisons.items()}}
    write(args.out, "grpo_toy", command=command_line("grpo_toy", argv), results=results, markdown=text,
          started=started)
    plot(runs, Path(args.out) / "grpo_toy.png")
    return results


if __name__ == "__main__":
    main()
