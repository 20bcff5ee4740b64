"""Nudging (Fei, Razeghi & Singh, ACL 2025): a base model decodes, a small aligned model inserts words where the
base model is unsure.

The two models exchange text, not token ids, so they may use different tokenizers (a character-level one and a
BPE one, say): every call re-tokenises the shared string with the caller's own tokenizer.

``nudge`` follows the official code's turn order by default (``order="nudger_first"``; ``fywalter/nudging`` @
2ffbf1f, ``utils.completion_with_nudging`` and ``complete_with_base``). Each round:

1. the nudging model looks ahead ``lookahead`` tokens greedily on its prompt + the answer so far; if the look-ahead
   ends with EOS it is taken whole and the answer ends;
2. its first word is always taken; further words are taken until the base model, asked for ``chunk`` greedy tokens
   after them, either starts the next nudging word itself or is confident there (top-1 probability >= ``gamma``);
   if it never does, the words but the last are taken and the next round asks the nudging model again;
3. the base model's first token of that probe is taken unconditionally, then its tokens while their top-1
   probability stays >= ``gamma``, in ``chunk``-token calls (the budget is checked before each call, so the last
   may run past it); a chunk found in the answer already (more than 5 words), an empty chunk, or base EOS ends the
   stage, not the answer;
4. guards: ``max_rounds`` rounds, a budget of ``max_tokens`` base-tokenizer tokens (the official code counts
   GPT-3.5 tokens), the same nudging words a fourth round in a row stops; at the end the answer is stripped and
   its repeated suffixes (>= 30 characters, found by the code's binary search) are removed.

So ``gamma = 0`` is the nudging model's first word, then the base model's greedy continuation; ``gamma > 1`` takes
the base model's token only where it starts the next nudging word. ``order="base_first"`` is the paper's
description instead: the base decodes until its top-1 probability falls below ``gamma`` and only then does the
nudging model write (``gamma = 0`` is then exactly the base model's greedy output).

``nudge_cached`` is the same-tokenizer fast path (the official ``nudging_with_caching`` notebook's token-level
variant, without its speculative drafting): both models keep a KV cache and advance together in one jitted loop,
one token per step for a whole batch of questions, never re-reading the growing answer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxalign.data.tokenize import padding_id
from jaxalign.sampling.generate import cache_bucket, left_pad, prefill, sample

PROMPT_BUCKET = 64


@dataclasses.dataclass
class Continuation:
    text: str
    token_texts: list[str]
    top1: list[float]  # per generated token, EOS included
    ended: bool  # stopped at EOS

    @property
    def tokens(self) -> list[str]:
        """The generated tokens as an OpenAI-style completions API lists them (what the official Nudging code
        reads): the EOS included, decoded as ``""``; aligned with ``top1``."""
        return [*self.token_texts, ""] if self.ended else list(self.token_texts)


class TextModel:
    """A model and its tokenizer behind a text-in, text-out greedy interface (prompts padded to buckets, so a
    growing prompt compiles a handful of shapes, not one per call)."""

    def __init__(self, model, tokenizer, *, add_special_tokens: bool = True):
        self.model, self.tokenizer = model, tokenizer
        self.add_special_tokens = add_special_tokens
        eos = tokenizer.eos_token_id
        self.eos_ids = () if eos is None else (eos,)
        self.pad_id = padding_id(tokenizer)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Left-padded ``(tokens, mask)``, the width rounded up to a multiple of ``PROMPT_BUCKET``."""
        ids = [self.tokenizer(t, add_special_tokens=self.add_special_tokens)["input_ids"] for t in texts]
        return left_pad(ids, self.pad_id, -(-max(max(len(i) for i in ids), 1) // PROMPT_BUCKET) * PROMPT_BUCKET)

    def continue_text(self, text: str, max_new_tokens: int, *, stop_below: float = 0.0) -> Continuation:
        tokens, mask = self.encode([text])
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


def longest_repeated_suffix(text: str, min_length: int = 30) -> str | None:
    """The official ``find_longest_repeated_suffix``: a binary search over suffix lengths for one that immediately
    repeats (``text[:-n].endswith(text[-n:])``, ``n >= min_length``); None if the search finds none."""
    left, right, found = 0, len(text), 0
    while left <= right:
        mid = (left + right) // 2
        if mid >= min_length and text[:-mid].endswith(text[-mid:]):
            found, left = mid, mid + 1
        else:
            right = mid - 1
    return text[-found:] if found else None


def remove_redundant_repetitions(text: str) -> str:
    """The official final clean-up: strip, then drop the longest repeated suffix until there is none."""
    text = text.strip()
    while suffix := longest_repeated_suffix(text):
        text = text[:-len(suffix)]
    return text


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


NUDGING_ORDERS = ("nudger_first", "base_first")


def nudge(base: TextModel, nudger: TextModel, base_prompt: str, nudger_prompt: str, *, gamma: float = 0.3,
          lookahead: int = 16, max_tokens: int = 512, max_rounds: int = 150, order: str = "nudger_first",
          chunk: int = 16) -> NudgingResult:
    """Decodes an answer with ``base`` guided by ``nudger``; prompts are plain strings in each model's own format
    (e.g. ``"Question: ...\\nAnswer:"`` for the base, the chat-template rendering for the nudger). ``order``:
    ``nudger_first`` (the official code, default) or ``base_first`` (the paper's description); ``chunk``: tokens
    per base call in the official order (16 in the code)."""
    if order == "nudger_first":
        return _nudge_official(base, nudger, base_prompt, nudger_prompt, gamma=gamma, lookahead=lookahead,
                               chunk=chunk, max_tokens=max_tokens, max_rounds=max_rounds)
    if order != "base_first":
        raise ValueError(f"order={order!r}; expected one of {NUDGING_ORDERS}")
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


def _base_stage(base: TextModel, base_prompt: str, answer: str, probe: Continuation, gamma: float, chunk: int,
                budget: int) -> tuple[str, int]:
    """Stage 2 of a round (the official ``complete_with_base``): the probe's first token, then base tokens while
    confident, ``chunk`` at a time; ``(text, base tokens taken)``."""
    text, taken = probe.tokens[0], 1
    pieces, top1, finished, first = probe.tokens[1:], probe.top1[1:], False, True
    while base.count_tokens(text) < budget:
        if not first:
            more = base.continue_text(base_prompt + answer + text, chunk)
            pieces, top1, finished = more.tokens, more.top1, more.ended
        whole = "".join(pieces)
        if whole in text:  # a repeat, or nothing (the empty string is in every text)
            break
        unsure = next((i for i, p in enumerate(top1) if p < gamma), -1)
        new = "".join(pieces[:unsure]) if unsure >= 0 else whole
        if len(new.split(" ")) > 5 and new in answer + text:  # the code's repetition check
            break
        text += new
        taken += unsure if unsure >= 0 else len(pieces)
        if unsure >= 0 or (not first and finished):
            break
        first = False
    return text, taken


def _nudge_official(base: TextModel, nudger: TextModel, base_prompt: str, nudger_prompt: str, *, gamma: float,
                    lookahead: int, chunk: int, max_tokens: int, max_rounds: int) -> NudgingResult:
    answer, rounds, nudged_words, base_tokens, nudger_tokens = "", 0, 0, 0, 0
    last_words, repeats = "", 0
    while base.count_tokens(answer) < max_tokens and rounds < max_rounds:
        rounds += 1
        look = nudger.continue_text(nudger_prompt + answer, lookahead)
        nudger_tokens += len(look.token_texts) + look.ended
        if look.ended:  # the nudging model finished the answer
            answer += look.text
            nudged_words += len(look.text.split())
            break
        lead, words = _leading_spaces(look.text), look.text.lstrip(" ").split(" ")
        keep, accepted, probe = (0 if len(words) > 1 else 1), False, None
        while not accepted and keep < len(words) - 1:
            keep += 1
            if not words[keep]:  # a double space
                continue
            probe = base.continue_text(base_prompt + answer + lead + " ".join(words[:keep]), chunk)
            first = probe.tokens[0]  # "" if the base ends at once: it starts every word
            accepted = (" " + words[keep]).startswith(first) or probe.top1[0] >= gamma
        taken = lead + " ".join(words[:keep])
        if taken == last_words:
            repeats += 1
            if repeats >= 3:
                break
        else:
            last_words, repeats = taken, 0
        answer += taken
        nudged_words += len(taken.split())
        if not accepted or not probe.text:  # ask the nudging model again / the base has nothing to add
            continue
        text, taken_tokens = _base_stage(base, base_prompt, answer, probe, gamma, chunk,
                                         max_tokens - base.count_tokens(answer))
        answer += text
        base_tokens += taken_tokens
    answer = remove_redundant_repetitions(answer)
    return NudgingResult(text=answer, rounds=rounds, nudged_words=nudged_words, total_words=len(answer.split()),
                         base_tokens=base_tokens, nudger_tokens=nudger_tokens)


def word_start_table(tokenizer, vocab_size: int) -> np.ndarray:
    """``[vocab_size]`` bool: the token's text starts a new word (leading whitespace, or a special token)."""
    table = np.zeros(vocab_size, bool)
    special = set(tokenizer.all_special_ids)
    for token_id in range(min(vocab_size, len(tokenizer))):
        text = tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        table[token_id] = token_id in special or (text[:1].isspace() if text else False)
    return table


@functools.partial(jax.jit, static_argnames=("base_graph", "nudger_graph", "base_cache", "nudger_cache", "pad_id"))
def _nudge_loop(base_graph, base_state, nudger_graph, nudger_state, base_tokens, base_mask, nudger_tokens,
                nudger_mask, word_start, gamma, max_new_tokens, eos_ids, *, base_cache: int, nudger_cache: int,
                pad_id: int):
    base, nudger = nnx.merge(base_graph, base_state), nnx.merge(nudger_graph, nudger_state)
    batch = base_tokens.shape[0]
    room = min(base_cache - base_tokens.shape[1], nudger_cache - nudger_tokens.shape[1])
    base_first, base_prefill = prefill(base, base_tokens, base_mask, base_cache)
    nudger_first, nudger_prefill = prefill(nudger, nudger_tokens, nudger_mask, nudger_cache)

    def cond(carry):
        return (carry[0] < max_new_tokens) & ~jnp.all(carry[7])

    def body(carry):
        step, b_cache, n_cache, b_logits, n_logits, tokens, by_nudger, done, nudging, rounds = carry
        b_probs = jax.nn.softmax(b_logits.astype(jnp.float32), axis=-1)
        b_top1, b_token = b_probs.max(-1), jnp.argmax(b_logits, -1).astype(jnp.int32)
        n_token = jnp.argmax(n_logits, -1).astype(jnp.int32)
        confident = b_top1 >= gamma
        # while nudging, the base takes over only where the nudger starts a new word and the base is confident
        # (or would write the same token); otherwise the base hands over as soon as it is unsure
        take_over = word_start[n_token] & (confident | (b_token == n_token))
        nudge_now = jnp.where(nudging, ~take_over, ~confident)
        token = jnp.where(nudge_now, n_token, b_token)
        rounds = rounds + (nudge_now & ~nudging & ~done).astype(jnp.int32)
        token = jnp.where(done, pad_id, token)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], step, 1)
        by_nudger = jax.lax.dynamic_update_slice_in_dim(by_nudger, (nudge_now & ~done)[:, None], step, 1)
        done = done | jnp.isin(token, eos_ids)
        ones = jnp.ones((batch, 1), bool)
        b_next, n_next = base(token[:, None], ones, cache=b_cache), nudger(token[:, None], ones, cache=n_cache)
        return (step + 1, b_next.cache, n_next.cache, b_next.logits[:, -1], n_next.logits[:, -1], tokens, by_nudger,
                done, nudge_now, rounds)

    carry = (jnp.zeros((), jnp.int32), base_prefill, nudger_prefill, base_first, nudger_first,
             jnp.full((batch, room), pad_id, jnp.int32), jnp.zeros((batch, room), bool),
             jnp.zeros((batch,), bool), jnp.zeros((batch,), bool), jnp.zeros((batch,), jnp.int32))
    result = jax.lax.while_loop(cond, body, carry)
    return result[5], result[6], result[9]


def nudge_cached(base: TextModel, nudger: TextModel, base_prompts: list[str], nudger_prompts: list[str], *,
                 gamma: float = 0.3, max_new_tokens: int = 256) -> list[NudgingResult]:
    """Token-level Nudging for a base and a nudging model that share one tokenizer, a batch of questions at once.

    Each step the base model's greedy token is taken while its top-1 probability is at least ``gamma``; below it
    the nudging model writes, and keeps writing until its next token starts a new word at which the base model is
    confident again (or agrees). Both KV caches advance with every emitted token. ``gamma = 0`` is the base
    model's greedy output; ``gamma > 1`` is the nudging model's greedy output. Word counts in the statistics
    are whitespace words of the text each model wrote; ``rounds`` counts hand-overs to the nudging model.
    """
    if base.tokenizer.get_vocab() != nudger.tokenizer.get_vocab():
        raise ValueError("nudge_cached needs one tokenizer for both models; use nudge() for different tokenizers")
    if len(base_prompts) != len(nudger_prompts) or not base_prompts:
        raise ValueError(f"need as many base prompts as nudger prompts (got {len(base_prompts)} and "
                         f"{len(nudger_prompts)})")
    vocab = base.model.config.vocab_size
    if nudger.model.config.vocab_size != vocab:
        raise ValueError(f"vocabulary sizes differ: base {vocab}, nudger {nudger.model.config.vocab_size}")

    (b_tokens, b_mask), (n_tokens, n_mask) = base.encode(base_prompts), nudger.encode(nudger_prompts)
    eos = tuple(sorted(set(base.eos_ids) | set(nudger.eos_ids))) or (-1,)
    b_graph, b_state = nnx.split(base.model)
    n_graph, n_state = nnx.split(nudger.model)
    tokens, by_nudger, rounds = _nudge_loop(
        b_graph, b_state, n_graph, n_state, jnp.asarray(b_tokens), jnp.asarray(b_mask), jnp.asarray(n_tokens),
        jnp.asarray(n_mask), jnp.asarray(word_start_table(base.tokenizer, vocab)), jnp.asarray(gamma, jnp.float32),
        jnp.asarray(max_new_tokens, jnp.int32), jnp.asarray(eos, jnp.int32),
        base_cache=cache_bucket(b_tokens.shape[1] + max_new_tokens),
        nudger_cache=cache_bucket(n_tokens.shape[1] + max_new_tokens), pad_id=base.pad_id)
    tokens, by_nudger, rounds = np.asarray(tokens), np.asarray(by_nudger), np.asarray(rounds)
    results = []
    for row in range(len(base_prompts)):
        ids = [int(t) for t in tokens[row, :max_new_tokens]]
        flags = [bool(f) for f in by_nudger[row, :max_new_tokens]]
        end = next((i for i, t in enumerate(ids) if t in eos), len(ids))
        if end < len(ids):
            end += 1  # the EOS was written by someone
        ids, flags = ids[:end], flags[:end]
        text = base.tokenizer.decode(ids, skip_special_tokens=True)
        nudged_text = base.tokenizer.decode([t for t, f in zip(ids, flags, strict=True) if f],
                                            skip_special_tokens=True)
        results.append(NudgingResult(text=text, rounds=int(rounds[row]), nudged_words=len(nudged_text.split()),
                                     total_words=len(text.split()), base_tokens=flags.count(False),
                                     nudger_tokens=flags.count(True)))
    return results
