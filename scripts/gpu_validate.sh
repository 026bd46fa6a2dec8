#!/usr/bin/env bash
# One device call that checks and measures the kernels after a change, from the repo root of a bare
# device machine (`.whl` carried):
#   OUT=<dir> bash scripts/gpu_validate.sh [quick] [tests] [grouped] [quant] [host] [kernels] [e2e]
#            (default: quick grouped kernels)
#   quick    tests/test_gpu.py and the quantization kernels' bit-identity tests at full shapes (~2 min)
#   tests    every GPU test of the kernels, the linear, the grouped path and compile  (~8 min)
#   quant    benchmarks/quant_variants.py: the quantization kernel per feature and tile (~2 min)
#   host     benchmarks/host_overhead.py: host time per launcher and per NVFP4Linear step (~1 min)
#   grouped  benchmarks/bench_grouped.py --profile                                   (~4 min)
#   kernels  benchmarks/bench_kernels.py --quick                                     (~2 min)
#   e2e      Llama3 2B_bench BF16 vs NVFP4, 24 batches (scripts/e2e_bench.sh)          (~4 min)
# Writes logs and JSON under $OUT (default ./outputs/gpu_validate).
set -uo pipefail
out=${OUT:-./outputs/gpu_validate}
mkdir -p "$out"
stages=("$@")
[[ ${#stages[@]} -eq 0 ]] && stages=(quick grouped kernels)
source scripts/device_setup.sh >/dev/null 2>&1 || exit 1
for stage in "${stages[@]}"; do
  start=$(date +%s)
  case $stage in
    quick) python -m pytest -q -x tests/test_gpu.py tests/test_kernels.py \
               -k "test_gpu or encoder or staged or bit_identical or stochastic or poisons or zero" \
               > "$out/pytest_quick.log" 2>&1; tail -3 "$out/pytest_quick.log" ;;
    tests) python -m pytest -q tests/test_gpu.py tests/test_kernels.py tests/test_linear.py -x \
               > "$out/pytest_gpu.log" 2>&1; tail -3 "$out/pytest_gpu.log" ;;
    host) python benchmarks/host_overhead.py > "$out/host_overhead.txt" 2>&1; tail -20 "$out/host_overhead.txt" ;;
    quant) python benchmarks/quant_variants.py > "$out/quant_variants.txt" 2>&1; grep "^|\|copy" "$out/quant_variants.txt" | head -70 ;;
    grouped) python benchmarks/bench_grouped.py --profile --json "$out/grouped.json" > "$out/grouped.txt" 2>&1
             grep "^|" "$out/grouped.txt" ;;
    kernels) python benchmarks/bench_kernels.py --quick --json "$out/kernels.json" > "$out/kernels.txt" 2>&1
             grep "^|" "$out/kernels.txt" | head -30 ;;
    e2e) BATCHES=24 ARM_TIMEOUT=200 bash scripts/e2e_bench.sh "$out/e2e" > "$out/e2e.txt" 2>&1; tail -8 "$out/e2e.txt" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  echo "== $stage: $(( $(date +%s) - start )) s"
done
