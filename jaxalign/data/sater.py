"""SATER data conventions (spec §3): stage I pairs from sampled responses, stage II threshold prompts.

Stage I: chosen = the shortest correct sample, rejected = the longest incorrect one (length in tokens);
questions with no correct or no incorrect sample, or whose two picks have the same text or length, give no
pair. Stage II: the prompt states the confidence threshold τ in a fixed format; the target is a correct
answer or the refusal string.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from typing import Any

REFUSAL = "Sorry, I can't answer that."
_NUMBER = re.compile(r"-?\d+")


def extract_answer(text: str) -> str:
    """The last integer in ``text`` (toy answers are numbers, short or inside a sentence), else the stripped text."""
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else text.strip()


def numeric_verifier(text: str, gold: str) -> bool:
    """Exact match of the extracted answer with the gold answer."""
    return extract_answer(text) == str(gold).strip()


def is_refusal(text: str, *, threshold: float = 0.8) -> bool:
    """Whether ``text`` is the refusal: exact after normalising case, spaces and punctuation, a prefix of it (a cut
    generation still counts), or a close fuzzy match (``difflib`` ratio >= ``threshold``)."""
    def norm(s: str) -> str:
        return re.sub(r"[^a-z0-9 ]", "", " ".join(s.lower().split()))

    said, refusal = norm(text), norm(REFUSAL)
    if not said:
        return False
    if said.startswith(refusal) or (len(said) >= 6 and refusal.startswith(said)):
        return True
    return difflib.SequenceMatcher(None, said[: len(refusal) + 5], refusal).ratio() >= threshold


def threshold_prompt(question: str, tau: float) -> str:
    """The stage-II prompt: the threshold instruction (τ with one decimal), then the question last, so the question
    stays right before the answer as in ordinary prompts (small models lose the question behind a long suffix)."""
    return (f"Answer only if you are at least {tau:.1f} confident; otherwise reply exactly \"{REFUSAL}\"\n\n"
            f"{question}")


def stage1_pair(record: dict[str, Any], count_tokens: Callable[[str], int]) -> dict[str, Any] | None:
    """A preference record (conversational) from a validated stage-I record, or None if degenerate."""
    correct = [s["text"] for s in record["samples"] if s["correct"]]
    wrong = [s["text"] for s in record["samples"] if not s["correct"]]
    if not correct or not wrong:
        return None
    chosen = min(correct, key=lambda text: (count_tokens(text), text))
    rejected = max(wrong, key=lambda text: (count_tokens(text), text))
    if chosen == rejected or count_tokens(chosen) == count_tokens(rejected):
        return None
    return {"kind": "preference", "prompt": [{"role": "user", "content": record["question"]}],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def stage2_example(record: dict[str, Any]) -> dict[str, Any]:
    """A conversational SFT record from a validated stage-II record."""
    return {"kind": "sft", "prompt": [{"role": "user", "content": threshold_prompt(record["question"], record["tau"])}],
            "completion": [{"role": "assistant", "content": record["target"]}]}
