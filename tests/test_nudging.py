"""Nudging on tiny models with different tokenizers. In the paper's order (``order="base_first"``) γ = 0 is the base
alone and γ > 1 the nudger every round; the official order (the default) is checked in test_nudging_official.py."""

import jax
import numpy as np
import pytest
from test_gguf import TEMPLATE, train_bpe
from transformers import PreTrainedTokenizerFast

from jaxalign.data.toy import toy_tokenizer
from jaxalign.models import LlamaConfig, create_model
from jaxalign.sampling import TextModel, nudge, nudge_cached, sample
from jaxalign.sampling.nudging import remove_repeated_suffix, word_start_table

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
    result = nudge(base, nudger, PROMPT, nudger_prompt, gamma=0.0, max_tokens=24, order="base_first")
    alone = base.continue_text(PROMPT, 24)
    assert result.text == remove_repeated_suffix(alone.text)
    assert result.rounds == 0 and result.nudged_words == 0 and result.nudger_tokens == 0


def test_gamma_above_one_nudges_every_round(models):
    base, nudger, nudger_prompt = models
    result = nudge(base, nudger, PROMPT, nudger_prompt, gamma=1.5, max_tokens=24, max_rounds=6, lookahead=8,
                   order="base_first")
    assert result.base_tokens == 0 and result.rounds >= 1 and result.nudger_tokens > 0
    assert result.nudged_words >= result.total_words and result.nudged_share >= 1.0


def test_intermediate_gamma_mixes_both(models):
    base, nudger, nudger_prompt = models
    probs = base.continue_text(PROMPT, 24).top1
    gamma = float(np.median(probs))  # the base is unsure about half the time
    result = nudge(base, nudger, PROMPT, nudger_prompt, gamma=gamma, max_tokens=24, max_rounds=5, lookahead=8,
                   order="base_first")
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


# ---- same-tokenizer fast path: both models keep a KV cache and advance together ----

QUESTIONS = ["What is 2 + 3?", "What is 17 - 9? Think briefly."]


@pytest.fixture(scope="module")
def same_tokenizer_models():
    tokenizer = toy_tokenizer()
    shape = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    base = TextModel(create_model(LlamaConfig(vocab_size=320, **shape), seed=3), tokenizer)
    nudger = TextModel(create_model(LlamaConfig(vocab_size=320, **shape), seed=4), tokenizer)
    base_prompts = [f"Question: {q}\nAnswer:" for q in QUESTIONS]
    nudger_prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=False) for q in QUESTIONS]
    return base, nudger, base_prompts, nudger_prompts


def test_cached_gamma_zero_is_base_greedy_and_above_one_is_nudger_greedy(same_tokenizer_models):
    base, nudger, base_prompts, nudger_prompts = same_tokenizer_models
    alone = nudge_cached(base, nudger, base_prompts, nudger_prompts, gamma=0.0, max_new_tokens=20)
    every = nudge_cached(base, nudger, base_prompts, nudger_prompts, gamma=1.5, max_new_tokens=20)
    for row in range(len(QUESTIONS)):
        assert alone[row].text == base.continue_text(base_prompts[row], 20).text
        assert alone[row].nudger_tokens == 0 and alone[row].rounds == 0
        assert every[row].text == nudger.continue_text(nudger_prompts[row], 20).text
        assert every[row].base_tokens == 0 and every[row].nudged_share == 1.0


def test_cached_intermediate_gamma_follows_the_token_rule(same_tokenizer_models):
    """Replays the rule step by step with full forward passes (no cache) and compares."""
    base, nudger, base_prompts, nudger_prompts = same_tokenizer_models
    top1 = base.continue_text(base_prompts[0], 16).top1
    # the base writes the first token and is unsure later; the threshold sits between the probabilities seen,
    # never on one, so the cached and the uncached forward pass (equal to float rounding) take the same branch
    values = np.unique(np.asarray(top1, np.float64))
    gamma = min(float(np.median(top1)), top1[0])
    below = values[values < gamma]
    gamma = (gamma + below[-1]) / 2 if below.size else gamma - 1e-3
    fast = nudge_cached(base, nudger, base_prompts, nudger_prompts, gamma=gamma, max_new_tokens=16)
    starts = word_start_table(base.tokenizer, 320)
    for row in range(len(QUESTIONS)):
        b_ids = base.tokenizer(base_prompts[row])["input_ids"]
        n_ids = nudger.tokenizer(nudger_prompts[row])["input_ids"]
        written, nudging, by_nudger = [], False, 0

        def last_logits(model, ids):  # right-padded to one width: one compilation, causal so padding is inert
            return np.asarray(model(np.array([ids + [0] * (64 - len(ids))]))[0, len(ids) - 1])

        for _ in range(16):
            b_logits, n_logits = last_logits(base.model, b_ids + written), last_logits(nudger.model, n_ids + written)
            confident = float(jax.nn.softmax(b_logits).max()) >= gamma
            b_tok, n_tok = int(b_logits.argmax()), int(n_logits.argmax())
            nudging = not (starts[n_tok] and (confident or b_tok == n_tok)) if nudging else not confident
            written.append(n_tok if nudging else b_tok)
            by_nudger += nudging
            if written[-1] == base.tokenizer.eos_token_id:
                break
        assert fast[row].text == base.tokenizer.decode(written, skip_special_tokens=True)
        assert fast[row].nudger_tokens == by_nudger
    assert sum(r.rounds for r in fast) >= 1 and sum(r.base_tokens for r in fast) >= 1


def test_cached_needs_one_tokenizer(models, same_tokenizer_models):
    base, nudger, nudger_prompt = models
    with pytest.raises(ValueError, match="one tokenizer"):
        nudge_cached(base, nudger, [PROMPT], [nudger_prompt])
    base, nudger, base_prompts, _ = same_tokenizer_models
    with pytest.raises(ValueError, match="as many"):
        nudge_cached(base, nudger, base_prompts, base_prompts[:1])
