"""Evaluation: the objective's loss and metrics on held-out batches, and exact-match accuracy of greedy answers
for records that carry an ``answer`` (the toy tasks)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxalign.data.sater import extract_answer
from jaxalign.sampling import generate, left_pad
from jaxalign.train.step import ModelParts, full_parts


def prompt_of(record: dict):
    """The chat prompt of a raw toy/eval record (messages minus the final answer), or None."""
    if "messages" in record:
        return record["messages"][:-1]
    if "prompt" in record:
        return record["prompt"]
    if "target_conversations" in record:
        return [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
                for t in record["target_conversations"]]
    return None


def exact_match(model, tokenizer, records: list[dict], *, max_new_tokens: int = 8, batch_size: int = 64) -> float:
    """Share of ``records`` whose greedy answer's last integer equals ``record["answer"]``."""
    usable = [(prompt_of(r), str(r["answer"])) for r in records if "answer" in r and prompt_of(r) is not None]
    if not usable:
        return float("nan")
    prompts = [tokenizer.apply_chat_template(p if isinstance(p, list) else [{"role": "user", "content": p}],
                                             add_generation_prompt=True, tokenize=True)["input_ids"]
               for p, _ in usable]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    correct = 0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        chunk = chunk + [chunk[-1]] * (batch_size - len(chunk))  # fixed shape: one compilation
        tokens, mask = left_pad(chunk, pad, width)
        out = np.asarray(generate(model, tokens, prompt_mask=mask, max_new_tokens=max_new_tokens,
                                  eos_id=tokenizer.eos_token_id, pad_id=pad))
        for row in range(min(batch_size, len(prompts) - start)):
            answer = usable[start + row][1]
            text = tokenizer.decode(out[row], skip_special_tokens=True)
            correct += extract_answer(text) == answer
    return correct / len(usable)


def make_eval_step(parts, objective, hparams):
    """``eval_step(params, batch, frozen=None, step=0) -> metrics`` (jitted); ``parts`` as for
    ``make_train_step`` (a ``ModelParts`` or a graphdef). No dropout."""
    parts = parts if isinstance(parts, ModelParts) else full_parts(parts)

    @jax.jit
    def eval_step(params, batch, frozen=None, step=0):
        _, metrics = objective(parts.policy(params, frozen, None), batch, hparams, reference=parts.reference(frozen),
                               step=jnp.asarray(step, jnp.int32), rng=jax.random.key(0))
        return metrics

    return eval_step
