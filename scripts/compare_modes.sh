#!/usr/bin/env bash
# Every arm of a comparison spec in the runner's three modes side by side, one GPU per mode (3 GPUs; on
# fewer the modes share GPUs): checks that CUDA graphs leave each arm's losses exactly as compile without
# them, and times each arm in each mode. From the repo root of a device machine, after device_setup.sh:
#   bash scripts/compare_modes.sh [SPEC] [STEPS] [OUT_DIR]
# SPEC defaults to configs/compare/llama3_debug.toml, STEPS to 150 (the spec's steps replaced), OUT_DIR to
# outputs/compare_modes. Prints one table: per arm and mode, the wall seconds, the last logged loss, and
# whether compile+cudagraphs equals compile at every logged step.
set -uo pipefail
spec=${1:-configs/compare/llama3_debug.toml} steps=${2:-150} out=${3:-outputs/compare_modes}
mkdir -p "$out"
sed -E "s/^steps = [0-9]+/steps = $steps/" "$spec" > "$out/spec.toml"
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
(( ngpu > 0 )) || ngpu=1
i=0
for mode in compile+cudagraphs compile eager; do
  CUDA_VISIBLE_DEVICES=$(( i % ngpu )) python -m titan_nvfp4.compare "$out/spec.toml" --mode "$mode" \
    --out "$out/$mode" > "$out/$mode.txt" 2>&1 &
  i=$(( i + 1 ))
done
wait
python - "$out" <<'PY'
import re, sys
from pathlib import Path
from titan_nvfp4.tools.loss_log import parse_log
out = Path(sys.argv[1])
modes = ["compile+cudagraphs", "compile", "eager"]
wall = {m: dict(re.findall(r"\] (\S+): exit \d+ in (\d+) s", (out / f"{m}.txt").read_text())) for m in modes}
arms = list(wall["eager"]) or list(wall["compile"])
print("| arm | " + " | ".join(f"{m} s" for m in modes) + " | " + " | ".join(f"{m} loss" for m in modes)
      + " | graphs = compile at every logged step |")
print("| --- " * (2 * len(modes) + 2) + "|")
for arm in arms:
    logs = {m: parse_log((out / m / f"{arm}.log").read_text(errors="replace")) if (out / m / f"{arm}.log").is_file()
            else [] for m in modes}
    same = bool(logs["compile"]) and [(s.step, s.loss) for s in logs["compile+cudagraphs"]] == \
        [(s.step, s.loss) for s in logs["compile"]]
    print(f"| {arm} | " + " | ".join(wall[m].get(arm, "-") for m in modes) + " | "
          + " | ".join(f"{logs[m][-1].loss:.5f} (step {logs[m][-1].step})" if logs[m] else "-" for m in modes)
          + f" | {'yes' if same else 'NO'} |")
PY
