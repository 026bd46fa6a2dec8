"""The compiled-kernel launch cache (titan_nvfp4/kernels/launch.py): its key separates what Triton
specializes on, anything it cannot key goes through Triton, and on a GPU cached launches give the same
bits as Triton's own launches of every NVFP4 kernel family (and skip Triton's launch path)."""

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

from titan_nvfp4.kernels import launch as L  # noqa: E402

GPU = torch.cuda.is_available()


def _launcher(tune_keys=(), names=("X", "M", "K", "FLAG"), constexprs=("FLAG",)):
    la = L.Launcher.__new__(L.Launcher)
    la.names = list(names)
    la.constexprs = set(constexprs)
    la.tune_keys = list(tune_keys)
    return la


def test_key_separates_what_triton_specializes_on(monkeypatch):
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    la = _launcher()
    x = torch.zeros(64, dtype=torch.float32)
    k = la._key((x, 32, 48), {"FLAG": True})
    assert la._key((torch.ones(64), 64, 96), {"FLAG": True}) == k  # same dtype, alignment, int classes
    assert la._key((x.half(), 32, 48), {"FLAG": True}) != k  # dtype
    assert la._key((x[1:], 32, 48), {"FLAG": True}) != k  # a data pointer off 16 bytes
    assert la._key((x, 1, 48), {"FLAG": True}) != k  # an int equal to 1 (a constant to Triton)
    assert la._key((x, 33, 48), {"FLAG": True}) != k  # divisibility by 16
    assert la._key((x, 2**31 + 16, 48), {"FLAG": True}) != k  # 64-bit int
    assert la._key((x, 32, 48), {"FLAG": False}) != k  # constexpr values
    assert la._key((x, 32, 48), {"FLAG": True, "num_warps": 4}) != k  # launch options
    assert la._key((x, 32, 48), {"FLAG": True, "num_warps": 2}) != la._key((x, 32, 48), {"FLAG": True, "num_warps": 4})


def test_key_holds_constexpr_ints_by_value(monkeypatch):
    """A constexpr is compiled into the kernel: 16 and 32 (both multiples of 16, one class as runtime
    ints) must not share a cached kernel, passed by keyword or by position."""
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    la = _launcher(names=("X", "M", "NSP2", "FLAG"), constexprs=("NSP2", "FLAG"))
    x = torch.zeros(64)
    assert la._key((x, 32, 16), {"FLAG": True}) != la._key((x, 32, 32), {"FLAG": True})
    assert la._key((x, 32), {"NSP2": 16, "FLAG": True}) != la._key((x, 32), {"NSP2": 32, "FLAG": True})
    assert la._key((x, 32), {"NSP2": 1, "FLAG": True}) != la._key((x, 32), {"NSP2": True, "FLAG": True})
    assert la._key((x, 32), {"NSP2": 16, "FLAG": True}) == la._key((x, 48), {"NSP2": 16, "FLAG": True})
    with pytest.raises(L._Uncacheable):
        la._key((x, 32), {"NSP2": [16], "FLAG": True})


def test_key_holds_the_autotuner_key_values(monkeypatch):
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    la = _launcher(tune_keys=["M", "FLAG"])
    x = torch.zeros(64)
    assert la._key((x, 32, 48), {"FLAG": True}) != la._key((x, 64, 48), {"FLAG": True})  # M: exact value
    assert la._key((x, 32, 48), {"FLAG": True}) == la._key((x, 32, 96), {"FLAG": True})  # K: not a tune key


@pytest.mark.parametrize("arg", [1.5, object(), [1, 2]])
def test_key_refuses_what_it_cannot_describe(arg, monkeypatch):
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    with pytest.raises(L._Uncacheable):
        _launcher()._key((torch.zeros(4), arg), {})


def test_cpu_tensors_launch_through_triton():
    """Off CUDA (the interpreter) every launch is Triton's own: nothing is cached."""
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k)) or "ran"

    fake = Kernel()
    la = L.Launcher.__new__(L.Launcher)
    la.fn, la.cache = fake, {}
    assert la((3, 1), torch.zeros(4), 7, FLAG=True) == "ran"
    assert calls and calls[0][0] == (3, 1) and la.cache == {}


def _raise(err):
    raise err


class _FailingAutotuner:
    """Triton's autotuner as the launcher sees it: the first launch of a spec benchmarks a config that fails (the error
    re-raised from a frame that holds it, as Triton does, so its traceback keeps the launch's tensors in a cycle) and
    keeps another; ``count_failures``: it counts the failed config as ShippedAutotuner does."""

    def __init__(self, count_failures: bool):
        self.cache, self.count_failures, self.failed_configs = {}, count_failures, 0

    def __getitem__(self, grid):
        def run(x, spec):
            if spec not in self.cache:
                try:
                    _raise(RuntimeError("out of resource: shared memory"))
                except RuntimeError:
                    self.failed_configs += self.count_failures
                self.cache[spec] = "the other config"
            return "kernel"
        return run


def _uncacheable_launches(monkeypatch, fn, collect_under_trees):
    """Launch ``fn`` twice with an argument the cache cannot key (Triton's own launch, as for a TMA descriptor);
    returns (whether the first launch's tensor died at once, the graph-tree collections asked for)."""
    import gc
    import weakref

    monkeypatch.setattr(L, "_fast", lambda args: True)
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    asked = []
    monkeypatch.setattr(L, "_collect_build_garbage",
                        lambda device: asked.append(device) or (gc.collect() if collect_under_trees else None))
    la = L.Launcher.__new__(L.Launcher)
    la.fn, la.jit, la.autotuner, la.cache = fn, object(), True, {}
    la.names, la.constexprs, la.tune_keys = ["X", "SPEC"], set(), []
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        x = torch.zeros(4)
        alive = weakref.ref(x)
        assert la((1,), x, 1.5) == "kernel" and la.cache == {}
        del x
        died = alive() is None
        assert la((1,), torch.zeros(4), 1.5) == "kernel"  # nothing built: nothing more collected
        return died, asked
    finally:
        if was_enabled:
            gc.enable()


def test_a_launch_through_triton_that_built_collects_its_garbage_under_graph_trees(monkeypatch):
    """A launch the cache cannot key (the grouped wgrad GEMM's TMA descriptors) goes through Triton; where that compiled
    or autotuned, its garbage is collected as a cached launch's is, once. Under CUDA-graph trees the tensors a cycle
    holds sit in the graphs' pool: left to the cyclic collector they failed the trees' pool check on the
    DeepSeek-V3-16B job's first compiled step."""
    died, asked = _uncacheable_launches(monkeypatch, _FailingAutotuner(count_failures=False), collect_under_trees=True)
    assert died and asked == [0]


def test_a_config_that_failed_to_benchmark_has_its_garbage_collected_in_eager_too(monkeypatch):
    """Without graph trees a build's garbage is left to Python, except where a config failed to benchmark: its cycle
    held 1.1 GB of the 16B expert block's tensors after the first backward, so it is collected at once."""
    died, asked = _uncacheable_launches(monkeypatch, _FailingAutotuner(count_failures=True), collect_under_trees=False)
    assert died and asked == []


def test_shipped_autotuner_counts_the_configs_that_failed_to_benchmark(monkeypatch):
    from triton.runtime.autotuner import Autotuner

    tuner = L.ShippedAutotuner.__new__(L.ShippedAutotuner)
    monkeypatch.setenv("TITAN_NVFP4_TUNE_THREADS", "0")  # no candidates to compile ahead on this bare autotuner
    inf = float("inf")
    for timings, failed in (([1.0, 0.9, 1.1], 0), ([inf, inf, inf], 1), ([2.0, 1.9, 2.1], 1), ([inf, inf, inf], 2)):
        monkeypatch.setattr(Autotuner, "_bench", lambda self, *a, _t=timings, **k: _t)
        assert tuner._bench(config=None) == timings and tuner.failed_configs == failed


# ----------------------------------------------------------------------------------------------- GPU

def _no_triton_launch(monkeypatch, *fns):
    """Make every later launch of ``fns`` through Triton's own path fail (cached ones do not go there).
    The cache's CHECK mode asks Triton too, so it is off here."""
    def refuse(*a, **k):
        raise AssertionError("launched through Triton, not the cache")
    monkeypatch.setattr(L, "CHECK", False)
    for fn in fns:
        monkeypatch.setattr(fn, "run", refuse)


@triton.jit
def _fill_kernel(OUT, n, V: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(OUT + i, tl.full((BLOCK,), V, tl.int32), mask=i < n)


@pytest.mark.skipif(not GPU, reason="the cache launches compiled CUDA kernels")
def test_check_mode_catches_a_cached_kernel_of_other_arguments(monkeypatch):
    """A cache entry filed under the wrong key (the kind of bug the constexpr key fixed, simulated):
    without CHECK it silently runs the other kernel; with CHECK the launch fails and says so."""
    out = torch.zeros(16, dtype=torch.int32, device="cuda")
    monkeypatch.setattr(L, "ENABLED", True)
    L.launch(_fill_kernel, (1,), out, 16, V=16, BLOCK=16)
    la = L.launcher(_fill_kernel)
    la.cache[la._key((out, 16), {"V": 32, "BLOCK": 16})] = la.cache[la._key((out, 16), {"V": 16, "BLOCK": 16})]
    monkeypatch.setattr(L, "CHECK", False)
    L.launch(_fill_kernel, (1,), out, 16, V=32, BLOCK=16)
    assert (out == 16).all()  # the wrong kernel ran
    monkeypatch.setattr(L, "CHECK", True)
    with pytest.raises(AssertionError, match="_fill_kernel would run a kernel compiled for other arguments"):
        L.launch(_fill_kernel, (1,), out, 16, V=32, BLOCK=16)
    L.launch(_fill_kernel, (1,), out, 16, V=16, BLOCK=16)  # a correct entry passes the check


@pytest.mark.skipif(not GPU, reason="the cache launches compiled CUDA kernels")
@pytest.mark.parametrize("m", [2048, 272])  # autotuned tiles / fixed tiles
def test_cached_launches_match_triton_on_gpu(m, monkeypatch):
    from titan_nvfp4.kernels import gemm as g
    from titan_nvfp4.kernels import quantize as q
    from titan_nvfp4.kernels.mxfp8 import quantize_mxfp8_tensors
    from titan_nvfp4.numerics.rht import rht_signs

    torch.manual_seed(0)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    signs = rht_signs(0, "cuda")
    seed = torch.full((1,), 11, dtype=torch.int64, device="cuda")

    def run():
        xr, xc = q.quantize_operand(x, colwise=True, signs=signs, stochastic_row=True, stochastic_col=True, seed=seed)
        wq, wt = q.quantize_weight_2d(w)
        y = g.nvfp4_gemm_triton(xr, wq, torch.bfloat16)
        mx = quantize_mxfp8_tensors(x, True, True)
        return [xr.data, xr.scale.view(torch.uint8), xc.data, wq.data, wt.data, y, *[t.view(torch.uint8) for t in mx]]

    monkeypatch.setattr(L, "ENABLED", False)
    want = run()
    monkeypatch.setattr(L, "ENABLED", True)
    first = run()  # fills the cache
    from titan_nvfp4.kernels import mxfp8

    kernels = [q._quantize_kernel, q._amax_kernel, q._quantize_2d_kernel, g._dequant_kernel,
               g._nvfp4_gemm_persistent_kernel, mxfp8._mxfp8_kernel]
    _no_triton_launch(monkeypatch, *kernels)
    for tuned in (q._quantize_autotuned, q._amax_autotuned, q._quantize_2d_autotuned, g._dequant_autotuned,
                  g._nvfp4_gemm_persistent_autotuned, mxfp8._mxfp8_autotuned):
        monkeypatch.setattr(tuned, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("autotuner ran")))
    hits = {k: v[1] for k, v in L.stats().items()}
    cached = run()
    assert all(L.stats()[k][1] > hits[k] for k in ("_quantize_kernel", "_quantize_2d_kernel", "_mxfp8_kernel"))
    for a, b, c in zip(want, first, cached):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.skipif(not GPU, reason="the cache launches compiled CUDA kernels")
def test_cached_kernels_of_other_constexpr_ints_are_not_reused(monkeypatch):
    """The bug the constexpr key fixes: grouped quantization of 4 experts (NSP2 = 16 amax slots)
    then of 8 (18 slots, NSP2 = 32) through the cache; the 8-expert decode scales must equal Triton's
    own launch (the 16-slot kernel wrote 16 of them and left two unset)."""
    from titan_nvfp4.kernels.quantize import quantize_operand_tensors

    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16) * torch.arange(1, 513, device="cuda")[:, None]
    monkeypatch.setattr(L, "ENABLED", True)
    for experts in (4, 8):
        offsets = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (512 // experts)
        cached = quantize_operand_tensors(x, colwise=True, groups=offsets)
        monkeypatch.setattr(L, "ENABLED", False)
        want = quantize_operand_tensors(x, colwise=True, groups=offsets)
        monkeypatch.setattr(L, "ENABLED", True)
        for a, b in zip(cached, want):
            assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                               b.view(torch.uint8) if b.dtype != torch.float32 else b), f"{experts} experts"


def _kernel_src(X, M, K, FLAG: "tl.constexpr", BK: "tl.constexpr", FOUR: "tl.constexpr" = False):
    pass


def test_record_lays_out_every_parameter():
    """A cached launch passes every parameter in order: positional, keyword, the autotuner's chosen
    config, then the defaults (a compiled Triton function, built here without a GPU)."""
    from triton.runtime.jit import JITFunction

    jit = JITFunction(_kernel_src)
    tuner = triton.autotune([triton.Config({"BK": 64}, num_warps=2), triton.Config({"BK": 128}, num_warps=4)],
                            key=["M"])(jit)
    la = L.Launcher(tuner)
    assert la.names == ["X", "M", "K", "FLAG", "BK", "FOUR"] and la.defaults == {"FOUR": False}
    assert la.constexprs == {"FLAG", "BK", "FOUR"}
    assert la.tune_keys == ["M"]
    tuner.best_config = tuner.configs[1]

    class Compiled:
        def _init_handles(self):
            self.ready = True

    entry = la._record(Compiled(), (torch.zeros(4), 32, 64), {"FLAG": True})
    assert entry.sources == [0, 0, 0, 1, 2, 2] and entry.fixed == {"FOUR": False, "BK": 128}
    assert entry.kernel.ready
    tuner.best_config = triton.Config({"BK": 64}, pre_hook=lambda nargs: None)
    assert la._record(Compiled(), (torch.zeros(4), 32, 64), {"FLAG": True}) is None  # a pre-hook: not cached


def test_stats_sum_the_launchers_of_one_kernel(monkeypatch):
    """A kernel launched both through its autotuner and with fixed tiles has two launchers under one
    name; stats() reports both (it once showed whichever was made last, so cached launches through the
    other went uncounted)."""
    from triton.runtime.jit import JITFunction

    jit = JITFunction(_kernel_src)
    tuner = triton.autotune([triton.Config({"BK": 64})], key=["M"])(jit)
    monkeypatch.setattr(L, "_LAUNCHERS", {})
    tuned, fixed = L.launcher(tuner), L.launcher(jit)
    assert tuned is not fixed and L.launcher(tuner) is tuned
    tuned.cache, tuned.hits = {1: None, 2: None}, 5
    fixed.cache, fixed.hits = {3: None}, 7
    assert L.stats() == {"_kernel_src": (3, 12)}
    tuned.hits += 1
    assert L.stats()["_kernel_src"] == (3, 13)


def test_host_grid_arithmetic_matches_triton():
    """The plain-Python grid helpers the kernels launch with equal Triton's constexpr ones."""
    import triton

    from titan_nvfp4.kernels.launch import cdiv, next_pow2

    for a in (0, 1, 15, 16, 17, 255, 256, 257, 2**31 + 5):
        for b in (1, 16, 64, 128):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    for n in (1, 2, 3, 15, 16, 17, 1000, 2**20 + 1):
        assert next_pow2(n) == triton.next_power_of_2(n), n


def test_choices_among_configs_with_a_pre_hook_are_kept_on_disk(tmp_path, monkeypatch):
    """Triton keeps no autotuning choice among configs with a pre-hook (the GEMMs set their TMA block shapes in one),
    so every process benchmarked the GEMMs again; the choice's position among the configs is kept in Triton's cache
    folder instead, and a second process (a second autotuner here) reads it without benchmarking."""
    from triton.runtime.cache import get_cache_manager

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(L, "_choice_file", lambda tuner, key, configs: (get_cache_manager("c" * 64), "k.choice.json"))

    def hook(nargs):
        pass

    configs = [triton.Config({"BM": 64}, pre_hook=hook), triton.Config({"BM": 128}, pre_hook=hook)]

    def tuner():
        t = L.ShippedAutotuner.__new__(L.ShippedAutotuner)
        t.cache = {}
        return t

    benchmarks = []
    first = tuner()

    def bench():
        benchmarks.append("first")
        first.cache[(4096, "torch.float16")] = configs[1]

    assert first.check_disk_cache((4096, "torch.float16"), configs, bench) is False and benchmarks == ["first"]
    second = tuner()
    assert second.check_disk_cache((4096, "torch.float16"), configs, lambda: benchmarks.append("second")) is True
    assert second.cache[(4096, "torch.float16")] is configs[1] and benchmarks == ["first"]
    (saved,) = list(tmp_path.rglob("k.choice.json"))
    saved.write_text('{"index": 7}')  # a choice past the configs (edited, or another list): benchmarked again
    third = tuner()
    assert third.check_disk_cache((4096, "torch.float16"), configs,
                                  lambda: third.cache.update({(4096, "torch.float16"): configs[0]})) is False
    assert third.cache[(4096, "torch.float16")] is configs[0]
