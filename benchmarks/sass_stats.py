"""Static cost of the quantization kernels without a GPU: compile each variant for sm_90 with Triton's
bundled ptxas, disassemble it (nvdisasm) and count SASS instructions per input element.

    python benchmarks/sass_stats.py [--variant NAME ...] [--config G BK WARPS] [--ops 12] [--dump DIR]
    python benchmarks/sass_stats.py --ceilings
    python benchmarks/sass_stats.py --ms-eden

``--ceilings``: for each operand kernel as bench_kernels.py times it (codes out, amaxes given), the
fewest instructions per element over the autotuner's tile configs and the share of the copy ceiling
that count allows at the full issue rate, against the count that 85% of copy allows. ``--ms-eden``: the
MS-EDEN backward kernels (kernels/ms_eden.py) at each Hadamard size, at the tile their launcher picks on a GPU.

The quantization kernel has no loops (every tile is unrolled), so the static count per program is its
dynamic count up to predication; divided by the elements one thread handles it is the issue cost per
element. An H100 issues ~29.6 T thread-instructions/s (132 SMs x 4 schedulers x 32 lanes x ~1.75 GHz)
and copies ~3 TB/s, so a kernel that reads 2 bytes and writes b bytes per element is issue-bound above
~(2 + b) x 10 instructions per element: ~26 for a row operand in codes, ~45 for forward X (fp16 rows +
column codes). benchmarks/quant_variants.py times the same variants on a GPU. For the device's codegen
run with its Triton: `pip download --no-deps triton==3.6.0` (the wheel for this Python), unzip it
into a folder and put that first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for real even when the test conftest set it

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402

from titan_nvfp4.kernels import ms_eden as me  # noqa: E402
from titan_nvfp4.kernels import quantize as q  # noqa: E402
from titan_nvfp4.kernels import swiglu as sw  # noqa: E402

VARIANTS = {  # name: (ROW, COL, RHT, STOCHASTIC_ROW, STOCHASTIC_COL, ROW_STAGED[, FOUR_OVER_SIX])
    "row": (True, False, False, False, False, False),
    "row f16": (True, False, False, False, False, True),
    "row SR": (True, False, False, True, False, False),
    "col RHT": (False, True, True, False, False, False),
    "col RHT SR": (False, True, True, False, True, False),
    "row f16 + col RHT (fwd X)": (True, True, True, False, False, True),
    "row SR f16 + col RHT SR f16 (bwd dY)": (True, True, True, True, True, True),
    "4/6: row": (True, False, False, False, False, False, True),
    "4/6: row f16 + col RHT (fwd X)": (True, True, True, False, False, True, True),
    "4/6: row SR f16 + col RHT SR f16 (bwd dY)": (True, True, True, True, True, True, True),
}
_POINTERS = {"X": "*bf16", "AMAX": "*i32", "GS": "*fp32", "RD": "*u8", "RS": "*fp8e4nv", "CD": "*u8",
             "CS": "*fp8e4nv", "SIGNS": "*fp32", "SEED": "*i64", "BEXP": "*i32"}
_ALIGNED_INTS = ("K", "sxm", "Mpad")  # what Triton's specialization sees for a contiguous K % 16 == 0 input


# the other kernels of a training step: (kernel, pointer types, constexprs); the elements counted are
# the input's, as for the operand kernel
OTHER = {
    "weight 16x16 staged + transpose (fwd W)": (q._quantize_2d_kernel, {"W": "*bf16", "AMAX": "*i32", "GS": "*fp32",
        "D": "*fp16", "S": "*fp8e4nv", "DT": "*u8", "ST": "*fp8e4nv", "BEXP": "*i32"},
        dict(swk=1, EMIT_T=True, GROUPED=False, EMIT_STAGED=True, NSP2=1, FOUR_OVER_SIX=False)),
    "4/6: weight 16x16 staged + transpose (fwd W)": (q._quantize_2d_kernel, {"W": "*bf16", "AMAX": "*i32",
        "GS": "*fp32", "D": "*fp16", "S": "*fp8e4nv", "DT": "*u8", "ST": "*fp8e4nv", "BEXP": "*i32"},
        dict(swk=1, EMIT_T=True, GROUPED=False, EMIT_STAGED=True, NSP2=1, FOUR_OVER_SIX=True)),
    "amax row + col RHT": (q._amax_kernel, {"X": "*bf16", "AMAX": "*i32", "SIGNS": "*fp32", "BEXP": "*i32"},
                           dict(sxk=1, ROW=True, COL=True, RHT=True, GROUPED=False)),
    "MoE SwiGLU forward + amaxes (h)": (sw._swiglu_fwd_kernel, {"H1": "*bf16", "H3": "*bf16", "OUT": "*bf16",
        "AMAX": "*i32", "SIGNS": "*fp32", "BEXP": "*i32"}, dict(COL=True, RHT=True, PRECISE=True, WIDE=False)),
    "MoE SwiGLU backward + amaxes (dh1, dh3)": (sw._swiglu_bwd_kernel, {"DH": "*bf16", "H1": "*bf16", "H3": "*bf16",
        "D1": "*bf16", "D3": "*bf16", "AMAX1": "*i32", "AMAX3": "*i32", "SIGNS": "*fp32", "BEXP": "*i32"},
        dict(COL=True, RHT=True, PRECISE=True, WIDE=False)),
}
VARIANTS.update({name: None for name in OTHER})


def _compile(fn, pointers: dict, const: dict, warps: int, arch: int, aligned_ints=(), **options):
    sig = {n: pointers.get(n, "i32") for n in fn.arg_names}
    for n in const:
        sig[n] = "constexpr"
    aligned = [n for n in fn.arg_names
               if n in pointers or n in _ALIGNED_INTS or n in aligned_ints or n in ("N", "swn", "D_ROWS", "D_EXPERT")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton_compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, **options})


def compile_variant(name: str, g=2, bk=128, warps=4, arch=90):
    if name in OTHER:
        fn, pointers, const = OTHER[name]
        return _compile(fn, pointers, dict(const, G=g, BK=bk), warps, arch)
    row, col, rht, sr_row, sr_col, row_f16, *four_over_six = VARIANTS[name]
    const = dict(sxk=1, ROW=row, COL=col, RHT=rht, STOCHASTIC_ROW=sr_row, STOCHASTIC_COL=sr_col, GROUPED=False,
                 ROW_STAGED=row_f16, NSP2=2, G=g, BK=bk, COL_STAGED=col and sr_col,  # dY's columns go out staged
                 FOUR_OVER_SIX=bool(four_over_six and four_over_six[0]))
    pointers = dict(_POINTERS, RD="*fp16" if row_f16 else "*u8", CD="*fp16" if const["COL_STAGED"] else "*u8")
    return _compile(q._quantize_kernel, pointers, const, warps, arch)


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass_and_registers(kernel) -> tuple[list[str], int, int]:
    """(SASS instruction lines, registers per thread, spill stores) of a compiled kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    lines = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", ln).rstrip(" ;") for ln in text.splitlines()
             if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    regs = re.search(r"REG:(\d+)", res)
    spills = re.search(r"STACK:(\d+)", res)
    return lines, int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else -1


def opcode(line: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", line).split()[0].split(".")[0]


ISSUE_PER_S = 29.6e12  # H100 thread-instructions per second (see the module docstring)
COPY_BYTES_PER_S = 2.97e12  # H100 copy ceiling, read + write (bench_kernels.py)
# bench_kernels.py's operand kernels with their constexprs and bytes per element (x read once, codes out)
CEILING_CASES = [
    ("rowwise 1x16 (RNE), amax given", dict(ROW=True, COL=False, RHT=False, STOCHASTIC_ROW=False, STOCHASTIC_COL=False), 2.5625),
    ("rowwise + RHT colwise, amaxes given", dict(ROW=True, COL=True, RHT=True, STOCHASTIC_ROW=False, STOCHASTIC_COL=False), 3.125),
    ("rowwise SR + RHT colwise SR, amaxes given (bwd dY)", dict(ROW=True, COL=True, RHT=True, STOCHASTIC_ROW=True, STOCHASTIC_COL=True),
     3.125),
]


def ceilings() -> None:
    """The issue-rate ceiling of each CEILING_CASES kernel, with and without Four Over Six."""
    print(f"triton {triton.__version__}, sm_90; issue {ISSUE_PER_S / 1e12:.1f} T/s, copy {COPY_BYTES_PER_S / 1e12:.2f} TB/s")
    print("| kernel | bytes / element | instructions / element at 85% of copy | fewest instructions / element "
          "(config) | ceiling, % of copy |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for four_over_six in (False, True):
        for name, flags, nbytes in CEILING_CASES:
            best = None
            for cfg in q._operand_configs():
                g, bk, warps = cfg.kwargs["G"], cfg.kwargs["BK"], cfg.num_warps
                const = dict(sxk=1, GROUPED=False, ROW_STAGED=False, COL_STAGED=False, NSP2=2,
                             FOUR_OVER_SIX=four_over_six, **cfg.kwargs, **flags)
                lines, _, _ = sass_and_registers(_compile(q._quantize_kernel, dict(_POINTERS), const, warps, 90))
                per = len(lines) / (16 * g * bk / (32 * warps))
                if best is None or per < best[0]:
                    best = (per, f"G{g} BK{bk} w{warps}")
            budget = ISSUE_PER_S * nbytes / (0.85 * COPY_BYTES_PER_S)
            ceiling = ISSUE_PER_S * nbytes / (best[0] * COPY_BYTES_PER_S)
            label = ("4/6: " if four_over_six else "") + name
            print(f"| {label} | {nbytes:.3f} | {budget:.1f} | {best[0]:.1f} ({best[1]}) | {ceiling:.0%} |", flush=True)


def ms_eden() -> None:
    """SASS per element of the MS-EDEN amax and quantize kernels (a bf16 dY read as values), sizes 16..128, at the
    launcher's GPU tile (me.tile_rows rows, me.WARPS warps): the issue cost that bounds them below copy bandwidth."""
    from titan_nvfp4.numerics.rht import rht_norm
    warps = me.WARPS
    print(f"triton {triton.__version__}, sm_90, {warps} warps, each thread holding whole rows of a program's tile")
    print("| kernel | size | SASS per element | regs | stack B | top opcodes per element |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    # a contiguous dY with 16 | rows, cols, as Triton's specialization sees it (sxc == 1), and its transpose as the
    # wgrad reads it: a strided view (sxr == 1), the form of three of the four operands of an emulated backward
    rows = (dict(sxc=1, HAS_PRE=False, CODES=False, TRANS=False, TILE_DIV=1, VEC=8), ("R", "C", "sxr", "ssr", "ssc"))
    view = (dict(sxr=1, HAS_PRE=False, CODES=False, TRANS=False, TILE_DIV=1, VEC=1), ("R", "C", "sxc", "ssr", "ssc"))
    for size in (16, 32, 64, 128):
        br = me.tile_rows(1 << 20, size, cuda=True)
        shape = dict(BR=br, SIZE=size, NORM=rht_norm(size), LOG2=size.bit_length() - 1)
        cases = [("amax", me._amax_kernel, dict(X="*bf16", S="*bf16", PRE="*fp32", SIGN_SEED="*i64", AMAX="*i32"),
                  {}, rows)]
        for staged, src in ((False, rows), (True, rows), (True, view)):
            name = "quantize, " + ("staged fp16" if staged else "codes + scales") + (", dYᵀ view" if src is view else "")
            cases.append((name, me._quantize_kernel,
                          dict(X="*bf16", XS="*bf16", PRE="*fp32", SIGN_SEED="*i64", DRAW_SEED="*i64", AMAX="*fp32",
                               GS="*fp32", D="*fp16" if staged else "*u8", S="*u8"), dict(STAGED=staged, ASM=True), src))
        for name, fn, pointers, extra, (src, aligned) in cases:
            kernel = _compile(fn, pointers, dict(src, **shape, **extra), warps, 90, aligned, enable_fp_fusion=False)
            lines, regs, stack = sass_and_registers(kernel)
            per_thread = br * size / (32 * warps)
            ops = collections.Counter(opcode(ln) for ln in lines)
            top = ", ".join(f"{o} {c / per_thread:.1f}" for o, c in ops.most_common(6))
            print(f"| {name} | {size} | {len(lines) / per_thread:.1f} | {regs} | {stack} | {top} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", action="append", choices=list(VARIANTS) + list(OTHER))
    p.add_argument("--config", nargs=3, type=int, default=(2, 128, 4), metavar=("G", "BK", "WARPS"))
    p.add_argument("--ops", type=int, default=10, help="most frequent opcodes to list")
    p.add_argument("--dump", help="folder for each variant's SASS")
    p.add_argument("--ceilings", action="store_true", help="issue-rate ceilings of bench_kernels.py's operand kernels")
    p.add_argument("--ms-eden", action="store_true", help="SASS per element of the MS-EDEN kernels")
    args = p.parse_args()
    if args.ms_eden:
        ms_eden()
        return
    if args.ceilings:
        ceilings()
        return
    g, bk, warps = args.config
    per_thread = 16 * g * bk / (32 * warps)
    print(f"triton {triton.__version__}, sm_90, G={g} BK={bk} warps={warps}: {per_thread:.0f} elements per thread")
    print("| variant | SASS instructions | per element | regs | stack B | top opcodes per element |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name in args.variant or VARIANTS:
        k = compile_variant(name, g=g, bk=bk, warps=warps)
        lines, regs, stack = sass_and_registers(k)
        ops = collections.Counter(opcode(ln) for ln in lines)
        top = ", ".join(f"{o} {c / per_thread:.1f}" for o, c in ops.most_common(args.ops))
        print(f"| {name} | {len(lines)} | {len(lines) / per_thread:.1f} | {regs} | {stack} | {top} |")
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, re.sub(r"\W+", "_", name) + ".sass"), "w") as f:
                f.write("\n".join(lines))


if __name__ == "__main__":
    main()
