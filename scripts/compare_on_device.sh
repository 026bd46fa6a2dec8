#!/usr/bin/env bash
# A comparison spec's arms on a lent GPU machine, resumable across device calls. From the repo root, with ".whl"
# (and ".kernel_cache" when an earlier session saved one) in the device tool's carry:
#   bash scripts/compare_on_device.sh SPEC [runner arguments]
#   e.g. bash scripts/compare_on_device.sh configs/compare/llama3_2b_pysources.toml --only bf16 nvfp4 --timeout-s 500
# Runs `python -m titan_nvfp4.compare SPEC ...` (the job files build their offline corpus on first use), then, when
# $OUT is set, copies the arms' logs (one tar), the table and the plot there and packs the kernel caches
# (scripts/save_kernel_cache.sh). With checkpoint_interval in the spec, the same command on the still-warm machine
# resumes each arm that --timeout-s (or a SIGTERM to this script) stopped; a new machine starts the arms afresh.
set -uo pipefail
spec=${1:?usage: bash scripts/compare_on_device.sh SPEC [runner arguments]}
shift
source scripts/device_setup.sh > "${OUT:-/tmp}/setup.txt" 2>&1 || { cat "${OUT:-/tmp}/setup.txt"; exit 1; }
# In the background, so that a SIGTERM to this script (an outer `timeout`) stops the runner, which stops its
# arms, and the logs below still get packed.
python -m titan_nvfp4.compare "$spec" "$@" &
runner=$!
trap 'kill -TERM "$runner" 2>/dev/null' TERM INT
wait "$runner"; rc=$?
if kill -0 "$runner" 2>/dev/null; then wait "$runner"; rc=124; fi  # a signal ended the first wait
trap - TERM INT
out=$(python -c "import sys; from pathlib import Path; from titan_nvfp4.compare import load_spec; print(load_spec(Path(sys.argv[1])).out)" "$spec")
prev=""
for a in "$@"; do [[ $prev == --out ]] && out=$a; prev=$a; done  # --out overrides the spec's folder
if [[ -n ${OUT:-} && -d $out ]]; then
  (cd "$out" && tar -cJf "$OUT/logs.tar.xz" ./*.log) && cp "$out"/compare.md "$out"/compare.png "$OUT"/ 2>/dev/null
  bash scripts/save_kernel_cache.sh
fi
exit $rc
