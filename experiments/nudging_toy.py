"""Nudging on toy models: a base model that knows arithmetic but answers in a noisy format, nudged by a small
chat model that knows the format but little arithmetic.

The "base" (4 layers × 128) is trained on raw text: arithmetic facts ("What is 7 + 5? The answer is 12."), and
question/answer transcripts in which the answer is, with equal odds, a refusal ("I don't know."), a digression (another
question), or "The answer is N.". Greedy decoding of the base alone rarely answers. The "aligned" model (2 layers
× 64) is trained briefly on chat-format SFT ("The answer is N."), so it follows the format but is weak at the
sums. Nudging (same toy tokenizer, so the KV-cached fast path `nudge_cached`) lets the aligned model write where
the base's top-1 probability is below γ. Scored by exact match of the number in the first answer line on
held-out questions, for γ from 0 (base alone) to above 1 (aligned alone). The word-level cross-tokenizer
algorithm `nudge` runs on a subset at three γ in both turn orders: the official code's (the default, each round
starts with the aligned model) and the paper's (the base model first).
"""

from __future__ import annotations

import sys
import time

import numpy as np
from common import (
    command_line,
    parser,
    pm,
    seeds_of,
    table,
    toy_config,
    train_model,
    workdir_of,
    write,
)

from jaxalign.data.sater import extract_answer
from jaxalign.data.tokenize import as_tokenizer
from jaxalign.data.toy import write_jsonl
from jaxalign.sampling import TextModel, nudge, nudge_cached

STUDY = "nudging_toy"
GAMMAS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.01)
DEFAULT_GAMMA = 0.4
WORD_GAMMAS = (0.0, DEFAULT_GAMMA, 1.01)
ORDERS = ("nudger_first", "base_first")
STYLES = ("refuse", "digress", "answer")


def questions(n: int, seed: int, max_operand: int = 20) -> list[tuple[str, int]]:
    rng = np.random.default_rng([seed, 77])
    out = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(0, max_operand + 1, 2))
        op = "+-"[int(rng.integers(2))]
        out.append((f"{a} {op} {b}", a + b if op == "+" else a - b))
    return out


def base_corpus(n: int, seed: int, held_out: set[str]) -> list[dict]:
    """Raw text: arithmetic facts, and Q/A transcripts whose answer style is a three-way coin."""
    rng = np.random.default_rng([seed, 78])
    pool = [q for q in questions(4 * n, seed + 1) if q[0] not in held_out]
    records = []
    for i in range(n):
        (expr, value), (other, _) = pool[i], pool[(i + 7) % len(pool)]
        if i % 2 == 0:  # arithmetic "facts" in the answer phrase, outside the question/answer frame
            records.append({"text": f"What is {expr}? The answer is {value}."})
            continue
        style = STYLES[int(rng.integers(3))]
        answer = {"refuse": "I don't know.", "digress": f"Next one. Question: What is {other}?",
                  "answer": f"The answer is {value}."}[style]
        records.append({"text": f"Question: What is {expr}?\nAnswer: {answer}"})
    return records


def chat_records(n: int, seed: int, held_out: set[str]) -> list[dict]:
    pool = [q for q in questions(4 * n, seed + 2) if q[0] not in held_out][:n]
    return [{"messages": [{"role": "user", "content": f"What is {expr}?"},
                          {"role": "assistant", "content": f"The answer is {value}."}]} for expr, value in pool]


def score(text: str, gold: int) -> bool:
    line = text.strip().split("\n")[0]
    return extract_answer(line) == str(gold)


def run_seed(seed: int, sizes: dict, workdir, smoke: bool) -> dict:
    held = questions(sizes["eval"], 10_000 + seed)
    held_out = {expr for expr, _ in held}
    base_path = write_jsonl(base_corpus(sizes["base_records"], seed, held_out), workdir / f"seed{seed}" / "base.jsonl")
    chat_path = write_jsonl(chat_records(sizes["chat_records"], seed, held_out), workdir / f"seed{seed}" / "chat.jsonl")
    base_cfg = toy_config(workdir / f"seed{seed}" / "base", base_path, steps=sizes["base_steps"],
                          shape="smoke" if smoke else "tiny", seed=seed)
    small_cfg = toy_config(workdir / f"seed{seed}" / "aligned", chat_path, steps=sizes["chat_steps"],
                           shape="smoke" if smoke else "small", seed=seed, lr=2e-3)
    base_model, tokenizer, _ = train_model(base_cfg)
    small_model, _, _ = train_model(small_cfg)
    base, nudger = TextModel(base_model, tokenizer), TextModel(small_model, tokenizer)
    base_prompts = [f"Question: What is {expr}?\nAnswer: " for expr, _ in held]
    chat_prompts = [as_tokenizer(tokenizer).prompt_text(f"What is {expr}?") for expr, _ in held]
    rows = {}
    for gamma in GAMMAS:
        results = nudge_cached(base, nudger, base_prompts, chat_prompts, gamma=gamma, max_new_tokens=24)
        rows[gamma] = {
            "accuracy": float(np.mean([score(r.text, gold) for r, (_, gold) in zip(results, held, strict=True)])),
            "nudged_token_share": float(np.mean([r.nudger_tokens / max(r.nudger_tokens + r.base_tokens, 1)
                                                 for r in results])),
            "rounds": float(np.mean([r.rounds for r in results])),
            "example": results[0].text}
    subset = held[: sizes["word_level"]]
    word = {}
    for order in ORDERS:
        for gamma in WORD_GAMMAS:
            results = [nudge(base, nudger, base_prompts[i], chat_prompts[i], gamma=gamma, max_tokens=24, lookahead=8,
                             order=order) for i in range(len(subset))]
            word[f"{order}@{gamma}"] = {
                "accuracy": float(np.mean([score(r.text, gold) for r, (_, gold) in zip(results, subset, strict=True)])),
                "nudged_share": float(np.mean([r.nudged_share for r in results])), "example": results[0].text}
    return {"seed": seed, "by_gamma": {str(g): v for g, v in rows.items()}, "word_level": word,
            "word_level_questions": len(subset)}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser(__doc__).parse_args(argv)
    started = time.time()
    sizes = (dict(base_records=200, chat_records=64, base_steps=4, chat_steps=4, eval=8, word_level=2) if args.smoke
             else dict(base_records=12_000, chat_records=2_000, base_steps=1500, chat_steps=150, eval=200,
                       word_level=40))
    seeds = seeds_of(args, (0,))
    per_seed = [run_seed(seed, sizes, workdir_of(args, STUDY), args.smoke) for seed in seeds]
    rows = []
    for gamma in GAMMAS:
        label = {0.0: "0 (base alone)", 1.01: "1.01 (aligned alone)"}.get(gamma, f"{gamma}")
        acc = [s["by_gamma"][str(gamma)]["accuracy"] for s in per_seed]
        share = [s["by_gamma"][str(gamma)]["nudged_token_share"] for s in per_seed]
        rows.append([label, pm(acc, 100), pm(share, 100)])
    markdown = table(["γ", "accuracy %", "tokens written by the aligned model %"], rows)
    names = {"nudger_first": "official (aligned model first, default)", "base_first": "paper (base first)"}
    word_rows = [[names[order], str(gamma)] + [pm([s["word_level"][f"{order}@{gamma}"][key] for s in per_seed], 100)
                                               for key in ("accuracy", "nudged_share")]
                 for order in ORDERS for gamma in WORD_GAMMAS]
    markdown += (f"\n\nWord-level cross-tokenizer algorithm (`nudge`, first {per_seed[0]['word_level_questions']} "
                 "questions):\n\n" + table(["turn order", "γ", "accuracy %", "words written by the aligned model %"],
                                           word_rows)
                 + f"\n\nSeeds: {', '.join(map(str, seeds))}; {sizes['eval']} held-out questions per seed.")
    example = per_seed[0]["by_gamma"][str(DEFAULT_GAMMA)]["example"]
    markdown += f"\nExample at γ = {DEFAULT_GAMMA}: `{example.strip()}`"
    results = {"sizes": sizes, "seeds": seeds, "per_seed": per_seed}
    write(args.out, STUDY, command=command_line(STUDY, argv), results=results, markdown=markdown, started=started)
    _plot(per_seed, args.out)
    return results


def _plot(per_seed, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4))
    gammas = [g for g in GAMMAS]
    acc = np.array([[s["by_gamma"][str(g)]["accuracy"] * 100 for g in gammas] for s in per_seed])
    share = np.array([[s["by_gamma"][str(g)]["nudged_token_share"] * 100 for g in gammas] for s in per_seed])
    ax.errorbar(gammas, acc.mean(0), yerr=acc.std(0), marker="o", label="accuracy %")
    ax.errorbar(gammas, share.mean(0), yerr=share.std(0), marker="s", label="aligned-model tokens %")
    ax.set_xlabel("γ (base top-1 probability threshold)")
    ax.set_title("Nudging a toy base model")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{out}/{STUDY}.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
