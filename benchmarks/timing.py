"""Timing harness shared by the benchmarks: one definition of how a figure is taken.

The scripts run as files (``python benchmarks/x.py``), so this folder is first on ``sys.path`` and they
import it as ``from timing import ...``.

* ``ms``: median of ``triton.testing.do_bench`` (L2 flushed before each call). An eager call: when its
  host time (Python, launches) exceeds its GPU time, the events measure the host.
* ``graph_ms``: median of ``triton.testing.do_bench_cudagraph``: back-to-back calls captured in one
  CUDA graph and replayed, i.e. the GPU work alone, no host time (no L2 flush; the inputs timed here
  are larger than L2).
* ``replay_ms``: one captured call replayed, timed by ``ms`` (L2 flushed): a whole training step's GPU
  time when the step is too long to unroll.
* ``copy_ceiling``: bytes read + written per second by a device-to-device copy, the bandwidth ceiling
  the "of copy" columns divide by. ``cublas_bf16_ms`` / ``bf16_tflops``: the cuBLAS BF16 GEMM ceiling.
* ``peak_gib``: memory a call allocates beyond what was allocated before it.
"""

from __future__ import annotations

import sys

import torch
import triton

COPY_BYTES = 512 * 2**20  # the copy ceiling's buffer: 512 MiB, far beyond L2


def require_cuda() -> None:
    """Exit with one line if there is no CUDA GPU (call after argument parsing, so --help works anywhere)."""
    if not torch.cuda.is_available():
        sys.exit(f"{sys.argv[0]}: needs a CUDA GPU (torch {torch.__version__} sees none)")


def versions() -> dict:
    """GPU name, torch and triton versions, as every JSON output records them."""
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}


def header() -> str:
    """The first line of every table: ``# GPU  torch X  triton Y``."""
    v = versions()
    return f"# {v['gpu']}  torch {v['torch']}  triton {v['triton']}"


def ms(fn, rep: int = 50, warmup: int = 10) -> float:
    """Median ms of an eager call (triton.testing.do_bench, L2 flushed before each call)."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_ms(fn, rep: int = 50) -> float:
    """Median ms of fn's launches replayed from a CUDA graph: the kernels alone, without the host time an
    eager call spends in Python and launches."""
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def graph_ms_or_none(fn, rep: int = 50) -> float | None:
    """``graph_ms``, or None with the reason printed if fn cannot be captured (a finding, not a crash)."""
    try:
        return graph_ms(fn, rep)
    except Exception as e:  # noqa: BLE001
        print(f"  (CUDA graph capture failed: {type(e).__name__}: {str(e)[:160]})")
        return None


def replay_ms(step) -> float:
    """Median ms of one replay of ``step`` captured in a CUDA graph (L2 flushed before each replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (autotuning, allocations) outside the capture
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return ms(graph.replay)


def copy_ceiling(nbytes: int = COPY_BYTES, graph: bool = False) -> float:
    """Device copy bandwidth, bytes read + written per second, of an ``nbytes`` buffer; timed eagerly
    (``ms``) or graph-timed (``graph_ms``) to match the figures it is compared with."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = (graph_ms if graph else ms)(lambda: y.copy_(x))
    return 2 * nbytes / (t * 1e-3)


def cublas_bf16_ms(m: int, n: int, k: int) -> float:
    """Median ms of cuBLAS's BF16 [m, k] · [n, k]ᵀ."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return ms(lambda: a @ b.t())


def bf16_tflops(m: int, n: int, k: int) -> float:
    """cuBLAS BF16 TFLOP/s at M×N×K: the GEMM ceiling of the same run."""
    return 2 * m * n * k / (cublas_bf16_ms(m, n, k) * 1e-3) / 1e12


def peak_gib(fn) -> float:
    """GiB that one call of fn allocates at its peak beyond what is allocated before it (run fn once
    beforehand, so that autotuning and caches are not counted)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30
