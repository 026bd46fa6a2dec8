"""Exploration: which emulated-GEMM structure gets closest to cuBLAS BF16 on this GPU.

Variants, all computing the same NVFP4 product (the kernel before 2026-11-23, both operands packed and
dequantized in registers, reached 33-41% of cuBLAS; see BENCHMARKS.md):
  rs      - A packed and dequantized in registers (wgmma A-from-registers), B pre-dequantized to fp16
            in a pair-split layout [2N, K/2] read by TMA
  rsa     - rs with A dequantized by PTX (4 bytes per call)
  rsaj    - rsa with lo/hi nibbles joined into one K-ordered tile and B in its plain layout (what
            titan_nvfp4/kernels/gemm.py ships)
  f16     - both operands fp16 via TMA: the ceiling of a Triton kernel with this epilogue
  pf16    - f16 as a persistent kernel (one program per SM walking the tiles, loops flattened so the
            next tile's loads overlap this tile's epilogue), C written by a TMA store
  pf16ws  - pf16 with Triton's warp specialization (producer warps for the loads)
  dpf16   - pf16 with device-side tensor descriptors (no host descriptor objects per launch): the
            library's persistent kernel, _nvfp4_gemm_persistent_kernel
Prints TFLOP/s per variant and tile config, and the ratio to cuBLAS BF16 in the same run.

    python benchmarks/gemm_variants.py [--shapes 8192x8192x8192,...]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from titan_nvfp4.kernels.gemm import _dequant_asm, _nvfp4_gemm_persistent_kernel, grouped_tile, swizzle_tile
from titan_nvfp4.numerics.nvfp4 import quantize_nvfp4


@triton.jit
def _k_rs(A, SA, b_desc, C, GS, M, N, K, sam, ssam, scm,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, EXPAND: tl.constexpr):
    pid_m, pid_n = grouped_tile(M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rb = tl.arange(0, BK // 2)
    a_ptr = A + rm[:, None].to(tl.int64) * sam + rb[None, :]
    if EXPAND:
        sa_ptr = SA + rm[:, None].to(tl.int64) * ssam + (rb // 8)[None, :]
    else:
        sa_ptr = SA + rm[:, None].to(tl.int64) * ssam + tl.arange(0, BK // 16)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K // 2, BK // 2):
        raw = tl.load(a_ptr).to(tl.uint16)
        if EXPAND:
            s = tl.load(sa_ptr).to(tl.float16)
        else:
            s16 = tl.load(sa_ptr).to(tl.float16)
            s = tl.reshape(tl.broadcast_to(s16[:, :, None], (BM, BK // 16, 8)), (BM, BK // 2))
        lo = (((raw & 0x7) << 9) | ((raw & 0x8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True) * s
        hi = (((raw & 0x70) << 5) | ((raw & 0x80) << 8)).to(tl.uint16).to(tl.float16, bitcast=True) * s
        b_lo = b_desc.load([pid_n * BN, k0])
        b_hi = b_desc.load([N + pid_n * BN, k0])
        acc = tl.dot(lo, b_lo.T, acc)
        acc = tl.dot(hi, b_hi.T, acc)
        a_ptr += BK // 2
        sa_ptr += BK // 16
    out = acc * (16384.0 * tl.load(GS))
    rn = pid_n * BN + tl.arange(0, BN)
    tl.store(C + rm[:, None].to(tl.int64) * scm + rn[None, :], out.to(C.dtype.element_ty))


@triton.jit
def _k_rsa(A, SA, b_desc, C, GS, M, N, K, sam, ssam, scm,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, JOIN: tl.constexpr):
    pid_m, pid_n = grouped_tile(M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rb = tl.arange(0, BK // 2)
    a_ptr = A + rm[:, None].to(tl.int64) * sam + rb[None, :]
    sa_ptr = SA + rm[:, None].to(tl.int64) * ssam + tl.arange(0, BK // 16)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K // 2, BK // 2):
        raw = tl.load(a_ptr)
        s16 = tl.load(sa_ptr).to(tl.float16)
        s = tl.reshape(tl.broadcast_to(s16[:, :, None], (BM, BK // 16, 8)), (BM, BK // 2))
        lo, hi = _dequant_asm(raw, s)
        if JOIN:
            a = tl.reshape(tl.join(lo, hi), (BM, BK))
            b = b_desc.load([pid_n * BN, 2 * k0])
            acc = tl.dot(a, b.T, acc)
        else:
            b_lo = b_desc.load([pid_n * BN, k0])
            b_hi = b_desc.load([N + pid_n * BN, k0])
            acc = tl.dot(lo, b_lo.T, acc)
            acc = tl.dot(hi, b_hi.T, acc)
        a_ptr += BK // 2
        sa_ptr += BK // 16
    out = acc * (16384.0 * tl.load(GS))
    rn = pid_n * BN + tl.arange(0, BN)
    tl.store(C + rm[:, None].to(tl.int64) * scm + rn[None, :], out.to(C.dtype.element_ty))


@triton.jit
def _k_f16(a_desc, b_desc, C, GS, M, N, K, scm,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(M, N, BM, BN, GROUP_M)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = a_desc.load([pid_m * BM, k0])
        b = b_desc.load([pid_n * BN, k0])
        acc = tl.dot(a, b.T, acc)
    out = acc * tl.load(GS)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    tl.store(C + rm[:, None].to(tl.int64) * scm + rn[None, :], out.to(C.dtype.element_ty))


@triton.jit
def _k_pf16(a_desc, b_desc, c_desc, GS, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, WS: tl.constexpr, SUBTILE: tl.constexpr):
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    gs = tl.load(GS)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_SMS, flatten=True, warp_specialize=WS):
        pid_m, pid_n = swizzle_tile(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([pid_m * BM, ki * BK])
            b = b_desc.load([pid_n * BN, ki * BK])
            acc = tl.dot(a, b.T, acc)
        out = acc * gs
        if SUBTILE:
            o0, o1 = tl.split(tl.permute(tl.reshape(out, (BM, 2, BN // 2)), (0, 2, 1)))
            c_desc.store([pid_m * BM, pid_n * BN], o0.to(c_desc.dtype))
            c_desc.store([pid_m * BM, pid_n * BN + BN // 2], o1.to(c_desc.dtype))
        else:
            c_desc.store([pid_m * BM, pid_n * BN], out.to(c_desc.dtype))


def _pair_split_fp16(t) -> torch.Tensor:
    """[2N, K/2] fp16: rows 0..N-1 the even-k values q·e_b, rows N..2N-1 the odd-k ones (exact in fp16)."""
    v = t.scaled_codes(torch.float32)
    n = v.shape[0]
    return torch.cat([v[:, 0::2], v[:, 1::2]], 0).to(torch.float16).contiguous().reshape(2 * n, -1)


CONFIGS = [(128, 256, 64, 8, 3), (128, 256, 128, 8, 3), (128, 256, 128, 8, 2), (128, 128, 64, 4, 4),
           (128, 128, 128, 8, 3), (256, 128, 64, 8, 3), (256, 128, 128, 8, 2), (128, 256, 64, 8, 4)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8192x8192x8192,16384x4096x4096,16384x14336x4096,16384x4096x14336")
    p.add_argument("--variants", default="rs,rsa,rsaj,f16")
    p.add_argument("--configs", default=None, help="BMxBNxBKxWARPSxSTAGES,... (default: CONFIGS)")
    args = p.parse_args()
    torch.manual_seed(0)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    for shape in args.shapes.split(","):
        M, N, K = (int(v) for v in shape.split("x"))
        flop = 2 * M * N * K
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        ms = triton.testing.do_bench(lambda: a @ b.t(), warmup=50, rep=300)
        cublas = flop / ms / 1e9
        print(f"\n{shape}: cuBLAS BF16 {ms:.3f} ms {cublas:.0f} TFLOP/s", flush=True)
        aq = quantize_nvfp4(a)
        bq = quantize_nvfp4(b)
        gs = (aq.global_scale.float() * bq.global_scale.float()).reshape(1)
        one = torch.ones(1, device="cuda")
        ref = None
        b_split = _pair_split_fp16(bq)
        a_f16 = aq.scaled_codes(torch.float16)
        b_f16 = bq.scaled_codes(torch.float16)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        configs = CONFIGS if args.configs is None else [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
        for var, (bm, bn, bk, w, s) in itertools.product(args.variants.split(","), configs):
            try:
                if var in ("rsa", "rsaj"):
                    join = var == "rsaj"
                    bd = TensorDescriptor.from_tensor(b_f16 if join else b_split, [bn, bk if join else bk // 2])
                    fn = lambda: _k_rsa[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](  # noqa: E731
                        aq.data, aq.scale, bd, out, gs, M, N, K, aq.data.stride(0), aq.scale.stride(0),
                        out.stride(0), BM=bm, BN=bn, BK=bk, GROUP_M=8, JOIN=join, num_warps=w, num_stages=s)
                elif var in ("rs", "rsx"):
                    bd = TensorDescriptor.from_tensor(b_split, [bn, bk // 2])
                    fn = lambda: _k_rs[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](  # noqa: E731
                        aq.data, aq.scale, bd, out, gs, M, N, K, aq.data.stride(0), aq.scale.stride(0),
                        out.stride(0), BM=bm, BN=bn, BK=bk, GROUP_M=8, EXPAND=(var == "rsx"),
                        num_warps=w, num_stages=s)
                elif var in ("pf16", "pf16ws", "pf16st", "dpf16"):
                    ws, sub = var == "pf16ws", var == "pf16st"
                    sms = torch.cuda.get_device_properties(0).multi_processor_count
                    grid = (min(sms, triton.cdiv(M, bm) * triton.cdiv(N, bn)),)
                    if var == "dpf16":
                        fn = lambda: _nvfp4_gemm_persistent_kernel[grid](  # noqa: E731
                            a_f16, b_f16, out, gs, one, gs, M, N, K, K, K, N, HAS_BIAS=False, BM=bm, BN=bn, BK=bk,
                            GROUP_M=8, SUBTILE=False, NUM_PROGRAMS=sms, num_warps=w, num_stages=s)
                    else:
                        descs = (TensorDescriptor.from_tensor(a_f16, [bm, bk]), TensorDescriptor.from_tensor(b_f16, [bn, bk]),
                                 TensorDescriptor.from_tensor(out, [bm, bn // 2 if sub else bn]))
                        fn = lambda: _k_pf16[grid](  # noqa: E731
                            *descs, gs, M, N, K, BM=bm, BN=bn, BK=bk, GROUP_M=8, NUM_SMS=sms, WS=ws, SUBTILE=sub,
                            num_warps=w, num_stages=s)
                else:
                    ad = TensorDescriptor.from_tensor(a_f16, [bm, bk])
                    bd = TensorDescriptor.from_tensor(b_f16, [bn, bk])
                    fn = lambda: _k_f16[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](  # noqa: E731
                        ad, bd, out, gs, M, N, K, out.stride(0), BM=bm, BN=bn, BK=bk, GROUP_M=8,
                        num_warps=w, num_stages=s)
                fn()
                torch.cuda.synchronize()
                if ref is None:
                    ref = out.float().clone()
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                t = triton.testing.do_bench(fn, warmup=25, rep=200)
                tf = flop / t / 1e9
                print(f"  {var:5s} {bm}x{bn}x{bk} w{w} s{s}: {t:.3f} ms {tf:.0f} TFLOP/s "
                      f"{tf / cublas:.0%} of cuBLAS  (max rel diff vs first {err:.1e})", flush=True)
            except Exception as e:  # a config that does not compile (shared memory) is reported, not fatal
                print(f"  {var:5s} {bm}x{bn}x{bk} w{w} s{s}: FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)


if __name__ == "__main__":
    main()
