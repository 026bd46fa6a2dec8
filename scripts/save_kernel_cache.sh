#!/usr/bin/env bash
# Pack the device machine's compiled kernels (Triton's and TorchInductor's caches) for the next session,
# which then skips the cold compile (3-5 minutes for an NVFP4 MoE debug run, ~1.5 for FlexAttention).
# On the device, at the end of a command, after `source scripts/device_setup.sh`:
#   bash scripts/save_kernel_cache.sh         -> $OUT/triton.tar.xz, $OUT/inductor.tar.xz (one larger than 16 MiB
#                                                as .tar.xz.part0, part1, ... of 15 MiB)
# Here, afterwards:  mkdir -p .kernel_cache && cp <files_at>/*.tar.xz* .kernel_cache/
# and name ".kernel_cache" in the next calls' carry (beside ".whl"). Valid for the same torch/triton and
# GPU kind; both caches key every entry by source and options, so stale entries are only dead weight.
# KERNEL_CACHE_LIMIT_MIB (16): the largest file that comes back from $OUT; a larger pack goes in parts of one MiB less.
set -uo pipefail
out=${OUT:?no \$OUT}
limit_mib=${KERNEL_CACHE_LIMIT_MIB:-16}
if [[ ! $limit_mib =~ ^[0-9]+$ ]] || (( limit_mib < 2 )); then
  echo "save_kernel_cache: KERNEL_CACHE_LIMIT_MIB must be a whole number of MiB, at least 2; got '$limit_mib'" >&2; exit 2
fi
for pair in "triton:${TRITON_CACHE_DIR:-}" "inductor:${TORCHINDUCTOR_CACHE_DIR:-}"; do
  name=${pair%%:*} dir=${pair#*:}
  [[ -n $dir && -d $dir ]] || { echo "kernel cache: no $name cache dir (source scripts/device_setup.sh first)"; continue; }
  # fast: runs inside a call. GNU tar's status 1: a file changed while read (a runner still compiling); kept
  tar -C "$dir" --exclude=.unpacked --warning=no-file-changed -I "xz -T0 -3" -cf "$out/$name.tar.xz" .
  (( $? <= 1 )) || { rm -f "$out/$name.tar.xz"; continue; }
  size=$(stat -c %s "$out/$name.tar.xz")
  echo "kernel cache $name: $(find "$dir" -type f ! -name .unpacked | wc -l) files, $(du -sh "$dir" | cut -f1) -> $((size / 1024)) KiB packed"
  if (( size > limit_mib * 1024 * 1024 )); then  # in parts of limit_mib - 1 MiB (15 for the device tool's 16)
    split -b $((limit_mib - 1))M -d -a 1 "$out/$name.tar.xz" "$out/$name.tar.xz.part" && rm -f "$out/$name.tar.xz" &&
      echo "kernel cache $name: in $(ls "$out/$name.tar.xz.part"* | wc -l) parts"
  fi
done
