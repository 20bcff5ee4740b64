"""llama.cpp GGUF files in: dequantised weights, the model config and the tokenizer with its chat template.

Weights are dequantised with the ``gguf`` package (any quantisation it knows) and renamed to Hugging Face
names, so the HF layout rules of ``hf.py`` place them. llama.cpp permutes the Q and K projections of
``llama``-architecture models for its interleaved RoPE; ``unpermute_qk`` undoes that so the standard
rotate-half RoPE applies. ``qwen2`` and ``qwen3`` GGUFs are stored unpermuted (NEOX RoPE); Qwen3's per-head
q/k norms are ``attn_q_norm`` / ``attn_k_norm``.

Gemma 2 / Gemma 3 (``gemma2``, ``gemma3``): llama.cpp stores every RMSNorm weight as ``1 + w`` (Gemma's norm
scales by ``1 + w``), so 1 is subtracted on load; ``ffn_norm`` is the pre-MLP norm and ``post_attention_norm`` /
``post_ffw_norm`` the sandwich norms; what the header leaves out follows llama.cpp's rules (``gemma_fields``).

Tokenizers: byte-level BPE (``tokenizer.ggml.model == "gpt2"``) with the ``gpt2``, ``smollm`` and ``qwen2``
pre-tokenizers, and Gemma's SentencePiece vocabulary (``"llama"`` in a ``gemma2`` / ``gemma3`` file); other
tokenizer kinds raise an error that names them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxalign.models.config import LlamaConfig, RopeScaling
from jaxalign.models.factory import build_model
from jaxalign.models.hf import CheckpointError, from_hf, hf_layout, hf_shape, new_score_head, save_hf
from jaxalign.models.llama import LlamaForCausalLM
from jaxalign.parallel.mesh import Rules

_GGUF_TO_HF = (
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", "model.layers.{0}.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_([qkv])\.(weight|bias)", "model.layers.{0}.self_attn.{1}_proj.{2}"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", "model.layers.{0}.self_attn.o_proj.{1}"),
    (r"blk\.(\d+)\.attn_([qk])_norm\.weight", "model.layers.{0}.self_attn.{1}_norm.weight"),
    (r"blk\.(\d+)\.ffn_(gate|up|down)\.(weight|bias)", "model.layers.{0}.mlp.{1}_proj.{2}"),
)
# Gemma's blocks have four norms: llama.cpp's ffn_norm is the norm before the MLP (pre_feedforward_layernorm) and
# post_attention_norm / post_ffw_norm the sandwich norms on the attention and MLP outputs
_GEMMA_NORMS = (
    (r"blk\.(\d+)\.ffn_norm\.weight", "model.layers.{0}.pre_feedforward_layernorm.weight"),
    (r"blk\.(\d+)\.post_attention_norm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", "model.layers.{0}.post_feedforward_layernorm.weight"),
)
_SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
_ARCHITECTURE = {"gemma3": "gemma3_text"}  # GGUF general.architecture -> ours, where the names differ
_GEMMA = ("gemma2", "gemma3")
_SUPPORTED_PRE = ("gpt2", "default", "smollm", "qwen2")


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of GGUF tensor ``name`` in a ``general.architecture=arch`` file (None: not a weight
    jaxalign reads)."""
    for pattern, template in (*_GEMMA_NORMS, *_GGUF_TO_HF) if arch in _GEMMA else _GGUF_TO_HF:
        match = re.fullmatch(pattern, name)
        if match:
            return template.format(*match.groups())
    return None


def unpermute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation (interleaved -> rotate-half RoPE); works for biases too."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    head_dim = rows // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _fields(reader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()}


def _open(path: str | os.PathLike):
    try:
        from gguf import GGUFReader
    except ImportError as err:  # pragma: no cover - gguf is a declared dependency
        raise ImportError("reading GGUF files needs the `gguf` package: pip install gguf") from err
    file = Path(path)
    if not file.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    _check_counts(file)
    try:
        reader = GGUFReader(str(file))
    except Exception as err:  # the reader's IndexError / struct / KeyError on a cut or corrupt header
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(err).__name__}: "
                              f"{str(err).splitlines()[0][:200] if str(err) else 'corrupt header'})") from None
    for tensor in reader.tensors:
        if tensor.tensor_type.name in _INTEGER_TYPES:
            raise CheckpointError(f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}; weights must be "
                                  "floating point or a quantised type")
    return reader


_INTEGER_TYPES = {"I8", "I16", "I32", "I64"}


def _check_counts(file: Path) -> None:
    """The header's tensor and metadata counts must fit the file (each tensor record takes >= 33 bytes, each
    key/value >= 14): a huge count in a small file is refused before the reader loops over it."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        head = handle.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        raise CheckpointError(f"{file}: not a readable GGUF file (no GGUF magic in its first bytes, {size} bytes "
                              "in all)")
    n_tensors, n_kv = int.from_bytes(head[8:16], "little"), int.from_bytes(head[16:24], "little")
    if n_tensors * 33 + n_kv * 14 > size:
        raise CheckpointError(f"{file}: the header claims {n_tensors} tensors and {n_kv} metadata fields, more than "
                              f"a {size}-byte file can hold (truncated or corrupt)")


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str], *, dtype: str = "float32",
                     source: str = "GGUF") -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch == "clip":
        raise CheckpointError(f"{source}: general.architecture='clip' is a vision tower (a multimodal model's "
                              "mmproj file); load the language model's GGUF")
    if arch not in _SUPPORTED_ARCHS:
        raise CheckpointError(f"{source}: general.architecture={arch!r} is not supported; "
                              f"supported: {', '.join(_SUPPORTED_ARCHS)}")
    if "rope_freqs.weight" in tensor_names:
        raise CheckpointError(f"{source}: rope_freqs (Llama-3.1 frequency scaling stored as a tensor) is not "
                              "supported from GGUF; load the Hugging Face folder instead")
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):
        raise CheckpointError(f"{source}: rope scaling {scaling_type!r} is not supported from GGUF")

    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{source}: metadata field {arch}.{key} is missing")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    layers = int(get("block_count"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    rope = (RopeScaling("linear", factor=float(get("rope.scaling.factor")))
            if scaling_type == "linear" else RopeScaling())
    gemma = gemma_fields(meta, arch, hidden, heads, layers) if arch in _GEMMA else {}
    return LlamaConfig(
        vocab_size=int(meta.get(f"{arch}.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 1e6 if arch == "gemma3" else 10000.0)),
        rope_scaling=rope,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm=arch in ("qwen3", "gemma3"),
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        **gemma,
        architecture=_ARCHITECTURE.get(arch, arch),
        dtype=dtype,
        param_dtype=dtype,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )


def gemma_fields(meta: dict[str, Any], arch: str, hidden: int, heads: int, layers: int) -> dict[str, Any]:
    """The Gemma 2 / Gemma 3 config fields from a GGUF header, with llama.cpp's rules for what the file leaves out
    (``llama-model.cpp``): ``query_pre_attn_scalar`` is not stored, so it is ``hidden / heads`` for the 27B models
    (46 layers for Gemma 2, 62 for Gemma 3) and ``head_dim`` otherwise; the sliding / global pattern is
    ``attention.sliding_window_pattern`` when present, else every 2nd (Gemma 2) or 6th (Gemma 3) layer global; Gemma
    3's local RoPE base is ``rope.freq_base_swa``, else 10000; absent soft-caps are off."""
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    every = meta.get(f"{arch}.attention.sliding_window_pattern")
    every = int(every) if isinstance(every, int | float) and every else (2 if arch == "gemma2" else 6)
    large = layers == (46 if arch == "gemma2" else 62)
    return dict(hidden_act="gelu_tanh", norm_offset=1.0, embed_scale=True, sandwich_norms=True,
                query_pre_attn_scalar=hidden // heads if large else 0,
                attn_softcap=float(meta.get(f"{arch}.attn_logit_softcapping") or 0.0),
                final_softcap=float(meta.get(f"{arch}.final_logit_softcapping") or 0.0),
                local_rope_theta=float(meta.get(f"{arch}.rope.freq_base_swa") or 10000.0) if arch == "gemma3" else 0.0,
                sliding_window=window,
                sliding_window_layers=tuple(bool((i + 1) % every) for i in range(layers)) if window else ())


def byte_level_pre_tokenizer(pre: str):
    """The ``tokenizers`` pre-tokenizer of a byte-level BPE for GGUF's ``tokenizer.ggml.pre`` name."""
    from tokenizers import Regex, pre_tokenizers

    if pre == "qwen2":  # the Qwen2 / Qwen3 tokenizers' split, as transformers' Qwen2 tokenizer defines it
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _token_list(meta: dict[str, Any], source: str) -> list[str]:
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise CheckpointError(f"{source}: the GGUF file has no tokenizer.ggml.tokens (no vocabulary to rebuild the "
                              "tokenizer from)")
    return list(tokens)


def _special(meta: dict[str, Any], tokens: list[str], key: str) -> str | None:
    """The token a ``tokenizer.ggml.{key}`` id names (``bos_token_id`` ...), or None when absent or out of range."""
    index = meta.get(f"tokenizer.ggml.{key}")
    return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None


def tokenizer_from_gguf(meta: dict[str, Any], *, source: str = "GGUF"):
    """A transformers fast tokenizer (special tokens, BOS policy, chat template) from GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if kind == "llama" and meta.get("general.architecture") in _GEMMA:
        return _gemma_tokenizer(meta, source)
    if kind != "gpt2":
        raise CheckpointError(f"{source}: tokenizer.ggml.model={kind!r} is not supported (only byte-level BPE, "
                              "'gpt2'); load the Hugging Face folder with its tokenizer.json instead")
    if pre not in _SUPPORTED_PRE:
        raise CheckpointError(f"{source}: tokenizer.ggml.pre={pre!r} is not supported "
                              f"(supported: {', '.join(_SUPPORTED_PRE)})")
    tokens = _token_list(meta, source)
    token_types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = []
    for i, merge in enumerate(meta.get("tokenizer.ggml.merges") or []):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"{source}: tokenizer.ggml.merges[{i}]={merge!r} is not a pair")
        merges.append((parts[0], parts[1]))
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    # token_type 3 = control (special), 4 = user-defined (added, not special)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind_ in zip(tokens, token_types, strict=True) if kind_ == 4])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind_ in zip(tokens, token_types, strict=True) if kind_ == 3])

    bos = _special(meta, tokens, "bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return _fast_tokenizer(tokenizer, meta, tokens, add_bos)


def _gemma_tokenizer(meta: dict[str, Any], source: str):
    """Gemma's SentencePiece vocabulary (``tokenizer.ggml.model == "llama"``: tokens, scores, token types; no merges)
    rebuilt by transformers' own GGUF converter (``convert_gguf_tokenizer``: a byte-fallback BPE whose merges follow
    the vocabulary's order, control tokens special), with the file's BOS policy and chat template."""
    from tokenizers import processors
    from transformers.integrations.gguf import convert_gguf_tokenizer

    tokens = _token_list(meta, source)
    fields = {"tokenizer_type": "llama", "tokens": tokens,
              "scores": list(meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]),
              "token_type": list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))}
    if len(fields["scores"]) != len(tokens) or len(fields["token_type"]) != len(tokens):
        raise CheckpointError(f"{source}: tokenizer.ggml.scores / token_type do not have one entry per token "
                              f"({len(tokens)} tokens)")
    backend, _ = convert_gguf_tokenizer(meta["general.architecture"], fields)

    bos = _special(meta, tokens, "bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True)) and bos is not None  # llama.cpp's default
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokens.index(bos))])
    return _fast_tokenizer(backend, meta, tokens, add_bos)


def _fast_tokenizer(backend, meta: dict[str, Any], tokens: list[str], add_bos: bool):
    """A transformers fast tokenizer over ``backend`` with the file's special tokens and chat template (pad: the
    padding token, else EOS)."""
    from transformers import PreTrainedTokenizerFast

    eos = _special(meta, tokens, "eos_token_id")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=_special(meta, tokens, "bos_token_id"), eos_token=eos,
        unk_token=_special(meta, tokens, "unknown_token_id"),
        pad_token=_special(meta, tokens, "padding_token_id") or eos, chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=add_bos, clean_up_tokenization_spaces=False)


def read_gguf_config(path: str | os.PathLike, *, dtype: str = "float32") -> LlamaConfig:
    """The model config from a GGUF file's header (the tensors are not read)."""
    reader = _open(path)
    return config_from_gguf(_fields(reader), {t.name for t in reader.tensors}, dtype=dtype, source=str(path))


def load_gguf(path: str | os.PathLike, *, dtype=jnp.float32, mesh: Mesh | None = None,
              rules: Rules | None = None, config_overrides: Mapping[str, Any] | None = None, seed: int = 0,
              ) -> tuple[LlamaForCausalLM, Any]:
    """(model, tokenizer) from a llama.cpp GGUF file; weights dequantised to ``dtype``.

    ``config_overrides`` replaces config fields (e.g. ``attention_impl``; ``num_labels=1``: a reward model with a
    new ``score`` head drawn from ``seed``)."""
    from gguf.quants import dequantize

    reader = _open(path)
    meta = _fields(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = config_from_gguf(meta, set(tensors), dtype=jnp.dtype(dtype).name, source=str(path))
    config = config.replace(**(config_overrides or {}))
    arch = meta.get("general.architecture")
    hf_to_gguf = {}
    for name in tensors:
        hf_name = gguf_to_hf_name(name, arch)
        if hf_name is not None:
            hf_to_gguf[hf_name] = name

    def load_tensor(our_path: tuple, shape: tuple[int, ...]) -> np.ndarray:
        hf_name, kind = hf_layout(our_path)
        if hf_name == "score.weight":
            return new_score_head(shape, seed)
        if hf_name not in hf_to_gguf:
            raise CheckpointError(f"{path}: the GGUF file has no tensor for {hf_name}")
        tensor = tensors[hf_to_gguf[hf_name]]
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        array = array.reshape(tuple(int(n) for n in reversed(tensor.shape)))
        expected = hf_shape(kind, shape)
        if array.shape != expected:
            raise CheckpointError(f"{path}: tensor {tensor.name} has shape {array.shape} but the config needs "
                                  f"{expected}")
        if config.architecture == "llama" and re.search(r"self_attn\.[qk]_proj", hf_name):
            heads = config.num_heads if ".q_proj" in hf_name else config.num_kv_heads
            array = unpermute_qk(array, heads)
        if arch in _GEMMA and hf_name.endswith("norm.weight"):  # llama.cpp stores Gemma's (1 + w) norms as 1 + w
            array = array - 1.0
        return from_hf(kind, array, shape)

    model = build_model(config, load_tensor, mesh=mesh, rules=rules)
    return model, tokenizer_from_gguf(meta, source=str(path))


def convert_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype=jnp.float32) -> Path:
    """Writes a Hugging Face folder (config, safetensors, tokenizer) for a GGUF file; returns its path."""
    model, tokenizer = load_gguf(gguf_path, dtype=dtype)
    save_hf(model, out_dir, tokenizer=tokenizer)
    return Path(out_dir)
