#!/usr/bin/env bash
# The issue-4 training comparison on one GPU, from the repo root of a bare device machine:
#   bash scripts/moe_runs.sh [STEPS] [MODELS...]        (default: 300 deepseek_v3 gpt_oss)
# For each MoE debug model runs train_configs/<model>_bf16.toml and <model>_nvfp4.toml with the same
# seed and data, then writes logs and a comparison table (markdown + CSV) to ${OUT:-./outputs/moe_runs}.
set -uo pipefail
steps=${1:-300}
shift || true
models=("$@")
[[ ${#models[@]} -eq 0 ]] && models=(deepseek_v3 gpt_oss)
out=${OUT:-./outputs/moe_runs}
mkdir -p "$out"
source scripts/device_setup.sh >/dev/null 2>&1 || exit 1
python -m titan_nvfp4.data.prepare 2>&1 | tail -2   # the offline corpus + tokenizer, built once

for model in "${models[@]}"; do
  for arm in bf16 nvfp4; do
    start=$(date +%s)
    torchrun --nproc_per_node=1 -m torchtitan.train \
        --job.config_file "train_configs/${model}_${arm}.toml" --training.steps "$steps" \
        > "$out/${model}_${arm}.log" 2>&1
    echo "$model $arm: exit $? in $(( $(date +%s) - start )) s"
    grep -E "NVFP4: converted|Traceback|Error" "$out/${model}_${arm}.log" | head -5
  done
  python -m titan_nvfp4.tools.loss_log "$out/${model}_bf16.log" "$out/${model}_nvfp4.log" \
      --last 10 --markdown --csv "$out/${model}.csv" | tee "$out/${model}.md"
  python -m titan_nvfp4.tools.loss_plot "$out/${model}_bf16.log" "$out/${model}_nvfp4.log" --out "$out/${model}.png" \
      || echo "loss_plot needs matplotlib (pip install -e .[plot]); plot the logs elsewhere"
done
