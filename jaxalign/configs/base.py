"""The full set of fields every training config has, with their defaults (big_vision style: values only).

Other config files start from ``base.get_config()`` and change what differs.
"""

import ml_collections


def use_toy(config, source: str = "toy:arithmetic"):
    """Train and evaluate on a toy generator with the built-in toy tokenizer (the bundled configs' default)."""
    config.tokenizer = "toy"
    config.data.train = source
    config.data.eval = source
    return config


def get_config(arg=None):
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.workdir = "runs/default"  # metrics, checkpoints, plots, exported model

    # The policy: a Hugging Face folder or .gguf file (`path`), or a randomly initialised `preset` of model.shape.
    config.model = ml_collections.ConfigDict(dict(
        path="", preset="tiny", dtype="float32", param_dtype="float32", attention_impl="xla", remat=False,
        remat_policy="nothing", scan_layers="auto"))
    config.model.shape = ml_collections.ConfigDict(dict(
        vocab_size=320, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2))
    config.tokenizer = ""  # "" = the model's own; "toy" = the built-in byte-level ChatML tokenizer

    # Training data: local files, or toy generators written to <workdir>/data ("toy:arithmetic", "toy:preferences",
    # "toy:mpo", "toy:multitask"). `eval` is held-out data of the same kind; with `eval` "", `eval_fraction` of each
    # training file is held out (0 = no evaluation; set to 0.05 when data.train is given on the command line).
    config.data = ml_collections.ConfigDict(dict(
        train="toy:arithmetic", eval="toy:arithmetic", eval_fraction=0.0, weights="", toy_size=4000, toy_eval_size=200,
        toy_style="short", max_length=64, max_prompt_length=0, truncation="keep_end", chat_template="",
        on_invalid="error", max_record_chars=1_000_000, template_timeout=2.0, packing=False, row_length=0,
        max_pairs_per_row=8, shared_prefix=False, bucket_step=0, shuffle=True))

    config.objective = ml_collections.ConfigDict(dict(name="sft"))
    config.objective.params = ml_collections.ConfigDict()

    # The frozen reference of DPO and MPO: "model" = the initial policy held once (with LoRA: the base with the
    # adapters off, sharing the policy's weights); "precomputed" = its log-probs computed before training and cached
    # on disk under a content hash.
    config.reference = ml_collections.ConfigDict(dict(kind="model", cache_dir=""))

    # LoRA: train low-rank adapters (update scaled by alpha / rank) on the listed projections; the base weights stay
    # frozen and out of the optimizer and the checkpoints. See docs/lora.md.
    config.lora = ml_collections.ConfigDict(dict(
        enabled=False, rank=8, alpha=16.0, dropout=0.0,
        target_modules="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"))

    config.optim = ml_collections.ConfigDict(dict(
        name="adamw", lr=3e-3, schedule="cosine", warmup_steps=50, min_lr_ratio=0.1, weight_decay=0.0, b1=0.9,
        b2=0.95, eps=1e-8, rmsprop_decay=0.9, clip_norm=1.0))

    config.train = ml_collections.ConfigDict(dict(
        steps=600, batch_size=32, grad_accum=1, log_every=25, eval_every=200, save_every=200, keep_checkpoints=2,
        checkpoint_layout="per_layer", nan_guard=True, nan_policy="skip", max_skip_streak=10, max_skip_fraction=0.1,
        resume=True))
    # Mesh axis sizes (-1 = fill the remaining devices) and the logical-axis -> mesh-axis rules table: entries
    # LOGICAL=MESH[+MESH] replace the defaults (jaxalign/parallel/mesh.py DEFAULT_RULES), an empty right-hand side
    # replicates, e.g. "embed=fsdp+tensor,mlp=" ; the run's config.json records the whole table.
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, expert=1, rules=""))
    # Several processes (TPU pod hosts, SLURM tasks, one process per GPU node): "auto" joins when the environment
    # says so (SLURM, Open MPI, a multi-host TPU slice, JAX_COORDINATOR_ADDRESS); set the coordinator by hand for
    # anything else. See launch/README.md.
    config.distributed = ml_collections.ConfigDict(dict(
        mode="auto", coordinator_address="", num_processes=0, process_id=-1, local_device_ids="",
        initialization_timeout=300))

    config.eval = ml_collections.ConfigDict(dict(batches=4, generate=200, max_new_tokens=8))
    config.logging = ml_collections.ConfigDict(dict(tensorboard=True, wandb=False, wandb_project="jaxalign",
                                                    plot=True, progress=True))
    return config
