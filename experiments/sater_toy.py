"""SATER on toy arithmetic (fair-test protocol): stage I (shortest-correct vs longest-incorrect DPO on the model's
own samples), stage II (threshold-conditioned refusal SFT) and routing to a large model (an exact solver).

1. The SFT model of each seed: the shared pretrained start fine-tuned on train-pool arithmetic answered half the
   time with just the number and half the time with the working ("7 + 5 = 12. The answer is 12."), so its samples
   vary in length.
2. Stage I: K samples per training question at temperature 1, judged by exact match; pairs (shortest correct,
   longest incorrect); DPO from the SFT model (also the reference). Its learning rate is chosen on the validation
   pool over seeds 100 and 101 by the claim's own rule: the shortest mean correct answer among the rates whose
   validation accuracy stays within 2 points of the SFT model's. Every published sweep chose 1e-5 (seeds 0-1, 21-22
   and 100-101), recorded as ``RECORDED``; the study runs at it unless ``--tune`` or ``--sweep-seeds`` asks for the
   sweep.
3. Stage II: K samples from the stage-I model give each training question's confidence c(q); for every τ of the
   grid an SFT record whose target is the refusal when c(q) < τ, else the shortest correct sample.
4. Routing on the test pool: a refusal sends the question to the exact solver (priced at 50x the small model per
   token): the cost-accuracy curve over τ (pre-generation) and cascade routing (M samples, confidence-weighted
   vote), each against random routing (ToA, the area under the curve).

Claims tested, paired by seed (5 seeds): stage I shortens correct answers; it keeps accuracy (non-inferiority,
margin 2 points); stage II answers the questions it keeps more accurately than the stage-I model answers all of
them (τ = 0.5); pre-generation and cascade routing beat random routing. ``--stage-one-only`` runs steps 1-2 and
tests the two stage-I claims alone (a cheaper way to add seeds to those).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from common import (
    cached_run,
    ci_text,
    command_line,
    paired_difference,
    parser,
    rate_options,
    rates_or_sweep,
    runs_note,
    seeds_of,
    table,
    toy_config,
    verdict,
    workdir_of,
    write,
)
from pretrained import pretrained_start

from jaxalign.data.sater import REFUSAL, numeric_verifier
from jaxalign.data.toy import arithmetic, arithmetic_pool, write_jsonl
from jaxalign.sampling.routing import (
    CostModel,
    answer,
    build_stage1,
    build_stage2,
    evaluate_routing,
    plot_routes,
    routing_table,
)
from jaxalign.train import train
from jaxalign.train.export import export, restore_model

STUDY = "sater_toy"
TAUS = (0.1, 0.3, 0.5, 0.7, 0.9)
SELECTIVE_TAU = 0.5  # the threshold at which stage II's selective accuracy is tested
LARGE_PRICE = 50.0  # per token, against 1 for the small model (a large model costs far more per token)
MARGIN = 0.02  # stage I "keeps accuracy": its loss is under 2 points (decided before the runs)
DPO_LRS = (1e-5, 3e-5, 1e-4)
# the stage-I rate every published sweep chose (seeds 0-1, 21-22, 100-101; docs/results.md): the default runs at it
RECORDED = {"stage1": 1e-5}
NEW_TOKENS = 32


def pool_questions(pool: str, limit: int = 0) -> tuple[list[str], list[str]]:
    records = arithmetic_pool(pool)[: limit or None]
    return [r["messages"][0]["content"] for r in records], [r["answer"] for r in records]


def greedy_stats(model, tokenizer, questions, golds) -> dict:
    """Greedy accuracy and the mean length (tokens) of the correct answers."""
    out = answer(model, tokenizer, questions, max_new_tokens=NEW_TOKENS)
    ok = [numeric_verifier(t[0], g) for t, g in zip(out.texts, golds, strict=True)]
    lengths = [n[0] for n, c in zip(out.n_tokens, ok, strict=True) if c]
    return {"accuracy": float(np.mean(ok)), "correct_length": float(np.mean(lengths)) if lengths else float("nan")}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = parser(__doc__)
    p.add_argument("--full", action="store_true", help="300 SFT and 300 stage-II steps (default 200 and 150)")
    p.add_argument("--stage-one-only", action="store_true",
                   help="the SFT models and stage I only: test the stage-I claims, skip stage II and routing")
    rate_options(p, RECORDED, "seeds 100-101, also chosen on seeds 0-1 and 21-22")
    args = p.parse_args(argv)
    started = time.time()
    sizes = (dict(shape="smoke", sft_records=300, sample_questions=24, validation=16, test=16, k=4, sft_steps=4,
                  dpo_steps=2, dpo_lrs=(1e-4, 3e-4), stage2_steps=2, stage2_lr=1e-4, cascade=2)
             if args.smoke else
             dict(shape="tiny", sft_records=4000, sample_questions=400, validation=0, test=0, k=8,
                  sft_steps=300 if args.full else 200, dpo_steps=100, dpo_lrs=DPO_LRS,
                  stage2_steps=300 if args.full else 150, stage2_lr=5e-4, cascade=8))
    seeds = seeds_of(args, (0, 1, 2, 3, 4), smoke=(0, 1))
    recorded, sweep_seeds = rates_or_sweep(args, seeds, None if args.full else RECORDED)
    start = pretrained_start(sizes["shape"])
    root = workdir_of(args, STUDY)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    validation = pool_questions("validation", sizes["validation"])
    test = pool_questions("test", sizes["test"])

    def config_for(workdir: Path, data: Path, model_path: Path, seed: int, **kw):
        return toy_config(workdir, data, shape=sizes["shape"], seed=seed, start=model_path, **kw)

    def fitted(folder: Path, config) -> Path:
        """Trains ``config`` into ``folder/run`` once and exports it to ``folder/hf``."""
        if not (folder / "hf" / "config.json").exists():
            train(config)
            export(folder / "run", folder / "hf")
        return folder / "hf"

    def sft_model(seed: int) -> dict:
        folder = root / f"seed{seed}" / "sft"

        def fit():
            begun = time.time()
            data = write_jsonl(arithmetic(sizes["sft_records"], seed, style="mixed", pool="train"),
                               folder / "train.jsonl")
            fitted(folder, config_for(folder / "run", data, start, seed, steps=sizes["sft_steps"], lr=1e-3))
            model, tokenizer, _ = restore_model(folder / "run")
            train_q = [r["messages"][0]["content"] for r in arithmetic(sizes["sample_questions"], seed + 7,
                                                                       pool="train")]
            train_g = [r["answer"] for r in arithmetic(sizes["sample_questions"], seed + 7, pool="train")]
            samples = answer(model, tokenizer, train_q, num_samples=sizes["k"], temperature=1.0,
                             max_new_tokens=NEW_TOKENS, seed=seed)
            pairs, counts = build_stage1(train_q, train_g, samples)
            write_jsonl(pairs, folder / "stage1_pairs.jsonl")
            return {"validation": greedy_stats(model, tokenizer, *validation), "test": greedy_stats(model, tokenizer,
                                                                                                      *test),
                    "stage1_data": counts, "train_questions": train_q, "train_golds": train_g,
                    "seconds": round(time.time() - begun, 1)}

        return {**cached_run(folder / "result.json", fit), "hf": folder / "hf", "pairs": folder / "stage1_pairs.jsonl"}

    def stage1(seed: int, lr: float) -> dict:
        folder = root / f"seed{seed}" / f"stage1_lr{lr:g}"
        base = sft_model(seed)

        if not base["stage1_data"]["pairs"]:  # no question had both a correct and a wrong sample (smoke size)
            return {"lr": lr, "validation": base["validation"], "test": base["test"], "seconds": 0.0,
                    "hf": base["hf"]}

        def fit():
            begun = time.time()
            fitted(folder, config_for(folder / "run", base["pairs"], base["hf"], seed, objective="dpo",
                                      steps=sizes["dpo_steps"], lr=lr, batch_size=16, params={"beta": 0.1}))
            model, tokenizer, _ = restore_model(folder / "run")
            return {"lr": lr, "validation": greedy_stats(model, tokenizer, *validation),
                    "test": greedy_stats(model, tokenizer, *test), "seconds": round(time.time() - begun, 1)}

        return {**cached_run(folder / "result.json", fit), "hf": folder / "hf"}

    def stage2(seed: int, lr1: float) -> dict:
        folder = root / f"seed{seed}" / f"stage2_from_lr{lr1:g}"
        base, first = sft_model(seed), stage1(seed, lr1)

        def fit():
            begun = time.time()
            model1, tokenizer, _ = restore_model(first["hf"].parent / "run")
            samples = answer(model1, tokenizer, base["train_questions"], num_samples=sizes["k"], temperature=1.0,
                             max_new_tokens=NEW_TOKENS, seed=seed + 1)
            records = build_stage2(base["train_questions"], base["train_golds"], samples, TAUS)
            data = write_jsonl(records, folder / "train.jsonl")
            fitted(folder, config_for(folder / "run", data, first["hf"], seed, steps=sizes["stage2_steps"],
                                      lr=sizes["stage2_lr"], max_length=192))
            model2, _, _ = restore_model(folder / "run")
            report = evaluate_routing(model2, tokenizer, *test, large=None, taus=TAUS,
                                      cascade_samples=sizes["cascade"], max_new_tokens=NEW_TOKENS,
                                      cost=CostModel(small_price=1.0, large_price=LARGE_PRICE))
            share = {f"{t:g}": float(np.mean([r["target"] == REFUSAL for r in records if r["tau"] == t]))
                     for t in TAUS}
            return {"routing": report, "target_refusal_share": share, "seconds": round(time.time() - begun, 1)}

        return cached_run(folder / "result.json", fit)

    # stage I's rate: over the sweep seeds, the shortest validation answers among rates that keep accuracy
    sweep = {lr: [stage1(seed, lr) for seed in sweep_seeds] for lr in sizes["dpo_lrs"]} if sweep_seeds else {}
    sft_val = np.mean([sft_model(seed)["validation"]["accuracy"] for seed in sweep_seeds]) if sweep else np.nan
    keeps = [lr for lr in sweep if np.mean([r["validation"]["accuracy"] for r in sweep[lr]]) >= sft_val - MARGIN]
    if recorded:
        chosen = recorded["stage1"]
    else:
        chosen = (min(keeps, key=lambda lr: np.nanmean([r["validation"]["correct_length"] for r in sweep[lr]]))
                  if keeps else max(sweep, key=lambda lr: np.mean([r["validation"]["accuracy"] for r in sweep[lr]])))
    runs = [{"seed": seed, "sft": sft_model(seed), "stage1": stage1(seed, chosen),
             "stage2": None if args.stage_one_only else stage2(seed, chosen)} for seed in seeds]
    if args.stage_one_only:
        _plot_stage1(runs, out / f"{STUDY}_stage1.png")
    elif runs[0]["stage2"]["routing"]:
        plot_routes(runs[0]["stage2"]["routing"], out / f"{STUDY}_routing.png",
                    title=f"SATER routing on toy arithmetic (seed {seeds[0]})")
    tuning_only = [r for lr, rs in sweep.items() for seed, r in zip(sweep_seeds, rs, strict=True)
                   if lr != chosen or seed not in seeds] + [sft_model(s) for s in sweep_seeds if s not in seeds]
    results = _results(runs, sweep, chosen, sft_val, sizes, seeds, sweep_seeds, start, tuning_only)
    write(args.out, STUDY, command=command_line(STUDY, argv), results=results, markdown=_markdown(results),
          started=started)
    return results


def answered_accuracy(point: dict) -> float:
    """Accuracy on the questions the small model answered at one pre-generation point (the exact solver gets the
    routed ones right, so total = (1 - routed) x answered + routed)."""
    routed = point["routed"]
    return (point["accuracy"] - routed) / (1 - routed) if routed < 1 else float("nan")


def _results(runs, sweep, chosen, sft_val, sizes, seeds, sweep_seeds, start, tuning_only) -> dict:
    def stat(run, stage, key):
        return run[stage]["test"][key]

    length_gain = paired_difference([stat(r, "sft", "correct_length") for r in runs],
                                    [stat(r, "stage1", "correct_length") for r in runs])
    accuracy = paired_difference([stat(r, "stage1", "accuracy") for r in runs],
                                 [stat(r, "sft", "accuracy") for r in runs])
    comparisons = {"stage I: correct-answer length, SFT − stage I (tokens)": length_gain,
                   "stage I: accuracy, stage I − SFT": accuracy}
    summary, stage_one_only = {}, runs[0]["stage2"] is None
    if not stage_one_only:
        summary, stage2_comparisons = _stage2_comparisons(runs)
        comparisons.update(stage2_comparisons)
    shifted = {**accuracy, "low": accuracy["low"] + MARGIN, "high": accuracy["high"] + MARGIN}
    verdicts = {name: verdict(d) for name, d in comparisons.items()}
    verdicts["stage I: accuracy, stage I − SFT"] = verdict(shifted)  # non-inferiority: above −2 points
    every = [x for r in runs for x in (r["sft"], r["stage1"], r["stage2"]) if x is not None]
    return {"sizes": {**sizes, "dpo_lrs": list(sizes["dpo_lrs"])}, "seeds": seeds, "sweep_seeds": sweep_seeds,
            "start": start.name,
            "stage1_lr": chosen, "sft_validation_accuracy": float(sft_val) if sweep else None,
            "sweep": {f"{lr:g}": {"validation_accuracy": [r["validation"]["accuracy"] for r in rs],
                                  "validation_correct_length": [r["validation"]["correct_length"] for r in rs]}
                      for lr, rs in sweep.items()},
            "per_seed": [_clean(r) for r in runs], "stage_one_only": stage_one_only,
            "routing_summary": summary, "comparisons": comparisons, "verdicts": verdicts,
            "runs_note": runs_note(every + tuning_only),
            "routing_table_first_seed": "" if stage_one_only else routing_table(runs[0]["stage2"]["routing"])}


def _stage2_comparisons(runs) -> tuple[dict, dict]:
    """Stage II's and routing's per-seed summaries and their paired comparisons."""
    selective = [next(p for p in r["stage2"]["routing"]["curves"]["pre_generation"]
                      if abs(p["setting"] - SELECTIVE_TAU) < 1e-9) for r in runs]
    selective_gain = paired_difference([answered_accuracy(p) for p in selective],
                                       [r["stage1"]["test"]["accuracy"] for r in runs])
    summary = {mode: {k: [r["stage2"]["routing"]["summary"][mode][k] for r in runs]
                      for k in ("toa", "toa_random", "toa_golden", "togr")}
               for mode in runs[0]["stage2"]["routing"]["summary"]}
    comparisons = {
        f"stage II: accuracy when answering (τ = {SELECTIVE_TAU}) − stage-I accuracy": selective_gain,
        **{f"{mode} routing: ToA − random ToA": paired_difference(v["toa"], v["toa_random"])
           for mode, v in summary.items()},
    }
    return summary, comparisons


def _clean(run: dict) -> dict:
    """A seed's results without paths or the training questions (JSON-able, short)."""
    drop = {"hf", "pairs", "train_questions", "train_golds"}
    return json.loads(json.dumps({stage: ({k: v for k, v in part.items() if k not in drop}
                                          if isinstance(part, dict) else part) for stage, part in run.items()},
                                 default=str))


def _markdown(results: dict) -> str:
    runs, sizes = results["per_seed"], results["sizes"]

    def col(stage, split, key, scale=1.0, digits=1):
        return ci_text([r[stage][split][key] for r in runs], scale, digits)

    sweep = table(["stage-I lr", "validation accuracy %", "validation correct length (tokens)", "chosen"],
                  [[lr, f"{100 * np.mean(v['validation_accuracy']):.1f}",
                    f"{np.nanmean(v['validation_correct_length']):.2f}",
                    "yes" if float(lr) == results["stage1_lr"] else ""] for lr, v in results["sweep"].items()])
    text = (f"Stage-I learning-rate sweep (seeds {results['sweep_seeds']}; the SFT model's validation accuracy "
            f"{100 * results['sft_validation_accuracy']:.1f} %; rule: shortest answers among rates within "
            f"{100 * MARGIN:.0f} points of it):\n\n{sweep}\n\n" if results["sweep"] else
            f"No sweep in this run: stage I ran at {results['stage1_lr']:g}, the rate every published sweep chose, "
            "recorded in the script (`--tune` runs the sweep again).\n\n")
    text += "Test pool, mean [95 % CI] over seeds:\n\n" + table(
        ["model", "greedy accuracy %", "greedy correct length (tokens)"],
        [[name, col(stage, "test", "accuracy", 100), col(stage, "test", "correct_length", 1, 2)]
         for name, stage in (("SFT", "sft"), ("SFT + stage I (DPO)", "stage1"))])
    if not results["stage_one_only"]:
        text += _stage2_markdown(results)
    text += "\n\nPaired by seed:\n\n" + _differences(results)
    if not results["stage_one_only"]:
        text += f"\n\nRouting table of seed {results['seeds'][0]}:\n\n{results['routing_table_first_seed']}"
    stage2 = (" (stage II and routing not run: --stage-one-only)" if results["stage_one_only"]
              else f", stage II {sizes['stage2_steps']} SFT steps (lr {sizes['stage2_lr']:g})")
    text += (f"\n\nSeeds {', '.join(map(str, results['seeds']))}; start `{results['start']}`; {sizes['sft_steps']} SFT "
             f"steps, stage I {sizes['dpo_steps']} DPO steps (lr {results['stage1_lr']:g}){stage2}; K = {sizes['k']} "
             f"samples on {sizes['sample_questions']} training questions; stage-I pairs per seed: "
             f"{', '.join(str(r['sft']['stage1_data']['pairs']) for r in runs)}. {results['runs_note']}")
    return text


def _stage2_markdown(results: dict) -> str:
    runs = results["per_seed"]
    text = "\n\nStage II on the test pool (pre-generation prompts; mean [95 % CI]):\n\n" + table(
        ["τ", "refusal rate %", "accuracy when answering %", "refusal share in its training targets %"],
        [[f"{tau:g}", ci_text([_point(r, tau)["routed"] for r in runs], 100),
          ci_text([answered_accuracy(_point(r, tau)) for r in runs], 100),
          ci_text([r["stage2"]["target_refusal_share"][f"{tau:g}"] for r in runs], 100)] for tau in TAUS])
    text += "\n\nRouting (area under the accuracy-cost curve, mean [95 % CI]):\n\n" + table(
        ["mode", "ToA", "random routing", "golden routing", "ToGR"],
        [[mode, ci_text(v["toa"], 1, 3), ci_text(v["toa_random"], 1, 3), ci_text(v["toa_golden"], 1, 3),
          ci_text(v["togr"], 1, 3)] for mode, v in results["routing_summary"].items()])
    return text


def _differences(results: dict) -> str:
    rows = []
    for name, d in results["comparisons"].items():
        scale, unit = (1.0, "tokens") if "tokens" in name else ((1.0, "area") if "ToA" in name else (100.0, "points"))
        digits = 3 if unit == "area" else (2 if unit == "tokens" else 1)
        low, high = (f"{scale * d[k]:+.{digits}f}" for k in ("low", "high"))
        rows.append([name, f"{scale * d['mean']:+.{digits}f} {unit}", f"[{low}, {high}]", f"{d['p']:.3f}",
                     results["verdicts"][name]])
    return table(["claim (difference)", "mean", "95 % CI", "paired t-test p", "verdict"], rows)


def _plot_stage1(runs, path: Path) -> None:
    """Per seed: stage I's change in test accuracy and in correct-answer length against its SFT model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    accuracy = [100 * (r["stage1"]["test"]["accuracy"] - r["sft"]["test"]["accuracy"]) for r in runs]
    length = [r["sft"]["test"]["correct_length"] - r["stage1"]["test"]["correct_length"] for r in runs]
    fig, ax = plt.subplots(figsize=(4.2, 3.4))
    ax.axvline(-100 * MARGIN, color="grey", ls=":", label=f"non-inferiority margin ({100 * MARGIN:.0f} points)")
    ax.axhline(0, color="grey", lw=0.5)
    ax.axvline(0, color="grey", lw=0.5)
    ax.plot(accuracy, length, "o")
    ax.set_xlabel("test accuracy, stage I − SFT (points)")
    ax.set_ylabel("correct length, SFT − stage I (tokens)")
    ax.set_title("SATER stage I, one point per seed", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _point(run: dict, tau: float) -> dict:
    return next(p for p in run["stage2"]["routing"]["curves"]["pre_generation"] if abs(p["setting"] - tau) < 1e-9)


if __name__ == "__main__":
    main()
