# shellcheck shell=bash
# Environment for the lent GPU machine (no network there). From the repo root, with ".whl" in the device
# tool's `carry` (scripts/fetch_device_wheels.sh fills it here):
#
#     source scripts/device_setup.sh || exit 1
#
# It
#   1. exports NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 (NVLink multicast
#      stays off: the workplace requires it), PYTHONUNBUFFERED=1, HF_DATASETS_OFFLINE=1, HF_HUB_OFFLINE=1;
#   2. installs .whl/*.whl into /tmp/site with --no-index --no-deps (wheels tagged [if-missing] in
#      scripts/device_requirements.txt only when the machine's python3 lacks that module);
#   3. exports PYTHONPATH=/tmp/site:<repo root> (so `import titan_nvfp4` works from the checkout);
#   4. prints python/torch/triton/torchtitan/datasets/tokenizers versions, the GPUs (nvidia-smi -L), an
#      import check and any unmet Requires-Dist of the carried packages;
#   5. exports TRITON_CACHE_DIR=<root>/.kernel_cache/triton and TORCHINDUCTOR_CACHE_DIR=<root>/.kernel_cache/
#      inductor, unpacking .kernel_cache/{triton,inductor}.tar.xz there when carried (compiled kernels of
#      an earlier session: scripts/save_kernel_cache.sh).
# Returns (or exits, when run with bash instead of sourced) 1 if the install fails, 2 if a module that
# training needs does not import; the variables above are exported either way. Safe under the caller's
# `set -euo pipefail`, and safe to source again. Overrides: PYTHON (python3), DEVICE_WHL_DIR (<root>/.whl),
# DEVICE_SITE (/tmp/site).

# 1. Safety and offline variables first, so they are set whatever fails below.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1

__device_setup_main() {
    local root py whl_dir site req
    root=$(CDPATH="" cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || return 1
    py=${PYTHON:-python3}
    whl_dir=${DEVICE_WHL_DIR:-$root/.whl}
    site=${DEVICE_SITE:-/tmp/site}
    req=$root/scripts/device_requirements.txt

    if [[ $PWD != "$root" ]]; then
        echo "device_setup: note: run from $PWD; using the repo root $root for PYTHONPATH"
    fi

    # 2. Install the carried wheels.
    local -a all=() wheels=() skipped=()
    local f
    for f in "$whl_dir"/*.whl; do
        [[ -e $f ]] && all+=("$f")
    done
    if (( ${#all[@]} == 0 )); then
        echo "device_setup: ERROR: no wheels in $whl_dir (run scripts/fetch_device_wheels.sh here and name .whl in carry)" >&2
        return 1
    fi

    # [if-missing] pins: skip those the machine's own python already imports (ignoring PYTHONPATH).
    local -a fallback=()
    if [[ -f $req ]]; then
        mapfile -t fallback < <(grep -F '[if-missing]' "$req" | sed -e 's/#.*//' -e 's/==.*//' -e 's/[[:space:]]//g' \
                                | tr '[:upper:]' '[:lower:]' | sed -E 's/[-_.]+/_/g' | grep -v '^$' || true)
    fi
    local present=" "
    if (( ${#fallback[@]} > 0 )); then
        present=" $(env -u PYTHONPATH "$py" - "${fallback[@]}" <<'PYEOF' 2>/dev/null || true
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None))
PYEOF
) "
    fi
    local b n
    for f in "${all[@]}"; do
        b=${f##*/}
        n=$(tr '[:upper:]' '[:lower:]' <<<"${b%%-*}" | sed -E 's/[-_.]+/_/g')
        if [[ $present == *" $n "* ]]; then
            skipped+=("$n")
        else
            wheels+=("$f")
        fi
    done
    echo "device_setup: installing ${#wheels[@]} wheels from $whl_dir into $site" \
         "${skipped[*]:+(machine already has, not installed: ${skipped[*]})}"
    if ! "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "${wheels[@]}"; then
        echo "device_setup: ERROR: pip install into $site failed" >&2
        return 1
    fi

    # 3. PYTHONPATH: our site and the checkout first, anything the caller had after them (once each).
    local newpp="$site:$root" e
    local -a old=()
    IFS=: read -r -a old <<<"${PYTHONPATH:-}"
    for e in "${old[@]}"; do
        [[ -z $e || :$newpp: == *":$e:"* ]] || newpp+=":$e"
    done
    export PYTHONPATH=$newpp

    # 4. Report.
    echo "device_setup: PYTHONPATH=$PYTHONPATH"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L || echo "device_setup: nvidia-smi -L failed"
    else
        echo "device_setup: nvidia-smi not found (no NVIDIA driver on this machine)"
    fi
    "$py" - "$req" <<'PYEOF'
import importlib, importlib.metadata as md, platform, re, sys

def ver(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "MISSING"

print(f"python {platform.python_version()} ({sys.executable})")
print("versions: " + ", ".join(f"{d} {ver(d)}" for d in (
    "torch", "triton", "torchtitan", "datasets", "tokenizers", "torchdata", "tyro", "huggingface_hub",
    "transformers", "pyarrow", "fsspec", "pandas", "numpy", "torchao", "pytest")))
try:
    import torch
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"torch {torch.__version__}: cuda {torch.version.cuda}, {n} GPU(s) visible"
          + (f", {torch.cuda.get_device_name(0)}" if n else ""))
except Exception as e:  # reported again by the import check
    print(f"torch: {type(e).__name__}: {e}")

# Modules that training needs (a failure makes this script return 2), then ones only the tests need.
required = ["torch", "triton", "numpy", "torchtitan.train", "datasets", "torchdata", "tyro", "tomli",
            "pyarrow", "pandas", "xxhash", "fsspec", "requests", "tqdm", "filelock", "huggingface_hub",
            "dill", "multiprocess", "yaml", "tokenizers", "einops", "PIL", "tensorboard"]
optional = ["torchao", "pytest", "titan_nvfp4", "transformers", "compressed_tensors"]
failed = []
for mod in required + optional:
    try:
        m = importlib.import_module(mod)
        where = getattr(m, "__file__", None) or "?"
        print(f"  import {mod:18s} ok   {where}")
    except Exception as e:
        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        print(f"  import {mod:18s} FAIL {type(e).__name__}: {msg}")
        failed.append(mod)

# Requires-Dist of the carried packages, checked against what is installed (pip ran with --no-deps).
try:
    from packaging.requirements import Requirement
    from packaging.version import Version
    carried = []
    for line in open(sys.argv[1]):
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            carried.append(line.split("==", 1)[0])
    unmet = []
    for dist in carried:
        if ver(dist) == "MISSING":
            continue  # an [if-missing] fallback the machine had anyway, or not installed at all
        for r in md.requires(dist) or []:
            req = Requirement(r)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            have = ver(req.name)
            if have == "MISSING" or not req.specifier.contains(Version(have), prereleases=True):
                unmet.append(f"{dist} needs {req.name}{req.specifier} (found {have})")
    print("requirements of carried packages: " + ("all met" if not unmet else "UNMET:"))
    for u in unmet:
        print("  " + u)
except Exception as e:
    print(f"requirements check skipped: {type(e).__name__}: {e}")

bad = [m for m in failed if m in required]
if bad:
    print("device_setup: IMPORT CHECK FAILED for " + ", ".join(bad) + " (training cannot run)")
    sys.exit(2)
if failed:
    print("device_setup: import check: only optional modules failed: " + ", ".join(failed))
else:
    print("device_setup: import check: all ok")
PYEOF
}

# 5. Compiled Triton kernels from an earlier session (same GPU kind, same triton): a cold start compiles
#    every kernel variant and autotune config first (3-5 minutes for an NVFP4 MoE debug run).
__device_kernel_cache() {
    local root cache name var dir
    root=$(CDPATH="" cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || return 0
    cache=$root/.kernel_cache
    for name in triton inductor; do
        var=TRITON_CACHE_DIR
        [[ $name == inductor ]] && var=TORCHINDUCTOR_CACHE_DIR
        dir=${!var:-$cache/$name}
        export "$var=$dir"
        mkdir -p "$dir"
        if [[ -f $cache/$name.tar.xz && ! -e $dir/.unpacked ]]; then
            tar -C "$dir" -xJf "$cache/$name.tar.xz" && touch "$dir/.unpacked"
        elif [[ -f $cache/$name.tar.xz.part0 && ! -e $dir/.unpacked ]]; then  # packed in parts (save_kernel_cache.sh)
            cat "$cache/$name.tar.xz.part"* | tar -C "$dir" -xJf - && touch "$dir/.unpacked"
        fi
        echo "device_setup: $var=$dir ($(find "$dir" -type f ! -name .unpacked | wc -l) cached files)"
    done
}

__device_setup_rc=0
__device_setup_main || __device_setup_rc=$?
__device_kernel_cache
unset -f __device_setup_main __device_kernel_cache
if (return 0 2>/dev/null); then
    eval "unset __device_setup_rc; return $__device_setup_rc"
else
    exit "$__device_setup_rc"
fi
