"""Models: the Llama-family Flax NNX decoder and its checkpoint formats (HF safetensors, GGUF)."""

from jaxalign.models.auto import bundled_smollm2, load_pretrained
from jaxalign.models.config import LlamaConfig, RopeScaling
from jaxalign.models.factory import abstract_model, build_model, create_model, param_shardings
from jaxalign.models.gguf import convert_gguf_to_hf, load_gguf
from jaxalign.models.hf import CheckpointError, config_from_hf, config_to_hf, load_hf, save_hf
from jaxalign.models.llama import KVCache, LlamaForCausalLM, ModelOutput, positions_from_mask
from jaxalign.models.tokenizer import load_tokenizer

__all__ = [
    "CheckpointError",
    "KVCache",
    "LlamaConfig",
    "LlamaForCausalLM",
    "ModelOutput",
    "RopeScaling",
    "abstract_model",
    "build_model",
    "bundled_smollm2",
    "config_from_hf",
    "config_to_hf",
    "convert_gguf_to_hf",
    "create_model",
    "load_gguf",
    "load_hf",
    "load_pretrained",
    "load_tokenizer",
    "param_shardings",
    "positions_from_mask",
    "save_hf",
]
