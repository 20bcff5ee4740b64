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
from jaxalign.sampling.generate import left_pad, sample


# ------------------------------------------------------------------------------------------------ sampling
def chat_prompts(tokenizer, questions: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded chat prompts (token ids, mask) for ``questions``."""
    encoded = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True)["input_ids"] for q in questions]
    return left_pad(encoded, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)


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


__all__ = ["Answers", "CostModel", "RoutePoint", "answer", "area", "build_stage1", "build_stage2", "cascade_point",
           "chat_prompts", "golden_area", "pre_generation_point", "summarize", "threshold_prompt", "weighted_vote"]
