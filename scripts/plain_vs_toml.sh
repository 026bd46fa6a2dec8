#!/usr/bin/env bash
# The plain-PyTorch loop (docs/plain_pytorch_loop.py, titan_nvfp4.convert) against the TOML path (torchrun -m
# torchtitan.train) on one GPU: the same Llama3 flavor, recipe, local batch, sequence and mode, NVFP4 both.
# From the repo root of a device machine (".whl" carried):
#
#   [CONFIG=llama3_2b_bench] [BATCH=16] [STEPS=60] [SKIP=10] [TOML_EXTRA="..."] bash scripts/plain_vs_toml.sh OUT_DIR [--compile]
#
# TOML_EXTRA: more torchtitan.train arguments (e.g. "--training.dataloader.num_workers 1": the data loader off the
# training process, as the loop's host-made batches are).
# --compile: TorchTitan's --compile.enable and the loop's per-block torch.compile, both with
# TORCHINDUCTOR_CUDAGRAPHS=1. OUT_DIR gets both logs and plain_vs_toml.md: TorchTitan's tokens/s logged every 10
# steps (its job files' cadence: no step waits for the GPU but the logged ones), the median of the intervals after
# SKIP; the loop's over all steps after SKIP (its losses read at the end, with a print every 10 steps).
set -uo pipefail
out=${1:?OUT_DIR}; shift
compile=0; [[ ${1:-} == --compile ]] && compile=1
config=${CONFIG:-llama3_2b_bench}; batch=${BATCH:-16}; steps=${STEPS:-60}; skip=${SKIP:-10}
mkdir -p "$out"
source scripts/device_setup.sh > "$out/device_setup.log" 2>&1 || { cat "$out/device_setup.log"; exit 1; }
python -m titan_nvfp4.data.prepare > "$out/prepare.log" 2>&1 || { tail -20 "$out/prepare.log"; exit 1; }
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
toml=train_configs/${config}_nvfp4.toml
flavor=$(python -c "import tomllib,sys; print(tomllib.load(open(sys.argv[1],'rb'))['model']['flavor'])" "$toml")
seq=$(python -c "import tomllib,sys; print(tomllib.load(open(sys.argv[1],'rb'))['training']['seq_len'])" "$toml")
tt=(); pl=()
if (( compile )); then export TORCHINDUCTOR_CUDAGRAPHS=1; tt=(--compile.enable); pl=(--compile); fi
start=$(date +%s)
timeout --kill-after=30 "${ARM_TIMEOUT:-240}" torchrun --standalone --nproc_per_node=1 -m torchtitan.train \
  --job.config_file "$toml" --training.local_batch_size "$batch" --training.steps "$steps" --metrics.log_freq 10 \
  "${tt[@]}" ${TOML_EXTRA:-} > "$out/toml.log" 2>&1
echo "== TOML path: exit $? in $(( $(date +%s) - start )) s"
start=$(date +%s)
timeout --kill-after=30 "${ARM_TIMEOUT:-240}" python docs/plain_pytorch_loop.py --flavor "$flavor" --seq "$seq" \
  --batch "$batch" --steps "$steps" --warmup "$skip" "${pl[@]}" > "$out/plain.log" 2>&1
echo "== plain loop: exit $? in $(( $(date +%s) - start )) s"
python -m titan_nvfp4.tools.e2e_report "$out/toml.log" --skip "$skip" > "$out/toml_report.md" 2>&1
toml_tps=$(grep -oE "step: +[0-9]+ .*tps: +[0-9,]+" "$out/toml.log" | awk -v s="$skip" '$2 > s + 10 - 1 {print $NF}' \
  | tr -d ',' | sort -n \
  | awk '{a[NR]=$1} END {if (NR) print (NR % 2 ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2)}')
plain_tps=$(grep -oE "tokens/s [0-9.]+" "$out/plain.log" | awk '{print $2}')
{
  echo "# Plain-PyTorch loop vs TOML path: $config ($flavor), batch $batch, seq $seq, $steps steps, compile=$compile, $(date -u '+%F %H:%M UTC')"
  [[ -n ${TOML_EXTRA:-} ]] && echo && echo "TorchTitan arguments added: \`${TOML_EXTRA}\`"
  echo
  echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  echo
  echo "| path | tokens/s (after step $skip) |"
  echo "| --- | ---: |"
  echo "| TOML (torchtitan.train) | ${toml_tps:-n/a} |"
  echo "| plain loop (titan_nvfp4.convert) | ${plain_tps:-n/a} |"
  python -c "import sys; t, p = map(float, sys.argv[1:]); print(f'\nplain / TOML = {p / t:.4f}')" "${toml_tps:-nan}" "${plain_tps:-nan}"
  echo; echo '```'; cat "$out/toml_report.md"; echo '```'
  echo; echo "TOML losses (last 3):"; grep -oE "step: +[0-9]+ +loss: +[0-9.]+" "$out/toml.log" | tail -3
  echo; echo "plain loop:"; tail -4 "$out/plain.log"
} > "$out/plain_vs_toml.md"
cat "$out/plain_vs_toml.md"
