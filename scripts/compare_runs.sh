#!/usr/bin/env bash
# The issue-7 recipe comparison on the lent GPU, its arms split over concurrent runner processes so
# that 1000 steps of every arm fit in one device call. From the repo root of a bare device machine
# (`.whl` and `.kernel_cache` carried):
#   OUT=<dir> bash scripts/compare_runs.sh SPEC "ARM ARM ..." ["ARM ..." ...]
# Each quoted group is one `python -m titan_nvfp4.compare SPEC --only ... --out $OUT/compare` process
# (its arms one after another); the groups run side by side on the GPU (the debug models are host-bound,
# so a few share one GPU at nearly full speed: their tokens/s are then those of a shared GPU). The logs
# land in $OUT/compare; gather them and run `--report-only --out <folder>` for the table and plot.
set -uo pipefail
out=${OUT:-./outputs/compare_runs}
spec=$1
shift
mkdir -p "$out/compare"
source scripts/device_setup.sh >/dev/null 2>&1 || exit 1
python -c "import titan_nvfp4.data.prepare" || exit 2  # builds the offline corpus once, before the arms race for it
pids=()
for group in "$@"; do
  # shellcheck disable=SC2086
  python -m titan_nvfp4.compare "$spec" --out "$out/compare" --only $group > "$out/compare/runner_${group%% *}.txt" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
grep -h "^\[" "$out"/compare/runner_*.txt
python -m titan_nvfp4.compare "$spec" --out "$out/compare" --report-only
exit $rc
