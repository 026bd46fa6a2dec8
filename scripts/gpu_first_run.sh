#!/usr/bin/env bash
# The issue-2 demonstration on one GPU, in one command from the repo root of a bare device machine:
#   bash scripts/gpu_first_run.sh [STEPS]
# Runs the GPU tests, then llama3_bf16.toml and llama3_nvfp4.toml with the same seed and data, and
# writes logs plus a comparison table (markdown + CSV) to ${OUT:-./outputs/first_run}.
set -uo pipefail
steps=${1:-300}
out=${OUT:-./outputs/first_run}
mkdir -p "$out"
source scripts/device_setup.sh || exit 1

python -m pytest -q tests/test_gpu.py tests/test_nvfp4_numerics.py 2>&1 | tee "$out/pytest_gpu.log" | tail -3
python -m titan_nvfp4.data.prepare 2>&1 | tail -5   # build the offline corpus + tokenizer once

for arm in bf16 nvfp4; do
  start=$(date +%s)
  torchrun --standalone --nproc_per_node=1 -m torchtitan.train \
      --job.config_file "train_configs/llama3_${arm}.toml" --training.steps "$steps" \
      > "$out/llama3_${arm}.log" 2>&1
  echo "arm $arm: exit $? in $(( $(date +%s) - start )) s"
  grep -E "NVFP4: converted|Error|error" "$out/llama3_${arm}.log" | head -5
done
python -m titan_nvfp4.tools.loss_log "$out/llama3_bf16.log" "$out/llama3_nvfp4.log" \
    --last 10 --markdown --csv "$out/first_run.csv" | tee "$out/first_run.md"
