"""DPO of Llama-3-8B-Instruct on a TPU v5p pod slice (e.g. v5p-64: 32 chips, 8 hosts), FSDP over every chip.

    jaxalign plan --config launch/configs/llama3_8b_dpo_v5p.py --devices 32 --hardware v5p
    launch/tpu_pod.sh my-v5p-64 us-east5-a -- --config launch/configs/llama3_8b_dpo_v5p.py

Every host must see the same `model.path`, `data.train` and `workdir` (a gcsfuse mount of a bucket, Filestore or
NFS); checkpoints are written by all hosts together into `workdir/checkpoints`.
"""

from jaxalign.configs import base, presets


def get_config(arg=None):
    config = presets.llama3_8b(base.get_config())
    config.workdir = "/mnt/shared/runs/llama3-8b-dpo"
    config.model.path = "/mnt/shared/models/Meta-Llama-3-8B-Instruct"
    config.model.attention_impl = "dot_product"  # cuDNN is GPU-only
    config.data.train = "/mnt/shared/data/pairs.jsonl"
    config.data.eval = ""
    config.objective.name = "dpo"
    config.objective.params.beta = 0.1
    config.objective.params.logps_chunk_size = 2048  # fused head: [tokens, 2048] logit tiles, never [tokens, vocab]
    config.train.batch_size = 128  # pairs per step across the slice
    config.train.steps = 2000
    config.train.save_every = 200
    config.train.eval_every = 0
    config.eval.generate = 0
    config.logging.progress = False
    config.distributed.mode = "on"  # JAX finds the slice's hosts from the TPU VM metadata server
    return config
