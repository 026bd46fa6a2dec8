#!/usr/bin/env bash
# A comparison spec's arms on a lent GPU machine, across device calls. From the repo root, with ".whl" (and
# ".kernel_cache" when an earlier session saved one) in the device tool's carry:
#   bash scripts/compare_on_device.sh SPEC [runner arguments]            # in this call; resumable
#   bash scripts/compare_on_device.sh --detach SPEC [runner arguments]   # first call of a run that outlasts it
#   bash scripts/compare_on_device.sh --wait                             # each later call
#   e.g. bash scripts/compare_on_device.sh --detach configs/compare/gpt_oss_memorize.toml --only nvfp4 --parallel 4
# Runs `python -m titan_nvfp4.compare SPEC ...` (the job files build their offline corpus on first use), then, when
# $OUT is set, copies the arms' logs (one tar), the table and the plot there and packs the kernel caches
# (scripts/save_kernel_cache.sh).
# In this call: with checkpoint_interval in the spec, the same command on the still-warm machine resumes each arm
# that --timeout-s (or a SIGTERM to this script) stopped; a new machine starts the arms afresh.
# --detach: the runner starts in a process session of its own, which the device tool leaves running when a call
# returns, so the arms train on between calls (no restart, no reload, no recompile: a 10,000-step arm of ~1,400 s
# fits one lease). This call and each --wait call wait up to WAIT_S seconds (default 540) or until the runner
# ends, print every arm's latest step and pack the logs so far into $OUT each POLL_S seconds (60), and on a
# signal. Issue the next --wait call at once: a machine idle for ~30 s goes back, and the detached arms with it.
# Exit status: the runner's once it has ended, 124 while it still runs, 1 if it ended without one (killed).
# The runner's state lives in COMPARE_STATE_DIR (/tmp/titan_nvfp4_compare), which each --detach replaces: only a
# folder this script made (it holds .compare_on_device_state), or an empty or new one, and never the logs' folder.
set -uo pipefail
state=$(realpath -m "${COMPARE_STATE_DIR:-/tmp/titan_nvfp4_compare}")  # the detached runner's pid, exit status, output folder
mode=call
if [[ ${1:-} == --detach || ${1:-} == --wait ]]; then mode=${1#--}; shift; fi

pack_logs() {  # the logs of folder $1 into $OUT/logs.tar.xz, whole or not at all (written aside, then renamed)
  [[ -n ${OUT:-} && -d $1 ]] && (cd "$1" && compgen -G '*.log' > /dev/null) || return 0
  local rc
  (cd "$1" && tar --warning=no-file-changed -cJf "$OUT/.logs.tar.xz.tmp" ./*.log); rc=$?
  # GNU tar's status 1: a log grew while it was read (an arm still running); the archive holds what was there
  if (( rc <= 1 )); then mv -f "$OUT/.logs.tar.xz.tmp" "$OUT/logs.tar.xz"; else rm -f "$OUT/.logs.tar.xz.tmp"; return 1; fi
}

pack() {  # the logs, table and plot of folder $1 into $OUT, and the kernel caches
  [[ -n ${OUT:-} && -d $1 ]] || return 0
  pack_logs "$1"
  cp "$1"/compare.md "$1"/compare.png "$OUT"/ 2>/dev/null
  bash scripts/save_kernel_cache.sh
}

out_of() {  # the output folder of spec $1 with runner arguments ${@:2} (--out overrides the spec's)
  local out prev="" a
  out=$(python -c "import sys; from pathlib import Path; from titan_nvfp4.compare import load_spec; print(load_spec(Path(sys.argv[1])).out)" "$1") || return 1
  for a in "${@:2}"; do
    [[ $prev == --out ]] && out=$a
    [[ $a == --out=* ]] && out=${a#--out=}
    prev=$a
  done
  echo "$out"
}

marker=.compare_on_device_state  # in each state folder this script made: the only folders it removes
if [[ $mode == detach ]]; then
  if [[ -f $state/pid ]] && kill -0 "$(cat "$state/pid")" 2>/dev/null; then
    echo "compare_on_device: a detached run is still going (pid $(cat "$state/pid")); use --wait" >&2; exit 1
  fi
  if [[ $state == / || $PWD == "$state" || $PWD == "$state"/* ]]; then
    echo "compare_on_device: COMPARE_STATE_DIR=$state holds this tree; name a folder of its own" >&2; exit 1
  fi
  if [[ -e $state && ! -d $state ]] || { [[ -d $state && ! -f $state/$marker ]] && [[ -n $(ls -A "$state") ]]; }; then
    echo "compare_on_device: COMPARE_STATE_DIR=$state is a folder this script did not make (no $marker in it);" \
      "name a new or empty one" >&2
    exit 1
  fi
  # the previous run's state goes first: a --detach that fails below leaves none for --wait to report as this one
  rm -rf "$state" || exit 1
fi
if [[ $mode == wait ]]; then
  [[ -f $state/pid ]] || { echo "compare_on_device: no detached run on this machine (start one with --detach)" >&2; exit 1; }
else
  spec=${1:?usage: bash scripts/compare_on_device.sh [--detach] SPEC [runner arguments] | --wait}
  shift
  source scripts/device_setup.sh > "${OUT:-/tmp}/setup.txt" 2>&1 || { cat "${OUT:-/tmp}/setup.txt"; exit 1; }
  out=$(out_of "$spec" "$@") || exit 1
fi

if [[ $mode == call ]]; then
  # In the background, so that a SIGTERM to this script (an outer `timeout`) stops the runner, which stops its
  # arms, and the logs below still get packed.
  python -m titan_nvfp4.compare "$spec" "$@" &
  runner=$!
  trap 'kill -TERM "$runner" 2>/dev/null' TERM INT
  wait "$runner"; rc=$?
  if kill -0 "$runner" 2>/dev/null; then wait "$runner"; rc=124; fi  # a signal ended the first wait
  trap - TERM INT
  pack "$out"
  exit $rc
fi

if [[ $mode == detach ]]; then
  # the spec as the snapshot holds it (one outside the tree as it is); the output folder under outputs/ or outside
  # the tree: elsewhere in it, each device call's fresh copy may replace what the arms write
  spec=$(realpath -m "$spec")
  [[ $spec == "$PWD"/* && $spec != "$PWD"/outputs/* ]] && spec=$state/tree/${spec#"$PWD"/}
  [[ -n $out ]] || { echo "compare_on_device: --out names no folder" >&2; exit 1; }
  absout=$(realpath -m "$out")
  if [[ $absout == "$PWD"/* && $absout != "$PWD"/outputs/* ]]; then
    echo "compare_on_device: --detach writes the arms' logs to $out, inside the tree, which each device call copies" \
      "afresh: use a folder under outputs/ (or outside the tree)" >&2
    exit 1
  fi
  if [[ $absout == "$state" || $absout == "$state"/* ]]; then
    echo "compare_on_device: the logs' folder $out is inside COMPARE_STATE_DIR=$state, which the next --detach" \
      "removes" >&2
    exit 1
  fi
  [[ $out == /* || $absout == "$PWD"/outputs/* ]] || { out=$absout && set -- "$@" --out "$out"; }
  mkdir -p "$state/tree" "$state/cache" && touch "$state/$marker" && echo "$out" > "$state/out" || exit 1
  # Each later device call copies the working tree here afresh and replaces the carried paths (.kernel_cache
  # with the caches unpacked in it): an arm starting, or importing, while that happens fails (a job file or a
  # preset briefly missing). So the runner runs from a snapshot of the tree, its outputs and corpus folders
  # linked back here, and on copies of the kernel caches.
  for f in * .[!.]*; do
    [[ -e $f ]] || continue  # an unmatched glob
    [[ $state == "$PWD/$f" || $state == "$PWD/$f"/* ]] && continue  # a state folder inside the tree
    case $f in outputs | assets | .kernel_cache | .whl | .git) ;; *) cp -a -- "$f" "$state/tree/" || exit 1 ;; esac
  done
  mkdir -p outputs assets && ln -s "$PWD/outputs" "$PWD/assets" "$state/tree/" || exit 1
  for var in TRITON_CACHE_DIR TORCHINDUCTOR_CACHE_DIR; do
    dir=${!var:-}
    [[ -n $dir ]] || continue
    copy=$state/cache/${var%_CACHE_DIR}
    if [[ -d $dir ]]; then cp -a "$dir" "$copy" || exit 1; else mkdir -p "$copy"; fi
    export "$var=$copy"
  done
  IFS=: read -r -a pp <<<"${PYTHONPATH:-}"  # the checkout's entry on PYTHONPATH (device_setup.sh) -> the snapshot
  for i in "${!pp[@]}"; do [[ ${pp[i]} == "$PWD" ]] && pp[i]=$state/tree; done
  PYTHONPATH=$(IFS=:; echo "${pp[*]}")
  # the kernel caches' folders, for the --wait calls' packing
  echo "export TRITON_CACHE_DIR='${TRITON_CACHE_DIR:-}' TORCHINDUCTOR_CACHE_DIR='${TORCHINDUCTOR_CACHE_DIR:-}'" > "$state/env"
  # in a subshell only for its cwd; `setsid` itself goes to the background, so $! is the runner's session leader
  (cd "$state/tree" || exit 1
   STATE=$state setsid bash -c 'python -m titan_nvfp4.compare "$@" > "$STATE/runner.log" 2>&1; echo $? > "$STATE/rc"' \
     compare "$spec" "$@" < /dev/null > /dev/null 2>&1 &
   echo $! > "$state/pid") || exit 1
  echo "compare_on_device: runner detached (pid $(cat "$state/pid")); its output: $state/runner.log"
fi

out=$(cat "$state/out")
source "$state/env"
# a call cut short (the device tool's time limit, a signal) still leaves the logs so far in $OUT
trap 'echo "compare_on_device: stopped by a signal; packing what the arms logged so far"; pack "$out"; exit 124' TERM INT
pid=$(cat "$state/pid")
progress() {
  echo "== $(date -u +%T) ($((SECONDS - t0)) s)"
  local log
  for log in "$out"/*.log; do
    [[ -e $log ]] && echo "$(basename "$log" .log): $(grep -a 'step:' "$log" | tail -1 | sed 's/.*step:/step:/' | cut -c1-90)"
  done
}
t0=$SECONDS next=${POLL_S:-60}
fresh=0 dead=0  # whether the last poll printed; whether the runner ended without writing its exit status
while [[ ! -f $state/rc ]] && (( SECONDS - t0 < ${WAIT_S:-540} )); do
  sleep 2
  fresh=0
  if [[ ! -f $state/rc ]] && ! kill -0 "$pid" 2>/dev/null; then
    sleep 1; [[ -f $state/rc ]] || { dead=1; break; }
  fi
  if (( SECONDS - t0 >= next )); then progress; pack_logs "$out"; fresh=1; next=$((next + ${POLL_S:-60})); fi
done
(( fresh )) || progress
tail -n 3 "$state/runner.log" 2>/dev/null
pack "$out"
if [[ -f $state/rc ]]; then exit "$(cat "$state/rc")"; fi
if (( dead )); then
  echo "compare_on_device: the runner (pid $pid) ended without an exit status (killed?); its arms stopped with it." \
    "Start them again with --detach (each resumes from its last checkpoint on this machine)" >&2
  exit 1
fi
exit 124
