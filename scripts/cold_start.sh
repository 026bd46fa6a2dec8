#!/usr/bin/env bash
# Cold and warm start, BF16 against NVFP4, on a bare device machine (".whl" carried), from the repo root:
#
#   bash scripts/cold_start.sh [OUT_DIR] [cold_start.py options]
#       e.g. bash scripts/cold_start.sh "$OUT" --configs llama3 --modes eager compiled
#
# Sets the machine up (scripts/device_setup.sh, the offline corpus: not timed), then runs scripts/cold_start.py:
# launch to the first "step:" line with empty Triton and inductor caches (cold), then again with the caches
# that run filled (warm); the table goes to OUT_DIR/cold_start.md (default $OUT, else ./outputs/cold_start).
# Budget (H100/H200, from issue 67's figures): the quick start pair (--configs llama3) takes about 2 min setup
# plus, per mode, BF16 ~40 + ~25 s and NVFP4 ~115 + ~35 s before the shipped choices (less after): eager and
# compiled together ~8 min, within one 10-minute device call; split --modes across calls for the MoE configs.
set -uo pipefail
out=${OUT:-./outputs/cold_start}
if [[ $# -gt 0 && $1 != -* ]]; then out=$1; shift; fi
mkdir -p "$out"
source scripts/device_setup.sh > "$out/device_setup.log" 2>&1 || { cat "$out/device_setup.log"; exit 1; }
grep -E "^versions:|^torch .*cuda|import check" "$out/device_setup.log"
python -m titan_nvfp4.data.prepare > "$out/prepare.log" 2>&1 || { tail -20 "$out/prepare.log"; exit 1; }
python scripts/cold_start.py "$out" "$@"
