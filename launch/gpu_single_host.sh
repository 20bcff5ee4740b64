#!/usr/bin/env bash
# Train on every GPU of one host: one process sees all local GPUs and the config's mesh spans them
# (FSDP with mesh.fsdp=-1). Arguments are those of `jaxalign train`:
#
#   launch/gpu_single_host.sh --config launch/configs/llama3_8b_dpo_gpu.py [--config.X=Y ...]
#
# Environment: GPUS (e.g. "0,1,2,3": restrict to these GPUs), DRY_RUN=1 (print the command and environment).
set -euo pipefail

[[ -n ${GPUS:-} ]] && export CUDA_VISIBLE_DEVICES=$GPUS
# Overlap collectives with compute, and let XLA take most of the memory up front (the plan's numbers assume it).
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-1}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$HOME/.cache/jaxalign/jax-compilation-cache}

command=(python3 -m jaxalign.cli train "$@" --config.distributed.mode=off)
if [[ -n ${DRY_RUN:-} ]]; then
  echo "XLA_FLAGS=$XLA_FLAGS XLA_PYTHON_CLIENT_MEM_FRACTION=$XLA_PYTHON_CLIENT_MEM_FRACTION"
  printf '%q ' "${command[@]}"; echo
  exit 0
fi
# exec: SIGTERM from the scheduler or Ctrl-C reaches the trainer, which checkpoints and exits.
exec "${command[@]}"
