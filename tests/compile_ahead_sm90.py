"""A stand-in process for tests/test_tune_compile_ahead.py: with Triton's driver presenting an sm_90 GPU (compile only:
nothing launches), compile the candidate configs of two of the package's autotuned kernels ahead
(ShippedAutotuner.compile_candidates, on threads) and then one by one as Triton's benchmarks would (each config's
pre-hook, then the kernel's run), in fresh in-memory caches each time; print the compiled kernels of both as JSON.

    TRITON_CACHE_DIR=... python tests/compile_ahead_sm90.py
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TITAN_NVFP4_TUNE_THREADS", "4")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from precompile_first_use import Sm90Driver  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402


def launches() -> list[tuple]:
    """(autotuner, args, launch kwargs) of a dequantization and of a TMA GEMM as the package calls them, captured."""
    from titan_nvfp4.kernels import gemm, launch
    from titan_nvfp4.numerics.nvfp4 import quantize_nvfp4
    captured = []
    gemm.launch = lambda fn, grid, *a, **k: captured.append((fn, a, dict(k, grid=grid, warmup=False)))
    gemm.shared_memory = lambda device: 232448  # an H100's, for the GEMM's shared-memory prune
    t = quantize_nvfp4(torch.randn(4096, 2048))
    rows, cols = t.storage_shape
    words = torch.empty((rows, cols), dtype=torch.float16).view(torch.int32)
    dequant = (t.data, t.scale, words, rows, cols, t.data.stride(0), t.scale.stride(0), t.scale.stride(1),
               words.stride(0), launch.tune_bucket(rows), launch.tune_bucket(cols))
    a = quantize_nvfp4(torch.randn(2048, 1024).bfloat16())
    b = quantize_nvfp4(torch.randn(1536, 1024).bfloat16(), block_shape=(16, 16))
    gemm.nvfp4_gemm_triton(a, b, torch.float32, autotune=True, use_tma=True, stage_a=False)
    tma = [c for c in captured if isinstance(c[0], launch.ShippedAutotuner)]
    return [(gemm._dequant_autotuned, dequant, {"SCALE_DIV": 1, "grid": (1,), "warmup": False}), tma[0]]


def kernels(jit) -> list[dict]:
    return sorted(({"hash": k.hash, "descs": {n: str(v) for n, v in k.src.signature.items() if "desc" in str(v)}}
                   for k in jit.device_caches[0][0].values()), key=lambda d: d["hash"])


def main() -> None:
    driver.set_active(Sm90Driver())
    out = {}
    for tuner, args, meta in launches():
        tuner.nargs = dict(zip(tuner.arg_names, args))
        jit = tuner.fn
        jit.device_caches = defaultdict(jit.create_binder)
        before = tuner.compiled_ahead
        tuner.compile_candidates(args, meta)
        ahead = kernels(jit)
        jit.device_caches = defaultdict(jit.create_binder)
        configs = tuner.prune_configs(meta)
        for config in configs:  # as Autotuner._bench calls the kernel for each config
            current = dict(meta, **config.all_kwargs())
            if config.pre_hook:
                config.pre_hook({**tuner.nargs, **current})
            jit.run(*args, **dict(current, warmup=True))
        out[tuner.base_fn.__name__] = {"sent": tuner.compiled_ahead - before, "ahead": ahead, "one_by_one": kernels(jit),
                                       "configs": [dict(c.kwargs) for c in configs]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
