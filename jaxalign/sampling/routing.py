"""SATER (Shen et al., EMNLP 2025): data builders from a small model's own samples, and routing between a small and
a large model with cost accounting.

The official code could not be read (spec §3 is an outline); the concrete design here is the spec's proposal:

* stage I — sample K responses per question, judge them with a verifier, pair the shortest correct with the
  longest incorrect (in tokens), skip questions without both; train with DPO (or SimPO);
* stage II — confidence c(q) = share of correct samples; for each τ of a grid an SFT record whose prompt states τ
  and whose target is the refusal when c(q) < τ, else the shortest correct response;
* pre-generation routing — the small model answers under threshold τ; a refusal sends the question to the large
  model;
* cascade routing — M samples from the small model, a vote over extracted answers weighted by each sample's
  confidence (the geometric-mean token probability); refusals abstain; a winning share below a threshold escalates.

Cost: tokens generated × price per token of each model. Curves are accuracy against cost normalised so that
answering everything with the small model costs 0 and everything with the large one costs 1; ToA is the area
under the curve (trapezoids, endpoints included) and ToGR the gain over random routing relative to golden routing
(escalate exactly the questions the small model gets wrong).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np

from jaxalign.data.sater import REFUSAL, extract_answer, is_refusal, numeric_verifier, stage1_pair, threshold_prompt
from jaxalign.data.tokenize import as_tokenizer, padding_id
from jaxalign.sampling.generate import left_pad, sample


# ------------------------------------------------------------------------------------------------ sampling
def chat_prompts(tokenizer, questions: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded chat prompts (token ids, mask) for ``questions``, encoded as training encodes prompts
    (``tokenizer``: a ``data.Tokenizer`` with the run's template, or a transformers tokenizer)."""
    tok = as_tokenizer(tokenizer)
    return left_pad([tok.encode_prompt(q) for q in questions], padding_id(tok.hf))


@dataclasses.dataclass
class Answers:
    """``texts[q][s]``, ``n_tokens[q][s]`` and ``confidence[q][s]`` (geometric-mean token probability)."""

    texts: list[list[str]]
    n_tokens: list[list[int]]
    confidence: list[list[float]]


def answer(model, tokenizer, questions: Sequence[str], *, num_samples: int = 1, temperature: float = 0.0,
           max_new_tokens: int = 32, seed: int = 0, batch_size: int = 64) -> Answers:
    """Samples ``num_samples`` answers per question (greedy when ``temperature`` is 0)."""
    texts, lengths, confidence = [], [], []
    for start in range(0, len(questions), batch_size):
        chunk = list(questions[start:start + batch_size])
        chunk += [chunk[-1]] * (batch_size - len(chunk))  # one compiled shape
        tokens, mask = chat_prompts(tokenizer, chunk)
        out = sample(model, tokens, prompt_mask=mask, max_new_tokens=max_new_tokens, temperature=temperature,
                     eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id or 0, seed=seed + start,
                     num_samples=num_samples)
        for q in range(min(batch_size, len(questions) - start)):
            rows = range(q * num_samples, (q + 1) * num_samples)
            texts.append([tokenizer.decode(np.asarray(out.tokens[r]), skip_special_tokens=True).strip() for r in rows])
            lengths.append([int(out.lengths[r]) for r in rows])
            confidence.append([float(np.exp(np.asarray(out.logps[r]).sum() / max(int(out.lengths[r]), 1)))
                               for r in rows])
    return Answers(texts, lengths, confidence)


# ------------------------------------------------------------------------------------------------ data
def build_stage1(questions: Sequence[str], golds: Sequence[str], answers: Answers, *,
                 verifier: Callable[[str, str], bool] = numeric_verifier) -> tuple[list[dict], dict]:
    """Preference records (conversational, with ``chosen_len``/``rejected_len``) and counts."""
    records, skipped = [], 0
    for question, gold, texts, lengths in zip(questions, golds, answers.texts, answers.n_tokens, strict=True):
        n_tokens = dict(zip(texts, lengths, strict=True))
        samples = [{"text": t, "correct": verifier(t, gold)} for t in texts if t]
        pair = stage1_pair({"question": question, "samples": samples},
                           lambda text, n=n_tokens: n.get(text, len(text))) if samples else None
        if pair is None:
            skipped += 1
            continue
        records.append({"prompt": pair["prompt"], "chosen": pair["chosen"], "rejected": pair["rejected"],
                        "chosen_len": n_tokens[pair["chosen"][0]["content"]],
                        "rejected_len": n_tokens[pair["rejected"][0]["content"]], "answer": str(gold)})
    return records, {"pairs": len(records), "skipped_questions": skipped}


def build_stage2(questions: Sequence[str], golds: Sequence[str], answers: Answers, taus: Sequence[float], *,
                 verifier: Callable[[str, str], bool] = numeric_verifier) -> list[dict]:
    """One SFT record per (question, τ): the refusal when c(q) < τ, else the shortest correct response."""
    records = []
    for question, gold, texts, lengths in zip(questions, golds, answers.texts, answers.n_tokens, strict=True):
        correct = [(n, t) for t, n in zip(texts, lengths, strict=True) if t and verifier(t, gold)]
        confidence = len(correct) / max(len(texts), 1)
        best = min(correct)[1] if correct else None
        for tau in taus:
            target = REFUSAL if confidence < tau or best is None else best
            records.append({"question": question, "tau": float(tau), "target": target,
                            "confidence": confidence, "answer": str(gold)})
    return records


# ------------------------------------------------------------------------------------------------ routing
@dataclasses.dataclass(frozen=True)
class CostModel:
    """Price per generated token of each model (any unit) and a fixed latency per call (seconds)."""

    small_price: float = 1.0
    large_price: float = 20.0
    small_latency: float = 0.0
    large_latency: float = 0.0


@dataclasses.dataclass
class RoutePoint:
    setting: float
    accuracy: float
    cost: float
    routed: float  # share of questions sent to the large model


def weighted_vote(texts: Sequence[str], weights: Sequence[float]) -> tuple[str | None, float]:
    """(winning extracted answer, its share of the total weight); refusals abstain (None if all refuse)."""
    totals: dict[str, float] = defaultdict(float)
    for text, weight in zip(texts, weights, strict=True):
        if text and not is_refusal(text):
            totals[extract_answer(text)] += weight
    if not totals:
        return None, 0.0
    winner = max(sorted(totals), key=lambda a: totals[a])
    return winner, totals[winner] / sum(weights)


def pre_generation_point(tau: float, small_texts: Sequence[str], small_tokens: Sequence[int],
                         large_correct: Sequence[bool], large_tokens: Sequence[int], golds: Sequence[str],
                         cost: CostModel) -> RoutePoint:
    """The small model answered under threshold τ; refusals go to the large model."""
    correct, spent, routed = 0, 0.0, 0
    for text, n_small, ok_large, n_large, gold in zip(small_texts, small_tokens, large_correct, large_tokens, golds,
                                                      strict=True):
        spent += n_small * cost.small_price + cost.small_latency
        if is_refusal(text):
            routed += 1
            spent += n_large * cost.large_price + cost.large_latency
            correct += ok_large
        else:
            correct += numeric_verifier(text, gold)
    return RoutePoint(tau, correct / len(golds), spent / len(golds), routed / len(golds))


def cascade_point(share_threshold: float, answers: Answers, large_correct: Sequence[bool],
                  large_tokens: Sequence[int], golds: Sequence[str], cost: CostModel) -> RoutePoint:
    """M small-model samples per question, confidence-weighted vote, escalation below the vote-share threshold."""
    correct, spent, routed = 0, 0.0, 0
    for texts, lengths, weights, ok_large, n_large, gold in zip(answers.texts, answers.n_tokens, answers.confidence,
                                                                large_correct, large_tokens, golds, strict=True):
        spent += sum(lengths) * cost.small_price + cost.small_latency
        winner, share = weighted_vote(texts, weights)
        if winner is None or share < share_threshold:
            routed += 1
            spent += n_large * cost.large_price + cost.large_latency
            correct += ok_large
        else:
            correct += winner == str(gold).strip()
    return RoutePoint(share_threshold, correct / len(golds), spent / len(golds), routed / len(golds))


def area(points: Sequence[RoutePoint], low: RoutePoint, high: RoutePoint) -> float:
    """Area under accuracy vs normalised cost in [0, 1] (``low`` = all small, ``high`` = all large), keeping the
    best accuracy seen at each cost (the achievable frontier)."""
    span = max(high.cost - low.cost, 1e-12)
    pts = sorted({(0.0, low.accuracy), (1.0, high.accuracy),
                  *((min(max((p.cost - low.cost) / span, 0.0), 1.0), p.accuracy) for p in points)})
    xs, ys, best = [], [], -1.0
    for x, y in pts:
        best = max(best, y)
        xs.append(x)
        ys.append(best)
    return float(np.trapezoid(ys, xs))


def golden_area(small_correct: Sequence[bool], low: RoutePoint, high: RoutePoint) -> float:
    """Area of golden routing: escalating exactly the wrong answers reaches the best accuracy at the cost share of
    the wrong answers (linear from there)."""
    wrong = 1 - float(np.mean(small_correct))
    best = float(np.mean(small_correct)) + wrong * high.accuracy
    points = [RoutePoint(-1, best, low.cost + wrong * (high.cost - low.cost), wrong)]
    return area(points, low, high)


def summarize(curve: Sequence[RoutePoint], low: RoutePoint, high: RoutePoint, small_correct: Sequence[bool]) -> dict:
    toa = area(curve, low, high)
    random = (low.accuracy + high.accuracy) / 2  # the straight line between the endpoints
    golden = golden_area(small_correct, low, high)
    return {"toa": toa, "toa_random": random, "toa_golden": golden,
            "togr": (toa - random) / (golden - random) if golden > random else float("nan")}


# ------------------------------------------------------------------------------------------------ a whole study
def evaluate_routing(small, tokenizer, questions: Sequence[str], golds: Sequence[str], *, large=None,
                     taus: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9), cascade_samples: int = 0,
                     temperature: float = 1.0, max_new_tokens: int = 32, cost: CostModel = CostModel(),
                     verifier: Callable[[str, str], bool] = numeric_verifier) -> dict:
    """Small model alone, large model alone, pre-generation routing over ``taus`` (the small model answers under
    each threshold prompt) and, with ``cascade_samples > 0``, cascade routing over vote-share thresholds.

    ``large``: ``(model, tokenizer)`` or None for an exact solver (always right, paying the bare answer's tokens).
    Returns ``{"small_alone", "large_alone", "curves", "summary", "refusal_rate"}`` (points as dicts).
    """
    if large is None:
        large_correct = [True] * len(golds)
        large_tokens = [len(tokenizer(g, add_special_tokens=False)["input_ids"]) + 1 for g in golds]
    else:
        large_answers = answer(large[0], large[1], questions, max_new_tokens=max_new_tokens)
        large_correct = [verifier(t[0], g) for t, g in zip(large_answers.texts, golds, strict=True)]
        large_tokens = [n[0] for n in large_answers.n_tokens]
    plain = answer(small, tokenizer, questions, max_new_tokens=max_new_tokens)
    small_correct = [verifier(t[0], g) for t, g in zip(plain.texts, golds, strict=True)]
    low = RoutePoint(0.0, float(np.mean(small_correct)),
                     float(np.mean([n[0] * cost.small_price for n in plain.n_tokens])), 0.0)
    high = RoutePoint(1.0, float(np.mean(large_correct)), float(np.mean([n * cost.large_price for n in large_tokens])),
                      1.0)
    curves: dict[str, list[RoutePoint]] = {"pre_generation": []}
    for tau in taus:
        routed = answer(small, tokenizer, [threshold_prompt(q, tau) for q in questions], max_new_tokens=max_new_tokens)
        curves["pre_generation"].append(pre_generation_point(
            tau, [t[0] for t in routed.texts], [n[0] for n in routed.n_tokens], large_correct, large_tokens, golds,
            cost))
    if cascade_samples > 0:
        sampled = answer(small, tokenizer, questions, num_samples=cascade_samples, temperature=temperature,
                         max_new_tokens=max_new_tokens, seed=1)
        curves["cascade"] = [cascade_point(share, sampled, large_correct, large_tokens, golds, cost)
                             for share in np.linspace(0.0, 1.0, 11)]
    return {"questions": len(golds), "small_alone": dataclasses.asdict(low), "large_alone": dataclasses.asdict(high),
            "curves": {k: [dataclasses.asdict(p) for p in v] for k, v in curves.items()},
            "summary": {k: summarize(v, low, high, small_correct) for k, v in curves.items()}}


def routing_table(report: dict) -> str:
    """The Markdown table (and ToA lines) of an ``evaluate_routing`` report."""
    low, high = report["small_alone"], report["large_alone"]
    lines = ["| mode | setting | accuracy | cost per question | routed |", "|---|---|---|---|---|",
             f"| small alone | - | {100 * low['accuracy']:.1f} % | {low['cost']:.2f} | 0 % |",
             f"| large alone | - | {100 * high['accuracy']:.1f} % | {high['cost']:.2f} | 100 % |"]
    for mode, points in report["curves"].items():
        lines += [f"| {mode} | {p['setting']:.2f} | {100 * p['accuracy']:.1f} % | {p['cost']:.2f} | "
                  f"{100 * p['routed']:.0f} % |" for p in points]
    lines += ["", *(f"{mode}: ToA {v['toa']:.3f} (random {v['toa_random']:.3f}, golden {v['toa_golden']:.3f}), "
                    f"ToGR {v['togr']:.3f}" for mode, v in report["summary"].items())]
    return "\n".join(lines)


def plot_routes(report: dict, path, title: str = "") -> None:
    """Accuracy against normalised cost for each routing mode, with the random-routing line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    low, high = report["small_alone"], report["large_alone"]
    span = max(high["cost"] - low["cost"], 1e-12)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([0, 1], [100 * low["accuracy"], 100 * high["accuracy"]], "k--", label="random routing")
    for mode, points in report["curves"].items():
        ordered = sorted(points, key=lambda p: p["cost"])
        ax.plot([(p["cost"] - low["cost"]) / span for p in ordered], [100 * p["accuracy"] for p in ordered], "o-",
                label=mode)
    ax.set_xlabel("cost (0 = small model alone, 1 = large model alone)")
    ax.set_ylabel("accuracy (%)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["Answers", "CostModel", "RoutePoint", "answer", "area", "build_stage1", "build_stage2", "cascade_point",
           "chat_prompts", "evaluate_routing", "golden_area", "plot_routes", "pre_generation_point", "routing_table",
           "summarize", "threshold_prompt", "weighted_vote"]
