#!/usr/bin/env bash
# Kill a TorchTitan run with SIGKILL in the middle of a step, resume it from its last DCP checkpoint, and
# check that its losses continue exactly as an uninterrupted run's (stochastic-rounding streams included).
# From the repo root on a GPU machine (after scripts/device_setup.sh there):
#   bash scripts/kill_resume.sh OUT_DIR NAME JOB STEPS KILL_AT [TorchTitan overrides ...]
#     e.g. bash scripts/kill_resume.sh outputs/kill_resume llama3 train_configs/llama3_nvfp4.toml 40 25
# Runs, each logging every step and checkpointing every 10 steps (TorchTitan's deterministic mode unless
# DETERMINISTIC=0):
#   OUT_DIR/NAME_full.log     the uninterrupted run
#   OUT_DIR/NAME_killed.log   the same run, SIGKILLed 0.3 s after it logged step KILL_AT, then started
#                             again with the same command: TorchTitan resumes from the newest checkpoint
# Then titan_nvfp4.tools.loss_log compares them; the script exits 1 unless every step the resumed run
# logged after its restart has the uninterrupted run's loss and grad norm, digit for digit.
# Environment: NPROC (processes, default 1) for multi-GPU layouts given as overrides.
set -uo pipefail
out=$1 name=$2 job=$3 steps=$4 kill_at=$5
shift 5
mkdir -p "$out"
nproc=${NPROC:-1}
common=(--job.config_file "$job" --training.steps "$steps" --metrics.log_freq 1
        --checkpoint.enable --checkpoint.interval 10 --checkpoint.keep_latest_k 0 "$@")
[[ ${DETERMINISTIC:-1} == 1 ]] && common+=(--debug.deterministic)
launch() {  # log ckpt_folder [background]
  torchrun --standalone --nproc_per_node="$nproc" -m torchtitan.train "${common[@]}" \
    --checkpoint.folder "$(realpath "$out")/ckpt_$2" --job.dump_folder "$out/dump_$2" >> "$1" 2>&1
}
rm -rf "$out/ckpt_${name}_full" "$out/ckpt_${name}_killed" "$out/${name}_full.log" "$out/${name}_killed.log"
launch "$out/${name}_full.log" "${name}_full"
echo "$name: uninterrupted run exit $?"

setsid bash -c "$(declare -p common out nproc); $(declare -f launch); launch '$out/${name}_killed.log' '${name}_killed'" &
pid=$!
until grep -qE "step: *${kill_at} " "$out/${name}_killed.log" 2>/dev/null; do
  kill -0 "$pid" 2>/dev/null || { echo "$name: run ended before step $kill_at"; exit 1; }
  sleep 0.1
done
sleep 0.3
# SIGKILL the launcher and its workers (torchrun starts them in sessions of their own): every process
# whose command line names this run's checkpoint folder
pkill -KILL -f "ckpt_${name}_killed"
kill -KILL -- "-$pid" 2>/dev/null
wait "$pid" 2>/dev/null
while pgrep -f "ckpt_${name}_killed" > /dev/null; do sleep 0.1; done
last=$(grep -oE "step: *[0-9]+ " "$out/${name}_killed.log" | tail -1)
echo "$name: SIGKILL after step $kill_at (last logged: $last); resuming" | tee -a "$out/${name}_killed.log"
launch "$out/${name}_killed.log" "${name}_killed"
echo "$name: resumed run exit $?"
sed -n '/SIGKILL after step/,$p' "$out/${name}_killed.log" | grep -m1 -iE "loading (the )?checkpoint|load.*step" || true

python - "$out/${name}_full.log" "$out/${name}_killed.log" <<'EOF'
import re, sys
line = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:\s*(\S+)")
def steps(path, after_marker=False):
    text = open(path, errors="replace").read()
    if after_marker:
        text = text.split("SIGKILL after step", 1)[1]
    return {int(m[1]): (m[2], m[3]) for m in map(line.search, re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines()) if m}
full, resumed = steps(sys.argv[1]), steps(sys.argv[2], after_marker=True)
same = [s for s in resumed if full.get(s) == resumed[s]]
diff = [s for s in resumed if full.get(s) != resumed[s]]
print(f"resumed steps {min(resumed)}-{max(resumed)}: {len(same)} identical to the uninterrupted run, {len(diff)} differ"
      + (f" (first: step {diff[0]}: {resumed[diff[0]]} vs {full.get(diff[0])})" if diff else ""))
sys.exit(1 if diff or not resumed or max(resumed) != max(full) else 0)
EOF
