"""An autotuner's candidate configs compile together on threads before their first benchmark (launch.ShippedAutotuner
.compile_candidates): each config's pre-hook runs before its specialization, the compiles go to Triton's async-compile
mode (a pool thread runs them), once per key, and the choice is the one the benchmarks make either way. The kernel is
a stand-in that records how Triton's autotuner calls it; tests/compile_ahead_sm90.py compiles two of the package's
autotuned kernels for sm_90 on the CPU (a stand-in driver, nothing launched), ahead and one by one; the last test
compiles real GEMM candidates ahead on a GPU."""

import inspect
import threading

import pytest

triton = pytest.importorskip("triton")
async_compile = pytest.importorskip("triton.runtime._async_compile")

from titan_nvfp4.kernels import launch as L  # noqa: E402


@triton.jit
def _kernel(x_ptr, n, BLOCK: triton.language.constexpr):
    pass


class _Recorder:
    """Stands in for the JIT function under the autotuner: records each call, and sends a warmup's compile to the
    active async-compile mode as JITFunction._do_compile does."""

    def __init__(self, block_seen):
        self.calls, self.block_seen, self.compiled_on = [], block_seen, []
        self.fail_compile, self.fail_finish = set(), False

    def run(self, *args, grid, warmup, **kw):
        mode = async_compile.active_mode.get()
        self.calls.append(("warmup" if warmup else "run", kw["BLOCK"], mode is not None, self.block_seen[0]))
        if warmup and mode is not None:
            block = kw["BLOCK"]

            def compile_fn():
                if block in self.fail_compile:
                    raise RuntimeError(f"PTXAS error for BLOCK={block}")  # as a compile that fails on its thread
                return threading.current_thread().name

            def finish(name):
                if self.fail_finish:
                    raise RuntimeError("a post-compile hook failed")
                self.compiled_on.append(name)
            hooks = [compile_fn, finish]
            if "cleanup_fn" in inspect.signature(mode.submit).parameters:  # Triton 3.7+
                hooks.append(lambda future_kernel: None)
            mode.submit(("k", kw["BLOCK"], args[1]), *hooks)
        return None


def _tuner(monkeypatch, threads="4"):
    block_seen = [None]

    def hook(nargs):  # as the GEMMs' hooks set a TMA descriptor's block shape from the config
        block_seen[0] = nargs["BLOCK"]
    configs = [triton.Config({"BLOCK": b}, num_warps=4, pre_hook=hook) for b in (16, 32, 64)]
    tuner = triton.autotune(configs, key=["n"])(_kernel)
    tuner.__class__ = L.ShippedAutotuner  # as launch.autotune makes it, without joining launch.TUNERS
    tuner.cache_results = False
    fake = _Recorder(block_seen)
    tuner.fn = fake
    speed = {16: 3.0, 32: 1.0, 64: 2.0}
    monkeypatch.setitem(tuner.__dict__, "do_bench", lambda call, quantiles=None: (call(), [speed[fake.calls[-1][1]]] * 3)[1])
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    monkeypatch.setenv("TITAN_NVFP4_TUNE_THREADS", threads)
    monkeypatch.setenv(L.shipped_tuning.ENV, "0")
    return tuner, fake


def test_candidates_compile_on_threads_before_the_first_benchmark(monkeypatch):
    tuner, fake = _tuner(monkeypatch)
    tuner.run(object(), 100, grid=(1,), warmup=False)
    warm = [c for c in fake.calls if c[0] == "warmup"]
    assert [c[1] for c in warm] == [16, 32, 64] and all(c[2] for c in warm)  # all three, inside the mode
    assert all(c[3] == c[1] for c in warm)  # each config's pre-hook ran before its specialization was taken
    assert fake.calls.index(warm[-1]) < fake.calls.index(next(c for c in fake.calls if c[0] == "run"))
    assert sorted(fake.compiled_on) and all(n.startswith("titan-nvfp4-tune") for n in fake.compiled_on)
    assert tuner.best_config.kwargs["BLOCK"] == 32 and tuner.compiled_ahead == 3
    assert async_compile.active_mode.get() is None  # the mode is closed again

    n = len(fake.calls)
    tuner.run(object(), 100, grid=(1,), warmup=False)  # the key is chosen: nothing compiles ahead again
    assert [c[0] for c in fake.calls[n:]] == ["run"] and tuner.compiled_ahead == 3
    tuner.run(object(), 300, grid=(1,), warmup=False)  # a new key: its candidates compile together
    assert tuner.compiled_ahead == 6
    tuner.cache.clear()  # the same key benchmarked again (a cleared cache): compiled ahead again
    tuner.run(object(), 300, grid=(1,), warmup=False)
    assert tuner.compiled_ahead == 9


def test_a_candidate_failing_to_compile_ahead_is_left_to_its_benchmark(monkeypatch):
    tuner, fake = _tuner(monkeypatch)
    fake.fail_compile = {64}
    tuner.run(object(), 100, grid=(1,), warmup=False)
    assert len(fake.compiled_on) == 2  # 16 and 32 compiled ahead; 64 failed on its thread
    assert [c[1] for c in fake.calls if c[0] == "run"][:3] == [16, 32, 64]  # all three benchmarked, as Triton does
    assert tuner.best_config.kwargs["BLOCK"] == 32 and async_compile.active_mode.get() is None


def test_a_failure_while_finishing_the_compiles_leaves_no_mode_active(monkeypatch):
    # Triton 3.6 clears its mode only after finishing every compile: later compiles would go to a shut-down pool.
    tuner, fake = _tuner(monkeypatch)
    fake.fail_finish = True
    with pytest.raises(RuntimeError, match="post-compile hook"):
        tuner.run(object(), 100, grid=(1,), warmup=False)
    assert async_compile.active_mode.get() is None


def test_real_kernels_compiled_ahead_are_the_ones_their_benchmarks_would_compile(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "TITAN_NVFP4_TUNE_THREADS": "4",
           "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(tests / "compile_ahead_sm90.py")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("_dequant_kernel", "_nvfp4_gemm_kernel"):
        k = got[name]
        assert k["sent"] == len(k["configs"]) == len(k["ahead"]) >= 3, k
        assert k["ahead"] == k["one_by_one"], name  # the same compiled kernels (Triton's hashes), one per config
    blocks = sorted(str([c["BN"], c["BK"]]) for c in got["_nvfp4_gemm_kernel"]["configs"])
    assert sorted(d["descs"]["b_desc"].split("[")[1].rstrip("]>") for d in got["_nvfp4_gemm_kernel"]["ahead"]) == \
        [b.strip("[]") for b in blocks]  # each TMA config compiled for its own block shape (its pre-hook ran)


@pytest.mark.parametrize("threads", ["0", "1"])
def test_one_thread_compiles_inside_the_benchmarks_as_triton_does(monkeypatch, threads):
    tuner, fake = _tuner(monkeypatch, threads)
    tuner.run(object(), 100, grid=(1,), warmup=False)
    assert not [c for c in fake.calls if c[0] == "warmup"] and tuner.best_config.kwargs["BLOCK"] == 32


def test_an_active_async_mode_of_the_caller_is_left_alone(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor
    tuner, fake = _tuner(monkeypatch)
    with ThreadPoolExecutor(1) as pool, async_compile.AsyncCompileMode(pool):
        tuner.run(object(), 100, grid=(1,), warmup=False)
    assert not [c for c in fake.calls if c[0] == "warmup"] and tuner.compiled_ahead == 0


def test_a_bad_thread_count_is_named(monkeypatch):
    monkeypatch.setenv("TITAN_NVFP4_TUNE_THREADS", "many")
    with pytest.raises(ValueError, match="TITAN_NVFP4_TUNE_THREADS='many'"):
        L.tune_threads()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="compiles and benchmarks for the GPU")
def test_gemm_candidates_compile_ahead_on_the_gpu_with_the_same_result(monkeypatch):
    """The TMA GEMM (configs with pre-hooks) and the grouped rows GEMM autotuned with nothing shipped or stored: no
    compile of their kernels happens inside a benchmark, and the result is the bits of the same tuning done one
    compile at a time (every config gives the same bits: tests/test_shipped_tuning.py)."""
    import torch

    from titan_nvfp4.kernels import gemm as g
    from titan_nvfp4.kernels import grouped_gemm as gg
    from titan_nvfp4.numerics.nvfp4 import quantize_nvfp4

    gen = torch.Generator().manual_seed(7)
    a = quantize_nvfp4(torch.randn(2048, 1024, generator=gen).cuda().bfloat16())
    b = quantize_nvfp4(torch.randn(1536, 1024, generator=gen).cuda().bfloat16(), block_shape=(16, 16))
    T, K, N = 4096, 1024, 1408
    ends = torch.tensor([0, 512, 1040, 1040, 2048, 2064, 3200, 4096], dtype=torch.int32).cuda()
    a16, w16 = torch.randn(T, K, generator=gen).half().cuda(), torch.randn(8 * N, K, generator=gen).half().cuda()
    gs = torch.rand(9, generator=gen).cuda() + 0.5
    tuners = (g._nvfp4_gemm_autotuned, gg._rows_persistent_autotuned)
    monkeypatch.setenv(L.shipped_tuning.ENV, "0")
    monkeypatch.setattr(gg, "ROWS_KERNEL", "persistent")
    for t in tuners:
        monkeypatch.setattr(t, "cache_results", False)
    compiles, benchmarking = [], [False]

    def hook(*args, **kwargs):  # any kernel compiled during the launches: inside a benchmark or not
        compiles.append(benchmarking[0])
        return False
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", hook)
    for t in tuners:
        bench = t.do_bench

        def timed(call, quantiles=None, _bench=bench):
            benchmarking[0] = True
            try:
                return _bench(call, quantiles=quantiles)
            finally:
                benchmarking[0] = False
        monkeypatch.setitem(t.__dict__, "do_bench", timed)

    def tuned(threads):
        monkeypatch.setenv("TITAN_NVFP4_TUNE_THREADS", threads)
        for t in tuners:
            monkeypatch.setattr(t, "cache", {})
            monkeypatch.setattr(L.launcher(t), "cache", {})
        compiles.clear()
        ahead = [t.compiled_ahead for t in tuners]
        out = [g.nvfp4_gemm_triton(a, b, torch.float32, autotune=True, use_tma=True, stage_a=False),
               gg.grouped_gemm_rows(a16, w16, ends, gs, gs, N, N, 0, torch.bfloat16)]
        torch.cuda.synchronize()
        return out, [t.compiled_ahead - n for t, n in zip(tuners, ahead)], list(compiles)

    one, ahead1, _ = tuned("1")  # also compiles every other kernel of the two launches
    assert ahead1 == [0, 0]
    from collections import defaultdict
    for t in tuners:  # the two kernels' compiled specializations forgotten (Triton's disk cache still serves them)
        jit = t.fn
        monkeypatch.setattr(jit, "device_caches", defaultdict(jit.create_binder))
    got, ahead, inside = tuned("8")
    assert inside, "no kernel compiled: the test would prove nothing"
    assert all(n >= 2 for n in ahead), ahead  # every candidate of each key went through the mode
    assert not any(inside), inside  # nothing compiled inside a benchmark
    for x, y in zip(got, one):
        assert torch.equal(x, y)
