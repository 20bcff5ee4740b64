"""SATER on toy arithmetic: stage I (shortest-correct vs longest-incorrect DPO on the model's own samples), stage
II (threshold-conditioned refusal SFT) and routing to a large model (an exact solver).

1. SFT a tiny Llama on arithmetic answered half the time with just the number and half the time with the working
   ("7 + 5 = 12. The answer is 12."), so its samples vary in length.
2. Stage I: K samples per training question at temperature 1, judged by exact match; pairs (shortest correct,
   longest incorrect); DPO from the SFT model. Measured on held-out questions: greedy accuracy and the average
   length (tokens) of correct answers, greedy and sampled, before and after.
3. Stage II: K samples from the stage-I model give each question's confidence c(q); for every τ of the grid an SFT
   record whose target is the refusal when c(q) < τ, else the shortest correct sample. Measured: the refusal rate
   on held-out questions at each τ (should rise with τ).
4. Routing: a refusal sends the question to the exact solver (priced at 50× the small model per token); the
   cost–accuracy curve over τ, and cascade routing (M samples, confidence-weighted vote), against random routing
   (ToA).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from common import command_line, parser, pm, seeds_of, table, toy_config, train_model, workdir_of, write

from jaxalign.data.sater import REFUSAL, is_refusal, numeric_verifier, threshold_prompt
from jaxalign.data.toy import arithmetic, write_jsonl
from jaxalign.sampling.routing import (
    CostModel,
    answer,
    build_stage1,
    build_stage2,
    evaluate_routing,
    plot_routes,
    routing_table,
)
from jaxalign.train.export import export

STUDY = "sater_toy"
TAUS = (0.1, 0.3, 0.5, 0.7, 0.9)
LARGE_PRICE = 50.0  # per token, against 1 for the small model (a large model costs far more per token)


def length_stats(model, tokenizer, questions, golds, *, samples: int, seed: int) -> dict:
    greedy = answer(model, tokenizer, questions, max_new_tokens=32)
    ok = [numeric_verifier(t[0], g) for t, g in zip(greedy.texts, golds, strict=True)]
    greedy_len = [n[0] for n, c in zip(greedy.n_tokens, ok, strict=True) if c]
    sampled = answer(model, tokenizer, questions, num_samples=samples, temperature=1.0, max_new_tokens=32, seed=seed)
    pairs = [(n, numeric_verifier(t, g)) for ts, ns, g in zip(sampled.texts, sampled.n_tokens, golds, strict=True)
             for t, n in zip(ts, ns, strict=True)]
    return {"greedy_accuracy": float(np.mean(ok)),
            "greedy_correct_length": float(np.mean(greedy_len)) if greedy_len else float("nan"),
            "sampled_accuracy": float(np.mean([c for _, c in pairs])),
            "sampled_correct_length": float(np.mean([n for n, c in pairs if c])) if any(c for _, c in pairs)
            else float("nan")}


def run_seed(seed: int, sizes: dict, workdir, smoke: bool, out) -> dict:
    root = workdir / f"seed{seed}"
    held = arithmetic(sizes["eval"], 10_000 + seed)
    held_q = {r["messages"][0]["content"] for r in held}
    pool = [r for r in arithmetic(sizes["sft_records"], seed, style="mixed")
            if r["messages"][0]["content"] not in held_q]
    questions = [r["messages"][0]["content"] for r in held]
    golds = [r["answer"] for r in held]
    train_q = [r["messages"][0]["content"] for r in pool[: sizes["sample_questions"]]]
    train_g = [r["answer"] for r in pool[: sizes["sample_questions"]]]
    shape = "smoke" if smoke else "tiny"
    k = sizes["k"]

    sft_model, tokenizer, _ = train_model(toy_config(root / "sft", write_jsonl(pool, root / "sft.jsonl"),
                                                     steps=sizes["sft_steps"], shape=shape, seed=seed))
    before = length_stats(sft_model, tokenizer, questions, golds, samples=4, seed=seed)
    export(root / "sft", root / "sft_hf")

    # stage I
    samples = answer(sft_model, tokenizer, train_q, num_samples=k, temperature=1.0, max_new_tokens=32, seed=seed)
    pairs, counts = build_stage1(train_q, train_g, samples)
    if pairs:
        dpo_cfg = toy_config(root / "stage1", write_jsonl(pairs, root / "stage1.jsonl"), objective="dpo",
                             steps=sizes["dpo_steps"], shape=shape, seed=seed, lr=sizes["dpo_lr"], batch_size=16,
                             params={"beta": 0.1})
        dpo_cfg.model.path = str(root / "sft_hf")
        stage1_model, _, _ = train_model(dpo_cfg)
        export(root / "stage1", root / "stage1_hf")
    else:  # no question had both a correct and an incorrect sample (an untrained smoke-size model): no stage I
        stage1_model, root_stage1 = sft_model, root / "sft_hf"
    after = length_stats(stage1_model, tokenizer, questions, golds, samples=4, seed=seed)

    # stage II
    samples2 = answer(stage1_model, tokenizer, train_q, num_samples=k, temperature=1.0, max_new_tokens=32,
                      seed=seed + 1)
    stage2 = build_stage2(train_q, train_g, samples2, TAUS)
    sft2_cfg = toy_config(root / "stage2", write_jsonl(stage2, root / "stage2.jsonl"), steps=sizes["stage2_steps"],
                          shape=shape, seed=seed, lr=sizes["stage2_lr"], max_length=192)
    sft2_cfg.model.path = str(root / "stage1_hf") if pairs else str(root_stage1)
    stage2_model, _, _ = train_model(sft2_cfg)
    refusal = {}
    for tau in TAUS:
        routed = answer(stage2_model, tokenizer, [threshold_prompt(q, tau) for q in questions], max_new_tokens=32)
        refused = [is_refusal(t[0]) for t in routed.texts]
        answered_ok = [numeric_verifier(t[0], g) for t, g, r in zip(routed.texts, golds, refused, strict=True) if not r]
        refusal[str(tau)] = {"refusal_rate": float(np.mean(refused)),
                             "accuracy_when_answering": float(np.mean(answered_ok)) if answered_ok else float("nan")}
    target_refusals = {str(t): float(np.mean([r["target"] == REFUSAL
                                              for r in stage2 if r["tau"] == t])) for t in TAUS}
    report = evaluate_routing(stage2_model, tokenizer, questions, golds, large=None, taus=TAUS,
                              cascade_samples=sizes["cascade"], max_new_tokens=32,
                              cost=CostModel(small_price=1.0, large_price=LARGE_PRICE))
    if seed == sizes["plot_seed"]:
        plot_routes(report, f"{out}/{STUDY}_routing.png", title=f"SATER routing on toy arithmetic (seed {seed})")
    return {"seed": seed, "before": before, "after_stage1": after, "stage1_data": counts,
            "stage2_target_refusal_share": target_refusals, "stage2": refusal, "routing": report,
            "routing_table": routing_table(report)}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser(__doc__).parse_args(argv)
    started = time.time()
    sizes = (dict(sft_records=300, sample_questions=24, eval=16, k=4, sft_steps=4, dpo_steps=2, dpo_lr=1e-4,
                  stage2_steps=2, stage2_lr=1e-4, cascade=2) if args.smoke
             else dict(sft_records=4000, sample_questions=800, eval=200, k=8, sft_steps=1500, dpo_steps=100,
                       dpo_lr=5e-5, stage2_steps=500, stage2_lr=5e-4, cascade=8))
    seeds = seeds_of(args, (0,))
    sizes["plot_seed"] = seeds[0]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    per_seed = [run_seed(s, sizes, workdir_of(args, STUDY), args.smoke, args.out) for s in seeds]

    def col(stage, key, scale=1.0):
        return pm([s[stage][key] for s in per_seed], scale)

    markdown = "Stage I (held-out questions; lengths in tokens of correct answers):\n\n" + table(
        ["model", "greedy accuracy %", "greedy correct length", "sampled accuracy %", "sampled correct length"],
        [[name, col(stage, "greedy_accuracy", 100), col(stage, "greedy_correct_length"),
          col(stage, "sampled_accuracy", 100), col(stage, "sampled_correct_length")]
         for name, stage in (("SFT", "before"), ("SFT + stage I (DPO)", "after_stage1"))])
    markdown += f"\n\nStage-I pairs: {', '.join(str(s['stage1_data']) for s in per_seed)}.\n\nStage II:\n\n"
    markdown += table(["τ", "refusal rate (held-out) %", "accuracy when answering %", "refusal share in training %"],
                      [[tau, pm([s["stage2"][str(tau)]["refusal_rate"] for s in per_seed], 100),
                        pm([s["stage2"][str(tau)]["accuracy_when_answering"] for s in per_seed], 100),
                        pm([s["stage2_target_refusal_share"][str(tau)] for s in per_seed], 100)] for tau in TAUS])
    markdown += "\n\nRouting to an exact solver (seed " + str(seeds[0]) + "):\n\n" + per_seed[0]["routing_table"]
    summary = {mode: {k: [s["routing"]["summary"][mode][k] for s in per_seed] for k in ("toa", "toa_random", "togr")}
               for mode in per_seed[0]["routing"]["summary"]}
    markdown += "\n\n" + "\n".join(f"{mode}: ToA {pm(v['toa'], 1, 3)} vs random {pm(v['toa_random'], 1, 3)}, "
                                   f"ToGR {pm(v['togr'], 1, 3)}" for mode, v in summary.items())
    markdown += f"\n\nSeeds: {', '.join(map(str, seeds))}; {sizes['eval']} held-out questions; K = {sizes['k']}."
    results = {"sizes": sizes, "seeds": seeds, "per_seed": per_seed}
    write(args.out, STUDY, command=command_line(STUDY, argv), results=results, markdown=markdown, started=started)
    return results


if __name__ == "__main__":
    main()
