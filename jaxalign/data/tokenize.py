"""Tokenisation with the model's chat template and exact loss masks.

A conversation is rendered with the tokenizer's chat template (transformers renders inside Jinja's
``ImmutableSandboxedEnvironment``) turn by turn: the text up to each assistant turn (with the generation
prompt) is the untrained prefix, the assistant's rendered content up to its end-of-turn token is trained, and
trailing whitespace after it is not. With a byte-level BPE each piece is tokenised on its own, so the
prompt/completion boundary is a token boundary — the completion tokens are exactly what the model emits after the
generation prompt at inference. Tokenizers whose encoding of a piece depends on what precedes it (SentencePiece
ones that add a prefix space: Llama 2, Mistral v0.1) tokenise the whole text once and cut it where the tokens of
each prefix end; a boundary that falls inside a token is an error naming the record, never a shifted mask.
Every assistant turn of a multi-turn conversation is trained (as in the IFT code).

BOS appears exactly once: the template's, or the tokenizer's own when the template has none; repeated leading
BOS tokens are collapsed. Standard (non-chat) completions get EOS appended once.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

import jinja2
import numpy as np

from jaxalign.data.schema import RecordError

TRUNCATIONS = ("keep_end", "keep_start")
# joins a chat template makes (word, space, newline, after a bracket): a tokenizer that encodes a piece differently
# after them encodes whole texts (``Tokenizer.encode_pieces``)
_JOIN_PROBES = (("x", " y"), ("a\n", "b"), ("]", " Hello"), ("a", " "))

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
ZEPHYR_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
NAMED_TEMPLATES = {"chatml": CHATML_TEMPLATE, "zephyr": ZEPHYR_TEMPLATE}


@dataclasses.dataclass(frozen=True)
class TokenizeConfig:
    """``max_length`` bounds prompt + completion; ``max_prompt_length`` (0 = none) bounds the prompt, which is cut
    by ``truncation`` (``keep_end``: keep the tokens nearest the completion, TRL's default; ``keep_start``).
    Completions are cut from the end; one left empty is an error, never silent. ``chat_template`` overrides
    the tokenizer's (a Jinja string or ``chatml`` / ``zephyr``). ``max_record_chars`` bounds a record before it is
    parsed or tokenised; ``template_timeout`` (seconds) and ``max_render_chars`` bound each template rendering."""

    max_length: int = 512
    max_prompt_length: int = 0
    truncation: str = "keep_end"
    chat_template: str | None = None
    add_eos: bool = True
    max_record_chars: int = 1_000_000
    template_timeout: float = 2.0

    @property
    def max_render_chars(self) -> int:
        """The longest text a chat-template rendering may produce: twice a whole record, plus room for markup."""
        return 2 * self.max_record_chars + 65536

    def __post_init__(self):
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"truncation={self.truncation!r}; expected one of {TRUNCATIONS}")
        if self.max_length < 2:
            raise ValueError(f"max_length={self.max_length} must be at least 2")


class Tokenizer:
    """A transformers tokenizer plus the facts the masking needs (BOS policy, template), and the one prompt
    encoder (``encode_prompt``) that training data, evaluation, generation, routing and Nudging share.

    ``training=False`` skips the check that prompt and completion can be tokenised apart (prompt encoding for
    generation works with any tokenizer)."""

    def __init__(self, tokenizer, config: TokenizeConfig = TokenizeConfig(), *, training: bool = True):
        self.hf = tokenizer
        self.config = config
        template = config.chat_template
        self.chat_template = NAMED_TEMPLATES.get(template, template) if template else tokenizer.chat_template
        self._template = None  # compiled on first use (bounded_template)
        self.bos_id = tokenizer.bos_token_id
        self.eos_id = tokenizer.eos_token_id
        probe = tokenizer("a")["input_ids"]
        self.adds_bos = self.bos_id is not None and bool(probe) and probe[0] == self.bos_id
        # whether pieces tokenised apart equal the whole text's tokens (byte-level BPE) or not (a SentencePiece
        # prefix space, or merges across the joins a chat template makes): then pieces are cut from the whole
        self.whole_text = any(self.encode(a) + self.encode(b) != self.encode(a + b) for a, b in _JOIN_PROBES)

    def encode(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=False)["input_ids"] if text else []

    def encode_pieces(self, pieces: Sequence[str]) -> list[list[int]]:
        """Token ids of each of ``pieces``, consecutive parts of one text. Tokenised apart where that equals the
        whole text's tokens at the joins (byte-level BPE); otherwise the whole text is tokenised once and cut
        where the tokens of each prefix end, which must be a token boundary of the whole (else ``ValueError``)."""
        if not self.whole_text:
            return [self.encode(piece) for piece in pieces]
        whole = self.encode("".join(pieces))
        cuts, text = [0], ""
        for piece in pieces[:-1]:
            text += piece
            prefix = self.encode(text)
            if whole[:len(prefix)] != prefix:
                raise ValueError(f"the text splits inside a token at character {len(text)} (after {text[-30:]!r}): "
                                 "this tokenizer joins the prompt and the completion there, so the trained tokens "
                                 "cannot be told apart; end the prompt (or the template's generation prompt) with a "
                                 "separator the tokenizer keeps")
            cuts.append(len(prefix))
        cuts.append(len(whole))
        return [whole[a:b] for a, b in itertools.pairwise(cuts)]

    def prompt_text(self, prompt: str | Sequence[dict], *, chat: bool = True, system: str | None = None) -> str:
        """The text a prompt becomes before tokenisation: with ``chat``, the messages (a string is one user turn;
        ``system`` adds a system turn) rendered with the run's chat template and its generation prompt; without,
        the plain string. (Nudging works on this text: its two models may tokenise differently.)"""
        if not chat:
            if not isinstance(prompt, str):
                raise ValueError("a message-list prompt needs the chat template (drop --no-chat)")
            return prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system:
            messages = [{"role": "system", "content": system}, *messages]
        return self.render(messages, generation_prompt=True)

    def encode_prompt(self, prompt: str | Sequence[dict], *, chat: bool = True, system: str | None = None,
                      ) -> list[int]:
        """Token ids of ``prompt_text(prompt)`` exactly as training tokenises the prompt part of a record, ready to
        generate from: one leading BOS when the tokenizer uses one."""
        ids = self.encode(self.prompt_text(prompt, chat=chat, system=system))
        return self.with_bos(ids, [0] * len(ids))[0]

    def render(self, messages: Sequence[dict], *, generation_prompt: bool) -> str:
        if self.chat_template is None:
            raise ValueError("the tokenizer has no chat template; set data.chat_template ('chatml', 'zephyr' or a "
                             "Jinja string) for conversational data")
        limit = self.config.template_timeout
        try:
            with deadline(limit):
                if self._template is None:
                    self._template = bounded_template(self.chat_template, self.config.max_render_chars)
                text = self._template.render(messages=list(messages), tools=None, documents=None,
                                             add_generation_prompt=generation_prompt, **self.hf.special_tokens_map)
        except RenderTimeout:
            raise ValueError(f"the chat template did not finish within data.template_timeout={limit} s") from None
        except RecursionError:
            raise ValueError("the chat template failed (RecursionError: it recurses without end)") from None
        except Exception as err:  # SecurityError, TemplateError, or whatever the template's own code raised
            if isinstance(err, TypeError) and "no loader" in str(err):  # {% include %} / {% import %} / {% extends %}
                raise ValueError("the chat template failed (it uses include / import / extends, which chat "
                                 "templates cannot)") from None
            message = str(err).splitlines()[0][:300] if str(err) else ""
            raise ValueError(f"the chat template failed ({type(err).__name__}: {message})") from None
        if len(text) > self.config.max_render_chars:
            raise ValueError(f"the chat template produced {len(text)} characters, over the limit of "
                             f"{self.config.max_render_chars} (2 x data.max_record_chars + 65536)")
        return text

    def with_bos(self, ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
        """Exactly one leading BOS when the tokenizer uses one (template BOS kept, duplicates removed)."""
        if self.bos_id is None:
            return ids, mask
        start = 0
        while start < len(ids) and ids[start] == self.bos_id:
            start += 1
        if start == 0 and not self.adds_bos:
            return ids, mask
        return [self.bos_id, *ids[start:]], [0, *mask[start:]]


def padding_id(hf_tokenizer) -> int:
    """The id batches are padded with: the tokenizer's pad token, else 0 (padding is masked either way)."""
    return hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else 0


def bounded_template(source: str, max_chars: int) -> jinja2.Template:
    """``source`` compiled in the sandbox transformers renders chat templates in (its filters, globals and
    ``{% generation %}`` tag, through an overlay of its environment), with ``*`` and ``**`` intercepted: a
    repetition longer than ``max_chars`` or a power over 4096 bits is a ``SecurityError`` before it is computed
    (Jinja would otherwise fold ``'a' * 10**9`` while compiling). Rendering it with ``messages``,
    ``add_generation_prompt`` and the tokenizer's special tokens is what ``apply_chat_template(tokenize=False)``
    does (tests/test_data_tokenize.py checks they agree)."""
    from jinja2.sandbox import SecurityError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    env = _compile_jinja_template("").environment.overlay()  # never compiled unbounded: Jinja folds constants

    def binop(_context, operator, left, right):
        if operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and (
                    right > 4096 or abs(left).bit_length() * right > 4096):
                raise SecurityError(f"{left} ** {right} is too large for a chat template")
            return left ** right
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and len(seq) * count > max_chars:
                raise SecurityError(f"repeating {len(seq)} items {count} times exceeds {max_chars}")
        return left * right

    env.intercepted_binops = frozenset({"*", "**"})
    env.call_binop = binop
    return env.from_string(source)


class RenderTimeout(BaseException):
    """Raised inside a rendering thread that passed its deadline (a BaseException, so no ``except Exception`` in
    template or library code swallows it)."""


class _Watchdog:
    """One daemon thread that raises ``RenderTimeout`` in any thread still inside ``deadline()`` past its time
    (through ``PyThreadState_SetAsyncExc``: Jinja's compiled loops are Python code, so they stop at the next
    bytecode)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._deadlines: dict[int, float] = {}
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                for ident, due in list(self._deadlines.items()):
                    if due <= now:
                        del self._deadlines[ident]
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident),
                                                                   ctypes.py_object(RenderTimeout))
                soonest = min(self._deadlines.values(), default=None)
                self._cond.wait(None if soonest is None else max(soonest - now, 0.001))

    @contextlib.contextmanager
    def limit(self, seconds: float):
        ident = threading.get_ident()
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="jaxalign-template-watchdog", daemon=True)
                self._thread.start()
            self._deadlines[ident] = time.monotonic() + seconds
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                fired = self._deadlines.pop(ident, None) is None
            if fired:  # the exception may still be pending: cancel it so it cannot surface after the render
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)


_WATCHDOG = _Watchdog()


def deadline(seconds: float):
    """``with deadline(s):`` raises ``RenderTimeout`` in this thread if the block runs longer than ``s``."""
    return _WATCHDOG.limit(seconds)


def as_tokenizer(tokenizer, chat_template: str | None = None) -> Tokenizer:
    """``tokenizer`` as the prompt encoder: a ``Tokenizer`` as it is (the run's template and lengths), a
    transformers tokenizer wrapped with its own chat template or ``chat_template`` (a Jinja string, ``chatml`` or
    ``zephyr``, as ``data.chat_template``)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    return Tokenizer(tokenizer, TokenizeConfig(chat_template=chat_template or None), training=False)


def chat_segments(tok: Tokenizer, messages: Sequence[dict]) -> list[tuple[str, bool]]:
    """``[(text, trained)]`` pieces of a rendered conversation; assistant turns trained up to their end token."""
    segments: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tok.render(messages[:i], generation_prompt=True) if i else ""
        full = tok.render(messages[: i + 1], generation_prompt=False)
        if not before.startswith(done) or not full.startswith(before):
            raise ValueError("the chat template is not prefix-stable (rendering a turn changes when later turns are "
                             "added), so assistant tokens cannot be located; set data.chat_template")
        body = full[len(before):]
        trained = body.rstrip()
        segments += [(before[len(done):], False), (trained, True), (body[len(trained):], False)]
        done = full
    rest = tok.render(messages, generation_prompt=False)
    if not rest.startswith(done):
        raise ValueError("the chat template is not prefix-stable; set data.chat_template")
    segments.append((rest[len(done):], False))
    return [(text, trained) for text, trained in segments if text]


def encode_segments(tok: Tokenizer, segments: Sequence[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    mask: list[int] = []
    for piece, (_, trained) in zip(tok.encode_pieces([text for text, _ in segments]), segments, strict=True):
        ids += piece
        mask += [int(trained)] * len(piece)
    return ids, mask


def _truncate_prompt(tok: Tokenizer, prompt: list[int]) -> list[int]:
    limit = tok.config.max_prompt_length
    if not limit or len(prompt) <= limit:
        return prompt
    return prompt[-limit:] if tok.config.truncation == "keep_end" else prompt[:limit]


class _Fail(Exception):
    def __init__(self, field: str, message: str):
        self.field, self.message = field, message


def _join(tok: Tokenizer, prompt: list[int], completion: list[int], tail: list[int],
          field: str) -> tuple[np.ndarray, np.ndarray]:
    """prompt (untrained) + completion (trained) + tail (untrained), truncated to the limits."""
    prompt = _truncate_prompt(tok, prompt)
    prompt, prompt_mask = tok.with_bos(prompt, [0] * len(prompt))
    if not completion:
        raise _Fail(field, "the completion has no tokens")
    room = tok.config.max_length - len(prompt)
    if room <= 0:
        raise _Fail(field, f"over-long: the prompt takes {len(prompt)} tokens, leaving no room for the completion "
                           f"within max_length={tok.config.max_length} (set max_prompt_length to cut prompts)")
    body = (completion + tail)[:room]
    mask = ([1] * len(completion) + [0] * len(tail))[:room]
    return np.asarray(prompt + body, np.int32), np.asarray(prompt_mask + mask, np.int8)


def _append_eos(tok: Tokenizer, ids: list[int]) -> list[int]:
    if tok.config.add_eos and tok.eos_id is not None and (not ids or ids[-1] != tok.eos_id):
        return [*ids, tok.eos_id]
    return ids


def _prompt_and_completion(tok: Tokenizer, prompt, completion) -> tuple[list[int], list[int], list[int]]:
    """Token ids of (prompt, trained completion, untrained tail) for string or conversational data."""
    if isinstance(completion, str):
        prompt_ids, completion_ids = tok.encode_pieces([prompt or "", completion])
        return prompt_ids, _append_eos(tok, completion_ids), []
    prompt_text = tok.render(prompt, generation_prompt=True) if prompt else ""
    full = tok.render([*(prompt or []), *completion], generation_prompt=False)
    if not full.startswith(prompt_text):
        raise ValueError("the chat template is not prefix-stable; set data.chat_template")
    if len(completion) == 1:
        body = full[len(prompt_text):]
        trained = body.rstrip()
        prompt_ids, trained_ids, tail_ids = tok.encode_pieces([prompt_text, trained, body[len(trained):]])
        return prompt_ids, trained_ids, tail_ids
    # several completion turns (e.g. assistant, tool, assistant): mask by segment, prompt stays untrained
    ids, mask = encode_segments(tok, chat_segments(tok, [*(prompt or []), *completion]))
    n_prompt = len(tok.encode(prompt_text))
    tail = len(mask) - (max(i for i, m in enumerate(mask) if m) + 1)
    return ids[:n_prompt], ids[n_prompt:len(ids) - tail], ids[len(ids) - tail:]


def _shared_prefix(a: Sequence, b: Sequence) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _pair(tok: Tokenizer, pair: dict[str, Any], prefix: str, field_prefix: str) -> dict[str, np.ndarray]:
    """Chosen and rejected sequences sharing one prompt. Without a prompt, the shared prefix becomes it: in
    token space for strings, in message space for conversations."""
    chosen, rejected, prompt = pair["chosen"], pair["rejected"], pair.get("prompt")
    if prompt is None and isinstance(chosen, str):
        full_c, full_r = tok.encode(chosen), tok.encode(rejected)
        shared = _shared_prefix(full_c, full_r)
        if shared in (len(full_c), len(full_r)):
            raise _Fail(f"{field_prefix}chosen", "one response is a prefix of the other: nothing left to compare")
        sides = {"chosen": (full_c[:shared], _append_eos(tok, full_c[shared:]), []),
                 "rejected": (full_r[:shared], _append_eos(tok, full_r[shared:]), [])}
    else:
        if prompt is None:
            shared = _shared_prefix(chosen, rejected)
            while shared and chosen[shared - 1]["role"] == "assistant":
                shared -= 1
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
            if not prompt:
                raise _Fail(f"{field_prefix}prompt", "missing, and chosen and rejected share no turn to use as one")
        sides = {"chosen": _prompt_and_completion(tok, prompt, chosen),
                 "rejected": _prompt_and_completion(tok, prompt, rejected)}
    out = {}
    for side, (p, c, t) in sides.items():
        tokens, mask = _join(tok, p, c, t, f"{field_prefix}{side}")
        out[f"{prefix}{side}_tokens"], out[f"{prefix}{side}_loss_mask"] = tokens, mask
    if "margin" in pair:
        out[f"{prefix}margin"] = np.float32(pair["margin"])
    return out


def tokenize_record(tok: Tokenizer, record: dict[str, Any], *, source: str = "<data>", index: int = 0,
                    ) -> dict[str, np.ndarray]:
    """Token arrays of one validated record (``schema.validate_record``).

    ``lm``/``sft`` -> ``tokens``, ``loss_mask``; ``unpaired`` -> the same and ``label``; ``preference`` ->
    ``{chosen,rejected}_{tokens,loss_mask}``; ``mpo`` -> the same with ``target_`` and ``dominant_`` prefixes.
    Raises ``RecordError`` for records that cannot be trained on after truncation.
    """
    kind = record["kind"]
    try:
        if kind == "lm":
            ids = _append_eos(tok, tok.encode(record["text"]))
            ids, mask = tok.with_bos(ids, [1] * len(ids))
            return {"tokens": np.asarray(ids[: tok.config.max_length], np.int32),
                    "loss_mask": np.asarray(mask[: tok.config.max_length], np.int8)}
        if kind == "sft" and "messages" in record:
            ids, mask = encode_segments(tok, chat_segments(tok, record["messages"]))
            ids, mask = tok.with_bos(ids, mask)
            ids, mask = ids[: tok.config.max_length], mask[: tok.config.max_length]
            if not any(mask[1:]):
                raise _Fail("messages", f"no assistant token left within max_length={tok.config.max_length}")
            return {"tokens": np.asarray(ids, np.int32), "loss_mask": np.asarray(mask, np.int8)}
        if kind in ("sft", "unpaired"):
            tokens, mask = _join(tok, *_prompt_and_completion(tok, record.get("prompt"), record["completion"]),
                                 "completion")
            if kind == "unpaired":
                return {"tokens": tokens, "loss_mask": mask, "label": np.int8(record["label"])}
            return {"tokens": tokens, "loss_mask": mask}
        if kind == "preference":
            return _pair(tok, record, "", "")
        if kind == "mpo":
            return {**_pair(tok, record["target"], "target_", "target_"),
                    **_pair(tok, record["dominant"], "dominant_", "source_")}
    except _Fail as err:
        raise RecordError(source, index, err.field, err.message) from None
    except ValueError as err:
        if isinstance(err, RecordError):
            raise
        raise RecordError(source, index, "<record>", str(err)) from None
    raise RecordError(source, index, "<record>", f"records of kind {kind!r} are not tokenised directly")
