#!/usr/bin/env bash
# The issue-4 training comparison on one GPU, from the repo root of a bare device machine:
#   bash scripts/moe_runs.sh [STEPS] [MODELS...]        (default: 300 deepseek_v3 gpt_oss)
# For each MoE debug model runs train_configs/<model>_bf16.toml and <model>_nvfp4.toml with the same
# seed and data (scripts/run_arms.sh: one arm per GPU at a time), then writes logs and a comparison table (markdown + CSV) to ${OUT:-./outputs/moe_runs}.
set -uo pipefail
steps=${1:-300}
shift || true
models=("$@")
[[ ${#models[@]} -eq 0 ]] && models=(deepseek_v3 gpt_oss)
out=${OUT:-./outputs/moe_runs}
mkdir -p "$out"
source scripts/device_setup.sh >/dev/null 2>&1 || exit 1
python -m titan_nvfp4.data.prepare 2>&1 | tail -2   # the offline corpus + tokenizer, built once

arms=()
for model in "${models[@]}"; do arms+=("${model}_bf16" "${model}_nvfp4"); done
bash scripts/run_arms.sh "$out" "$steps" "${arms[@]}"   # side by side on a multi-GPU machine
for model in "${models[@]}"; do
  python -m titan_nvfp4.tools.loss_log "$out/${model}_bf16.log" "$out/${model}_nvfp4.log" \
      --last 10 --markdown --csv "$out/${model}.csv" | tee "$out/${model}.md"
  python -m titan_nvfp4.tools.loss_plot "$out/${model}_bf16.log" "$out/${model}_nvfp4.log" --out "$out/${model}.png" \
      || echo "loss_plot needs matplotlib (pip install -e .[plot]); plot the logs elsewhere"
done
