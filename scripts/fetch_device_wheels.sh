#!/usr/bin/env bash
# Run HERE (a machine with PyPI), from anywhere inside the checkout:
#     bash scripts/fetch_device_wheels.sh
# (Re)creates ./.whl with exactly the wheels pinned in scripts/device_requirements.txt, for the lent GPU
# machine (x86_64, CPython 3.12), makes sure git ignores it (/.whl/ in .git/info/exclude) and prints the
# total size. Idempotent: it downloads into a scratch folder and swaps it in only when every wheel came;
# pip's HTTP cache makes a rerun quick.
#
# Then name ".whl" in the device tool's `carry` and start the command there with
#     source scripts/device_setup.sh || exit 1
#
# For a local simulation only (not for the device): WHL_DIR=/tmp/simwhl WHL_PYVER=3.11 fetches the same
# pins for another Python into another folder (only version-tagged wheels such as multiprocess differ).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
req=scripts/device_requirements.txt
whl_dir=${WHL_DIR:-.whl}
pyver=${WHL_PYVER:-3.12}

# NAME==VERSION lines, comments and blanks dropped.
mapfile -t pins < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$req" | grep -v '^$')
norm() { tr '[:upper:]' '[:lower:]' <<<"$1" | sed -E 's/[-_.]+/_/g'; }

declare -A want=()
for pin in "${pins[@]}"; do
    if [[ ! $pin =~ ^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!-]+$ ]]; then
        echo "fetch_device_wheels: not a NAME==VERSION pin in $req: '$pin'" >&2; exit 2
    fi
    n=$(norm "${pin%%==*}")
    if [[ -n ${want[$n]:-} ]]; then
        echo "fetch_device_wheels: $n is pinned twice in $req (two versions break the install)" >&2; exit 2
    fi
    want[$n]=${pin#*==}
done

# Keep the wheels out of git (the device tool carries ignored paths only when named in `carry`).
if [[ $whl_dir == .whl ]]; then
    exclude=$(git rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)
    mkdir -p "$(dirname "$exclude")"
    touch "$exclude"
    grep -qxF '/.whl/' "$exclude" || echo '/.whl/' >>"$exclude"
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/device_wheels.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

set +e
python3 -m pip download --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --progress-bar off -q -d "$tmp" "${pins[@]}" 2>&1 | grep -v "is ignored: it is neither a file nor a directory"
pip_rc=${PIPESTATUS[0]}
set -e
if (( pip_rc != 0 )); then
    echo "fetch_device_wheels: pip download failed (exit $pip_rc); $whl_dir left as it was" >&2
    exit 1
fi

# Exactly one wheel per pin, at the pinned version, and nothing else.
declare -A got=()
bad=0
for f in "$tmp"/*; do
    b=$(basename "$f")
    if [[ $b != *.whl ]]; then echo "fetch_device_wheels: unexpected file $b" >&2; bad=1; continue; fi
    n=$(norm "${b%%-*}")
    v=$(cut -d- -f2 <<<"$b")
    if [[ -z ${want[$n]:-} ]]; then echo "fetch_device_wheels: unexpected wheel $b" >&2; bad=1; continue; fi
    if [[ $v != "${want[$n]}" ]]; then echo "fetch_device_wheels: $b is not version ${want[$n]}" >&2; bad=1; fi
    if [[ -n ${got[$n]:-} ]]; then echo "fetch_device_wheels: two wheels of $n" >&2; bad=1; fi
    got[$n]=$b
done
for n in "${!want[@]}"; do
    [[ -n ${got[$n]:-} ]] || { echo "fetch_device_wheels: no wheel came for $n==${want[$n]}" >&2; bad=1; }
done
if (( bad )); then
    echo "fetch_device_wheels: FAILED; $whl_dir left as it was" >&2
    exit 1
fi

rm -rf "$whl_dir"
mv "$tmp" "$whl_dir"
trap - EXIT

echo "fetch_device_wheels: ${#pins[@]} wheels in $whl_dir (for CPython $pyver, x86_64):"
find "$whl_dir" -maxdepth 1 -name '*.whl' -printf '  %9s  %f\n' | sort -k2
bytes=$(du -cb "$whl_dir"/*.whl | tail -1 | cut -f1)
awk -v b="$bytes" 'BEGIN {printf "fetch_device_wheels: total %.2f MiB (%d bytes)\n", b/1048576, b}'
