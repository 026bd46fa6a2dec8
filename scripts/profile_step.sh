#!/usr/bin/env bash
# One profiled training step, BF16 and NVFP4, for the step-time breakdown of benchmarks/trace_breakdown.py.
# From the repo root of a device machine (".whl" carried):
#
#   [CONFIG=llama3] [BS=8] bash scripts/profile_step.sh OUT_DIR [TORCHTITAN_OVERRIDES...]
#   e.g.  bash scripts/profile_step.sh "$OUT" --compile.enable
#
# CONFIG names the twin job files train_configs/<CONFIG>_bf16.toml and _nvfp4.toml (default llama3_2b_bench,
# local batch BS, default 16 there; other configs keep their own batch unless BS is set). Each arm trains
# 12 steps with TorchTitan's profiler on step 10 (3 warm-up steps) and TORCH_LOGS=graph_breaks,recompiles,
# and leaves in OUT_DIR:
#   <arm>.log                  the training log (graph breaks and recompiles included)
#   <arm>_trace.json.gz        rank 0's chrome trace of step 10
#   memory_peak.md             with MEMORY=1: what is live at each arm's memory peak (below)
set -uo pipefail
out=$1
shift
extra=("$@")
config=${CONFIG:-llama3_2b_bench}
bs=${BS:-}
if [[ $config == llama3_2b_bench ]]; then bs=${bs:-16}; fi
if [[ -n $bs ]]; then extra=(--training.local_batch_size "$bs" "${extra[@]}"); fi
mkdir -p "$out"
source scripts/device_setup.sh > "$out/device_setup.log" 2>&1 || { cat "$out/device_setup.log"; exit 1; }
python -m titan_nvfp4.data.prepare > "$out/prepare.log" 2>&1 || { tail -20 "$out/prepare.log"; exit 1; }
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
# train ARM LOG DUMP [OVERRIDES...]: one arm's job file into the dump folder DUMP, its console into LOG
train() {
  local arm=$1 log=$2 dump=$3
  shift 3
  timeout --kill-after=30 "${ARM_TIMEOUT:-300}" \
    torchrun --standalone --nproc_per_node=1 -m torchtitan.train --job.config_file "train_configs/${config}_${arm}.toml" \
      "$@" --job.dump_folder "$dump" "${extra[@]}" > "$log" 2>&1
}
for arm in bf16 nvfp4; do
  dump="$out/dump_$arm"
  TORCH_LOGS=graph_breaks,recompiles train "$arm" "$out/$arm.log" "$dump" --training.steps 12 --metrics.log_freq 1 \
    --profiling.enable_profiling --profiling.profile_freq 10 --profiling.profiler_warmup 3 --profiling.profiler_active 1
  echo "$arm: exit $?"
  trace=$(find "$dump" -name "rank0_trace.json" | head -1)
  if [[ -n $trace ]]; then gzip -c "$trace" > "$out/${arm}_trace.json.gz"; fi
  rm -rf "$dump"
  grep -E "step: *1[0-2] " "$out/$arm.log" | tail -3
done

# MEMORY=1: then one more run per arm, 10 steps with allocation history (it slows every allocation, so not in the
# time profile), and what is live at step 10's memory peak, by the code that allocated it, in OUT_DIR/memory_peak.md
# (titan_nvfp4.tools.memory_peak; the snapshots themselves are too large to keep).
if [[ ${MEMORY:-0} == 1 ]]; then
  for arm in bf16 nvfp4; do
    dump="$out/mem_$arm"
    train "$arm" "$out/${arm}_memory.log" "$dump" --training.steps 10 --metrics.log_freq 1 \
      --profiling.enable_memory_snapshot --profiling.profile_freq 10
    echo "$arm with allocation history: exit $?"
    snap=$(find "$dump" -name "rank0_memory_snapshot.pickle" | sort | tail -1)
    if [[ -n $snap ]]; then mv "$snap" "$out/$arm.pickle"; fi
    rm -rf "$dump"
  done
  python -m titan_nvfp4.tools.memory_peak "$out/bf16.pickle" "$out/nvfp4.pickle" --out "$out/memory_peak.md" | head -40
  rm -f "$out/bf16.pickle" "$out/nvfp4.pickle"
fi
