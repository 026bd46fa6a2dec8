#!/usr/bin/env bash
# Train several single-GPU arms side by side: ARMS_PER_GPU (default 1) at a time on each visible GPU.
# The debug models are host-bound and small, so 2-3 arms share one GPU at nearly full speed each, and
# a 2- or 4-GPU machine multiplies that again. From the repo root, after device_setup.sh:
#   bash scripts/run_arms.sh OUT_DIR STEPS ARM [ARM...]        (ARM = train_configs/<ARM>.toml)
# Each arm logs to OUT_DIR/<ARM>.log; an arm whose log already reached STEPS is skipped.
# Environment:
#   ARM_ARGS       extra TorchTitan overrides for every arm
#   ARM_TIMEOUT    seconds after which an arm is stopped (to stay inside a device call's limit)
#   CKPT_INTERVAL  checkpoint every N steps under OUT_DIR/ckpt/<ARM>; a re-run resumes from the
#                  latest one (TorchTitan restores model, optimizer, LR schedule and data position)
#                  and appends to the log, whose later lines for a step win in tools/loss_log.
set -uo pipefail
out=$1 steps=$2
shift 2
mkdir -p "$out"
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
(( ngpu > 0 )) || ngpu=1
slots=$(( ngpu * ${ARMS_PER_GPU:-1} ))
declare -a pids=() slot_of=()
run_arm() {  # arm slot
  local arm=$1 slot=$2 start gpu=$(( $2 % ngpu )) extra=()
  start=$(date +%s)
  if [[ -n ${CKPT_INTERVAL:-} ]]; then
    extra=(--checkpoint.enable --checkpoint.interval "$CKPT_INTERVAL"
           --checkpoint.folder "$(realpath "$out")/ckpt/$arm" --checkpoint.keep_latest_k 2)
  fi
  CUDA_VISIBLE_DEVICES=$gpu ${ARM_TIMEOUT:+timeout "$ARM_TIMEOUT"} \
    torchrun --nproc_per_node=1 --master_port=$((29500 + slot)) -m torchtitan.train \
      --job.config_file "train_configs/${arm}.toml" --training.steps "$steps" "${extra[@]}" ${ARM_ARGS:-} \
      >> "$out/${arm}.log" 2>&1
  local rc=$?
  echo "$arm (GPU $gpu): exit $rc in $(( $(date +%s) - start )) s, last: $(grep -oE "step: *[0-9]+ " "$out/${arm}.log" | tail -1)"
  grep -E "NVFP4: converted|Traceback|Error" "$out/${arm}.log" | grep -v lspci | head -3
}
next_slot=0
for arm in "$@"; do
  if grep -qE "step: *${steps} " "$out/${arm}.log" 2>/dev/null; then
    echo "$arm: already done"; continue
  fi
  [[ -z ${CKPT_INTERVAL:-} ]] && : > "$out/${arm}.log"   # no resume: start the log afresh
  if (( ${#pids[@]} >= slots )); then  # every slot busy: wait for the oldest arm
    wait "${pids[0]}"
    next_slot=${slot_of[0]}
    pids=("${pids[@]:1}") slot_of=("${slot_of[@]:1}")
  fi
  run_arm "$arm" "$next_slot" &
  pids+=($!) slot_of+=("$next_slot")
  next_slot=$(( (next_slot + 1) % slots ))
done
wait
