"""Kernel launches without Triton's per-call Python: a cache of compiled kernels keyed by what Triton
specializes on, launched through the compiled kernel's own launcher.

A launch through ``kernel[grid](...)`` binds and specializes every argument, hashes a cache key and,
through ``triton.autotune``, builds the autotuning key too: 25-100 µs of host time per launch on the
H100 machines (benchmarks/host_overhead.py), more than many of these kernels take on the GPU at
M = 2048. ``launch`` does that once per specialization: the first call goes through Triton (compiling
and autotuning as usual) and records the compiled kernel and the chosen config; later calls with the
same specialization build the argument list and call the compiled kernel's launcher (~10 µs).

The key holds what Triton's specialization looks at (benchmarks and tests compare both paths):
tensors by dtype and 16-byte alignment of the data pointer, ints by ``== 1``, divisibility by 16 and
32/64-bit range, and every ``tl.constexpr`` parameter and other argument (flags, None) by value, plus
the values of the autotuner's key arguments. (A constexpr int keyed like a runtime int once let a
kernel compiled for 16 amax slots serve a call with 18.) Anything the cache cannot key safely (a
tensor descriptor, a float, an unknown object) and the CPU interpreter take Triton's own path;
launch hooks (profilers) are called as Triton calls them.
"""

from __future__ import annotations

import gc
import hashlib
import inspect
import json
import os
import sys

import torch
import triton
from triton import knobs as _knobs  # the launch hooks (profilers such as proton), passed on as Triton does
from triton.runtime.autotuner import Autotuner

from . import precompile, shipped_tuning

#: Set TITAN_NVFP4_TRITON_LAUNCH=1 to launch every kernel through Triton (to compare or to debug).
ENABLED = os.environ.get("TITAN_NVFP4_TRITON_LAUNCH", "0") in ("", "0")
#: Set TITAN_NVFP4_LAUNCH_CHECK=1 (the test suite does) to verify every cached launch: Triton is asked,
#: without launching, which compiled kernel it would run for the same arguments, and another one is an
#: error. It catches a key that misses something Triton compiles in, at the cost of Triton's host time.
CHECK = os.environ.get("TITAN_NVFP4_LAUNCH_CHECK", "0") not in ("", "0")

_INT32 = (-2**31, 2**31)
_OPTIONS = frozenset(("num_warps", "num_stages", "num_ctas", "maxnreg"))
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_current_device = torch.cuda.current_device
_raw_stream = torch._C._cuda_getCurrentRawStream if hasattr(torch._C, "_cuda_getCurrentRawStream") else None


class _Uncacheable(Exception):
    """An argument the key cannot describe: launch through Triton."""


def _spec(a):
    """What Triton's specialization sees of one argument (see the module docstring)."""
    t = type(a)
    if t in _TENSORS:
        return (a.dtype, a.data_ptr() % 16 == 0)
    if t is int:
        return (a == 1, a % 16 == 0, _INT32[0] <= a < _INT32[1])
    if a is None or t is bool or t is str or t is torch.dtype:
        return a
    raise _Uncacheable


def _const(a):
    """A constexpr argument as the key holds it: its value (with its type, so that 1 and True differ)."""
    if a is None or type(a) in (bool, int, str, float) or type(a) is torch.dtype:
        return (type(a), a)
    if hasattr(a, "value") and type(a.value) in (bool, int, str, float):  # a tl.constexpr
        return (type(a.value), a.value)
    raise _Uncacheable


class _Entry:
    """A compiled kernel and how to lay out its full argument list (every parameter, constexprs too)."""

    __slots__ = ("kernel", "names", "fixed", "sources", "options")

    def __init__(self, kernel, names, fixed, sources, options):
        self.kernel, self.names, self.fixed, self.sources = kernel, names, fixed, sources
        self.options = options  # the autotuner's chosen config with its launch options (for CHECK)


class Launcher:
    """``launch(grid, *args, **kwargs)`` for one Triton kernel: a ``triton.jit`` function or a
    ``triton.autotune`` over one (``grid`` a tuple or a function of the meta-parameter dict)."""

    def __init__(self, fn):
        self.fn = fn
        self.autotuner = isinstance(fn, Autotuner)
        self.jit = fn.fn if self.autotuner else fn
        self.names = list(self.jit.arg_names)
        self.constexprs = {p.name for p in self.jit.params if p.is_constexpr}  # compiled in: keyed by value
        self.defaults = {p.name: p.default for p in self.jit.params if p.default is not inspect.Parameter.empty}
        self.tune_keys = list(fn.keys) if self.autotuner else []
        self.cache: dict = {}
        self.hits = 0  # cached launches (benchmarks/host_overhead.py reports them)

    def _key(self, args, kwargs):
        key = [_current_device()]
        key += [_const(a) if name in self.constexprs else _spec(a) for name, a in zip(self.names, args)]
        for k in sorted(kwargs):  # launch options (num_warps, ...) are compiled in: keyed by value too
            key += (k, _const(kwargs[k]) if k in self.constexprs or k in _OPTIONS else _spec(kwargs[k]))
        if self.tune_keys:  # the autotuner keys on these values exactly (shapes, flags)
            pos = dict(zip(self.names, args))
            key += [pos[k] if k in pos else kwargs.get(k) for k in self.tune_keys]
        return tuple(key)

    def __call__(self, grid, *args, **kwargs):
        if not _fast(args):
            return self.fn[grid](*args, **kwargs)
        try:
            key = self._key(args, kwargs)
        except _Uncacheable:
            key = None
        if key is None:  # through Triton (out of the except block: a failed config's error would chain to ours)
            return self._build(grid, args, kwargs)
        entry = self.cache.get(key)
        if entry is None:
            precompile.wait()  # a kernel the background precompile may be compiling comes from the cache
            kernel = self._build(grid, args, kwargs)
            entry = self._record(kernel, args, kwargs)
            if entry is not None:
                self.cache[key] = entry
            return kernel
        full = [args[i] if src == 0 else kwargs[name] if src == 1 else entry.fixed[name]
                for i, (name, src) in enumerate(zip(entry.names, entry.sources))]
        if CHECK:
            self._verify(entry, args, kwargs)
        if callable(grid):
            grid = grid(dict(zip(entry.names, full)))
        self.hits += 1
        k, stream = entry.kernel, _raw_stream(key[0])
        enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook  # as Triton passes them
        meta = k.launch_metadata(grid, stream, *full) if enter is not None else None
        k.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, k.function,
              k.packed_metadata, meta, enter, leave, *full)
        return k

    def _build(self, grid, args, kwargs):
        """``fn[grid](*args, **kwargs)``, then the garbage of any compile or autotuning it ran collected: always where
        a config failed to benchmark (its error holds the launch's tensors in a cycle: 1.1 GB after the 16B expert
        block's first backward), else under CUDA-graph trees (_collect_build_garbage)."""
        built, failed = self._built(), getattr(self.fn, "failed_configs", 0)
        kernel = self.fn[grid](*args, **kwargs)
        if getattr(self.fn, "failed_configs", 0) != failed:
            gc.collect()
        elif self._built() != built:
            _collect_build_garbage(_current_device())
        return kernel

    def _built(self) -> int:
        """Kernels compiled and configs tuned so far (to tell a launch that built one)."""
        n = sum(len(c[0]) for c in getattr(self.jit, "device_caches", {}).values())
        return n + (len(self.fn.cache) if self.autotuner else 0)

    def _verify(self, entry: _Entry, args, kwargs) -> None:
        """CHECK: the cached kernel is the one Triton would launch for these arguments."""
        want = self.jit.warmup(*args, grid=(1,), **kwargs, **entry.options)
        if want is not entry.kernel:
            raise AssertionError(f"launch cache: {self.jit.__name__} would run a kernel compiled for other arguments "
                                 f"than Triton's for key {self._key(args, kwargs)}")

    def _record(self, kernel, args, kwargs) -> _Entry | None:
        """How each parameter is filled on a cached launch: 0 positional, 1 keyword, 2 fixed (the
        autotuner's chosen config or the parameter's default); None if a launch needs more than the
        arguments (a config's pre-hook)."""
        fixed = dict(self.defaults)
        options = {}
        if self.autotuner:
            config = self.fn.best_config
            if config.pre_hook is not None:
                return None
            fixed.update(config.kwargs)
            options = config.all_kwargs()
        sources = []
        for i, name in enumerate(self.names):
            if i < len(args):
                sources.append(0)
            elif name in kwargs:
                sources.append(1)
            elif name in fixed:
                sources.append(2)
            else:
                raise TypeError(f"{self.jit.__name__}: no value for parameter {name!r}")
        kernel._init_handles()
        return _Entry(kernel, self.names, fixed, sources, options)


def _collect_build_garbage(device: int) -> None:
    """Free the reference cycles a Triton compile or autotuning run leaves behind, where CUDA graphs run.

    Those cycles hold frames that hold the launch's tensors, so the tensors outlive their last use until
    Python's cyclic collector runs. Under inductor's CUDA-graph trees the first launches run in the
    graphs' memory pool, and a tensor kept alive that way fails the trees' check that every live
    allocation in the pool is a graph output (seen on the debug model's second block). A full collection
    costs about 0.4 s with inductor loaded, so it runs only while a graph tree exists on this device.
    """
    global collections
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return
    try:
        active = trees.get_manager(device, create_if_none_exists=False) is not None
    except (AttributeError, TypeError):  # another torch: collect rather than guess
        active = True
    if active:
        collections += 1
        gc.collect()


#: collections run by _collect_build_garbage (compiles under CUDA-graph trees) in this process
collections = 0


def launcher(fn) -> Launcher:
    """The Launcher of a Triton kernel (one per kernel object, made on first use)."""
    la = _LAUNCHERS.get(id(fn))
    if la is None or la.fn is not fn:
        la = _LAUNCHERS[id(fn)] = Launcher(fn)
    return la


_LAUNCHERS: dict[int, Launcher] = {}


def _fast(args) -> bool:
    """Whether a launch may use the cache: enabled, on a CUDA tensor (the interpreter runs on the CPU)."""
    first = args[0] if args else None
    return ENABLED and _raw_stream is not None and type(first) in _TENSORS and first.is_cuda


def stats() -> dict[str, tuple[int, int]]:
    """{kernel name: (specializations cached, cached launches)} of every kernel launched so far, summed
    over a kernel's launchers (a jit function and an autotuner over it are two, under one name)."""
    out: dict[str, tuple[int, int]] = {}
    for la in _LAUNCHERS.values():
        n, h = out.get(la.jit.__name__, (0, 0))
        out[la.jit.__name__] = (n + len(la.cache), h + la.hits)
    return out


#: Set TITAN_NVFP4_AUTOTUNE_CACHE=0 to benchmark every config in every process (no choices read from disk).
TUNE_ON_DISK = os.environ.get("TITAN_NVFP4_AUTOTUNE_CACHE", "1") not in ("", "0") and \
    "cache_results" in inspect.signature(triton.autotune).parameters


def tune_threads() -> int:
    """TITAN_NVFP4_TUNE_THREADS: threads that compile an autotuned kernel's candidate configs at once before their
    benchmark (unset: this process's share of the CPUs, at most 8; 0 or 1: one by one, as Triton does)."""
    setting = os.environ.get("TITAN_NVFP4_TUNE_THREADS", "")
    if setting.strip():
        try:
            return max(int(setting), 0)
        except ValueError:
            raise ValueError(f"TITAN_NVFP4_TUNE_THREADS={setting!r}: expected a whole number of threads") from None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(8, max(1, cpus // max(local, 1)))


try:  # Triton ≥ 3.4: a JIT compile inside this mode goes to an executor and returns a future
    from triton.runtime import _async_compile
except ImportError:  # older Triton: candidates compile one by one inside their benchmarks
    _async_compile = None


class ShippedAutotuner(Autotuner):
    """An autotuner that first looks the key up in the package's table of choices for this GPU class
    (shipped_tuning): a hit is placed in the autotuner's own cache, so Triton launches that config without
    benchmarking; a miss autotunes as Triton does, its candidate configs compiled at once on a few threads first
    (``compile_candidates``)."""

    shipped_hits = 0  # keys served from a table (per autotuner once set; tests and tune_kernels count them)
    failed_configs = 0  # configs whose benchmark failed (out of resources): Launcher._build collects their garbage
    compiled_ahead = 0  # candidate configs sent to compile on threads before a benchmark (tests count them)
    _ahead = False  # whether this run compiled its candidates ahead (one run benchmarks one key)

    def check_disk_cache(self, tuning_key, configs, bench_fn):
        """Triton keeps no choice among configs with a pre-hook (the GEMMs' TMA block shapes: it cannot serialize
        the hook) and benchmarks them again in every process; keep the chosen config's position among ``configs``
        instead, in Triton's cache folder under a key built as Triton builds its own."""
        if not tuning_key or not any(c.pre_hook for c in configs):
            return super().check_disk_cache(tuning_key, configs, bench_fn)
        try:
            cache, name = _choice_file(self, tuning_key, configs)
        except Exception:  # noqa: BLE001 -- another Triton's internals: benchmark, as Triton would
            bench_fn()
            return False
        path = cache.get_file(name)
        if path:
            with open(path) as f:
                index = json.load(f).get("index")
            if isinstance(index, int) and 0 <= index < len(configs):
                self.cache[tuning_key] = configs[index]
                return True
        bench_fn()
        index = configs.index(self.cache[tuning_key])
        cache.put(json.dumps({"key": str(tuning_key), "index": index, "config": str(configs[index])}), name,
                  binary=False)
        return False

    def compile_candidates(self, args: tuple, meta: dict) -> None:
        """Compile every config this launch would benchmark, on threads, before the first benchmark: Triton compiles
        each inside its own benchmark, one after another, and a compile (seconds at the real MoE shapes) costs far
        more than the benchmark. The same kernels as Triton would build (each config's pre-hook runs before its
        specialization is taken); a compile that fails here is left to its benchmark, which reports it as Triton
        does."""
        threads = tune_threads()
        if (_async_compile is None or threads <= 1 or getattr(_knobs.runtime, "interpret", False)
                or _async_compile.active_mode.get() is not None):  # a caller's own mode (one may be active)
            return
        configs = self.prune_configs(meta)
        if len(configs) < 2:
            return
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(min(threads, len(configs)), thread_name_prefix="titan-nvfp4-tune") as pool:
            mode = _async_compile.AsyncCompileMode(pool, ignore_errors=True)
            try:
                with mode:
                    self._send_to_compile(configs, args, meta)
            finally:  # Triton 3.6 leaves the mode set when finishing a compile raised: later compiles would go to
                if _async_compile.active_mode.get() is mode:  # this pool, shut down
                    _async_compile.active_mode.set(None)

    def _send_to_compile(self, configs, args: tuple, meta: dict) -> None:
        """Each config's compile to the active async mode, as its benchmark will call the kernel."""
        for config in configs:
            current = dict(meta, **config.all_kwargs())
            if config.pre_hook:  # the GEMMs' hooks set the TMA block shapes the specialization includes
                config.pre_hook({**self.nargs, **current})
            try:  # as the benchmark will call it (Triton passes grid and warmup through), compiling only
                self.fn.run(*args, **{"grid": (1,), **current, "warmup": True})
            except Exception:  # noqa: BLE001 -- left to the config's benchmark, which reports it
                continue
            self.compiled_ahead += 1

    def _bench(self, *args, config, **meta):
        if not self._ahead:  # the run's first benchmark: all its candidates compile together
            self._ahead = True
            self.compile_candidates(args, meta)
        timings = super()._bench(*args, config=config, **meta)
        if timings and timings[0] == float("inf"):  # Triton's mark of a config that could not run
            self.failed_configs += 1
        return timings

    def run(self, *args, **kwargs):
        if len(self.configs) > 1:
            key = tuning_key(self, args, kwargs)
            if key not in self.cache:
                path = shipped_tuning.table_path(_cuda_index(args[0] if args else None))
                if path is not None:
                    config = shipped_tuning.choices(path, self.base_fn.__name__, self.configs).get(key)
                    if config is not None:
                        self.cache[key] = config
                        self.shipped_hits += 1
        try:
            return super().run(*args, **kwargs)
        finally:
            self._ahead = False


def _choice_file(tuner: Autotuner, tuning_key: tuple, configs) -> tuple:
    """(Triton cache manager, file name) of a tuning choice, keyed as Triton's check_disk_cache keys its own: Triton,
    the GPU target, the kernel's source, the cache-invalidating environment, the tuning key and the configs."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_manager, triton_key
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    fn = tuner.fn
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    parts = [triton_key(), make_backend(driver.active.get_current_target()).hash(), fn.cache_key,
             str(sorted(get_cache_invalidating_env_vars().items())), str(tuning_key)] + [str(c) for c in configs]
    digest = hashlib.sha256("-".join(parts).encode("utf-8")).hexdigest()
    return get_cache_manager(digest), f"{fn.__name__[:150]}.choice.json"


def _cuda_index(t) -> int | None:
    """The CUDA device index of a launch's first tensor; None for a CPU tensor (the interpreter) or no tensor."""
    if type(t) not in _TENSORS or not t.is_cuda:
        return None
    return t.device.index if t.device.index is not None else _current_device()


def tuning_key(tuner: Autotuner, args: tuple, kwargs: dict) -> tuple:
    """The key ``tuner`` caches a launch's choice under, built as Triton's Autotuner.run builds it: the values of
    its key arguments, then the dtype of every argument that has one (tests pin the two alike)."""
    named = {**dict(zip(tuner.arg_names, args)), **kwargs}
    named = {k: v for k, v in named.items() if k in tuner.arg_names}
    key = [named[k] for k in tuner.keys if k in named]
    key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
    return tuple(key)


#: every autotuner made by ``autotune`` (scripts/tune_kernels.py reads their choices)
TUNERS: list[ShippedAutotuner] = []


def autotune(configs, key, **kwargs):
    """``triton.autotune`` whose choices persist in Triton's cache folder (``cache_results``): a later process
    with the same kernel source, key values, configs and GPU reads the choice instead of benchmarking every
    config again, which was most of an NVFP4 debug run's first step (about 40 s on an H100). Before that, a
    key is looked up in the choices shipped for this GPU class (ShippedAutotuner)."""
    if TUNE_ON_DISK:
        kwargs.setdefault("cache_results", True)

    def wrap(fn):
        tuner = triton.autotune(configs, key, **kwargs)(fn)
        tuner.__class__ = ShippedAutotuner  # Triton's own constructor: its arguments differ between versions
        TUNERS.append(tuner)
        return tuner
    return wrap


def tune_bucket(n: int) -> int:
    """A size as the autotuners key on it: n rounded up to a power of two. The routed-token count changes
    every step under expert parallelism; keyed exactly, each new count would autotune its kernels again
    (a benchmark of every config, hundreds of ms), and each would be a new launch-cache entry."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for host-side grids: ``triton.cdiv`` is a constexpr function, ~2 µs a call on the host."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of two ≥ n (n ≥ 1), in plain Python like ``cdiv``."""
    return 1 << (n - 1).bit_length()


def launch(fn, grid, *args, **kwargs):
    """``fn[grid](*args, **kwargs)``, through the compiled-kernel cache when it can be (module docstring)."""
    if not _fast(args):
        return fn[grid](*args, **kwargs)
    return launcher(fn)(grid, *args, **kwargs)
