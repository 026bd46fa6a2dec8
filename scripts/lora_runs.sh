#!/usr/bin/env bash
# The issue-5 comparison on one GPU, from the repo root of a bare device machine (".whl" carried, and
# ".kernel_cache" when an earlier session saved one):
#   bash scripts/lora_runs.sh [STEPS] [ARMS...]
# Default: 2000 steps of gpt_oss_bf16, gpt_oss_nvfp4, gpt_oss_nvfp4_lora32 (rank 32 on dense Linears
# and experts) and the diagnostics gpt_oss_nvfp4_lora32_dense (rank 32 on dense Linears only),
# gpt_oss_nvfp4_attn (only the dense Linears in NVFP4), gpt_oss_bf16_lora32 (the rank-32 modules with no
# quantization) and gpt_oss_nvfp4_lora32_refresh (re-split every 100 steps), all with the same seed and
# data, side by side on each GPU (ARMS_PER_GPU, default 5: the debug model is small and host-bound). Runs live in
# ./outputs/lora_runs and checkpoint every CKPT_INTERVAL (250) steps, so a call stopped by ARM_TIMEOUT
# (500 s) is resumed by running the same command again on the still-warm machine. Once every arm has
# reached STEPS, writes the table (share of the BF16-NVFP4 gap each arm closes), CSV and plot, and
# copies logs, table and the compiled-kernel caches (scripts/save_kernel_cache.sh) to $OUT when set.
set -uo pipefail
steps=${1:-2000}
shift || true
arms=("$@")
[[ ${#arms[@]} -eq 0 ]] && arms=(gpt_oss_bf16 gpt_oss_nvfp4 gpt_oss_nvfp4_lora32 gpt_oss_nvfp4_lora32_dense gpt_oss_nvfp4_attn
                                  gpt_oss_bf16_lora32 gpt_oss_nvfp4_lora32_refresh)
run=./outputs/lora_runs
mkdir -p "$run"
source scripts/device_setup.sh >/dev/null 2>&1 || exit 1
python -m titan_nvfp4.data.prepare 2>&1 | tail -1

ARMS_PER_GPU=${ARMS_PER_GPU:-5} ARM_TIMEOUT=${ARM_TIMEOUT:-500} CKPT_INTERVAL=${CKPT_INTERVAL:-250} \
  bash scripts/run_arms.sh "$run" "$steps" "${arms[@]}"
logs=() done=1
for arm in "${arms[@]}"; do
  logs+=("$run/${arm}.log")
  grep -qE "step: *${steps} " "$run/${arm}.log" 2>/dev/null || done=0
done
if (( done )); then
  python -m titan_nvfp4.tools.loss_log "${logs[@]}" --last 20 --markdown --gap --csv "$run/lora_runs.csv" \
      | tee "$run/lora_runs.md"
  python -m titan_nvfp4.tools.loss_plot "${logs[@]}" --out "$run/lora_runs.png" \
      || echo "loss_plot needs matplotlib (pip install -e .[plot]); plot the logs elsewhere"
else
  echo "not every arm reached step $steps: run the same command again to resume"
fi
if [[ -n ${OUT:-} ]]; then  # at most 8 files come back: the logs packed in one, the table, 2 kernel caches
  tar -cJf "$OUT/lora_logs.tar.xz" -C "$run" $(cd "$run" && ls "${arms[@]/%/.log}" 2>/dev/null)
  cp "$run"/lora_runs.md "$OUT/" 2>/dev/null
  bash scripts/save_kernel_cache.sh
fi
true
