"""A trained reward model as a GRPO reward: ``rewards="reward_model:PATH"``.

``PATH`` is a jaxalign reward-model run folder, or a Hugging Face ``*ForSequenceClassification`` folder with one
label (what ``jaxalign export`` writes for a reward run, or a reward model from the Hub, downloaded). Each
completion is tokenised with the reward model's own tokenizer exactly as its training pairs were (the record's
prompt, a string or a message list, then the completion: the chat template for messages, EOS after a string), and
scored by ``LlamaForCausalLM.rewards`` in fixed-shape batches (one compile per length bucket).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxalign.data.batching import bucket_length, default_buckets
from jaxalign.data.schema import RecordError
from jaxalign.data.tokenize import TokenizeConfig, Tokenizer, padding_id, tokenize_record
from jaxalign.parallel import make_mesh

PREFIX = "reward_model:"


class RewardModelReward:
    """``reward(prompts, completions, *, raw_prompts=None, **fields) -> list[float]``: the reward model's score of
    each (prompt, completion). ``raw_prompts`` (the trainer passes them) are the records' prompts before any chat
    template; without them the rendered ``prompts`` are used as plain text."""

    def __init__(self, path: str, *, max_length: int = 2048, batch_size: int = 16):
        from jaxalign.train.build import load_any

        self.path = path
        model, hf_tokenizer = load_any(path)
        if not model.config.num_labels:
            raise ValueError(f"reward_model:{path}: a causal LM, not a reward model (train one with the reward "
                             "objective, or give a *ForSequenceClassification folder with one label)")
        self.model, self.batch_size = model, batch_size
        self.tok = Tokenizer(hf_tokenizer, TokenizeConfig(max_length=max_length))
        self.pad = padding_id(hf_tokenizer)
        self.buckets = default_buckets(max_length)
        self._score = jax.jit(lambda m, tokens, mask: m.rewards(tokens, mask))
        # its own one-device mesh: the reward model runs on this process's first device, inside or outside the
        # training step's mesh
        self.mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.local_devices()[:1])
        self.__name__ = f"{PREFIX}{path}"

    def encode(self, prompt: Any, completion: str) -> np.ndarray:
        if isinstance(prompt, list):
            record = {"kind": "sft", "prompt": prompt, "completion": [{"role": "assistant", "content": completion}]}
        else:
            record = {"kind": "sft", "prompt": prompt or "", "completion": completion}
        try:
            return tokenize_record(self.tok, record, source=self.__name__)["tokens"]
        except RecordError:  # an empty completion: score the prompt alone (as a sequence ending there)
            return np.asarray(self.tok.encode_prompt(prompt, chat=isinstance(prompt, list)), np.int32)

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], *,
                 raw_prompts: Sequence[Any] | None = None, **_fields) -> list[float]:
        sources = raw_prompts if raw_prompts is not None else prompts
        rows = [self.encode(p, c) for p, c in zip(sources, completions, strict=True)]
        scores: list[float] = []
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start:start + self.batch_size]
            length = bucket_length(max(len(r) for r in chunk), self.buckets)
            tokens = np.full((self.batch_size, length), self.pad, np.int32)
            mask = np.zeros((self.batch_size, length), np.int32)
            for i, row in enumerate(chunk):
                tokens[i, :len(row)], mask[i, :len(row)] = row, 1
            mask[len(chunk):, 0] = 1  # filler rows: one token, scores discarded
            with jax.set_mesh(self.mesh):
                out = np.asarray(self._score(self.model, jnp.asarray(tokens), jnp.asarray(mask)))
            scores += [float(v) for v in out[:len(chunk)]]
        return scores
