#!/usr/bin/env bash
# End-to-end TorchTitan throughput on one GPU, BF16 vs NVFP4, in one command from the repo root of a bare
# device machine (".whl" carried):
#
#   [CONFIG=llama3] bash scripts/e2e_bench.sh [OUT_DIR] [TORCHTITAN_OVERRIDES...]     e.g.  ... --compile.enable
#
# Runs train_configs/<CONFIG>_bf16.toml then <CONFIG>_nvfp4.toml (torchrun --nproc_per_node=1) with the same
# local batch size, tees each log into OUT_DIR (default $OUT, else ./outputs/e2e_bench) with its TensorBoard events
# in LOG-stem.dump beside it (the report's peak active memory), and writes the table of
# titan_nvfp4.tools.e2e_report to OUT_DIR/e2e_bench.md (+ .json). CONFIG defaults to llama3_2b_bench
# (Llama3 "2B_bench", 386M parameters, seq 2048, 40 steps); CONFIG=llama3 is the README's debug model.
# Environment: BATCHES  local batch sizes tried in order until both arms run without running out of
#                       memory (2B_bench default "32 24 16"; other configs: "config", their own batch)
#              SKIP     warm-up steps left out of the report (default 5)
#              PYTORCH_ALLOC_CONF  allocator settings (default expandable_segments:True, as TorchTitan's
#                       run_train.sh)
#              ARM_TIMEOUT  seconds per training run before it is stopped (default 240; the report
#                       still uses the steps logged so far)
#              ARMS     the arms to run, in order (default "bf16 nvfp4"); an arm "nvfp4:PRESET" runs the NVFP4 job
#                       file with --quantize.linear.nvfp4.recipe PRESET (e.g. "bf16 nvfp4 nvfp4:quartet2"); the report
#                       covers BF16 (its baseline) and the other arms in this order; an arm "nvfp4=TAG" runs the
#                       NVFP4 job file with the overrides in the variable ARGS_TAG, e.g.
#                       ARMS="bf16 nvfp4 nvfp4=rq" ARGS_rq="--quantize.grouped_mm.nvfp4.requantize_expert_weights True"
set -uo pipefail
out=${OUT:-./outputs/e2e_bench}
if [[ $# -gt 0 && $1 != -* ]]; then out=$1; shift; fi
extra=("$@")
config=${CONFIG:-llama3_2b_bench}
if [[ $config == llama3_2b_bench ]]; then batches=${BATCHES:-32 24 16}; else batches=${BATCHES:-config}; fi
mkdir -p "$out"

source scripts/device_setup.sh > "$out/device_setup.log" 2>&1 || { cat "$out/device_setup.log"; exit 1; }
grep -E "^versions:|^torch .*cuda|import check" "$out/device_setup.log"
python -m titan_nvfp4.data.prepare > "$out/prepare.log" 2>&1 || { tail -20 "$out/prepare.log"; exit 1; }

# TorchTitan's own launcher (run_train.sh) runs with expandable segments; so do both arms here
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
echo "PYTORCH_ALLOC_CONF=$PYTORCH_ALLOC_CONF"

arm_file() { local a=${1%%:*}; echo "${a%%=*}"; }  # the job file's suffix: bf16 or nvfp4
arm_name() { local a=${1/:/-}; echo "${a/=/-}"; }   # in log names: nvfp4-quartet2, nvfp4-rq
# torch's CUDA allocator error only: inductor logs Triton's "OutOfMemoryError: out of resource" (shared memory) for
# flex-attention candidates it skips, in runs that go on fine.
oom() { grep -qE "torch\.OutOfMemoryError|CUDA out of memory" "$1"; }
for bs in $batches; do
  retry=0
  bs_arg=(--training.local_batch_size "$bs")
  if [[ $bs == config ]]; then bs_arg=(); fi
  for arm in ${ARMS:-bf16 nvfp4}; do
    log="$out/${config}_$(arm_name "$arm")_bs${bs}.log"
    preset=()
    if [[ $arm == *:* ]]; then preset=(--quantize.linear.nvfp4.recipe "${arm#*:}"); fi
    if [[ $arm == *=* ]]; then
      tag=${arm#*=}
      [[ $tag =~ ^[A-Za-z0-9_]+$ ]] || { echo "e2e_bench: arm $arm: the tag after = must be letters, digits or _"; exit 2; }
      var="ARGS_$tag"
      [[ -n ${!var:-} ]] || { echo "e2e_bench: arm $arm needs its overrides in the variable $var"; exit 2; }
      read -r -a preset <<< "${!var}"
    fi
    start=$(date +%s)
    timeout --kill-after=30 "${ARM_TIMEOUT:-240}" \
      torchrun --standalone --nproc_per_node=1 -m torchtitan.train \
        --job.config_file "train_configs/${config}_$(arm_file "$arm").toml" \
        --metrics.enable_tensorboard --job.dump_folder "${log%.log}.dump" \
        "${bs_arg[@]}" "${preset[@]}" "${extra[@]}" 2>&1 \
      | tee "$log" | grep --line-buffered -E "NVFP4: converted|size: .* parameters|step: +(1|2|5|10|20|30|40) |Error"
    rc=${PIPESTATUS[0]}
    echo "== $arm, local batch $bs: exit $rc in $(( $(date +%s) - start )) s, log $log"
    if oom "$log"; then echo "== $arm ran out of memory at local batch $bs"; retry=1; break; fi
    (( rc == 0 )) || tail -15 "$log"
  done
  (( retry )) || break
done

{
  echo "# End-to-end throughput, train_configs/${config}_*.toml, local batch $bs, $(date -u '+%F %H:%M UTC')"
  echo
  echo "GPU: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1);" \
       "$(python -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}")' 2>&1 | tail -1);" \
       "extra args: ${extra[*]:-none}; PYTORCH_ALLOC_CONF=$PYTORCH_ALLOC_CONF"
  echo
  logs=("$out/${config}_bf16_bs${bs}.log")  # the baseline, run here or by an earlier call into this folder
  for arm in ${ARMS:-bf16 nvfp4}; do [[ $arm == bf16 ]] || logs+=("$out/${config}_$(arm_name "$arm")_bs${bs}.log"); done
  python -m titan_nvfp4.tools.e2e_report "${logs[@]}" --skip "${SKIP:-5}" --json "$out/e2e_bench.json"
} | tee "$out/e2e_bench.md"
