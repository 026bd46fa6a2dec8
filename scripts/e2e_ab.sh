#!/usr/bin/env bash
# End-to-end A/B of git revisions in one device call: scripts/e2e_bench.sh on this tree (BF16 and NVFP4), then
# its NVFP4 arm on a copy of each other revision, all with one pair of kernel caches, each reported against this
# call's BF16 run. From the repo root:
#
#   bash scripts/e2e_ab.sh --prepare REV...                       here, with git: each REV's files into ab/<REV>
#   bash scripts/e2e_ab.sh OUT REV... [-- E2E_BENCH_ARGUMENTS]    on the device, with ".whl" and "ab" carried
#
#   e.g.  bash scripts/e2e_ab.sh --prepare issue43-combined
#         TORCHINDUCTOR_CUDAGRAPHS=1 SKIP=10 BATCHES=16 bash scripts/e2e_ab.sh $OUT issue43-combined -- \
#             --training.steps 60 --metrics.log_freq 10 --compile.enable
#
# ab/ is git-ignored, so the copies travel only when the device tool's carry names it; each holds its tests too,
# for `cd ab/REV && python -m pytest tests/test_gpu.py` in the same call. Environment: as
# e2e_bench.sh (CONFIG, BATCHES, SKIP, ARM_TIMEOUT, PYTORCH_ALLOC_CONF); the revisions' arms use the local batch
# size this tree's arms settled on. Reports: OUT/head/e2e_bench.md, OUT/<REV>/e2e_bench.md, and OUT/ab.md with
# every report's ratio line.
set -uo pipefail
name_of() { echo "${1//\//_}"; }  # a revision as a folder name

if [[ ${1:-} == --prepare ]]; then
  shift
  (( $# )) || { echo "usage: bash scripts/e2e_ab.sh --prepare REV..." >&2; exit 2; }
  for rev in "$@"; do
    dir=ab/$(name_of "$rev")
    rm -rf "$dir" && mkdir -p "$dir" || exit 1
    git archive "$rev" titan_nvfp4 scripts train_configs configs benchmarks tests pyproject.toml | tar -x -C "$dir" || exit 1
    echo "e2e_ab: $rev ($(git rev-parse --short "$rev")) in $dir ($(du -sh "$dir" | cut -f1))"
  done
  exit 0
fi

out=${1:?usage: bash scripts/e2e_ab.sh OUT REV... [-- E2E_BENCH_ARGUMENTS] | --prepare REV...}
shift
names=()
while (( $# )) && [[ $1 != -- ]]; do names+=("$(name_of "$1")"); shift; done
[[ ${1:-} == -- ]] && shift
for name in "${names[@]}"; do
  [[ -d ab/$name ]] || { echo "e2e_ab: no ab/$name: run --prepare where git is, and carry ab" >&2; exit 2; }
done
root=$PWD
out=$(mkdir -p "$out" && cd "$out" && pwd) || exit 1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$root/.kernel_cache/triton}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$root/.kernel_cache/inductor}
export DEVICE_WHL_DIR=${DEVICE_WHL_DIR:-$root/.whl}

bash scripts/e2e_bench.sh "$out/head" "$@"
config=${CONFIG:-llama3_2b_bench}
bf16=$(ls -t "$out/head/${config}_bf16_bs"*.log 2>/dev/null | head -1)
[[ -n $bf16 ]] || { echo "e2e_ab: no BF16 log in $out/head" >&2; exit 1; }
bs=${bf16##*_bs}; bs=${bs%.log}
for name in "${names[@]}"; do
  mkdir -p "$out/$name" && cp "$bf16" "$out/$name/"
  (cd "ab/$name" && BATCHES=$bs ARMS=nvfp4 bash scripts/e2e_bench.sh "$out/$name" "$@")
done
for name in head "${names[@]}"; do
  echo "## $name"
  grep -E "ratio|^\| " "$out/$name/e2e_bench.md"
  echo
done | tee "$out/ab.md"
