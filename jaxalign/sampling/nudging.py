"""Nudging (Fei, Razeghi & Singh, ACL 2025): a base model decodes, a small aligned model inserts words where the
base model is unsure.

The two models exchange text, not token ids, so they may use different tokenizers (a character-level one and a
BPE one, say): every call re-tokenises the shared string with the caller's own tokenizer.

A round, following the paper's rule (base first) with the official code's word-level hand-over
(``fywalter/nudging``, ``utils.completion_with_nudging``):

1. the base model continues greedily while its top-1 probability stays at or above ``gamma`` (one jitted decode
   that stops *before* the first unsure token); base EOS ends the answer;
2. at the unsure position the nudging model looks ahead ``lookahead`` tokens greedily; its first word is always
   taken; further words are taken while the base model neither starts the next nudging word itself nor is
   confident there (the code's acceptance test); if the look-ahead ends with EOS it is taken whole and the
   answer ends;
3. guards: at most ``max_rounds`` nudges, a base-token budget ``max_tokens``, the same nudged text three rounds in a
   row stops, and a repeated suffix of ≥ 30 characters is removed at the end.

``gamma = 0`` is the base model's greedy output exactly; ``gamma > 1`` hands every round to the nudging model.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxalign.sampling.generate import left_pad, sample

PROMPT_BUCKET = 64


@dataclasses.dataclass
class Continuation:
    text: str
    token_texts: list[str]
    top1: list[float]
    ended: bool  # stopped at EOS


class TextModel:
    """A model and its tokenizer behind a text-in, text-out greedy interface (prompts padded to buckets, so a
    growing prompt compiles a handful of shapes, not one per call)."""

    def __init__(self, model, tokenizer, *, add_special_tokens: bool = True):
        self.model, self.tokenizer = model, tokenizer
        self.add_special_tokens = add_special_tokens
        eos = tokenizer.eos_token_id
        self.eos_ids = () if eos is None else (eos,)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0

    def continue_text(self, text: str, max_new_tokens: int, *, stop_below: float = 0.0) -> Continuation:
        ids = self.tokenizer(text, add_special_tokens=self.add_special_tokens)["input_ids"]
        tokens, mask = left_pad([ids], self.pad_id, -(-max(len(ids), 1) // PROMPT_BUCKET) * PROMPT_BUCKET)
        out = sample(self.model, tokens, prompt_mask=mask, max_new_tokens=max(max_new_tokens, 1),
                     eos_id=self.eos_ids or None, pad_id=self.pad_id, stop_below=stop_below)
        n = int(out.lengths[0])
        generated = [int(t) for t in np.asarray(out.tokens[0, :n])]
        ended = bool(generated) and generated[-1] in self.eos_ids
        if ended:
            generated = generated[:-1]
        pieces, previous = [], ""
        for i in range(len(generated)):
            current = self.tokenizer.decode(generated[: i + 1], skip_special_tokens=True)
            pieces.append(current[len(previous):])
            previous = current
        top1 = [float(p) for p in np.asarray(out.top1_probs[0, :n])]
        return Continuation(text=previous, token_texts=pieces, top1=top1, ended=ended)


@dataclasses.dataclass
class NudgingResult:
    text: str
    rounds: int  # nudges
    nudged_words: int
    total_words: int
    base_tokens: int
    nudger_tokens: int

    @property
    def nudged_share(self) -> float:
        return self.nudged_words / max(self.total_words, 1)


def remove_repeated_suffix(text: str, min_length: int = 30) -> str:
    """Strips a suffix of ``min_length``+ characters that immediately repeats itself, until none is left."""
    changed = True
    while changed:
        changed = False
        for size in range(len(text) // 2, min_length - 1, -1):
            if text.endswith(text[-size:] * 2):
                text, changed = text[:-size], True
                break
    return text


def _leading_spaces(text: str) -> str:
    return text[: len(text) - len(text.lstrip(" "))]


def nudge(base: TextModel, nudger: TextModel, base_prompt: str, nudger_prompt: str, *, gamma: float = 0.3,
          lookahead: int = 16, max_tokens: int = 512, max_rounds: int = 150) -> NudgingResult:
    """Decodes an answer with ``base`` guided by ``nudger``; prompts are plain strings in each model's own format
    (e.g. ``"Question: ...\\nAnswer:"`` for the base, the chat-template rendering for the nudger)."""
    answer, rounds, nudged_words, base_tokens, nudger_tokens = "", 0, 0, 0, 0
    recent: list[str] = []
    while True:
        budget = max_tokens - base.count_tokens(answer)
        if budget <= 0:
            break
        confident = base.continue_text(base_prompt + answer, budget, stop_below=gamma)
        answer += confident.text
        base_tokens += len(confident.token_texts)
        if confident.ended or rounds >= max_rounds or base.count_tokens(answer) >= max_tokens:
            break
        rounds += 1
        look = nudger.continue_text(nudger_prompt + answer, lookahead)
        nudger_tokens += len(look.token_texts) + look.ended
        if look.ended:
            answer += look.text
            nudged_words += len(look.text.split())
            break
        lead, words = _leading_spaces(look.text), look.text.lstrip(" ").split(" ")
        keep = 1
        while keep < len(words) - 1:
            if words[keep]:
                probe = base.continue_text(base_prompt + answer + lead + " ".join(words[:keep]), 1)
                first = probe.token_texts[0] if probe.token_texts else ""
                if (first and (" " + words[keep]).startswith(first)) or (probe.top1 and probe.top1[0] >= gamma):
                    break
            keep += 1
        chunk = lead + " ".join(words[:keep])
        recent = [*recent[-2:], chunk]
        if not chunk or (len(recent) == 3 and len(set(recent)) == 1):
            break
        answer += chunk
        nudged_words += len(chunk.split())
    answer = remove_repeated_suffix(answer)
    return NudgingResult(text=answer, rounds=rounds, nudged_words=nudged_words, total_words=len(answer.split()),
                         base_tokens=base_tokens, nudger_tokens=nudger_tokens)
