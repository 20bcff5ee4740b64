"""A byte-level toy tokenizer with a ChatML template, built in code (no files, no hub).

Every UTF-8 byte is one token (no merges), plus three special tokens; 259 ids in all. Small enough for a
tiny model, complete enough for any text.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from jaxalign.data.tokenize import CHATML_TEMPLATE

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def toy_tokenizer():
    """``PreTrainedTokenizerFast``: pad ``<|endoftext|>`` (0), ``<|im_start|>`` (1), eos ``<|im_end|>`` (2),
    then the 256 byte symbols; ChatML chat template; no BOS."""
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({symbol: len(SPECIAL_TOKENS) + i for i, symbol in enumerate(sorted(alphabet))})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   chat_template=CHATML_TEMPLATE, clean_up_tokenization_spaces=False)
