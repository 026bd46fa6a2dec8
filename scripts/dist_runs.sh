#!/usr/bin/env bash
# Issue 6 on a 2-GPU machine (nvidia-h100-x2 / nvidia-h200-x2), from the repo root (".whl" carried, and
# ".kernel_cache" and "outputs/dist_runs" from an earlier call when there is one):
#   bash scripts/dist_runs.sh runs  [STEPS]   loss curves: 1-GPU references and controls, then each 2-GPU layout
#   bash scripts/dist_runs.sh bench [STEPS]   FSDP2 step time, BF16 vs NVFP4 all-gather, Llama3 2B_bench
#   bash scripts/dist_runs.sh ep [STEPS]      EP2 speed: the BF16 twin, and NVFP4 with autotuning printed
#   bash scripts/dist_runs.sh compile [STEPS] FSDP2 (NVFP4 all-gather), TP2 and EP2 with torch.compile and
#                                             selective activation checkpointing, against the eager 1-GPU runs
#   bash scripts/dist_runs.sh four [STEPS]    issue 8 on 4 GPUs (nvidia-h200-x4 / -h100-x4): FSDP2 2 x TP2 with the
#                                             BF16 and the NVFP4 all-gather, and the MoE with experts EP2 x FSDP2 2
#   bash scripts/dist_runs.sh four_bench [STEPS]  issue 8's step time: Llama3 2B_bench FSDP2 2 x TP2 on 4 GPUs,
#                                             BF16 model, NVFP4 with the BF16 and with the NVFP4 all-gather
#   bash scripts/dist_runs.sh same_tokens [STEPS]  deepseek_v3_nvfp4 (seeds 42-47) and llama3_nvfp4 (42-44) on one
#                                             GPU each, trained on the batches of the 2-GPU runs
#                                             (titan_nvfp4.tools.emulated_dp --data-parallel 2); EP2 seeds 45, 46
#   bash scripts/dist_runs.sh same_tokens4 [STEPS]  deepseek_v3_nvfp4 on one GPU each (seeds 42-47) trained on
#                                             the batches of the 4-GPU MoE arm (--data-parallel 4); its seed 43
#                                             (PRECISION=bf16: the same in BF16)
#   bash scripts/dist_runs.sh moe_fsdp [STEPS]  deepseek_v3_nvfp4_ep2 with expert_parallel_degree 1 (FSDP2 alone)
#   bash scripts/dist_runs.sh moe_bf16 [STEPS]  the MoE comparison in BF16: deepseek_v3_bf16 on one GPU (seeds
#                                             42-47) and deepseek_v3_bf16_ep2 (seeds 42-44)
#   bash scripts/dist_runs.sh moe_seeds [STEPS] more seeds of the MoE comparison: deepseek_v3_nvfp4 on one GPU
#                                             (seeds 44-49) and deepseek_v3_nvfp4_ep2 (seeds 43, 44)
# The 1-GPU reference logs of an earlier session can stand in for a rerun (same torch/triton/GPU kind):
#   mkdir -p outputs/dist_runs && cp docs/results/multi_gpu/{llama3,deepseek_v3}_nvfp4{,@seed43,@rotated}.log outputs/dist_runs/
# "runs": train_configs/llama3_nvfp4 and deepseek_v3_nvfp4 on one GPU each (side by side), with two
# controls each for the run-to-run noise: another seed (@seed43: other initial weights and SR streams)
# and another document order (@rotated: the training file from its middle on); then llama3_nvfp4_fsdp2
# (BF16 all-gather), llama3_nvfp4_fsdp2_ag (NVFP4 all-gather), llama3_nvfp4_tp2 and deepseek_v3_nvfp4_ep2
# on both GPUs, STEPS (default 150) each, same global batch; then one loss table per model
# (titan_nvfp4.tools.loss_log, deltas against the 1-GPU run).
# Every arm validates at steps 1, 50, 100, 150 on 16 batches of 8 x 512 tokens of the validation split
# written four times (titan_nvfp4.data.variants): each rank of a 1-, 2- or 4-way data-parallel run then
# reads the same tokens as a one-GPU run, so validation losses compare layouts whose training batches differ.
# An arm whose log already reached STEPS is skipped, so a stopped call is finished by running it again;
# each arm is stopped after ARM_TIMEOUT s (default 240) or at DEADLINE (epoch seconds), whichever is first,
# and not started with less than ARM_MIN s (default 60) left before DEADLINE.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1): see KINDS.md.
# Logs, tables and the kernel caches go to $OUT when set (logs packed in one file); SAVE_KERNEL_CACHE=0
# leaves the caches out (packing them takes about a minute of the call).
set -uo pipefail
mode=${1:-runs} steps=${2:-150}
run=./outputs/dist_runs
mkdir -p "$run"
source scripts/device_setup.sh >/dev/null 2>&1 || { echo "device_setup.sh failed"; exit 1; }
python -m titan_nvfp4.data.prepare 2>&1 | tail -1
variants=./outputs/data_variants
mkdir -p "$variants"
python -m titan_nvfp4.data.variants replicate ./assets/pystdlib/validation.jsonl "$variants/validation_x4.jsonl" \
    --copies 4
python -m titan_nvfp4.data.variants rotate ./assets/pystdlib/train.jsonl "$variants/train_rotated.jsonl"
val=(--validation.enable --validation.dataset pystdlib_validation
     --validation.dataset_path "$variants/validation_x4.jsonl" --validation.local_batch_size 8
     --validation.seq_len 512 --validation.freq 50 --validation.steps 16)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTORCH_ALLOC_CONF=expandable_segments:True
# Triton keeps each autotuning result in its cache dir and later processes reuse it: without this, every
# arm re-benchmarks every kernel's tile configs (most of a 2-3 minute MoE arm), and arms may pick different
# tiles, hence different fp32 summation orders. Loss runs only: the benchmarks tune afresh (a result
# measured while several runs shared a GPU is no speed reference). Set it to 0 to tune in every arm.
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}

done_() { grep -qE "step: *${steps} " "$run/$1.log" 2>/dev/null; }
train() {  # ARM NPROC GPUS PORT [OVERRIDES...]
  local arm=$1 n=$2 gpus=$3 port=$4 start=$(date +%s) limit=${ARM_TIMEOUT:-240}
  shift 4
  done_ "$arm" && { echo "$arm: already done"; return; }
  if [[ -n ${DEADLINE:-} ]]; then  # end by DEADLINE; not worth starting with less than ARM_MIN s left
    (( DEADLINE - start < ${ARM_MIN:-60} )) && { echo "$arm: not started (DEADLINE)"; return; }
    (( DEADLINE - start < limit )) && limit=$(( DEADLINE - start ))
  fi
  local module=torchtitan.train  # --data-parallel N: the 1-GPU run reads an N-way run's batches
  [[ " $* " == *" --data-parallel "* ]] && module=titan_nvfp4.tools.emulated_dp
  CUDA_VISIBLE_DEVICES=$gpus timeout --kill-after=20 "$limit" \
    torchrun --nproc_per_node="$n" --master_port="$port" -m "$module" \
      --job.config_file "train_configs/${arm%%@*}.toml" --training.steps "$steps" "${val[@]}" "$@" > "$run/$arm.log" 2>&1
  echo "$arm ($n GPU): exit $? in $(( $(date +%s) - start )) s, last: $(grep -oE "step: *[0-9]+ " "$run/$arm.log" | tail -1)"
  grep -E "NVFP4: (converted|FSDP2)|Traceback|Error" "$run/$arm.log" | grep -v lspci | sort -u | head -4
}

references() {  # the six 1-GPU runs at once, each model's three on one GPU (they compile the same kernels side by side)
  local rot=(--training.dataset_path "$variants/train_rotated.jsonl") m cfg gpu port
  for m in "llama3_nvfp4 0 29500" "deepseek_v3_nvfp4 1 29510"; do
    read -r cfg gpu port <<<"$m"
    train "$cfg" 1 "$gpu" "$port" & train "$cfg@seed43" 1 "$gpu" $((port + 1)) --debug.seed 43 &
    train "$cfg@rotated" 1 "$gpu" $((port + 2)) "${rot[@]}" &
  done
  wait
}
seeds() {  # CONFIG "SEEDS" EP_CONFIG "SEEDS": CONFIG@seedS on one GPU each (three a GPU at once), then
  # EP_CONFIG@seedS on both GPUs, one after another
  local one=$1 ones=$2 two=$3 twos=$4 s
  for s in $ones; do train "$one@seed$s" 1 $(( s % 2 )) $(( 29470 + s )) --debug.seed "$s" & done
  wait
  for s in $twos; do train "$two@seed$s" 2 0,1 29502 --debug.seed "$s"; done
}
arms() { (cd "$run" && for p in "$@"; do ls $p 2>/dev/null; done | sed 's/\.log$//'); }  # QUOTED_GLOB... : arms with a log
paths() { local a; for a in "$@"; do [[ -f $run/$a.log ]] && echo "$run/$a.log"; done; }  # ARM... : their logs
tables_of() {  # NAME ARM... : the loss table of these arms (those with a log), first the reference
  local name=$1
  shift
  python -m titan_nvfp4.tools.loss_log $(paths "$@") \
      --last 10 --markdown --csv "$run/$name.csv" | tee "$run/$name.md"
}

if [[ $mode == runs ]]; then
  references
  for arm in llama3_nvfp4_fsdp2 llama3_nvfp4_fsdp2_ag llama3_nvfp4_tp2; do
    train "$arm" 2 0,1 29502
  done
  TRITON_PRINT_AUTOTUNING=1 train deepseek_v3_nvfp4_ep2 2 0,1 29502
  llama=(llama3_nvfp4 llama3_nvfp4@seed43 llama3_nvfp4@rotated llama3_nvfp4_fsdp2 llama3_nvfp4_fsdp2_ag llama3_nvfp4_tp2)
  deepseek=(deepseek_v3_nvfp4 deepseek_v3_nvfp4@seed43 deepseek_v3_nvfp4@rotated deepseek_v3_nvfp4_ep2)
  tables_of llama3 "${llama[@]}"
  tables_of deepseek_v3 "${deepseek[@]}"
  echo "EP2 autotuning events: $(grep -c "Triton autotuning" "$run/deepseek_v3_nvfp4_ep2.log")"
  logs=("${llama[@]}" "${deepseek[@]}")
  tables=(llama3.md llama3.csv deepseek_v3.md deepseek_v3.csv)
elif [[ $mode == bench ]]; then
  # 2B_bench with FSDP2 over both GPUs, local batch 16: BF16 all-gather, then NVFP4 all-gather
  val=()  # step time only
  export TRITON_CACHE_AUTOTUNING=0  # a speed comparison: each arm tunes on an otherwise idle machine
  common=(--parallelism.data_parallel_shard_degree 2 --training.local_batch_size 16)
  train "llama3_2b_bench_nvfp4@ag_false" 2 0,1 29502 "${common[@]}"
  train "llama3_2b_bench_nvfp4@ag_true" 2 0,1 29502 "${common[@]}" --quantize.linear.nvfp4.fsdp_nvfp4_all_gather
  python -m titan_nvfp4.tools.e2e_report "$run/llama3_2b_bench_nvfp4@ag_false.log" \
      "$run/llama3_2b_bench_nvfp4@ag_true.log" --skip 5 | tee "$run/fsdp_bench.md"
  logs=("llama3_2b_bench_nvfp4@ag_false" "llama3_2b_bench_nvfp4@ag_true")
  tables=(fsdp_bench.md)
elif [[ $mode == four_bench ]]; then
  # issue 8's step time at a size where compute counts: 2B_bench on 4 GPUs, FSDP2 2 x TP2, local batch 16:
  # the BF16 model, then NVFP4 with the BF16 all-gather, then NVFP4 with the NVFP4 all-gather. TorchTitan's
  # tps divides a rank's tokens by the TP degree too, so a step's time is (local batch x 2048 / 2) / tps
  val=()
  export TRITON_CACHE_AUTOTUNING=0
  lb=16
  common=(--parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2
          --training.local_batch_size $lb)
  train "llama3_2b_bench_bf16@fsdp2_tp2" 4 0,1,2,3 29502 "${common[@]}"
  train "llama3_2b_bench_nvfp4@fsdp2_tp2" 4 0,1,2,3 29502 "${common[@]}"
  train "llama3_2b_bench_nvfp4@fsdp2_tp2_ag" 4 0,1,2,3 29502 "${common[@]}" \
      --quantize.linear.nvfp4.fsdp_nvfp4_all_gather
  python -m titan_nvfp4.tools.e2e_report "$run/llama3_2b_bench_bf16@fsdp2_tp2.log" \
      "$run/llama3_2b_bench_nvfp4@fsdp2_tp2.log" "$run/llama3_2b_bench_nvfp4@fsdp2_tp2_ag.log" --skip 5 \
      --tokens-per-step $(( lb * 2048 / 2 )) \
      | tee "$run/four_bench.md"
  grep -h "NVFP4: FSDP2 all-gather, first step" "$run/llama3_2b_bench_nvfp4@fsdp2_tp2_ag.log" | sort -u
  logs=("llama3_2b_bench_bf16@fsdp2_tp2" "llama3_2b_bench_nvfp4@fsdp2_tp2" "llama3_2b_bench_nvfp4@fsdp2_tp2_ag")
  tables=(four_bench.md)
elif [[ $mode == ep ]]; then
  # why EP2 is slow: the BF16 twin under the same layout, then NVFP4 with Triton's autotuning printed
  # (a new token count that re-tunes a kernel shows up as one "Triton autotuning" line per step)
  train deepseek_v3_bf16_ep2 2 0,1 29502
  TRITON_PRINT_AUTOTUNING=1 train deepseek_v3_nvfp4_ep2 2 0,1 29502  # the "runs" arm, if that ran
  tables_of ep deepseek_v3_bf16_ep2 deepseek_v3_nvfp4_ep2
  echo "autotuning events: $(grep -c "Triton autotuning" "$run/deepseek_v3_nvfp4_ep2.log")"
  grep "Triton autotuning" "$run/deepseek_v3_nvfp4_ep2.log" | sed 's/ with.*//' | sort | uniq -c | sort -rn | head
  logs=(deepseek_v3_bf16_ep2 deepseek_v3_nvfp4_ep2)
  tables=(ep.md ep.csv)
elif [[ $mode == compile ]]; then
  # each 2-GPU layout with --compile.enable and selective AC (the custom ops under both), against the same
  # eager 1-GPU references and controls as "runs" (already-finished arms are skipped: rerun to finish a stopped call)
  ca=(--compile.enable --activation_checkpoint.mode selective)
  references
  for arm in llama3_nvfp4_fsdp2_ag llama3_nvfp4_tp2 deepseek_v3_nvfp4_ep2; do
    train "$arm@compile_ac" 2 0,1 29502 "${ca[@]}"
  done
  tables_of compile_llama3 llama3_nvfp4 llama3_nvfp4@seed43 llama3_nvfp4@rotated "llama3_nvfp4_fsdp2_ag@compile_ac" \
      "llama3_nvfp4_tp2@compile_ac"
  tables_of compile_deepseek_v3 deepseek_v3_nvfp4 deepseek_v3_nvfp4@seed43 deepseek_v3_nvfp4@rotated \
      "deepseek_v3_nvfp4_ep2@compile_ac"
  logs=(llama3_nvfp4 llama3_nvfp4@seed43 llama3_nvfp4@rotated deepseek_v3_nvfp4 deepseek_v3_nvfp4@seed43
        deepseek_v3_nvfp4@rotated "llama3_nvfp4_fsdp2_ag@compile_ac" "llama3_nvfp4_tp2@compile_ac"
        "deepseek_v3_nvfp4_ep2@compile_ac")
  tables=(compile_llama3.md compile_deepseek_v3.md)
elif [[ $mode == moe_seeds ]]; then
  # is EP2's lower validation loss (docs/results.md, multi-GPU) noise? more seeds of both sides
  seeds deepseek_v3_nvfp4 "44 45 46 47 48 49" deepseek_v3_nvfp4_ep2 "43 44"
  logs=(deepseek_v3_nvfp4 deepseek_v3_nvfp4@seed43 deepseek_v3_nvfp4@rotated deepseek_v3_nvfp4@seed{44..49}
        deepseek_v3_nvfp4_ep2 deepseek_v3_nvfp4_ep2@compile_ac deepseek_v3_nvfp4_ep2@seed43 deepseek_v3_nvfp4_ep2@seed44)
  tables_of moe_seeds "${logs[@]}"
  tables=(moe_seeds.md moe_seeds.csv)
elif [[ $mode == same_tokens ]]; then
  # the 1-GPU runs on the 2-GPU runs' batches (titan_nvfp4.tools.emulated_dp): rank 0's 8 rows, then rank 1's,
  # so a 1-GPU vs 2-GPU difference is the layout's and not the data order's; then more EP2 seeds.
  # DS_SEEDS, LLAMA_SEEDS, EP2_SEEDS pick the seeds; the tables pool every such log there is.
  for s in ${DS_SEEDS-42 43 44 45 46 47}; do
    train "deepseek_v3_nvfp4@dp2_seed$s" 1 $(( s % 2 )) $(( 29470 + s )) --debug.seed "$s" --data-parallel 2 &
  done
  for s in ${LLAMA_SEEDS-42 43 44}; do
    train "llama3_nvfp4@dp2_seed$s" 1 $(( s % 2 )) $(( 29440 + s )) --debug.seed "$s" --data-parallel 2 &
  done
  wait
  for s in ${EP2_SEEDS-45 46}; do train "deepseek_v3_nvfp4_ep2@seed$s" 2 0,1 29502 --debug.seed "$s"; done
  logs=($(arms deepseek_v3_nvfp4.log "deepseek_v3_nvfp4@seed*.log" "deepseek_v3_nvfp4@dp2_seed*.log" \
          deepseek_v3_nvfp4_ep2.log "deepseek_v3_nvfp4_ep2@seed*.log"))
  tables_of same_tokens_deepseek_v3 "${logs[@]}"
  python -m titan_nvfp4.tools.loss_log $(paths "${logs[@]}") --markdown \
      --group "1 GPU=deepseek_v3_nvfp4,deepseek_v3_nvfp4@seed*" --group "1 GPU, EP2's batches=*@dp2_seed*" \
      --group "EP2=deepseek_v3_nvfp4_ep2*" | tail -14 | tee -a "$run/same_tokens_deepseek_v3.md"
  llama=($(arms llama3_nvfp4.log llama3_nvfp4@seed43.log llama3_nvfp4@rotated.log "llama3_nvfp4@dp2_seed*.log" \
           llama3_nvfp4_fsdp2.log llama3_nvfp4_fsdp2_ag.log))
  tables_of same_tokens_llama3 "${llama[@]}"
  logs+=("${llama[@]}")
  tables=(same_tokens_deepseek_v3.md same_tokens_llama3.md)
elif [[ $mode == same_tokens4 ]]; then
  # issue 8's MoE arm against one GPU on its own batches: deepseek_v3_nvfp4 with --data-parallel 4 (the
  # EP2 x FSDP2 2 run's four data-parallel ranks), seeds DS4_SEEDS on GPU seed % 4 at once; then more 4-GPU seeds (EP4_SEEDS).
  # PRECISION=bf16 runs the BF16 twins instead (deepseek_v3_bf16, and deepseek_v3_bf16_ep2 over 4 GPUs).
  p=${PRECISION:-nvfp4}
  one=deepseek_v3_$p four=deepseek_v3_${p}_ep2_fsdp4 four_args=()
  [[ $p == bf16 ]] && { four="deepseek_v3_bf16_ep2@fsdp4"
    four_args=(--parallelism.data_parallel_shard_degree 4 --training.local_batch_size 4); }
  for s in ${DS4_SEEDS-42 43 44 45 46 47}; do
    train "$one@dp4_seed$s" 1 $(( s % 4 )) $(( 29470 + s )) --debug.seed "$s" --data-parallel 4 &
  done
  wait
  for s in ${EP4_SEEDS-43}; do train "$four@seed$s" 4 0,1,2,3 29502 --debug.seed "$s" "${four_args[@]}"; done
  [[ $p == bf16 ]] && train "$four" 4 0,1,2,3 29502 "${four_args[@]}"  # the twin of seed 42
  logs=($(arms $one.log "$one@seed*.log" $one@rotated.log "$one@dp4_seed*.log" "$four*.log"))  # those there are
  tables_of same_tokens4_$one "${logs[@]}"
  python -m titan_nvfp4.tools.loss_log $(paths "${logs[@]}") --markdown \
      --group "1 GPU=$one,$one@seed*,$one@rotated" \
      --group "1 GPU, EP2 x FSDP2 2's batches=*@dp4_seed*" --group "EP2 x FSDP2 2=$four*" \
      --train-windows 51-100,101-150 | tail -24 | tee -a "$run/same_tokens4_$one.md"
  tables=(same_tokens4_$one.md same_tokens4_$one.csv)
elif [[ $mode == moe_fsdp ]]; then
  # EP2 over FSDP2 against FSDP2 alone (experts replicated, both in bf16 mixed precision): is a lower
  # MoE loss on two GPUs expert parallelism's, or FSDP2's mixed precision (one GPU runs under autocast)?
  # (FSDP_SEEDS, default 42 43; all three layouts read the same batches, see same_tokens)
  for s in ${FSDP_SEEDS-42 43}; do
    train "deepseek_v3_nvfp4_ep2@ep1_seed$s" 2 0,1 29502 --parallelism.expert_parallel_degree 1 --debug.seed "$s"
  done
  logs=($(arms "deepseek_v3_nvfp4@dp2_seed*.log" deepseek_v3_nvfp4_ep2.log "deepseek_v3_nvfp4_ep2@seed*.log" \
          "deepseek_v3_nvfp4_ep2@ep1_seed*.log"))
  tables_of moe_fsdp "${logs[@]}"
  python -m titan_nvfp4.tools.loss_log $(paths "${logs[@]}") --markdown \
      --group "1 GPU, EP2's batches=*@dp2_seed*" --group "FSDP2, no EP=*@ep1_seed*" \
      --group "EP2=deepseek_v3_nvfp4_ep2*" | tail -14 | tee -a "$run/moe_fsdp.md"
  tables=(moe_fsdp.md moe_fsdp.csv)
elif [[ $mode == moe_bf16 ]]; then
  # the same comparison in BF16: is EP2's lower MoE loss (docs/results.md, multi-GPU) the layout's, whatever the precision?
  seeds deepseek_v3_bf16 "42 43 44 45 46 47" deepseek_v3_bf16_ep2 "42 43 44"
  logs=(deepseek_v3_bf16@seed{42..47} deepseek_v3_bf16_ep2@seed{42..44})
  tables_of moe_bf16 "${logs[@]}"
  tables=(moe_bf16.md moe_bf16.csv)
elif [[ $mode == four ]]; then
  # issue 8: the 1-GPU references and controls (skipped where their logs are there), then the 4-GPU layouts
  references
  train llama3_nvfp4_fsdp2_tp2_ag 4 0,1,2,3 29502  # (a) the NVFP4 all-gather first, then (b) BF16, then (c) the MoE
  train llama3_nvfp4_fsdp2_tp2 4 0,1,2,3 29502
  train deepseek_v3_nvfp4_ep2_fsdp4 4 0,1,2,3 29502
  llama=(llama3_nvfp4 llama3_nvfp4@seed43 llama3_nvfp4@rotated llama3_nvfp4_fsdp2_tp2 llama3_nvfp4_fsdp2_tp2_ag)
  deepseek=(deepseek_v3_nvfp4 deepseek_v3_nvfp4@seed43 deepseek_v3_nvfp4@rotated deepseek_v3_nvfp4_ep2_fsdp4)
  tables_of four_llama3 "${llama[@]}"
  tables_of four_deepseek_v3 "${deepseek[@]}"
  grep -h "NVFP4: FSDP2 all-gather, first step" "$run/llama3_nvfp4_fsdp2_tp2_ag.log" | sort -u
  logs=("${llama[@]}" "${deepseek[@]}")
  tables=(four_llama3.md four_llama3.csv four_deepseek_v3.md four_deepseek_v3.csv)
else
  echo "usage: bash scripts/dist_runs.sh runs|bench|ep|compile|moe_seeds|same_tokens|moe_fsdp|moe_bf16|four|four_bench|same_tokens4 [STEPS]"; exit 2
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -2
if [[ -n ${OUT:-} ]]; then  # at most 8 files come back
  tar -cJf "$OUT/dist_logs_$mode.tar.xz" -C "$run" $(cd "$run" && ls "${logs[@]/%/.log}" 2>/dev/null)
  for t in "${tables[@]}"; do cp "$run/$t" "$OUT/" 2>/dev/null; done
  [[ ${SAVE_KERNEL_CACHE:-1} == 0 ]] || bash scripts/save_kernel_cache.sh
fi
true
