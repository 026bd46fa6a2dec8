#!/usr/bin/env bash
# Train several single-GPU arms, one per visible GPU at a time (a 2- or 4-GPU machine runs them side
# by side: the same device time buys 2-4x the steps). From the repo root, after device_setup.sh:
#   bash scripts/run_arms.sh OUT_DIR STEPS ARM [ARM...]        (ARM = train_configs/<ARM>.toml)
# Each arm logs to OUT_DIR/<ARM>.log; an arm whose log already reached STEPS is skipped. Extra
# TorchTitan overrides for every arm can be given in $ARM_ARGS.
set -uo pipefail
out=$1 steps=$2
shift 2
mkdir -p "$out"
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
(( ngpu > 0 )) || ngpu=1
declare -a pids=() gpus=()
run_arm() {  # arm gpu
  local arm=$1 gpu=$2 start
  start=$(date +%s)
  CUDA_VISIBLE_DEVICES=$gpu torchrun --nproc_per_node=1 --master_port=$((29500 + gpu)) -m torchtitan.train \
      --job.config_file "train_configs/${arm}.toml" --training.steps "$steps" ${ARM_ARGS:-} > "$out/${arm}.log" 2>&1
  local rc=$?
  echo "$arm (GPU $gpu): exit $rc in $(( $(date +%s) - start )) s"
  grep -E "NVFP4: converted|Traceback|Error" "$out/${arm}.log" | grep -v lspci | head -3
}
next_gpu=0
for arm in "$@"; do
  if grep -qE "step: *${steps} " "$out/${arm}.log" 2>/dev/null; then
    echo "$arm: already done"; continue
  fi
  if (( ${#pids[@]} >= ngpu )); then  # all GPUs busy: wait for the oldest arm
    wait "${pids[0]}"
    next_gpu=${gpus[0]}
    pids=("${pids[@]:1}") gpus=("${gpus[@]:1}")
  fi
  run_arm "$arm" "$next_gpu" &
  pids+=($!) gpus+=("$next_gpu")
  next_gpu=$(( (next_gpu + 1) % ngpu ))
done
wait
