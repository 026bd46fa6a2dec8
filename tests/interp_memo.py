"""Test helper: a launch that Triton's CPU interpreter has already run on the same inputs is replayed, not run again.

An interpreted kernel is a deterministic function of its launch: the kernel's code and the module globals it reads,
the grid, the scalar arguments, the tensors' layouts, and the bytes the programs load. The suite launches many kernels
twice on the same inputs (eager against compiled, ``opcheck``'s several runs of one op, a quantization beside its
reference twin), each costing the interpreter tenths of a second per program. The first run of a launch is recorded:
which argument storages its programs loaded from (any byte of them), and which bytes they stored and their values.
A later launch with the same structure whose loaded storages hold the same bytes (BLAKE2b of each) gets those bytes
stored again, without running. Everything else runs as Triton runs it: a launch that reads memory outside its
arguments, a grid given as a function, an autotuner's pre-run hook, a kernel with a closure or an argument of a type
not listed here.

``TITAN_NVFP4_TEST_INTERP_MEMO``: ``1`` (the default under the interpreter), ``0`` (off: every launch runs), or
``verify`` (every replay also runs, and a byte that differs fails the launch, naming the kernel; the whole suite
passed so, docs/development.md). ``TITAN_NVFP4_TEST_INTERP_MEMO_STATS=<folder>`` writes each process's hits, runs
and their seconds there at exit.
"""

from __future__ import annotations

import atexit
import hashlib
import inspect
import json
import os
import sys
import time
import types
from collections import OrderedDict

import numpy as np

#: bytes of stored values kept per process (the oldest launches go first)
BUDGET = 512 << 20
#: recorded runs kept per launch structure (the same launch on different values)
PER_KEY = 8
#: per kernel ("module:name"): hits (replays), runs, and their seconds (a replay: its recorded run's)
STATS: dict[str, dict] = {}


class _Uncacheable(Exception):
    """A launch this helper does not replay (it runs as Triton runs it)."""


def install(itp, grid_executor, launch) -> None:
    """Wrap ``launch`` (GridExecutor.__call__, as triton_interp patched it) with the replay, and the interpreter's
    memory operations with the recording of what a run loads and stores."""
    mode = os.environ.get("TITAN_NVFP4_TEST_INTERP_MEMO", "1")
    if mode == "0":
        return
    import torch
    import triton.language as tl
    from triton.runtime.jit import JITFunction, TensorWrapper

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover
        TensorDescriptor = ()
    builder = itp.interpreter_builder
    recorders: list = []  # the recording of the run in progress (launches do not nest; a stack for safety)
    entries: OrderedDict = OrderedDict()  # structure key -> [recorded runs], least recently used first
    held = 0  # bytes of stored values kept
    scalars = (int, float, bool, str, type(None), bytes)

    class _Recording:
        def __init__(self, storages):
            order = sorted(range(len(storages)), key=lambda i: storages[i][0])
            self.index = np.array(order, dtype=np.int64)
            self.bases = np.array([storages[i][0] for i in order], dtype=np.uint64)
            self.ends = np.array([storages[i][0] + storages[i][1] for i in order], dtype=np.uint64)
            self.sizes = [s[1] for s in storages]
            self.read: set[int] = set()
            self.written: dict[int, np.ndarray] = {}
            self.outside = False

        def _which(self, addrs, mask, itemsize):
            # the addresses the operation touches (mask on) and the sorted-storage position of each; an address
            # outside every argument storage marks the run as not replayable
            addrs = np.asarray(addrs, dtype=np.uint64)
            if mask is not None:
                addrs = addrs[np.broadcast_to(np.asarray(mask, dtype=bool), addrs.shape)]
            addrs = addrs.reshape(-1)
            if addrs.size == 0:
                return addrs, np.zeros(0, dtype=np.int64)
            pos = np.searchsorted(self.bases, addrs, side="right").astype(np.int64) - 1
            ok = pos >= 0
            if self.ends.size:
                ok &= addrs + np.uint64(itemsize) <= self.ends[np.maximum(pos, 0)]
            if not ok.all():
                self.outside = True
                return addrs[ok], pos[ok]
            return addrs, pos

        def load(self, addrs, mask, itemsize):
            _, pos = self._which(addrs, mask, itemsize)
            if pos.size:
                self.read.update(int(self.index[p]) for p in np.unique(pos))

        def store(self, addrs, mask, itemsize):
            addrs, pos = self._which(addrs, mask, itemsize)
            for p in np.unique(pos):
                i = int(self.index[p])
                offs = (addrs[pos == p] - self.bases[p]).astype(np.int64)
                bits = self.written.get(i)
                if bits is None:
                    bits = self.written[i] = np.zeros(self.sizes[i], dtype=bool)
                for k in range(itemsize):
                    bits[offs + k] = True

    def wrap(name, reads, writes, pick):
        original = getattr(builder, name)
        sig = inspect.signature(original)

        def op(*args, **kwargs):
            rec = recorders[-1] if recorders else None
            if rec is not None:
                ptr, mask = pick(sig.bind(*args, **kwargs).arguments)
                size = np.dtype(itp._get_np_dtype(ptr.get_element_ty())).itemsize
                mask = None if mask is None else mask.data
                if reads:
                    rec.load(ptr.data, mask, size)
                if writes:
                    rec.store(ptr.data, mask, size)
            return original(*args, **kwargs)

        setattr(builder, name, op)

    wrap("create_masked_load", True, False, lambda a: (a["ptrs"], a["mask"]))
    wrap("create_masked_store", False, True, lambda a: (a["ptrs"], a["mask"]))
    wrap("create_atomic_cas", True, True, lambda a: (a["ptr"], None))
    wrap("create_atomic_rmw", True, True, lambda a: (a["ptr"], a["mask"]))

    def scalar_key(v):
        # floats by their bits: -0.0 == 0.0 and NaN != NaN under ==, yet a kernel may tell them apart
        return (type(v).__name__, v.hex() if isinstance(v, float) else v)

    def storage_bytes(storage) -> np.ndarray:
        return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()

    def describe(arg, storages, ids, out):
        if isinstance(arg, TensorWrapper):
            out.append(("W", repr(arg.dtype)))
            arg = arg.base
        if isinstance(arg, torch.Tensor):
            if arg.device.type != "cpu" or arg.is_quantized or arg.layout != torch.strided:
                raise _Uncacheable
            st = arg.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
            i = ids.get(ptr)
            if i is None:
                i = ids[ptr] = len(storages)
                storages.append((ptr, n, st))
            elif storages[i][1] != n:
                raise _Uncacheable
            out.append(("T", i, n, arg.storage_offset(), tuple(arg.shape), tuple(arg.stride()), str(arg.dtype)))
        elif isinstance(arg, tuple):
            out.append(("(", len(arg)))
            for a in arg:
                describe(a, storages, ids, out)
        elif TensorDescriptor and isinstance(arg, TensorDescriptor):
            out.append(("D", tuple(arg.shape), tuple(arg.strides), tuple(arg.block_shape), repr(arg.padding),
                        getattr(arg, "round_f32_to_tf32", None)))
            describe(arg.base, storages, ids, out)
        elif isinstance(arg, scalars):
            out.append(scalar_key(arg))
        elif isinstance(arg, (tl.constexpr, tl.dtype, torch.dtype)):
            out.append((type(arg).__name__, repr(arg)))
        else:
            raise _Uncacheable

    module_sets: dict = {}

    def modules_of(fn):
        # the modules whose globals the kernel may read: its own and those of the jit functions it can reach
        hit = module_sets.get(fn)
        if hit is not None and hit[0] == len(sys.modules):
            return hit[1]
        top = fn.__module__.split(".")[0]
        names, todo = set(), [fn.__module__]
        while todo:
            name = todo.pop()
            if name in names or name not in sys.modules:
                continue
            names.add(name)
            for v in vars(sys.modules[name]).values():
                if isinstance(v, JITFunction):
                    todo.append(v.fn.__module__)
                elif isinstance(v, types.ModuleType) and v.__name__.split(".")[0] == top:
                    todo.append(v.__name__)
        mods = [sys.modules[n] for n in sorted(names)]
        module_sets[fn] = (len(sys.modules), mods)
        return mods

    def fingerprint(fn):
        parts = []
        for mod in modules_of(fn):
            for k, v in vars(mod).items():
                if isinstance(v, scalars):
                    parts.append((k, scalar_key(v)))
                elif isinstance(v, (tl.constexpr, tl.dtype, tuple)):  # a tuple: by its repr (-0.0 shows)
                    parts.append((k, repr(v)))
                elif callable(v) and not isinstance(v, type):
                    parts.append((k, id(v)))
        return tuple(parts)

    def structure(self, args, kwargs):
        fn = self.fn
        if callable(self.grid) or self.pre_run_hooks or fn.__closure__:
            raise _Uncacheable
        storages, ids, out = [], {}, []
        for a in args:
            describe(a, storages, ids, out)
        for k in sorted(kwargs):
            out.append(("=", k))
            describe(kwargs[k], storages, ids, out)
        key = (fn.__code__, fn.__module__, fn.__qualname__, tuple(self.grid), tuple(out), fingerprint(fn))
        return key, storages

    def digest(storage) -> bytes:
        return hashlib.blake2b(storage_bytes(storage), digest_size=16).digest()

    def count(fn, what, seconds):
        s = STATS.setdefault(f"{fn.__module__}:{fn.__qualname__}", {"hits": 0, "runs": 0, "run_s": 0.0, "saved_s": 0.0})
        s[what] += 1
        s["run_s" if what == "runs" else "saved_s"] += seconds

    def memo_call(self, *args, **kwargs):
        nonlocal held
        if recorders:
            return launch(self, *args, **kwargs)
        try:
            key, storages = structure(self, args, kwargs)
            hash(key)
        except (_Uncacheable, TypeError):
            return launch(self, *args, **kwargs)
        digests: dict[int, bytes] = {}

        def d(i):
            v = digests.get(i)
            if v is None:
                v = digests[i] = digest(storages[i][2])
            return v

        runs = entries.get(key)
        if runs is not None:
            entries.move_to_end(key)
            for run in runs:
                if all(d(i) == h for i, h in run["read"]):
                    if mode == "verify":
                        verify(self, args, kwargs, storages, run)
                    else:
                        for i, (pos, vals) in run["wrote"].items():
                            storage_bytes(storages[i][2])[pos] = vals
                    count(self.fn, "hits", run["seconds"])
                    return None
        for i in range(len(storages)):
            d(i)
        rec = _Recording([(p, n) for p, n, _ in storages])
        recorders.append(rec)
        t = time.perf_counter()
        try:
            result = launch(self, *args, **kwargs)
        finally:
            recorders.pop()
        seconds = time.perf_counter() - t
        count(self.fn, "runs", seconds)
        if rec.outside:
            return result
        wrote = {}
        for i, bits in rec.written.items():
            pos = np.flatnonzero(bits)
            wrote[i] = (pos, storage_bytes(storages[i][2])[pos].copy())
        run = {"read": [(i, digests[i]) for i in sorted(rec.read)], "wrote": wrote, "seconds": seconds,
               "bytes": sum(p.nbytes + v.nbytes for p, v in wrote.values())}
        runs = entries.setdefault(key, [])
        runs.insert(0, run)
        held += run["bytes"]
        while len(runs) > PER_KEY:
            held -= runs.pop()["bytes"]
        while held > BUDGET and entries:
            _, old = entries.popitem(last=False)
            held -= sum(r["bytes"] for r in old)
        return result

    def verify(self, args, kwargs, storages, run):
        want = [storage_bytes(st).copy() for _, _, st in storages]
        for i, (pos, vals) in run["wrote"].items():
            want[i][pos] = vals
        launch(self, *args, **kwargs)
        for i, (_, _, st) in enumerate(storages):
            got = storage_bytes(st)
            if not np.array_equal(got, want[i]):
                bad = np.flatnonzero(got != want[i])
                raise AssertionError(f"interp_memo: the replay of {self.fn.__module__}:{self.fn.__qualname__} differs "
                                     f"from its run in argument storage {i} at {bad.size} bytes (first {bad[:8]})")

    folder = os.environ.get("TITAN_NVFP4_TEST_INTERP_MEMO_STATS")
    if folder:
        def write_stats():
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
                json.dump(STATS, f)
        atexit.register(write_stats)
    grid_executor.__call__ = memo_call
