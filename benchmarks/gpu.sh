#!/usr/bin/env bash
# One prepared GPU run (H200 class): SFT / IFT / DPO train-step throughput and MFU at a ~1B Llama shape, sequence
# 2048, bf16 compute, cuDNN attention; then SFT again with the memory-light chunked log-probs. Results as JSON lines
# in ${OUT:-.}; copy the tables into docs/benchmarks.md with the date and the hardware.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
python3 benchmarks/train_step.py --out "$out/train_step.jsonl" --objectives sft,ift,dpo
python3 benchmarks/train_step.py --out "$out/train_step.jsonl" --objectives sft --chunk 1024
