"""SATER data conventions (spec §3): stage I pairs from sampled responses, stage II threshold prompts.

Stage I: chosen = the shortest correct sample, rejected = the longest incorrect one (length in tokens);
questions with no correct or no incorrect sample, or whose two picks have the same text or length, give no
pair. Stage II: the prompt states the confidence threshold τ in a fixed format; the target is a correct
answer or the refusal string.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

REFUSAL = "Sorry, I can't answer that."


def threshold_prompt(question: str, tau: float) -> str:
    """The stage-II prompt: the question plus the threshold, always formatted with one decimal."""
    return (f"{question}\n\nAnswer only if you are at least {tau:.1f} confident; otherwise reply exactly "
            f"\"{REFUSAL}\"")


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
