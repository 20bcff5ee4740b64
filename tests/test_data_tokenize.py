"""Tokenisation: trained tokens decode back to exactly the assistant texts, BOS once, clean boundaries."""

import numpy as np
import pytest
from chat_tokenizers import FAMILIES, SENTENCEPIECE_FAMILIES, make_sentencepiece, make_tokenizer

from jaxalign.data import RecordError, TokenizeConfig, Tokenizer, tokenize_record, validate_record

FAMILY_NAMES = list(FAMILIES)
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "The answer is 5."},
    {"role": "user", "content": "Tell me a joke about JAX."},
    {"role": "assistant", "content": "Sure! Compile once, run everywhere."},
]


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request):
    return request.param, make_tokenizer(request.param)


def trained_spans(tokens, mask):
    """Runs of consecutive trained tokens."""
    spans, current = [], []
    for token, trained in zip(tokens, mask, strict=True):
        if trained:
            current.append(int(token))
        elif current:
            spans.append(current)
            current = []
    return [*spans, current] if current else spans


def tokenize(hf, record, **config):
    tok = Tokenizer(hf, TokenizeConfig(**{"max_length": 256, **config}))
    return tokenize_record(tok, validate_record(record, source="mem", index=0), source="mem", index=0)


def bos_count(hf, tokens):
    return int(np.sum(np.asarray(tokens) == hf.bos_token_id)) if hf.bos_token_id is not None else 0


def test_multi_turn_messages_decode_back(family):
    name, hf = family
    assert not Tokenizer(hf).whole_text  # byte-level BPE: prompt and completion tokenised apart
    out = tokenize(hf, {"messages": CONVERSATION})
    spans = trained_spans(out["tokens"], out["loss_mask"])
    assert [hf.decode(span) for span in spans] == [m["content"] + hf.eos_token for m in CONVERSATION
                                                   if m["role"] == "assistant"]
    # the whole sequence is the rendered conversation (with the tokenizer's BOS when the template has none),
    # and BOS appears once where the family has one
    rendered = hf.apply_chat_template(CONVERSATION, tokenize=False)
    if FAMILIES[name]["adds_bos"] and not rendered.startswith(hf.bos_token):
        rendered = hf.bos_token + rendered
    assert hf.decode(out["tokens"]) == rendered
    assert bos_count(hf, out["tokens"]) == (1 if FAMILIES[name]["bos"] else 0)
    if FAMILIES[name]["bos"]:
        assert out["tokens"][0] == hf.bos_token_id


def test_preference_shares_the_prompt_and_masks_only_the_answer(family):
    name, hf = family
    record = {"prompt": CONVERSATION[:2], "chosen": [{"role": "assistant", "content": "The answer is 5."}],
              "rejected": [{"role": "assistant", "content": "Sure! It is 6."}]}
    out = tokenize(hf, record)
    prompt_len = int(np.argmax(out["chosen_loss_mask"]))
    assert prompt_len == int(np.argmax(out["rejected_loss_mask"]))
    np.testing.assert_array_equal(out["chosen_tokens"][:prompt_len], out["rejected_tokens"][:prompt_len])
    prompt_text = hf.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    if FAMILIES[name]["adds_bos"] and not prompt_text.startswith(hf.bos_token):
        prompt_text = hf.bos_token + prompt_text
    assert hf.decode(out["chosen_tokens"][:prompt_len]) == prompt_text
    for side, text in (("chosen", "The answer is 5."), ("rejected", "Sure! It is 6.")):
        spans = trained_spans(out[f"{side}_tokens"], out[f"{side}_loss_mask"])
        assert len(spans) == 1 and hf.decode(spans[0]) == text + hf.eos_token
        assert bos_count(hf, out[f"{side}_tokens"]) == (1 if FAMILIES[name]["bos"] else 0)


def test_standard_format_adds_bos_and_eos_once(family):
    name, hf = family
    out = tokenize(hf, {"prompt": "What is 2 + 3?", "completion": " The answer is 5."})
    spans = trained_spans(out["tokens"], out["loss_mask"])
    assert [hf.decode(s) for s in spans] == [" The answer is 5." + hf.eos_token]
    assert int(np.sum(out["tokens"] == hf.eos_token_id)) == 1
    assert bos_count(hf, out["tokens"]) == (1 if FAMILIES[name]["adds_bos"] else 0)
    # a completion that already ends with EOS does not get a second one
    again = tokenize(hf, {"prompt": "What is 2 + 3?", "completion": " The answer is 5." + hf.eos_token})
    np.testing.assert_array_equal(again["tokens"], out["tokens"])


def test_implicit_prompt_is_the_shared_token_prefix(family):
    _, hf = family
    out = tokenize(hf, {"chosen": "What is 2 + 3? The answer is 5.", "rejected": "What is 2 + 3? The answer is 6."})
    chosen_prompt = out["chosen_tokens"][out["chosen_loss_mask"] == 0]
    rejected_prompt = out["rejected_tokens"][out["rejected_loss_mask"] == 0]
    np.testing.assert_array_equal(chosen_prompt, rejected_prompt)
    assert hf.decode(out["chosen_tokens"][out["chosen_loss_mask"] == 1]).endswith("5." + hf.eos_token)
    conversational = tokenize(hf, {"chosen": CONVERSATION[:3],
                                   "rejected": [*CONVERSATION[:2], {"role": "assistant", "content": "Six."}]})
    spans = trained_spans(conversational["rejected_tokens"], conversational["rejected_loss_mask"])
    assert [hf.decode(s) for s in spans] == ["Six." + hf.eos_token]


def test_truncation_policies():
    hf = make_tokenizer("qwen2")
    record = {"prompt": "What is 2 + 3? " * 6, "completion": "The answer is 5. " * 6}
    full = tokenize(hf, record)
    n_prompt = int(np.argmax(full["loss_mask"]))
    keep_end = tokenize(hf, record, max_prompt_length=8, truncation="keep_end")
    keep_start = tokenize(hf, record, max_prompt_length=8, truncation="keep_start")
    np.testing.assert_array_equal(keep_end["tokens"][:8], full["tokens"][n_prompt - 8:n_prompt])
    np.testing.assert_array_equal(keep_start["tokens"][:8], full["tokens"][:8])
    short = tokenize(hf, record, max_length=n_prompt + 3)
    assert len(short["tokens"]) == n_prompt + 3 and short["loss_mask"].sum() == 3
    with pytest.raises(RecordError, match=r"mem, record 0, field 'completion': over-long: the prompt takes"):
        tokenize(hf, record, max_length=n_prompt)


@pytest.fixture(scope="module", params=list(SENTENCEPIECE_FAMILIES))
def sentencepiece(request):
    return request.param, make_sentencepiece(request.param)


def test_sentencepiece_conversations_are_the_whole_text_with_exact_masks(sentencepiece):
    """Llama 2, Mistral-Instruct and Gemma templates on SentencePiece-style tokenizers (▁ words, byte fallback;
    Llama 2 / Mistral add a prefix space): the tokens are the rendered conversation tokenised whole (decoding back
    to it exactly), one leading BOS, the trained tokens exactly each assistant turn, the prompt's tokens exactly
    what generation encodes."""
    name, hf = sentencepiece
    tok = Tokenizer(hf, TokenizeConfig(max_length=256))
    assert tok.whole_text == SENTENCEPIECE_FAMILIES[name]["prefix_space"]
    conversation = CONVERSATION[1:] if name != "llama2" else CONVERSATION  # Mistral and Gemma have no system turn
    out = tokenize(hf, {"messages": conversation})
    rendered = hf.apply_chat_template(conversation, tokenize=False)
    assert out["tokens"].tolist() == hf(rendered, add_special_tokens=False)["input_ids"]
    assert hf.decode(out["tokens"]) == rendered
    assert out["tokens"][0] == hf.bos_token_id and out["tokens"][1] != hf.bos_token_id
    spans = [hf.decode(span) for span in trained_spans(out["tokens"], out["loss_mask"])]
    end = {"gemma": "<end_of_turn>"}.get(name, hf.eos_token)
    answers = [m["content"] for m in conversation if m["role"] == "assistant"]
    assert [span.strip() for span in spans] == [f"{a}{' ' if name == 'llama2' else ''}{end}" for a in answers]
    single = tokenize(hf, {"prompt": conversation[:-1], "completion": conversation[-1:]})
    n_prompt = int(np.argmax(single["loss_mask"]))
    assert single["tokens"][:n_prompt].tolist() == tok.encode_prompt(conversation[:-1])
    pair = tokenize(hf, {"prompt": [CONVERSATION[1]], "chosen": [CONVERSATION[2]],
                         "rejected": [{"role": "assistant", "content": "Six."}]})
    chosen = int(np.argmax(pair["chosen_loss_mask"]))
    assert pair["chosen_tokens"][:chosen].tolist() == pair["rejected_tokens"][:chosen].tolist()
    assert hf.decode(trained_spans(pair["rejected_tokens"], pair["rejected_loss_mask"])[0]).strip().startswith("Six.")


def test_a_join_inside_a_token_is_an_error_naming_the_record():
    hf = make_sentencepiece("llama2")
    tok = Tokenizer(hf)
    assert tok.encode_pieces(["What is", " 2 + 3?"]) == [tok.encode("What is"), tok.encode("What is 2 + 3?")[2:]]
    with pytest.raises(ValueError, match="splits inside a token at character 3"):
        tok.encode_pieces(["Hel", "lo there"])
    with pytest.raises(RecordError, match=r"mem, record 0, .*splits inside a token"):
        tokenize(hf, {"prompt": "Tell me a jo", "completion": "ke about JAX."})


# A template using what Hub templates use: namespace, loop controls, tojson, raise_exception, strftime_now-free
# system defaults, {% generation %} (TRL's assistant-mask tag) and whitespace control.
FEATURE_TEMPLATE = (
    "{%- set ns = namespace(system='You are helpful.') -%}"
    "{%- if messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] %}{% endif -%}"
    "{{ bos_token }}<|system|>{{ ns.system }}\n"
    "{%- for message in messages %}{% if message['role'] == 'system' %}{% continue %}{% endif %}"
    "{% if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>{% generation %}{{ message['content'] | trim }}"
    "{{ eos_token }}{% endgeneration %}\n{% else %}<|user|>{{ message['content'] }} {{ {'n': loop.index} | tojson }}"
    "\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("template", [None, "chatml", "zephyr", FEATURE_TEMPLATE])
def test_bounded_rendering_equals_apply_chat_template(family, template):
    hf = make_tokenizer(family)
    tok = Tokenizer(hf, TokenizeConfig(chat_template=template))
    conversations = [
        [{"role": "user", "content": "What is 2 + 3?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": " Hello! "}, {"role": "user", "content": "Joke?"},
         {"role": "assistant", "content": "compile once, run everywhere"}],
    ]
    for messages in conversations:
        for generation_prompt in (True, False):
            expected = hf.apply_chat_template(messages, chat_template=tok.chat_template, tokenize=False,
                                              add_generation_prompt=generation_prompt)
            assert tok.render(messages, generation_prompt=generation_prompt) == expected
