"""Does Triton's Hopper warp specialization speed up a persistent TMA fp16 GEMM at the MoE shape?

    python benchmarks/warp_specialize_probe.py

A dense persistent GEMM [98768, 2048] x [2816, 2048]^T (the DeepSeek-like W1|W3 forward without the
expert grouping), its tile loop flattened (what kernels/grouped_gemm.py runs), nested, or nested and
warp-specialized (Triton needs it nested on Hopper), against cuBLAS. "check" is the largest difference
to cuBLAS's bf16-rounded product (0 or one bf16 ulp of the large outputs). Result (BENCHMARKS.md,
thirtieth entry): warp specialization is not faster than the flattened loop under triton 3.6.
"""
import torch
import triton
import triton.language as tl

@triton.jit
def mm(A, B, C, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NP: tl.constexpr,
       FLATTEN: tl.constexpr, WS: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(B, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    tm = tl.cdiv(M, BM)
    tn = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tm * tn, NP, flatten=FLATTEN, warp_specialize=WS):
        pm = tile // tn
        pn = tile % tn
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            acc = tl.dot(a_desc.load([pm * BM, k0]), b_desc.load([pn * BN, k0]).T, acc)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        tl.store(C + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(tl.bfloat16),
                 mask=(rm < M)[:, None] & (rn < N)[None, :])

triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
M, N, K = 98768, 2816, 2048
a = torch.randn(M, K, device="cuda", dtype=torch.float16)
b = torch.randn(N, K, device="cuda", dtype=torch.float16)
c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
np_ = torch.cuda.get_device_properties(0).multi_processor_count
ref = (a @ b.t()).bfloat16()
t = triton.testing.do_bench(lambda: a @ b.t(), rep=50, return_mode="median")
print(f"cuBLAS fp16 {t:.3f} ms {2*M*N*K/t/1e9:.0f} TF")
CONFIGS = ((128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4))
for bm, bn, bk, w, s in CONFIGS:
    for flat, ws in ((True, False), (False, False), (False, True)):
        name = f"{bm}x{bn}x{bk} w{w} s{s} flatten={flat} ws={ws}"
        try:
            def f():
                mm[(np_,)](a, b, c, M, N, K, BM=bm, BN=bn, BK=bk, NP=np_, FLATTEN=flat, WS=ws, num_warps=w,
                           num_stages=s)
            f()
            ok = torch.equal(c, ref) or (c.float() - ref.float()).abs().max().item()
            t = triton.testing.do_bench(f, rep=50, return_mode="median")
            print(f"{name}: {t:.3f} ms {2 * M * N * K / t / 1e9:.0f} TF (check {ok})", flush=True)
        except Exception as e:  # a config the compiler rejects
            print(f"{name}: failed {str(e).splitlines()[-1][:100]}", flush=True)
