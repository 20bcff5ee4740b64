"""Nudging a toy base model with a small aligned model: γ tuned on validation questions, 10 seeds, paired tests.

The Nudging paper's claim (Fei et al., 2024): a base model decoded with a small aligned model's help wherever the
base is unsure (top-1 probability below γ) beats the small aligned model alone, and the base alone, on the task's
own metric. Here the task is toy arithmetic, the metric exact match of the number in the first answer line.

* The **base** model: per seed, the shared pretrained start (``experiments/pretrained.py``: it has read arithmetic
  in several wordings, never a chat template) trained further on raw text in which arithmetic facts ("What is 7 + 5?
  The answer is 12.") sit beside question/answer transcripts whose answer is, with equal odds, a refusal ("I don't
  know."), a digression (another question) or "The answer is N.". It knows the sums but is unsure how to answer.
* The **aligned** model: a smaller model (2 layers × 64) trained from random weights, briefly, on chat records
  "What is a + b?" → "The answer is N.": it follows the format but is weak at the sums.

Both see train-pool questions only; γ is chosen from ``GAMMAS`` by mean exact match on the validation pool over
the first two seeds (the same-tokenizer path ``nudge_cached``, the official notebook's KV-cached variant), and
every seed is scored at it on the whole test pool, with the base alone (γ = 0) and the aligned model alone
(γ > 1) on the same questions. Also reported: the base model with the answer's format forced ("... Answer: The
answer is"), what the base knows once the style is chosen for it; and the official word-level algorithm
(``nudge``, the aligned model writing each round's first word) at the chosen γ on the first ``word_level`` test
questions.
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
    seeds_of,
    table,
    toy_config,
    verdict,
    workdir_of,
    write,
)
from pretrained import pretrained_start

from jaxalign.data.sater import extract_answer
from jaxalign.data.tokenize import as_tokenizer
from jaxalign.data.toy import arithmetic, arithmetic_pool, write_jsonl
from jaxalign.sampling import TextModel, nudge, nudge_cached
from jaxalign.train import train
from jaxalign.train.export import restore_model

STUDY = "nudging_toy"
GAMMAS = (0.1, 0.2, 0.3, 0.4, 0.6, 0.8)
BASE_ALONE, ALIGNED_ALONE = 0.0, 1.01
STYLES = ("refuse", "digress", "answer")
FORCED = "The answer is"
# the paper's claims, as (method, baseline) on test exact match
CLAIMS = {"nudged − aligned alone": ("nudged", "aligned"), "nudged − base alone": ("nudged", "base")}
LABELS = {"base": "base alone (γ = 0)", "aligned": "aligned model alone", "nudged": "nudged (`nudge_cached`, tuned γ)",
          "base_forced": "base, answer format forced", "word_level": "official word-level `nudge`, tuned γ"}


def base_corpus(n: int, seed: int) -> list[dict]:
    """Raw text on train-pool questions: arithmetic facts, and Q/A transcripts whose answer style is a coin."""
    rng = np.random.default_rng([seed, 78])
    pool = [(r["messages"][0]["content"], r["answer"]) for r in arithmetic(n + 7, seed + 1, pool="train")]
    records = []
    for i in range(n):
        (question, value), (other, _) = pool[i], pool[i + 7]
        if i % 2 == 0:  # arithmetic "facts" in the answer phrase, outside the question/answer frame
            records.append({"text": f"{question} The answer is {value}."})
            continue
        style = STYLES[int(rng.integers(3))]
        reply = {"refuse": "I don't know.", "digress": f"Next one. Question: {other}",
                 "answer": f"The answer is {value}."}[style]
        records.append({"text": f"Question: {question}\nAnswer: {reply}"})
    return records


def chat_records(n: int, seed: int) -> list[dict]:
    return [{"messages": [r["messages"][0], {"role": "assistant", "content": f"The answer is {r['answer']}."}]}
            for r in arithmetic(n, seed + 2, pool="train")]


def score(text: str, gold: str) -> bool:
    line = text.strip().split("\n")[0]
    return extract_answer(line) == str(gold)


def run_seed(seed: int, sizes: dict, root: Path, start: Path, validation: list[dict], test: list[dict]) -> dict:
    folder = root / f"seed{seed}"

    def fit() -> dict:
        begun = time.time()
        base_cfg = toy_config(folder / "base", write_jsonl(base_corpus(sizes["base_records"], seed),
                                                           folder / "base.jsonl"),
                              steps=sizes["base_steps"], shape=sizes["base_shape"], seed=seed, lr=1e-3, start=start)
        small_cfg = toy_config(folder / "aligned", write_jsonl(chat_records(sizes["chat_records"], seed),
                                                               folder / "chat.jsonl"),
                               steps=sizes["chat_steps"], shape=sizes["aligned_shape"], seed=seed, lr=2e-3)
        train(base_cfg)
        train(small_cfg)
        base, nudger, tokenizer = _models(folder)

        def prompts(records, suffix=""):
            questions = [r["messages"][0]["content"] for r in records]
            return ([f"Question: {q}\nAnswer: {suffix}" for q in questions],
                    [as_tokenizer(tokenizer).prompt_text(q) for q in questions])

        def accuracy(records, gamma, suffix="") -> tuple[float, float]:
            results = nudge_cached(base, nudger, *prompts(records, suffix), gamma=gamma, max_new_tokens=24)
            share = np.mean([r.nudger_tokens / max(r.nudger_tokens + r.base_tokens, 1) for r in results])
            right = [score(r.text, x["answer"]) for r, x in zip(results, records, strict=True)]
            return float(np.mean(right)), float(share)

        sweep = {f"{g:g}": accuracy(validation, g)[0] for g in GAMMAS}
        on_test = {f"{g:g}": accuracy(test, g) for g in (BASE_ALONE, *GAMMAS, ALIGNED_ALONE)}
        forced = accuracy(test, BASE_ALONE, FORCED + " ")[0]
        return {"seed": seed, "validation": sweep, "test": {g: v[0] for g, v in on_test.items()},
                "aligned_share": {g: v[1] for g, v in on_test.items()}, "base_forced": forced,
                "seconds": round(time.time() - begun, 1)}

    return cached_run(folder / "result.json", fit)


def _models(folder: Path) -> tuple[TextModel, TextModel, object]:
    (base_model, tokenizer, _), (small_model, _, _) = restore_model(folder / "base"), restore_model(folder / "aligned")
    return TextModel(base_model, tokenizer), TextModel(small_model, tokenizer), tokenizer


def word_level(seed: int, root: Path, gamma: float, records: list[dict]) -> dict:
    """The official word-level algorithm at ``gamma`` on ``records`` (cached per seed and γ)."""
    folder = root / f"seed{seed}"

    def fit() -> dict:
        base, nudger, tokenizer = _models(folder)
        out = [nudge(base, nudger, f"Question: {r['messages'][0]['content']}\nAnswer: ",
                     as_tokenizer(tokenizer).prompt_text(r["messages"][0]["content"]), gamma=gamma, max_tokens=24,
                     lookahead=8) for r in records]
        return {"accuracy": float(np.mean([score(o.text, r["answer"]) for o, r in zip(out, records, strict=True)])),
                "aligned_share": float(np.mean([o.nudged_share for o in out])), "example": out[0].text}

    return cached_run(folder / f"word_level_gamma{gamma:g}_{len(records)}.json", fit)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser(__doc__).parse_args(argv)
    started = time.time()
    if args.smoke:
        sizes = dict(base_records=200, chat_records=64, base_steps=4, chat_steps=4, validation=8, test=8, word_level=2,
                     base_shape="smoke", aligned_shape="smoke")
    else:
        sizes = dict(base_records=12_000, chat_records=2_000, base_steps=300, chat_steps=150, validation=0, test=0,
                     word_level=40, base_shape="tiny", aligned_shape="small")
    seeds = seeds_of(args, tuple(range(10)), smoke=(0, 1))
    start = pretrained_start(sizes["base_shape"])
    root = workdir_of(args, STUDY)
    validation = arithmetic_pool("validation")[: sizes["validation"] or None]
    test = arithmetic_pool("test")[: sizes["test"] or None]
    per_seed = [run_seed(seed, sizes, root, start, validation, test) for seed in seeds]
    gamma = max(GAMMAS, key=lambda g: np.mean([s["validation"][f"{g:g}"] for s in per_seed[:2]]))
    words = [word_level(seed, root, gamma, test[: sizes["word_level"]]) for seed in seeds]
    scores = {"base": [s["test"][f"{BASE_ALONE:g}"] for s in per_seed],
              "aligned": [s["test"][f"{ALIGNED_ALONE:g}"] for s in per_seed],
              "nudged": [s["test"][f"{gamma:g}"] for s in per_seed],
              "base_forced": [s["base_forced"] for s in per_seed],
              "word_level": [w["accuracy"] for w in words]}
    comparisons = {name: paired_difference(scores[a], scores[b]) for name, (a, b) in CLAIMS.items()}
    results = {"sizes": {**sizes, "validation": len(validation), "test": len(test)}, "seeds": seeds,
               "start": start.name, "gammas": list(GAMMAS), "chosen_gamma": gamma, "per_seed": per_seed,
               "word_level": words, "scores": scores, "comparisons": comparisons,
               "verdicts": {name: verdict(d) for name, d in comparisons.items()}}
    markdown = _markdown(results)
    write(args.out, STUDY, command=command_line(STUDY, argv), results=results, markdown=markdown, started=started)
    _plot(results, Path(args.out) / f"{STUDY}.png")
    return results


def _markdown(results: dict) -> str:
    sizes, per_seed = results["sizes"], results["per_seed"]
    sweep = table(["γ", *[f"{g:g}" for g in results["gammas"]]],
                  [["validation exact match, % (seeds " + ", ".join(map(str, results["seeds"][:2])) + ")",
                    *[f"{100 * np.mean([s['validation'][f'{g:g}'] for s in per_seed[:2]]):.1f}"
                      for g in results["gammas"]]]])
    curve = table(["γ on the test pool", *[f"{g:g}" for g in (BASE_ALONE, *results["gammas"], ALIGNED_ALONE)]],
                  [["exact match, %", *[f"{100 * np.mean([s['test'][f'{g:g}'] for s in per_seed]):.1f}"
                                        for g in (BASE_ALONE, *results["gammas"], ALIGNED_ALONE)]],
                   ["tokens by the aligned model, %",
                    *[f"{100 * np.mean([s['aligned_share'][f'{g:g}'] for s in per_seed]):.1f}"
                      for g in (BASE_ALONE, *results["gammas"], ALIGNED_ALONE)]]])
    n_word = min(sizes["word_level"], sizes["test"])
    main = table(["decoding", "test exact match, % (95 % CI)", "per seed, %"],
                 [[LABELS[k] + (f" (first {n_word} questions)" if k == "word_level" else ""), ci_text(v, 100),
                   ", ".join(f"{100 * x:.1f}" for x in v)] for k, v in results["scores"].items()])
    return (f"γ sweep ({sizes['validation']} validation questions):\n\n{sweep}\n\nChosen γ = "
            f"{results['chosen_gamma']:g}. Test pool ({sizes['test']} questions), seeds "
            f"{', '.join(map(str, results['seeds']))}:\n\n{main}\n\n"
            + differences_table(results["comparisons"], verdicts=True)
            + f"\n\nEvery γ on the test pool (mean over seeds):\n\n{curve}\n\nBase: the pretrained start "
              f"`{results['start']}` + {sizes['base_steps']} steps on {sizes['base_records']} raw-text records; "
              f"aligned: {sizes['chat_steps']} SFT steps from random weights on {sizes['chat_records']} chat records.")


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gammas = (BASE_ALONE, *results["gammas"], ALIGNED_ALONE)
    acc = np.array([[100 * s["test"][f"{g:g}"] for g in gammas] for s in results["per_seed"]])
    share = np.array([[100 * s["aligned_share"][f"{g:g}"] for g in gammas] for s in results["per_seed"]])
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.errorbar(gammas, acc.mean(0), yerr=acc.std(0), marker="o", label="test exact match %")
    ax.errorbar(gammas, share.mean(0), yerr=share.std(0), marker="s", label="aligned-model tokens %")
    ax.axvline(results["chosen_gamma"], color="grey", lw=0.8, ls="--")
    ax.set_xlabel("γ (base top-1 probability threshold)")
    ax.set_title("Nudging a toy base model", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
