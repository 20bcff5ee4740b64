"""One line of help for every config field, and ``describe``: the rows ``jaxalign config show`` prints.

The defaults live in ``jaxalign/configs/base.py``, the types and checks in ``jaxalign/train/spec.py``; this table
says what each field means (``tests/test_run_folder.py`` checks that every field of the base config has a line).
"""

from __future__ import annotations

import json

import ml_collections

HELP: dict[str, str] = {
    "seed": "random seed of the model initialisation, data order and dropout",
    "workdir": "run folder: config.json, metrics, checkpoints, plots, the exported model",
    "tokenizer": '"" = the model\'s own; "toy" = the built-in byte-level ChatML tokenizer; or a tokenizer folder',
    "model.path": "Hugging Face folder or .gguf file; empty = a random model of model.shape",
    "model.preset": "tiny (random, of model.shape) or a large shape for `jaxalign plan` (llama3_8b, qwen25_7b, "
                    "qwen3_8b, qwen3_30b_a3b)",
    "model.dtype": "compute dtype: float32 or bfloat16",
    "model.param_dtype": "parameter dtype of a random model (loaded weights keep model.dtype)",
    "model.attention_impl": "xla (einsum), dot_product (jax.nn.dot_product_attention), cudnn (GPU) or pallas "
                            "(blocked kernels, no [B, T, S] mask; interpret mode on the CPU)",
    "model.remat": "recompute each layer in the backward pass (less memory, more compute)",
    "model.remat_policy": "with remat: nothing (least memory), dots (keep matmul outputs), dots_no_batch",
    "model.scan_layers": "auto (scan the repeated layers of models with more than 4 layers), true or false",
    "model.shape.vocab_size": "random model: vocabulary rows",
    "model.shape.hidden_size": "random model: width",
    "model.shape.intermediate_size": "random model: MLP width",
    "model.shape.num_layers": "random model: decoder layers",
    "model.shape.num_heads": "random model: attention heads",
    "model.shape.num_kv_heads": "random model: key/value heads (grouped-query attention)",
    "data.train": "training files (comma-separated JSONL / JSON / Parquet / datasets folders) or toy:NAME",
    "data.eval": "held-out files of the same kind, or toy:NAME; empty = data.eval_fraction of data.train",
    "data.eval_fraction": "with data.eval empty: share of each training file held out for eval (>= one batch)",
    "data.weights": "mixture weights, one per data.train file (empty = by size)",
    "data.toy_size": "records generated for a toy:NAME training source",
    "data.toy_eval_size": "records generated for a toy:NAME eval source (held out of the training file)",
    "data.toy_style": "toy:arithmetic answers: short, verbose or mixed",
    "data.max_length": "tokens per sequence (prompt + completion)",
    "data.max_prompt_length": "tokens per prompt, cut by data.truncation (0 = no separate limit)",
    "data.truncation": "which end of a long prompt to keep: keep_end (TRL's default) or keep_start",
    "data.chat_template": "override the tokenizer's template: chatml, zephyr or a Jinja string",
    "data.on_invalid": "a bad record: error (list them and stop) or skip (count and go on)",
    "data.max_record_chars": "a record with more characters is invalid (checked before parsing and tokenising)",
    "data.template_timeout": "seconds one chat-template rendering may take before the record is invalid",
    "data.packing": "pack several examples (preference: whole pairs) into rows of data.row_length",
    "data.row_length": "with packing: tokens per packed row",
    "data.max_pairs_per_row": "with packing of preference data: pairs per row at most",
    "data.shared_prefix": "preference data: write each pair's prompt once (the completions attend to it; same "
                          "losses, fewer tokens): in the packed rows, or without packing one pair per row",
    "data.bucket_step": "without packing: pad each batch to a multiple of this many tokens (0 = the next power of "
                        "two); more shapes to compile, less padding",
    "data.shuffle": "shuffle the training order every epoch",
    "objective.name": "sft, ift, dpo, simpo, orpo, cpo, kto, reward, distill, mpo or grpo (docs/objectives.md)",
    "reference.kind": "DPO/MPO reference: model (held once; LoRA: the base) or precomputed (cached log-probs)",
    "reference.cache_dir": "where precomputed reference log-probs are cached (default: workdir/reference_cache)",
    "lora.enabled": "train LoRA adapters only; the base stays frozen (docs/lora.md)",
    "lora.rank": "adapter rank r",
    "lora.alpha": "adapter scale alpha (the update is scaled by alpha / rank)",
    "lora.dropout": "dropout on the adapter input",
    "lora.target_modules": "projections with an adapter (comma-separated)",
    "optim.name": "adamw, rmsprop or sgd",
    "optim.lr": "peak learning rate",
    "optim.schedule": "after warm-up: constant, linear or cosine decay",
    "optim.warmup_steps": "linear warm-up from 0",
    "optim.min_lr_ratio": "the decay ends at lr x min_lr_ratio",
    "optim.weight_decay": "decoupled weight decay",
    "optim.b1": "Adam beta1",
    "optim.b2": "Adam beta2",
    "optim.eps": "Adam / RMSprop epsilon",
    "optim.rmsprop_decay": "RMSprop decay",
    "optim.clip_norm": "global gradient-norm clipping (0 = off)",
    "train.steps": "optimizer steps",
    "train.batch_size": "examples per step over all devices and hosts",
    "train.grad_accum": "micro-batches per step (gradients summed; equals the full batch)",
    "train.log_every": "steps between console / metrics lines",
    "train.eval_every": "steps between evaluations (0 = at the start and the end only)",
    "train.save_every": "steps between checkpoints (0 = at the end only)",
    "train.keep_checkpoints": "checkpoints kept",
    "train.checkpoint_layout": "per_layer: a scanned model's checkpoints hold its layers one by one, as an unrolled "
                               "model's; as_run: its stacked arrays (one host copy less while saving)",
    "train.nan_guard": "skip an update whose loss or gradients are not finite",
    "train.nan_policy": "a skipped update: skip (count and go on) or halt (checkpoint and stop)",
    "train.max_skip_streak": "stop with an error after this many skipped updates in a row (0 = no limit)",
    "train.max_skip_fraction": "a run that skipped more than this share of its updates ends with an error (0 = off)",
    "train.resume": "continue from the newest checkpoint in workdir",
    "mesh.data": "data-parallel devices (-1 = the rest)",
    "mesh.fsdp": "fully sharded data-parallel devices (-1 = the rest)",
    "mesh.tensor": "tensor-parallel devices (-1 = the rest)",
    "mesh.expert": "expert-parallel devices of a mixture of experts (its experts split over them; -1 = the rest)",
    "mesh.rules": "logical -> mesh axis entries replacing the defaults, e.g. embed=fsdp+tensor,mlp=",
    "distributed.mode": "several processes: auto (join when SLURM / Open MPI / TPU say so), on or off",
    "distributed.coordinator_address": "HOST:PORT of process 0 (empty = from the environment)",
    "distributed.num_processes": "processes in the job (0 = from the environment)",
    "distributed.process_id": "this process's index (-1 = from the environment)",
    "distributed.local_device_ids": "devices this process uses (comma-separated; empty = all)",
    "distributed.initialization_timeout": "seconds to wait for the other processes",
    "eval.batches": "held-out batches for the eval loss and metrics",
    "eval.generate": "held-out records with an answer scored by greedy exact match (0 = none)",
    "eval.max_new_tokens": "tokens generated per exact-match answer",
    "logging.tensorboard": "write TensorBoard event files",
    "logging.wandb": "log to Weights & Biases (needs the wandb package)",
    "logging.wandb_project": "the W&B project",
    "logging.plot": "write curves.png at the end",
    "logging.progress": "a progress bar on a terminal",
}


def flatten(values: dict, prefix: str = "") -> list[tuple[str, object]]:
    """``(dotted field, value)`` of a nested config dict, ``objective.params`` entries one by one."""
    rows = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path != "objective.params":
            rows += flatten(value, f"{path}.")
        elif path == "objective.params":
            rows += [(f"{path}.{k}", v) for k, v in value.items()]
        else:
            rows.append((path, value))
    return rows


def describe(config: ml_collections.ConfigDict) -> list[tuple[str, str, str]]:
    """``(field, value as JSON, help)`` for every field of ``config``, the objective's hyper-parameters with their
    defaults filled in (``RunSpec``), sections the base lacks (``cpi``) included."""
    from jaxalign.train.spec import RunSpec, effective_config

    values = config.to_dict()
    spec = RunSpec.from_config(config, check=False)
    if spec.objective.params is not None:
        values = effective_config(config, spec)
    params_help = "objective hyper-parameter (docs/objectives.md)"
    return [(path, json.dumps(value), HELP.get(path, params_help if path.startswith("objective.params.") else ""))
            for path, value in flatten(values)]


def table(rows: list[tuple[str, str, str]]) -> str:
    width = max(len(path) for path, _, _ in rows)
    value_width = min(max(len(value) for _, value, _ in rows), 40)
    lines = []
    for path, value, text in rows:
        shown = value if len(value) <= 40 else value[:37] + "..."
        lines.append(f"{path:<{width}}  {shown:<{value_width}}  {text}".rstrip())
    return "\n".join(lines)


__all__ = ["HELP", "describe", "table"]
