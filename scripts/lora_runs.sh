#!/usr/bin/env bash
# The issue-5 comparison on one GPU, from the repo root of a bare device machine:
#   bash scripts/lora_runs.sh [STEPS] [ARMS...]   (default: 2000 gpt_oss_bf16 gpt_oss_nvfp4 gpt_oss_nvfp4_lora32)
# Runs each train_configs/<arm>.toml with the same seed and data (scripts/run_arms.sh: one arm per
# GPU at a time, arms whose log already reached STEPS skipped), then writes the table with the share of the BF16-NVFP4 gap each later arm closes
# to ${OUT:-./outputs/lora_runs}.
set -uo pipefail
steps=${1:-2000}
shift || true
arms=("$@")
[[ ${#arms[@]} -eq 0 ]] && arms=(gpt_oss_bf16 gpt_oss_nvfp4 gpt_oss_nvfp4_lora32)
out=${OUT:-./outputs/lora_runs}
mkdir -p "$out"
source scripts/device_setup.sh >/dev/null 2>&1 || exit 1
python -m titan_nvfp4.data.prepare 2>&1 | tail -2

bash scripts/run_arms.sh "$out" "$steps" "${arms[@]}"   # side by side on a multi-GPU machine
logs=()
for arm in "${arms[@]}"; do logs+=("$out/${arm}.log"); done
python -m titan_nvfp4.tools.loss_log "${logs[@]}" --last 20 --markdown --gap --csv "$out/lora_runs.csv" \
    | tee "$out/lora_runs.md"
python -m titan_nvfp4.tools.loss_plot "${logs[@]}" --out "$out/lora_runs.png" \
    || echo "loss_plot needs matplotlib (pip install -e .[plot]); plot the logs elsewhere"
