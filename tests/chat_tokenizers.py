"""Offline tokenizers with the chat templates of Llama-3, Qwen2 (ChatML) and Zephyr, for masking tests.

Byte-level BPE trained in the test on a small corpus, plus each family's special tokens. The Llama-3 one also
adds BOS by itself (like the real one), so BOS-exactly-once is exercised.
"""

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = ["What is 2 + 3? The answer is 5.", "Hello there, how can I help you today?",
          "Tell me a joke about JAX and TPUs.", "Sure! Here it is: compile once, run everywhere."] * 30

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
ZEPHYR_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + eos_token }}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}")

FAMILIES = {
    "llama3": dict(specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                             "<|eot_id|>"], bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|end_of_text|>",
                   template=LLAMA3_TEMPLATE, adds_bos=True),
    "qwen2": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, eos="<|im_end|>",
                  pad="<|endoftext|>", template=QWEN2_TEMPLATE, adds_bos=False),
    "zephyr": dict(specials=["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"], bos="<s>",
                   eos="</s>", pad="</s>", template=ZEPHYR_TEMPLATE, adds_bos=True),
}


def make_tokenizer(family: str) -> PreTrainedTokenizerFast:
    spec = FAMILIES[family]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=spec["specials"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["specials"]])
    if spec["adds_bos"]:
        bos = spec["bos"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=spec["bos"], eos_token=spec["eos"],
                                   pad_token=spec["pad"], chat_template=spec["template"],
                                   clean_up_tokenization_spaces=False)


# SentencePiece-style tokenizers (▁ for spaces, byte fallback), as transformers converts Llama 2 / Mistral v0.1
# (a prefix space before the first word: Metaspace ``prepend_scheme="first"``) and Gemma (no prefix space).
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}")
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
SENTENCEPIECE_FAMILIES = {
    "llama2": dict(specials=["<unk>", "<s>", "</s>"], bos="<s>", eos="</s>", template=LLAMA2_TEMPLATE,
                   prefix_space=True),
    "mistral": dict(specials=["<unk>", "<s>", "</s>"], bos="<s>", eos="</s>", template=MISTRAL_TEMPLATE,
                    prefix_space=True),
    "gemma": dict(specials=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"], bos="<bos>",
                  eos="<eos>", template=GEMMA_TEMPLATE, prefix_space=False),
}


def make_sentencepiece(family: str) -> PreTrainedTokenizerFast:
    """A byte-fallback BPE over ▁-words (SentencePiece's layout) trained on ``CORPUS``; words never merge across a
    ▁ (SentencePiece's ``split_by_whitespace``), BOS added by the tokenizer."""
    spec = SENTENCEPIECE_FAMILIES[family]
    scheme = "first" if spec["prefix_space"] else "never"
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=True)
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=[*spec["specials"], *alphabet])
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["specials"]])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    strip = [decoders.Strip(" ", 1, 0)] if spec["prefix_space"] else []  # the prefix space comes off again
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           *strip])
    bos = spec["bos"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=spec["eos"],
                                   unk_token="<unk>", pad_token=spec["specials"][0], chat_template=spec["template"],
                                   clean_up_tokenization_spaces=False)
