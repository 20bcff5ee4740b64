"""The lm-evaluation-harness (``lm_eval``) over jaxalign models: ``JaxalignLM`` and ``evaluate``.

``JaxalignLM(model, tokenizer)`` is an ``lm_eval.api.model.LM``: ``loglikelihood`` (summed log-probability of each
continuation after its context, and whether greedy decoding gives it), ``loglikelihood_rolling`` (the whole text's
log-likelihood in windows of ``max_length``) and ``generate_until`` (greedy or sampled decoding with the KV cache,
cut at the stop strings), with the harness's conventions: the context's trailing whitespace moves to the
continuation, the continuation's tokens are those of ``context + continuation`` after the context's, an empty
context is the end-of-text token. ``evaluate`` runs ``lm_eval.simple_evaluate`` on any model ``jaxalign`` loads (a
run folder, a Hugging Face folder or Hub id, a .gguf) and tasks by name or from YAML files (``include_path``).

    jaxalign eval --lm-eval hellaswag,arc_easy --model runs/dpo --limit 100
    jaxalign eval --lm-eval my_task --include-path tasks/ --model runs/dpo
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from jaxalign.data.tokenize import padding_id
from jaxalign.sampling import generate, left_pad, truncate_at_stop

BUCKET = 64  # sequences pad to a multiple of this, so a task compiles a handful of shapes


@jax.jit
def _continuation_scores(model, tokens: jax.Array, scored: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(summed log-prob of the ``scored`` tokens [B], whether each is the argmax of its logits [B]); ``tokens``
    right-padded ``[B, T]`` (causal attention: the padding after a row never reaches its real positions),
    ``scored`` marks the continuation positions."""
    logits = model(tokens).astype(jnp.float32)
    logps = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    targets = tokens[:, 1:]
    picked = jnp.take_along_axis(logps, targets[..., None], axis=-1)[..., 0]
    hits = jnp.argmax(logits[:, :-1], axis=-1) == targets
    keep = scored[:, 1:].astype(bool)
    return jnp.where(keep, picked, 0.0).sum(axis=1), jnp.all(hits | ~keep, axis=1)


class JaxalignLM(LM):
    """An ``lm_eval`` model over a jaxalign decoder and its transformers tokenizer."""

    def __init__(self, model, tokenizer, *, batch_size: int = 8, max_length: int | None = None,
                 max_gen_toks: int = 256, seed: int = 0):
        super().__init__()
        self.model, self.tokenizer = model, tokenizer
        self.batch_size = int(batch_size)
        self.max_length = int(max_length or min(model.config.max_position_embeddings, 4096))
        self.max_gen_toks, self.seed = max_gen_toks, seed
        eot = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
        if eot is None:
            raise ValueError("the tokenizer has neither an end-of-text nor a beginning-of-text token")
        self.eot_token_id = eot
        self.pad_id = padding_id(tokenizer)

    # -- the harness's hooks
    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "jaxalign").replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def tok_encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context tokens, continuation tokens) as the harness splits them."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tok_encode(context + continuation)
        context_ids = self.tok_encode(context)
        if not context_ids:
            return [self.eot_token_id], whole
        return context_ids, whole[len(context_ids):]

    # -- scoring
    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each continuation after its context; contexts are cut from the left to fit
        ``max_length``."""
        rows = []
        for context, continuation in pairs:
            if not continuation:
                rows.append(None)
                continue
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens exceeds max_length="
                                 f"{self.max_length}")
            sequence = (context + continuation)[-(self.max_length + 1):]
            rows.append((sequence, len(continuation)))
        out: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
        real = [i for i, row in enumerate(rows) if row is not None]
        for start in range(0, len(real), self.batch_size):
            chunk = real[start:start + self.batch_size]
            width = -(-max(len(rows[i][0]) for i in chunk) // BUCKET) * BUCKET
            tokens = np.full((self.batch_size, width), self.pad_id, np.int32)
            scored = np.zeros((self.batch_size, width), np.int32)
            for row, i in enumerate(chunk):
                sequence, n = rows[i]
                tokens[row, : len(sequence)] = sequence
                scored[row, len(sequence) - n: len(sequence)] = 1
            sums, greedy = jax.device_get(_continuation_scores(self.model, jnp.asarray(tokens), jnp.asarray(scored)))
            for row, i in enumerate(chunk):
                out[i] = (float(sums[row]), bool(greedy[row]))
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return self.score([self.encode_pair(*request.args) for request in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        results = []
        for request in requests:
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(request.args[0]), prefix_token=self.eot_token_id, max_seq_len=self.max_length,
                context_len=1)]
            results.append(sum(logp for logp, _ in self.score(windows)))
        return results

    def generate_until(self, requests) -> list[str]:
        out = []
        for start in range(0, len(requests), self.batch_size):
            chunk = list(requests[start:start + self.batch_size])
            kwargs: dict[str, Any] = dict(chunk[0].args[1])
            until = kwargs.get("until") or [self.tokenizer.decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            new_tokens = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
            prompts = [self.tok_encode(r.args[0])[-(self.max_length - new_tokens):] or [self.eot_token_id]
                       for r in chunk]
            prompts += [prompts[-1]] * (self.batch_size - len(prompts))
            width = -(-max(len(p) for p in prompts) // BUCKET) * BUCKET
            tokens, mask = left_pad(prompts, self.pad_id, width)
            generated = np.asarray(generate(self.model, tokens, prompt_mask=mask, max_new_tokens=new_tokens,
                                            temperature=temperature, eos_id=self.tokenizer.eos_token_id,
                                            pad_id=self.pad_id, seed=self.seed + start))
            for row in range(len(chunk)):
                text = self.tokenizer.decode(generated[row], skip_special_tokens=True)
                out.append(truncate_at_stop(text, until))
        return out


def evaluate(model, tokenizer, tasks: Sequence[str], *, include_path: str | None = None, limit: float | None = None,
             num_fewshot: int | None = None, batch_size: int = 8, max_length: int | None = None) -> dict:
    """``lm_eval.simple_evaluate`` of ``tasks`` (names, or tasks from the YAML files under ``include_path``);
    returns the harness's results dict (``results[task][metric]``)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    lm = JaxalignLM(model, tokenizer, batch_size=batch_size, max_length=max_length)
    return simple_evaluate(model=lm, tasks=list(tasks), task_manager=TaskManager(include_path=include_path),
                           limit=limit, num_fewshot=num_fewshot, log_samples=False)
