"""Where FSDP2's NVFP4 all-gather (`fsdp_nvfp4_all_gather`) spends its time, against FSDP2's BF16
all-gather of the same NVFP4 model: step time, host time inside the all-gather hooks, and the GPU
kernels that differ between the two.

    torchrun --nproc_per_node=1 benchmarks/fsdp_gather_overhead.py [--layers 8] [--dim 2048]
        [--hidden 5632] [--tokens 32768] [--steps 20] [--profile-hooks 2] [--json out.json]
    torchrun --nproc_per_node=2 benchmarks/fsdp_gather_overhead.py ...   (two GPUs of one host)

The model is the Linears of Llama3 `2B_bench` blocks (q, k, v, o and the SwiGLU MLP's three; RMSNorm
and attention's softmax left out, since neither all-gather touches them) as NVFP4Linear with the
`nvidia_paper` recipe, each block and the root under fully_shard with bf16 params and fp32 reduction,
as TorchTitan applies FSDP2. One rank isolates the hooks' own GPU and host cost: there the hook skips
the all-reduce of each weight's tile amaxes, which two ranks add back. --profile-hooks prints where the
pre hook's host time goes (cProfile inflates it: read the shares, not the totals). The third arm calls
``precompute_scales`` after each optimizer step, as the converter does in training: the forward's hooks
then only encode, and one all-reduce per step carries every weight's tile amaxes.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from titan_nvfp4 import NVFP4Recipe
from titan_nvfp4.distributed import fsdp_all_gather as AG
from titan_nvfp4.modules.nvfp4_linear import NVFP4Linear

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run on gloo with the reference backend


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


class Block(nn.Module):
    def __init__(self, i: int, dim: int, hidden: int, recipe: NVFP4Recipe):
        super().__init__()
        lin = lambda a, b, n: NVFP4Linear(a, b, False, recipe=recipe, layer_id=7 * i + n, name=f"{i}.{n}")  # noqa: E731
        self.q, self.k, self.v = lin(dim, dim, 0), lin(dim, dim // 2, 1), lin(dim, dim // 2, 2)
        self.o = lin(dim, dim, 3)
        self.w1, self.w3, self.w2 = lin(dim, hidden, 4), lin(dim, hidden, 5), lin(hidden, dim, 6)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        x = x + self.o(q + torch.cat([k, v], -1))  # stands in for attention: every projection gets a gradient
        return x + self.w2(F.silu(self.w1(x)) * self.w3(x))


class HookTimer:
    """Host seconds spent inside the NVFP4 all-gather hooks (wrapped around the class methods; FSDP2
    reads their signatures, which functools.wraps keeps)."""

    def __init__(self):
        self.pre = self.post = 0.0
        self.calls = 0
        self.profile: cProfile.Profile | None = None  # --profile-hooks: cProfile inside the pre hook
        AG.NVFP4ShardedWeight.fsdp_pre_all_gather = self._wrap(AG.NVFP4ShardedWeight.fsdp_pre_all_gather, "pre")
        AG.NVFP4ShardedWeight.fsdp_post_all_gather = self._wrap(AG.NVFP4ShardedWeight.fsdp_post_all_gather, "post")

    def _wrap(self, fn, which: str):
        @functools.wraps(fn)
        def timed(*a, **k):
            t = time.perf_counter()
            prof = self.profile if which == "pre" else None
            if prof is not None:
                prof.enable()
            try:
                return fn(*a, **k)
            finally:
                if prof is not None:
                    prof.disable()
                setattr(self, which, getattr(self, which) + time.perf_counter() - t)
                self.calls += which == "pre"
        return timed


def build(args, nvfp4_gather: bool, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    recipe = NVFP4Recipe(gemm_backend="emulated" if DEV == "cuda" else "reference")
    model = nn.Sequential(*[Block(i, args.dim, args.hidden, recipe) for i in range(args.layers)]).to(DEV)
    for m in model.modules():
        if isinstance(m, NVFP4Linear):
            nn.init.normal_(m.weight, std=m.weight.shape[1] ** -0.5)
            if nvfp4_gather:
                AG.wrap_weight(m)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def run_arm(args, nvfp4_gather: bool, mesh, timer: HookTimer, precompute: bool = False) -> dict:
    model = build(args, nvfp4_gather, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.tokens, args.dim, device=DEV, dtype=torch.bfloat16)

    def step():
        model(x).float().square().mean().backward()
        opt.step()
        if precompute:  # what the converter's post-optimizer hook does: all tile amaxes in one all-reduce
            AG.precompute_scales(model)
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    sync()
    timer.pre = timer.post = 0.0
    timer.calls = 0
    times = []
    for _ in range(args.steps):
        dist.barrier()
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    hooks = dict(hook_pre_ms=timer.pre * 1e3 / args.steps, hook_post_ms=timer.post * 1e3 / args.steps,
                 hook_calls=timer.calls / args.steps)  # the timed steps only, before the profiled ones
    hook_profile = ""
    if args.profile_hooks and nvfp4_gather:
        timer.profile = cProfile.Profile()
        for _ in range(args.profile_hooks):
            step()
        sync()
        buf = io.StringIO()
        pstats.Stats(timer.profile, stream=buf).sort_stats("tottime").print_stats(15)
        hook_profile, timer.profile = buf.getvalue(), None
    kernels = {}
    if DEV == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            sync()
        for ev in prof.key_averages():
            if ev.device_type == torch.autograd.DeviceType.CUDA and ev.self_device_time_total > 0:
                kernels[ev.key] = ev.self_device_time_total / 2e3  # ms per step
    return dict(step_ms=statistics.median(times), **hooks,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else 0.0, kernels=kernels,
                hook_profile=hook_profile)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=5632)
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per rank and step (16 x 2048 by default)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile-hooks", type=int, default=0, metavar="STEPS",
                    help="after timing, cProfile the NVFP4 pre-all-gather hook over this many steps (rank 0 prints it)")
    ap.add_argument("--json")
    args = ap.parse_args()
    from torch.distributed.device_mesh import init_device_mesh

    if DEV == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if DEV == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(DEV, (world,))
    timer = HookTimer()
    res = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "CPU (smoke run)", "world": world, **vars(args)}
    arms = (("bf16_gather", False, False), ("nvfp4_gather", True, False), ("nvfp4_gather_precomputed", True, True))
    for name, on, pre in arms:
        if DEV == "cuda":
            torch.cuda.reset_peak_memory_stats()
        res[name] = run_arm(args, on, mesh, timer, precompute=pre)
    if rank == 0:
        b, n, p = res["bf16_gather"], res["nvfp4_gather"], res["nvfp4_gather_precomputed"]
        print(f"# {res['gpu']} x{world}, torch {torch.__version__}; {args.layers} blocks dim {args.dim} hidden "
              f"{args.hidden}, {args.tokens} tokens per rank, median of {args.steps} steps")
        print("| all-gather | step ms | GPU kernels ms/step | hooks: pre ms/step (host) | post ms/step (host) "
              "| pre-hook calls/step | peak GiB |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, r in (("BF16", b), ("NVFP4 (each hook reduces)", n), ("NVFP4, precomputed scales", p)):
            print(f"| {name} | {r['step_ms']:.1f} | {sum(r['kernels'].values()):.1f} | {r['hook_pre_ms']:.1f} | "
                  f"{r['hook_post_ms']:.1f} | {r['hook_calls']:.0f} | {r['peak_gib']:.2f} |")
        print(f"NVFP4/BF16 step time: {n['step_ms'] / b['step_ms']:.3f}; with precomputed scales: "
              f"{p['step_ms'] / b['step_ms']:.3f}")
        diff = {k: n["kernels"].get(k, 0.0) - b["kernels"].get(k, 0.0) for k in set(n["kernels"]) | set(b["kernels"])}
        print("\nGPU kernels, ms per step, largest NVFP4 - BF16 differences:")
        print("| kernel | BF16 | NVFP4 | diff |\n| --- | ---: | ---: | ---: |")
        for k in sorted(diff, key=lambda k: -abs(diff[k]))[:15]:
            print(f"| {k[:90]} | {b['kernels'].get(k, 0.0):.2f} | {n['kernels'].get(k, 0.0):.2f} | {diff[k]:+.2f} |")
        if n["hook_profile"]:
            print(f"\ncProfile of the NVFP4 pre-all-gather hook over {args.profile_hooks} steps:\n{n['hook_profile']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
