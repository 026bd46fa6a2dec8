"""A stand-in for `torchrun -m torchtitan.train` in tests/test_compare.py: reads the runner's arguments
and writes what TorchTitan writes, metric lines on stdout or (with --metrics.enable_tensorboard) only
TensorBoard scalars under the dump folder. --stub.offset shifts the loss; --stub.fail_at exits 1 there (in a
run not resumed from its own checkpoint: a resumed run goes on); --stub.progress draws a progress bar (a carriage
return inside a line); --stub.sleep sleeps that long per step; --stub.corpus ID logs the line of a split read from
corpus ID; --stub.child starts a child process (as torchrun starts workers) and writes its pid to
<dump>/child.pid; --stub.worker starts one in a session of its own, as torchrun starts each worker, that writes a
line to the log every 0.1 s, and writes its pid and the stub's to <dump>/worker.pid and <dump>/stub.pid. With
--checkpoint.enable it saves <dump>/checkpoint/step-N (a .metadata file last) every --checkpoint.interval steps,
keeps the latest --checkpoint.keep_latest_k, and resumes after the latest whole one, or, without a checkpoint
folder, after the step of --checkpoint.initial_load_path (with --checkpoint.no_initial_load_model_only), as
TorchTitan does."""

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--job.config_file", dest="config")
ap.add_argument("--module")  # TorchTitan 0.3: --module M --config NAME, --dump_folder
ap.add_argument("--config", dest="config")
ap.add_argument("--training.steps", dest="steps", type=int, required=True)
ap.add_argument("--job.dump_folder", "--dump_folder", dest="dump", required=True)
ap.add_argument("--metrics.log_freq", dest="freq", type=int, default=1)
ap.add_argument("--metrics.enable_tensorboard", dest="tb", action="store_true")
ap.add_argument("--compile.enable", dest="compile", action="store_true")
ap.add_argument("--checkpoint.enable", dest="ckpt", action="store_true")
ap.add_argument("--checkpoint.interval", dest="interval", type=int, default=500)
ap.add_argument("--checkpoint.keep_latest_k", dest="keep", type=int, default=0)
ap.add_argument("--checkpoint.initial_load_path", dest="initial", default="")
ap.add_argument("--checkpoint.no_initial_load_model_only", dest="full_initial", action="store_true")
ap.add_argument("--debug.seed", dest="seed", type=int, default=42)  # shifts the loss by 0.003 a seed from 42
ap.add_argument("--stub.offset", dest="offset", type=float, default=0.0)
ap.add_argument("--stub.fail_at", dest="fail_at", type=int, default=0)
ap.add_argument("--stub.sleep", dest="sleep", type=float, default=0.0)
ap.add_argument("--stub.child", dest="child", action="store_true")
ap.add_argument("--stub.worker", dest="worker", action="store_true")
ap.add_argument("--stub.corpus", dest="corpus", default="")
ap.add_argument("--stub.progress", dest="progress", action="store_true")
args = ap.parse_args()
args.offset += 0.003 * (args.seed - 42)
dump = Path(args.dump)
dump.mkdir(parents=True, exist_ok=True)
if args.child:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    (dump / "child.pid").write_text(str(child.pid))
if args.worker:
    worker = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: print('[worker] alive', flush=True); "
                               "time.sleep(0.1)"], start_new_session=True)
    (dump / "stub.pid").write_text(str(os.getpid()))
    (dump / "worker.pid").write_text(str(worker.pid))
# TorchTitan: a step folder counts once its .metadata is written; an existing checkpoint folder, even without one,
# means this run's own (initial_load_path ignored, so a cut-short save starts the job at step 1)
ckpts = sorted(int(p.parent.name[5:]) for p in (dump / "checkpoint").glob("step-*/.metadata")) if args.ckpt else []
own = args.ckpt and (dump / "checkpoint").exists()
first = ckpts[-1] + 1 if ckpts else 1
if args.ckpt and not own and args.initial:
    if not Path(args.initial).is_dir():
        print("ValueError: checkpoint.initial_load_path is specified but the path is not valid.", flush=True)
        sys.exit(1)
    first = int(Path(args.initial).name[5:]) + 1 if args.full_initial else 1
print(f"[titan] INFO - Starting job from {args.config} (module {args.module}), compile {args.compile}, "
      f"TORCHINDUCTOR_CUDAGRAPHS={os.environ.get('TORCHINDUCTOR_CUDAGRAPHS')}, "
      f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}, from step {first}, at {time.time():.3f}", flush=True)
if args.progress:  # a progress bar, as the datasets library draws one: carriage returns inside a line
    print("Generating train split: 0 examples\rGenerating train split: 10 examples", flush=True)
if args.corpus:  # the line titan_nvfp4.data.registry logs for each split a job reads
    print(f"[titan] INFO - Reading train.jsonl of /assets/pysources: corpus {args.corpus} (10 documents, ~0.01M "
          "tokens)", flush=True)
writer = None
if args.tb:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(f"{args.dump}/tb/20261123-0000")
for step in range(first, args.steps + 1):
    time.sleep(args.sleep)
    if step == args.fail_at and not ckpts:  # not in a run resumed from its own checkpoint
        print("Traceback: stub failure", flush=True)
        sys.exit(1)
    if args.ckpt and step % args.interval == 0:
        saved = dump / "checkpoint" / f"step-{step}"
        saved.mkdir(parents=True, exist_ok=True)
        (saved / "__0_0.distcp").write_text(f"state at step {step}")
        (saved / ".metadata").write_text("written last")
        old = sorted((p for p in (dump / "checkpoint").glob("step-*")), key=lambda p: int(p.name[5:]))
        for gone in old[:-args.keep] if args.keep > 0 else []:
            shutil.rmtree(gone)
    if step % args.freq and step != 1:
        continue
    loss = 8.0 / step ** 0.5 + args.offset + 0.01 * ((step * 7919) % 13 - 6) / 6  # shared "batch noise"
    if writer is not None:
        writer.add_scalar("loss_metrics/global_avg_loss", loss, step)
        writer.add_scalar("grad_norm", 1.0, step)
        writer.add_scalar("throughput(tps)", 1000.0, step)
        writer.add_scalar("memory/max_reserved(GiB)", 2.5, step)
    else:
        print(f"[titan] 2026-11-23 - root - INFO - step: {step:2}  loss: {loss:8.5f}  grad_norm:  1.0000  "
              f"memory:  2.50GiB(3.00%)  tps: 1,000  tflops: 1.00  mfu: 0.10%", flush=True)
        if step % 20 == 0:  # TorchTitan's validator line, the loss 0.1 above the training loss's trend
            print(f"[titan] 2026-11-23 - root - INFO - validate step: {step:2}  loss: {8.0 / step ** 0.5 + args.offset + 0.1:7.4f}",
                  flush=True)
print(f"[titan] INFO - done at {time.time():.3f}", flush=True)
if writer is not None:
    writer.close()
