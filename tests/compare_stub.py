"""A stand-in for `torchrun -m torchtitan.train` in tests/test_compare.py: reads the runner's arguments
and writes what TorchTitan writes, metric lines on stdout or (with --metrics.enable_tensorboard) only
TensorBoard scalars under the dump folder. --stub.offset shifts the loss; --stub.fail_at exits 1 there."""

import argparse
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--job.config_file", dest="config", required=True)
ap.add_argument("--training.steps", dest="steps", type=int, required=True)
ap.add_argument("--job.dump_folder", dest="dump", required=True)
ap.add_argument("--metrics.log_freq", dest="freq", type=int, default=1)
ap.add_argument("--metrics.enable_tensorboard", dest="tb", action="store_true")
ap.add_argument("--stub.offset", dest="offset", type=float, default=0.0)
ap.add_argument("--stub.fail_at", dest="fail_at", type=int, default=0)
args = ap.parse_args()
print(f"[titan] INFO - Starting job from {args.config}")
writer = None
if args.tb:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(f"{args.dump}/tb/20261123-0000")
for step in range(1, args.steps + 1):
    if step == args.fail_at:
        print("Traceback: stub failure", flush=True)
        sys.exit(1)
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
if writer is not None:
    writer.close()
