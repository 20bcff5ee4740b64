#!/usr/bin/env bash
# One prepared GPU run (H200 class), in sections; results as JSON in ${OUT:-docs/benchmarks}. Copy the tables into
# docs/benchmarks.md with the date and the hardware.
#
#   bash benchmarks/gpu.sh                          # every section
#   bash benchmarks/gpu.sh decode,scan,shared-prefix
#
# train-step     the trainer's SFT / IFT / DPO step at a ~1B Llama shape, sequence 2048, bf16 compute, cuDNN
#                attention, then SFT with chunked log-probs (benchmarks/train_step.py)
# decode         the device's memory bandwidth and greedy decoding as a fraction of it, at the SmolLM2-135M and
#                Llama-3.2-1B shapes with random float32 weights, scanned / unrolled / bf16 weights, batch 1 and 8
#                (benchmarks/decode.py --random)
# scan           scanned vs unrolled layers: compile time, step time, memory, decode (benchmarks/scan_layers.py)
# shared-prefix  shared-prefix DPO against packing and padding on the prompt-heavy set, and the shared-prefix GRPO
#                step against repeated prompts (benchmarks/packed_preference.py, benchmarks/grpo_shared_prefix.py)
#
# Each section runs under its own time limit in seconds (LIMIT_<section>, "-" for "_", default 240) so that one slow
# section still leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-docs/benchmarks}"
mkdir -p "$out"
sections="${1:-train-step,decode,scan,shared-prefix}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
status=0
section() {  # name, command...
  local name="$1"; shift
  [[ ",$sections," == *",$name,"* ]] || return 0
  local variable="LIMIT_${name//-/_}"
  echo "=== $name ($(date -u +%H:%M:%S))"
  timeout "${!variable:-240}" "$@" || { echo "=== $name exited $?"; status=1; }
}
section train-step bash -c "python3 benchmarks/train_step.py --out '$out/train_step.jsonl' --objectives sft,ift,dpo &&
  python3 benchmarks/train_step.py --out '$out/train_step.jsonl' --objectives sft --chunk 1024"
section decode python3 benchmarks/decode.py --random smollm2-135m,llama-1b --gib 4 --out "$out"
section scan python3 benchmarks/scan_layers.py --out "$out"
section shared-prefix bash -c "python3 benchmarks/packed_preference.py --sets prompt-heavy --out '$out/packed_preference-gpu.json' &&
  python3 benchmarks/grpo_shared_prefix.py --out '$out/grpo_shared_prefix-gpu.json'"
exit $status
