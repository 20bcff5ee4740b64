"""GGUF in: a GGUF written here from a known model loads back to the same logits and tokenizer."""

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxalign.models import CheckpointError, create_model, load_gguf, load_hf, save_hf
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


def write_gguf(path, hf_folder, config, tokenizer: Tokenizer, pre: str):
    tensors = load_file(str(hf_folder / "model.safetensors"))
    arch = config.architecture
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
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
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
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
