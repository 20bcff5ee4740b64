"""Evaluation: the objective's loss and metrics on held-out batches, and exact-match accuracy of greedy answers
for records that carry an ``answer`` (the toy tasks). Prompts go through the run's ``Tokenizer.encode_prompt``,
so evaluation sees exactly the prompt tokens training saw (``data.chat_template`` included)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxalign.data.sater import extract_answer
from jaxalign.data.tokenize import as_tokenizer, padding_id
from jaxalign.parallel.distributed import to_host
from jaxalign.sampling import generate, left_pad
from jaxalign.train.inputs import device_batch
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


def greedy_answers(model, tokenizer, prompts: list, *, max_new_tokens: int = 8, batch_size: int = 64) -> list[str]:
    """The greedy completion text of each chat prompt (a list of messages), in fixed-shape batches of
    ``batch_size`` (one compilation). ``tokenizer``: the run's ``Tokenizer`` (or a transformers tokenizer)."""
    tok = as_tokenizer(tokenizer)
    encoded = [tok.encode_prompt(p) for p in prompts]
    width = max(len(p) for p in encoded)
    pad = padding_id(tok.hf)
    texts = []
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start:start + batch_size]
        chunk = chunk + [chunk[-1]] * (batch_size - len(chunk))  # fixed shape: one compilation
        tokens, mask = left_pad(chunk, pad, width)
        out = to_host(generate(model, tokens, prompt_mask=mask, max_new_tokens=max_new_tokens, eos_id=tok.eos_id,
                               pad_id=pad))  # every process generates the same rows
        texts += [tok.hf.decode(out[row], skip_special_tokens=True)
                  for row in range(min(batch_size, len(encoded) - start))]
    return texts


def exact_match(model, tokenizer, records: list[dict], *, max_new_tokens: int = 8, batch_size: int = 64) -> float:
    """Share of ``records`` whose greedy answer's last integer equals ``record["answer"]``. ``tokenizer``: the
    run's ``Tokenizer`` (or a transformers tokenizer)."""
    usable = [(prompt_of(r), str(r["answer"])) for r in records if "answer" in r and prompt_of(r) is not None]
    if not usable:
        return float("nan")
    texts = greedy_answers(model, tokenizer, [p for p, _ in usable], max_new_tokens=max_new_tokens,
                           batch_size=batch_size)
    return sum(extract_answer(text) == answer for text, (_, answer) in zip(texts, usable, strict=True)) / len(usable)


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


def reduce(metrics: dict) -> dict[str, float]:
    """``{name: Metric(total, count)}`` -> ``{name: total / count}`` as floats (one read from the devices)."""
    metrics = jax.device_get(metrics)
    return {name: float(m.total) / max(float(m.count), 1e-9) for name, m in metrics.items()}


def evaluate(engine, inputs, eval_fn) -> dict[str, float]:
    """Held-out loss and metrics over ``eval.batches`` batches, and exact-match accuracy of ``eval.generate``
    records, for ``engine``'s current state (``jaxalign.train.build.Engine``, ``jaxalign.train.inputs.Inputs``)."""
    spec, out = engine.spec.eval, {}
    if inputs.eval_pipeline is not None:
        pipeline, totals = inputs.eval_pipeline, {}
        pipeline.restore({**pipeline.state(), "epoch": 0, "step": 0})
        for _ in range(min(spec.batches, pipeline.steps_per_epoch)):
            metrics = eval_fn(engine.state.params, device_batch(engine.batch_sharding, next(pipeline)), engine.frozen,
                              engine.state.step)
            totals = metrics if not totals else jax.tree.map(jnp.add, totals, metrics)
        out.update(reduce(totals))
    answered = [r for r in inputs.eval_records if "answer" in r]  # exact match only where there is an answer
    if answered and spec.generate > 0 and not engine.model_config.num_labels:  # a reward model does not generate
        out["accuracy"] = exact_match(engine.policy(), engine.tokenizer, answered[: spec.generate],
                                      max_new_tokens=spec.max_new_tokens)
    return out
