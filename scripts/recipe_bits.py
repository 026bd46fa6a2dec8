"""Does this checkout compute the NVFP4 recipe's bits as another commit did? Saves an NVFP4Linear's forward and
backward outputs (the default recipe on the CPU reference path: inputs with outlier rows, fp32 and bf16, three steps
of the stochastic-rounding stream) and compares two such files bit for bit:

    python scripts/recipe_bits.py /tmp/head.pt
    git worktree add /tmp/old 888cf56 && PYTHONPATH=/tmp/old python scripts/recipe_bits.py /tmp/old.pt
    python scripts/recipe_bits.py --compare /tmp/old.pt /tmp/head.pt

With --experts it records TorchTitan's two grouped-expert blocks instead (SwiGLU and gpt-oss's, converted to NVFP4,
token groups with an empty expert; on the CPU, Triton interpreted: TorchTitan pads the token groups with a Triton
kernel, and `--backend emulated` runs ours; it needs titan_nvfp4.integration.experts, there since 2026-11):

    python scripts/recipe_bits.py --experts --backend emulated /tmp/head_experts.pt

Used to tell a change in the recipe's math from run-to-run drift when a training run is repeated on newer code
(docs/results.md, the ranking's progress), and to check that a change left the experts' bits alone
(docs/performance.md, MoE at real shapes). Runs on either layout of the package (flat before 2026-12, layered after).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import torch


def _classes():
    try:
        from titan_nvfp4.modules.nvfp4_linear import NVFP4Linear
        from titan_nvfp4.recipe import NVFP4Recipe
    except ImportError:  # the flat package of 2026-11
        from titan_nvfp4.nvfp4_linear import NVFP4Linear
        from titan_nvfp4.recipe import NVFP4Recipe
    return NVFP4Linear, NVFP4Recipe


def record(steps: int = 3) -> dict[str, torch.Tensor]:
    """{dtype_step_tensor: value} of y, dX and dW for ``steps`` forward+backward passes of one layer."""
    NVFP4Linear, NVFP4Recipe = _classes()
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        torch.manual_seed(1)
        lin = NVFP4Linear(512, 384, bias=False, recipe=NVFP4Recipe(), layer_id=3, dtype=dt)
        for step in range(steps):
            x = (torch.randn(256, 512) * (1 + 10 * (torch.rand(256, 1) < 0.05))).to(dt).requires_grad_()
            y = lin(x)
            y.backward(torch.randn_like(y))
            for k, v in (("y", y), ("dx", x.grad), ("dw", lin.weight.grad)):
                out[f"{dt}_{step}_{k}"] = v.detach().clone()
            lin.weight.grad = None
    return out


def _atomic_file():
    """This checkout's tools/atomic.atomic_file, loaded by path: PYTHONPATH may point titan_nvfp4 at an older tree
    that lacks it (stdlib imports only)."""
    spec = importlib.util.spec_from_file_location(
        "_recipe_bits_atomic", Path(__file__).resolve().parents[1] / "titan_nvfp4" / "tools" / "atomic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.atomic_file


WHAT = "what"  # the key naming what a file recorded (a Linear, or the experts on one backend)

# token counts per expert: an empty expert and groups that are not multiples of 16
EXPERT_COUNTS = (40, 0, 72, 8, 56, 24, 16, 40)


def record_experts(steps: int = 3, backend: str = "reference") -> dict[str, torch.Tensor]:
    """{block_step_tensor: value} of y, dX and every parameter's gradient for ``steps`` forward+backward passes of
    NVFP4GroupedExperts and NVFP4GptOssExperts (8 experts, dim 256), on the CPU with Triton interpreted."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError("recording the experts runs Triton kernels on CPU tensors: set TRITON_INTERPRET=1 before "
                           "Triton is imported (the script's --experts does)")
    from torchtitan.models.gpt_oss.model.moe import GptOssGroupedExperts
    from torchtitan.models.moe.moe import GroupedExperts

    from titan_nvfp4.integration.experts import NVFP4GptOssExperts, NVFP4GroupedExperts
    from titan_nvfp4.recipe import NVFP4Recipe

    blocks = {"swiglu": (NVFP4GroupedExperts, lambda: GroupedExperts(256, 176, 8, use_grouped_mm=True)),
              "gpt_oss": (NVFP4GptOssExperts, lambda: GptOssGroupedExperts(256, 192, 8, 7.0, use_grouped_mm=True))}
    counts = torch.tensor(EXPERT_COUNTS)
    rows = int(counts.sum())
    out = {}
    for block, (cls, build) in blocks.items():
        torch.manual_seed(1)
        mod = build()
        with torch.no_grad():
            for p in mod.parameters():
                p.normal_(0, 0.05)
        experts = cls.convert(mod, NVFP4Recipe(gemm_backend=backend), 5, name=f"{block}.experts")
        for step in range(steps):
            x = (torch.randn(rows, 256) * (1 + 10 * (torch.rand(rows, 1) < 0.05))).requires_grad_()
            y = experts(x, counts)
            y.backward(torch.randn_like(y))
            out[f"{block}_{step}_y"], out[f"{block}_{step}_dx"] = y.detach().clone(), x.grad.clone()
            for name, p in experts.named_parameters():
                out[f"{block}_{step}_d{name}"] = p.grad.clone()
                p.grad = None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="OUT.pt to record; with --compare, the two files")
    ap.add_argument("--compare", action="store_true", help="compare two recorded files bit for bit")
    ap.add_argument("--experts", action="store_true", help="record the grouped-expert blocks instead of a Linear")
    ap.add_argument("--backend", choices=("reference", "emulated"),
                    help="the experts' GEMM backend (default reference; emulated: the Triton kernels)")
    args = ap.parse_args(argv)
    if args.backend and not args.experts:
        ap.error("--backend applies to --experts")
    if not args.compare:
        if len(args.files) != 1:
            ap.error("record takes one output file")
        if args.experts:
            os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton
            rec = record_experts(backend=args.backend or "reference")
            rec[WHAT] = f"experts, backend {args.backend or 'reference'}"
        else:
            rec = record()
            rec[WHAT] = "linear"
        with _atomic_file()(args.files[0]) as tmp:  # a failed run leaves no half-written recording
            torch.save(rec, tmp)
        import titan_nvfp4
        print(f"recorded {args.files[0]} from {titan_nvfp4.__file__}")
        return 0
    if len(args.files) != 2:
        ap.error("--compare takes two files")
    if args.experts:
        ap.error("--compare reads what each file recorded; --experts applies to recording")
    a, b = (torch.load(f) for f in args.files)
    what = [rec.pop(WHAT, "linear") for rec in (a, b)]  # files of 2026-12-06 and before: a Linear
    if what[0] != what[1]:
        print(f"the files record different things: {what[0]} ({args.files[0]}) against {what[1]} ({args.files[1]})")
        return 2
    if a.keys() != b.keys():
        print(f"different tensors: {sorted(a.keys() ^ b.keys())}")
        return 1
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    for k in differ:
        print(f"{k}: max |difference| {(a[k].float() - b[k].float()).abs().max().item():.3g}")
    print(f"{len(a) - len(differ)} of {len(a)} tensors bit-identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
