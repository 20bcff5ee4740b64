"""DPO of Llama-3-8B-Instruct on one host with 8 H100 or H200 GPUs, FSDP over the 8 GPUs.

    jaxalign plan --config launch/configs/llama3_8b_dpo_gpu.py --devices 8 --hardware h100
    launch/gpu_single_host.sh --config launch/configs/llama3_8b_dpo_gpu.py

For several such hosts, use launch/slurm.sbatch (one process per host; set mesh.data to the number of hosts to keep
FSDP inside a host's NVLink domain).
"""

from jaxalign.configs import base, presets


def get_config(arg=None):
    config = presets.llama3_8b(base.get_config())
    config.workdir = "runs/llama3-8b-dpo"
    config.model.path = "/models/Meta-Llama-3-8B-Instruct"
    config.data.train = "data/pairs.jsonl"
    config.data.eval = ""
    config.objective.name = "dpo"
    config.objective.params.beta = 0.1
    config.objective.params.logps_chunk_size = 2048  # fused head: [tokens, 2048] logit tiles, never [tokens, vocab]
    config.train.batch_size = 64  # pairs per optimizer step
    config.train.grad_accum = 4  # 16 pairs per micro-batch: 2 per GPU
    config.train.steps = 2000
    config.train.save_every = 200
    config.train.eval_every = 0
    config.eval.generate = 0
    config.logging.progress = False
    return config
