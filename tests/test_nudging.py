"""Nudging on tiny models with different tokenizers: γ = 0 is the base alone, γ > 1 is the nudger every round."""

import numpy as np
import pytest
from test_gguf import TEMPLATE, train_bpe
from transformers import PreTrainedTokenizerFast

from jaxalign.data.toy import toy_tokenizer
from jaxalign.models import LlamaConfig, create_model
from jaxalign.sampling import TextModel, nudge, sample
from jaxalign.sampling.nudging import remove_repeated_suffix

PROMPT = "Question: What is 2 + 3?\nAnswer:"


@pytest.fixture(scope="module")
def models():
    base_tokenizer = toy_tokenizer()  # one token per byte
    bpe = train_bpe("gpt2")
    nudger_tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                               pad_token="<|endoftext|>", chat_template=TEMPLATE)
    shape = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    base = TextModel(create_model(LlamaConfig(vocab_size=320, **shape), seed=1), base_tokenizer)
    nudger = TextModel(create_model(LlamaConfig(vocab_size=bpe.get_vocab_size(), **shape), seed=2), nudger_tokenizer,
                       add_special_tokens=False)
    nudger_prompt = nudger_tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                                         add_generation_prompt=True, tokenize=False)
    return base, nudger, nudger_prompt


def test_gamma_zero_is_the_base_models_greedy_output(models):
    base, nudger, nudger_prompt = models
    result = nudge(base, nudger, PROMPT, nudger_prompt, gamma=0.0, max_tokens=24)
    alone = base.continue_text(PROMPT, 24)
    assert result.text == remove_repeated_suffix(alone.text)
    assert result.rounds == 0 and result.nudged_words == 0 and result.nudger_tokens == 0


def test_gamma_above_one_nudges_every_round(models):
    base, nudger, nudger_prompt = models
    result = nudge(base, nudger, PROMPT, nudger_prompt, gamma=1.5, max_tokens=24, max_rounds=6, lookahead=8)
    assert result.base_tokens == 0 and result.rounds >= 1 and result.nudger_tokens > 0
    assert result.nudged_words >= result.total_words and result.nudged_share >= 1.0


def test_intermediate_gamma_mixes_both(models):
    base, nudger, nudger_prompt = models
    probs = base.continue_text(PROMPT, 24).top1
    gamma = float(np.median(probs))  # the base is unsure about half the time
    result = nudge(base, nudger, PROMPT, nudger_prompt, gamma=gamma, max_tokens=24, max_rounds=5, lookahead=8)
    assert 1 <= result.rounds <= 5 and result.text  # the base is unsure within 24 tokens, so a nudge happened
    assert result.nudged_words > 0 and result.nudger_tokens > 0


def test_stop_below_stops_before_the_unsure_token(models):
    base, _, _ = models
    ids = np.array([base.tokenizer(PROMPT)["input_ids"]])
    free = sample(base.model, ids, max_new_tokens=12)
    threshold = float(np.asarray(free.top1_probs[0])[5]) + 1e-6  # the 6th token is the first one below this?
    first_below = int(np.argmax(np.asarray(free.top1_probs[0]) < threshold))
    stopped = sample(base.model, ids, max_new_tokens=12, stop_below=threshold)
    assert int(stopped.lengths[0]) == first_below
    np.testing.assert_array_equal(stopped.tokens[0, :first_below], free.tokens[0, :first_below])
    assert int(sample(base.model, ids, max_new_tokens=12, stop_below=1.01).lengths[0]) == 0


def test_remove_repeated_suffix():
    unit = "and the answer is five, I am quite sure. "
    assert remove_repeated_suffix("Start. " + unit * 4) == "Start. " + unit
    assert remove_repeated_suffix("short short short") == "short short short"  # below 30 characters
