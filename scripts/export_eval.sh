#!/usr/bin/env bash
# Issue 65's GPU figures in one device call: each exported model's validation loss (transformers) against its
# counterpart computed on the run's own checkpoint and model (TorchTitan). From the repo root of a device machine
# (".whl" carried):
#
#   [CONFIG=llama3_2b_pysources] [STEPS=600] [BATCH=16] [ARM_TIMEOUT=330] [VALIDATION="..."] bash scripts/export_eval.sh OUT_DIR
#
# Trains train_configs/${CONFIG}_nvfp4.toml for STEPS steps at local batch BATCH (compiled with CUDA graphs,
# validation at step 1 and at STEPS, a full checkpoint at STEPS), exports that checkpoint with
# titan_nvfp4.tools.export_hf as bf16, nvfp4 (w4a16) and nvfp4 w4a4 (input scales from 1 calibration batch), and
# evaluates each with titan_nvfp4.tools.eval_hf on the GPU in bf16 (the run's validation batches, read as its
# validator reads them). The same checkpoint is evaluated with titan_nvfp4.tools.eval_run, on TorchTitan's model
# under the run's bf16 autocast, eager, in the three forwards the exports compare with: bf16 (the weights without
# NVFP4), w4a16 (the forward's NVFP4 weights, activations unquantized) and nvfp4 (the run's forward). The table
# pairs bf16 export / run bf16, nvfp4_w4a16 export / run w4a16, nvfp4_w4a4 export / run nvfp4 and the run's own
# logged "validate step: STEPS" line, and run nvfp4 / that line (eager against the run's compiled validator).
# The default is the 386M runs' setup: the pysources corpus (built on first use, about 20 s
# on an H200 machine) and the job's own held-out validation (20 batches of 16 x 2048). VALIDATION: [validation]
# flags for all the steps instead, e.g. the pystdlib held-out split with CONFIG=llama3_2b_bench:
#   VALIDATION="--validation.enable --validation.dataset pystdlib_validation --validation.local_batch_size 16
#   --validation.seq_len 2048 --validation.steps 4"
# OUT_DIR gets the logs, the JSON of each evaluation (eval_<export>.json, run_<forward>.json) and export_eval.md;
# the run and the exported folders stay in WORK (/tmp/export_eval; large).
set -uo pipefail
out=${1:?OUT_DIR}
config=${CONFIG:-llama3_2b_pysources}; steps=${STEPS:-600}; batch=${BATCH:-16}
read -r -a validation <<< "${VALIDATION-}"
job=train_configs/${config}_nvfp4.toml
mkdir -p "$out"
work=${WORK:-/tmp/export_eval}; rm -rf "$work"; mkdir -p "$work"
source scripts/device_setup.sh > "$out/device_setup.log" 2>&1 || { cat "$out/device_setup.log"; exit 1; }
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True} TORCHINDUCTOR_CUDAGRAPHS=1
start=$(date +%s)
timeout --kill-after=30 "${ARM_TIMEOUT:-330}" torchrun --standalone --nproc_per_node=1 -m torchtitan.train \
  --job.config_file "$job" --job.dump_folder "$work/run" --training.steps "$steps" --training.local_batch_size "$batch" \
  "${validation[@]}" --validation.freq "$steps" \
  --checkpoint.enable --checkpoint.interval "$steps" --checkpoint.no_last_save_model_only \
  --metrics.log_freq 50 --compile.enable > "$out/train.log" 2>&1
echo "== training: exit $? in $(( $(date +%s) - start )) s"
run_loss=$(grep -oE "validate step: *$steps +loss: *[0-9.]+" "$out/train.log" | tail -1 | awk '{print $NF}')
[[ -n $run_loss ]] || { echo "no validation at step $steps in train.log"; tail -20 "$out/train.log"; exit 1; }
# the run's own step count: the job's model (export_hf, eval_run) places bf16_after_fraction's switch by it
run_flags=(--training.steps "$steps")
declare -A flags=([bf16]="--format bf16" [nvfp4_w4a16]="--format nvfp4" \
                  [nvfp4_w4a4]="--format nvfp4 --scheme w4a4 --calibration-batches 1")
for name in bf16 nvfp4_w4a16 nvfp4_w4a4; do
  start=$(date +%s)
  # shellcheck disable=SC2086
  python -m titan_nvfp4.tools.export_hf "$work/run/checkpoint" --job.config_file "$job" "${run_flags[@]}" "${validation[@]}" \
    ${flags[$name]} --out "$work/hf_$name" > "$out/export_$name.log" 2>&1
  echo "== export $name: exit $? in $(( $(date +%s) - start )) s"
  python -m titan_nvfp4.tools.eval_hf "$work/hf_$name" --job.config_file "$job" "${validation[@]}" --json "$out/eval_$name.json" \
    > "$out/eval_$name.log" 2>&1
  echo "== eval $name: exit $?"; tail -1 "$out/eval_$name.log"
done
for forward in bf16 w4a16 nvfp4; do
  start=$(date +%s)
  python -m titan_nvfp4.tools.eval_run "$work/run/checkpoint" --job.config_file "$job" "${run_flags[@]}" "${validation[@]}" \
    --forward "$forward" --json "$out/run_$forward.json" > "$out/run_$forward.log" 2>&1
  echo "== eval_run $forward: exit $? in $(( $(date +%s) - start )) s"; tail -1 "$out/run_$forward.log"
done
{
  echo "# Exported models' validation loss against the run's: $config, $steps steps of batch $batch, $(date -u '+%F %H:%M UTC')"
  echo
  echo "Validation flags: ${validation[*]:-none (the job file sets them)}"
  echo
  echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1); commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo
  echo "Exports: transformers in bf16 (eval_hf). Run: the checkpoint of step $steps on TorchTitan's model, eager, bf16"
  echo "autocast (eval_run --forward ...); the run's validator: its logged \"validate step: $steps\" line (compiled)."
  echo
  python - "$out" "$run_loss" "$steps" <<'PY'
import json, sys
out, logged, steps = sys.argv[1], float(sys.argv[2]), sys.argv[3]


def loss(name):
    try:
        return json.load(open(f"{out}/{name}.json"))["loss"]
    except (OSError, ValueError, KeyError):
        return None


validator = (f"the run's validator (step {steps})", logged)
rows = [("export bf16", "eval_bf16", ("run bf16", loss("run_bf16"))),
        ("export nvfp4_w4a16", "eval_nvfp4_w4a16", ("run w4a16", loss("run_w4a16"))),
        ("export nvfp4_w4a4", "eval_nvfp4_w4a4", ("run nvfp4", loss("run_nvfp4"))),
        ("export nvfp4_w4a4", "eval_nvfp4_w4a4", validator),
        ("run nvfp4", "run_nvfp4", validator)]
print("| model | validation loss | counterpart | difference |")
print("| --- | ---: | --- | ---: |")
for model, name, (other, reference) in rows:
    mine = loss(name)
    shown = "failed" if mine is None else f"{mine:.5f}"
    paired = f"{other}: " + ("failed" if reference is None else f"{reference:.5f}")
    diff = "" if mine is None or reference is None else f"{mine - reference:+.5f}"
    print(f"| {model} | {shown} | {paired} | {diff} |")
PY
} > "$out/export_eval.md"
cat "$out/export_eval.md"
# the device tool brings back a few files per call: the logs travel as one archive
(cd "$out" && tar -czf logs.tgz ./*.log && rm -f ./*.log)
