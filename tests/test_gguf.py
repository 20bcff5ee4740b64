"""GGUF in: a GGUF written here from a known model loads back to the same logits and tokenizer."""

import dataclasses
import re

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxalign.models import CheckpointError, LlamaConfig, create_model, load_gguf, load_hf, save_hf
from jaxalign.models.gguf import unpermute_qk

CORPUS = ["The capital of France is Paris.", "In 2024 there were 365 + 1 = 366 days.",
          "Hello world, hello JAX!", "Alignment makes models helpful and honest."] * 20
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def train_bpe(pre: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "qwen2":  # as Qwen2's / Qwen3's tokenizer.json spells it
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
                                       r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    else:
        tokenizer.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                            byte_level]) if pre == "smollm" else byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's conversion: rotate-half rows -> interleaved pairs."""
    return weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def new_writer(path, arch: str, config):
    """A GGUF writer with the header fields every architecture has."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    return writer


def finish(writer) -> None:
    """Writes the header, the metadata and the tensors, and closes the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf(path, hf_folder, config, tokenizer: Tokenizer, pre: str):
    tensors = load_file(str(hf_folder / "model.safetensors"))
    arch = config.architecture
    writer = new_writer(path, arch, config)
    writer.add_rope_freq_base(config.rope_theta)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(pair) for pair in _merges(tokenizer)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for name, tensor in tensors.items():
        gguf_name = names.get(name)
        if gguf_name is None:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
            rest = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight"
                    }.get(rest, rest)
            rest = rest.replace("self_attn.o_proj", "attn_output").replace("self_attn.", "attn_").replace(
                "_proj", "").replace("mlp.", "ffn_")
            gguf_name = f"blk.{layer}.{rest}"
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            tensor = llama_cpp_permute(tensor, config.num_heads if ".attn_q." in gguf_name else config.num_kv_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(tensor, np.float32))
    finish(writer)


def _merges(tokenizer: Tokenizer) -> list[tuple[str, str]]:
    import json

    model = json.loads(tokenizer.to_str())["model"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]


@pytest.mark.parametrize(("arch", "pre"), [("llama", "smollm"), ("qwen2", "gpt2"), ("qwen3", "qwen2")])
def test_gguf_round_trip(arch, pre, tmp_path, tiny_config):
    reference_tokenizer = train_bpe(pre)
    config = tiny_config.replace(vocab_size=reference_tokenizer.get_vocab_size(), architecture=arch,
                                 qkv_bias=arch == "qwen2", tie_word_embeddings=arch == "llama",
                                 qk_norm=arch == "qwen3")
    model = create_model(config, seed=7)
    if arch == "qwen3":
        for layer in model.layers:
            layer.self_attn.k_norm.weight[...] = 1 + 0.3 * jnp.cos(jnp.arange(config.head_dim))
    if arch == "qwen2":
        for layer in model.layers:
            layer.self_attn.k_bias[...] = 0.3 * jnp.ones_like(layer.self_attn.k_bias[...])
    save_hf(model, tmp_path / "hf")
    write_gguf(tmp_path / "m.gguf", tmp_path / "hf", config, reference_tokenizer, pre)

    loaded, tokenizer = load_gguf(tmp_path / "m.gguf")
    assert loaded.config.tie_word_embeddings == (arch == "llama")
    assert loaded.config.qkv_bias == (arch == "qwen2")
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, (2, 9)))
    np.testing.assert_allclose(loaded(tokens), model(tokens), atol=1e-5)

    for text in [*CORPUS[:4], "unseen wörds 12345 ✓"]:
        assert tokenizer(text)["input_ids"] == reference_tokenizer.encode(text).ids
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token == "<|im_start|>"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n"
    assert tokenizer("<|im_end|>")["input_ids"] == [reference_tokenizer.token_to_id("<|im_end|>")]


def test_unpermute_inverts_llama_cpp_permutation():
    weight = np.arange(6 * 8 * 5, dtype=np.float32).reshape(48, 5)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(weight, 6), 6), weight)
    bias = np.arange(48, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(bias, 3), 3), bias)


def test_gguf_errors(tmp_path):
    with pytest.raises(CheckpointError, match="GGUF file not found"):
        load_gguf(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"definitely not gguf")
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        load_gguf(tmp_path / "junk.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    finish(writer)
    with pytest.raises(CheckpointError, match=r"general\.architecture='bert' is not supported"):
        load_gguf(tmp_path / "bert.gguf")


def test_converted_folder_loads_back(tmp_path, tiny_config):
    from jaxalign.models import convert_gguf_to_hf

    reference_tokenizer = train_bpe("gpt2")
    config = tiny_config.replace(vocab_size=reference_tokenizer.get_vocab_size())
    model = create_model(config, seed=8)
    save_hf(model, tmp_path / "hf")
    write_gguf(tmp_path / "m.gguf", tmp_path / "hf", config, reference_tokenizer, "gpt2")
    out = convert_gguf_to_hf(tmp_path / "m.gguf", tmp_path / "converted")
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()
    tokens = jnp.asarray(np.arange(12).reshape(2, 6))
    np.testing.assert_allclose(load_hf(out)(tokens), model(tokens), atol=1e-5)
    from jaxalign.models import load_tokenizer

    assert load_tokenizer(out)("Hello world")["input_ids"] == reference_tokenizer.encode("Hello world").ids


GEMMA_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def write_gemma_gguf(path, hf_folder, config, arch: str, reference):
    """A Gemma GGUF as llama.cpp's converter writes one: its tensor names, every norm weight stored as 1 + w, no
    output.weight (tied), no query_pre_attn_scalar or window pattern in the header, the SentencePiece vocabulary as
    tokens / scores / token types without merges."""
    tensors = load_file(str(hf_folder / "model.safetensors"))
    writer = new_writer(path, arch, config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_softcap)
        writer.add_final_logit_softcapping(config.final_softcap)
    else:
        writer.add_rope_freq_base(config.rope_theta)
        writer.add_rope_freq_base_swa(config.local_rope_theta)
    vocab = reference.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    specials = set(reference.all_special_tokens) | {"<start_of_turn>", "<end_of_turn>"}
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types([2 if t == "<unk>" else 3 if t in specials else 6 if re.fullmatch(r"<0x[0-9A-F]{2}>", t)
                            else 1 for t in tokens])
    writer.add_bos_token_id(vocab["<bos>"])
    writer.add_eos_token_id(vocab["<eos>"])
    writer.add_unk_token_id(vocab["<unk>"])
    writer.add_pad_token_id(vocab["<pad>"])
    writer.add_add_bos_token(True)
    writer.add_chat_template(reference.chat_template)
    for name, tensor in tensors.items():
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
            module = rest.removesuffix(".weight")
            rest = GEMMA_GGUF_NAMES.get(module, module) + ".weight"
            rest = rest.replace("self_attn.o_proj", "attn_output").replace("self_attn.", "attn_").replace(
                "_proj", "").replace("mlp.", "ffn_")
            gguf_name = f"blk.{layer}.{rest}"
        if name.endswith("norm.weight"):
            tensor = tensor + 1.0
        writer.add_tensor(gguf_name, np.ascontiguousarray(tensor, np.float32))
    finish(writer)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_loads_weights_config_and_sentencepiece_tokenizer(arch, tmp_path):
    from chat_tokenizers import CORPUS, make_sentencepiece
    from flax import nnx

    reference = make_sentencepiece("gemma")
    layers = 4 if arch == "gemma2" else 6
    every = 2 if arch == "gemma2" else 6
    config = LlamaConfig(
        vocab_size=len(reference.get_vocab()), hidden_size=64, intermediate_size=96, num_layers=layers, num_heads=4,
        num_kv_heads=2, head_dim=16, architecture="gemma2" if arch == "gemma2" else "gemma3_text",
        norm_offset=1.0, embed_scale=True, sandwich_norms=True, hidden_act="gelu_tanh", tie_word_embeddings=True,
        qk_norm=arch == "gemma3", sliding_window=4,
        sliding_window_layers=tuple(bool((i + 1) % every) for i in range(layers)),
        attn_softcap=50.0 if arch == "gemma2" else 0.0, final_softcap=30.0 if arch == "gemma2" else 0.0,
        rope_theta=10000.0 if arch == "gemma2" else 1e6, local_rope_theta=0.0 if arch == "gemma2" else 10000.0)
    model = create_model(config, seed=5)
    state = nnx.state(model)  # non-zero norm weights, so the stored 1 + w must be undone exactly
    for path, variable in nnx.to_flat_state(state):
        if len(path) > 1 and "norm" in str(path[-2]):
            shape = variable.get_value().shape
            variable.set_value(0.2 * np.cos(np.arange(np.prod(shape)) + len(path)).reshape(shape).astype(np.float32))
    nnx.update(model, state)
    save_hf(model, tmp_path / "hf")
    write_gemma_gguf(tmp_path / "m.gguf", tmp_path / "hf", config, arch, reference)

    loaded, tokenizer = load_gguf(tmp_path / "m.gguf")
    expected = config.replace(bos_token_id=2, eos_token_id=1, pad_token_id=0,  # GGUF keeps float32 numbers
                              max_position_embeddings=loaded.config.max_position_embeddings,
                              rms_norm_eps=float(np.float32(config.rms_norm_eps)))
    differ = {f.name: (getattr(loaded.config, f.name), getattr(expected, f.name))
              for f in dataclasses.fields(config) if getattr(loaded.config, f.name) != getattr(expected, f.name)}
    assert not differ
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, (2, 11)))  # longer than the window
    np.testing.assert_allclose(loaded(tokens), model(tokens), atol=1e-5)

    for text in [*CORPUS[:4], "unseen wörds 12345 ✓", "two  spaces and\nnewlines"]:
        assert tokenizer(text)["input_ids"] == reference(text)["input_ids"], text
        assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == reference.apply_chat_template(chat, tokenize=False)
    assert tokenizer("<end_of_turn>", add_special_tokens=False)["input_ids"] == [
        reference.convert_tokens_to_ids("<end_of_turn>")]
