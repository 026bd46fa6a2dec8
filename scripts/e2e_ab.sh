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
# size this tree's arms settled on. The runs go to AB_WORK (default: a new folder under /tmp), each revision's to
# AB_WORK/<REV>; OUT gets few files, as the device tool returns at most 8: ab.md (every report's table and ratio,
# each setup log's last line) and the training logs head_bf16.log, head_nvfp4.log and <REV>_nvfp4.log.
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
work=${AB_WORK:-$(mktemp -d /tmp/e2e_ab.XXXXXX)}
work=$(mkdir -p "$work" && cd "$work" && pwd) || exit 1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$root/.kernel_cache/triton}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$root/.kernel_cache/inductor}
export DEVICE_WHL_DIR=${DEVICE_WHL_DIR:-$root/.whl}

bash scripts/e2e_bench.sh "$work/head" "$@"
config=${CONFIG:-llama3_2b_bench}
bf16=$(ls -t "$work/head/${config}_bf16_bs"*.log 2>/dev/null | head -1)
[[ -n $bf16 ]] || { echo "e2e_ab: no BF16 log in $work/head" >&2; exit 1; }
bs=${bf16##*_bs}; bs=${bs%.log}
cp "$bf16" "$out/head_bf16.log"
for name in "${names[@]}"; do
  mkdir -p "$work/$name" && cp "$bf16" "$work/$name/"
  (cd "ab/$name" && BATCHES=$bs ARMS=nvfp4 bash scripts/e2e_bench.sh "$work/$name" "$@")
done
for name in head "${names[@]}"; do
  echo "## $name"
  grep -E "ratio|^\| " "$work/$name/e2e_bench.md"
  echo "setup: $(tail -1 "$work/$name/device_setup.log" 2>/dev/null)"
  echo
  nvfp4=$(ls -t "$work/$name/${config}_nvfp4_bs"*.log 2>/dev/null | head -1)
  [[ -n $nvfp4 ]] && cp "$nvfp4" "$out/${name}_nvfp4.log"
done | tee "$out/ab.md"
echo "e2e_ab: every run's folder is under $work"
