"""Compile this package's Triton kernels ahead of the first step, on several CPU cores at once.

A cold start otherwise compiles each kernel specialization when the first step meets it, one after another on the
training process. The package ships, per GPU class, a manifest of the specializations its job files compile
(titan_nvfp4/kernels/tuned/<class>.kernels.json, recorded by scripts/tune_kernels.py with the shipped autotuning
choices in place). At conversion ``start`` forks a background process (precompile_process.py) that compiles them on
a pool of processes into Triton's on-disk cache while the model is built; the first step then loads each kernel from that
cache. A specialization the manifest lacks compiles on first use, as before. ``start`` first looks each entry up in
Triton's cache and compiles only those missing (none: no process at all), leaves out for a model without NVFP4
grouped experts the entries only those launch (``experts_only``, expert_kernels.py), and the pool takes the longest
compiles first (``compile_s``, measured by the tool's --time), so the slowest one does not start last.

Precompiling changes no result: it is Triton's own compile of the same source, signature, constants and options,
and the training process computes every cache key itself (a precompiled kernel it does not ask for is unused work).
To keep that work useful the recorder checks that each entry rebuilds the cache hash of the kernel Triton compiled
(an entry that does not is left out and listed, with what differs, under "unfaithful"), and notes each kernel's
source hash ("sources") and source fingerprint ("fingerprints", what the compile compares: Triton's hash of a kernel
depends on the order a process hashed kernels sharing helpers in): the compile skips, by name, the entries of a
kernel edited since the recording.

By hand, ``python -m titan_nvfp4.tools.precompile_kernels MANIFEST`` fills a cache folder the same way.
TITAN_NVFP4_PRECOMPILE: unset or 1, the package's manifest for this GPU's class (none: nothing to do); 0, off; any
other value, the path of a manifest to use on every device.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib
import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import triton

ENV = "TITAN_NVFP4_PRECOMPILE"
FORMAT = 1
#: the keys of a manifest entry: what rebuilds the compile, then what annotates it (optional)
ENTRY_KEYS = frozenset({"module", "name", "signature", "constants", "attrs", "options"})
ANNOTATIONS = {"experts_only": (bool,), "compile_s": (int, float)}
#: the kernels recorded: those defined in this package's modules
PACKAGE = "titan_nvfp4."
LOG = logging.getLogger("titan_nvfp4")
_MAX_WORKERS = 16


# ---- encoding a specialization (JSON round trip that rebuilds the objects Triton hashes) ----------------------------

def _encode_constant(value):
    """A constexpr argument's value as JSON that ``_decode_constant`` turns back into an equal object of the same
    type (the cache key hashes ``str`` of it); None for a value that cannot be written."""
    import triton.language as tl
    if value is None or type(value) in (bool, int, float, str):
        return {"v": value}
    if isinstance(value, tl.dtype):
        return {"tl.dtype": str(value)}
    if isinstance(value, tl.constexpr) and (value.value is None or type(value.value) in (bool, int, float, str)):
        return {"constexpr": value.value}
    return None


def _decode_constant(doc):
    import triton.language as tl
    if "v" in doc:
        return doc["v"]
    if "tl.dtype" in doc:
        return tl.dtype(doc["tl.dtype"])
    return tl.constexpr(doc["constexpr"])


def _tuples(x):
    """JSON lists back to the tuples Triton built (options, signatures hold tuples, never lists)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def entry_from_hook(fn, compile: dict) -> dict | None:
    """A manifest entry from the arguments of Triton's ``jit_post_compile_hook``; None for a kernel outside this
    package, one not reachable by module and name, or one with a constant that cannot be written."""
    if not fn.module.startswith(PACKAGE) or "<locals>" in fn.name:
        return None
    constants = []
    for path, value in compile["constants"].items():
        enc = _encode_constant(value)
        if enc is None:
            return None
        constants.append([list(path), enc])
    attrs = [[list(path), value] for path, value in compile["configs"][0].items()]
    options = json.loads(compile["specialization_data"])["options"]
    # libdevice's path is this install's; the compiling process fills in its own (the key hashes the file's bytes)
    options.pop("extern_libs", None)
    return classified({"module": fn.module, "name": fn.name, "signature": compile["signature"],
                       "constants": constants, "attrs": attrs, "options": options})


def classified(entry: dict) -> dict:
    """``entry`` with its ``experts_only`` field (expert_kernels.py) set, or left out where unknown."""
    from .expert_kernels import experts_only
    names = list(entry["signature"])
    values = {names[path[0]]: next(iter(v.values())) for path, v in entry["constants"]
              if len(path) == 1 and path[0] < len(names)}
    only = experts_only(f"{entry['module']}:{entry['name']}", values)
    out = {k: v for k, v in entry.items() if k != "experts_only"}
    return out if only is None else {**out, "experts_only": only}


def identity(entry: dict) -> str:
    """The text of what an entry compiles (its annotations left out), to tell entries apart."""
    return json.dumps({k: entry[k] for k in ENTRY_KEYS}, sort_keys=True)


def source_and_options(entry: dict):
    """(ASTSource, options dict) of a manifest entry, as the training process would build them."""
    from triton.compiler import ASTSource
    fn = kernel_function(entry["module"], entry["name"])
    signature = {k: _tuples(v) for k, v in entry["signature"].items()}
    constants = {tuple(path): _decode_constant(v) for path, v in entry["constants"]}
    attrs = {tuple(path): value for path, value in entry["attrs"]}
    options = {k: _tuples(v) for k, v in entry["options"].items()}
    return ASTSource(fn, signature, constants, attrs), options


def _environment() -> dict:
    """The environment variables Triton's cache keys include, as they are now."""
    from triton.compiler.compiler import get_cache_invalidating_env_vars
    return dict(get_cache_invalidating_env_vars())


def cache_hash(src, options: dict, target: dict) -> str:
    """The hash that names ``triton.compile(src, target, options)``'s folder in Triton's cache, in this process."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import get_cache_key, make_backend
    backend = make_backend(GPUTarget(target["backend"], target["arch"], target["warp_size"]))
    key = get_cache_key(src, backend, backend.parse_options(dict(options)), _environment())
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def unfaithful(entry: dict, jit_fn, compile: dict, compiled: str, target: dict) -> list[str] | None:
    """None when compiling the manifest entry gives the kernel this process compiled (cache hash ``compiled``);
    else what differs between the entry and the compile Triton reported to the hook, for the manifest to show."""
    from triton.compiler import ASTSource
    src, options = source_and_options(entry)
    if cache_hash(src, options, target) == compiled:
        return None
    real = ASTSource(jit_fn, compile["signature"], compile["constants"], compile["configs"][0])
    def parts(s):
        return {"function": s.fn.cache_key, "attrs": str(s.attrs), "signature": str(sorted(s.signature.items())),
                "constants": str(sorted((k, str(v), type(v).__name__) for k, v in s.constants.items()))}
    a, b = parts(real), parts(src)
    why = [f"{k}: {a[k][:400]} (compiled) != {b[k][:400]} (manifest)" for k in a if a[k] != b[k]]
    if cache_hash(real, options, target) != compiled:
        why.append(f"the compile Triton reported with the manifest's options does not give its cache hash (options "
                   f"or environment; cache-invalidating variables now: {_environment()})")
    return why


def kernel_function(module: str, name: str):
    """The compiled-kind ``triton.jit`` function named ``name`` in ``module`` (through an autotuner or heuristics
    over it; jit_object)."""
    from triton.runtime.jit import JITFunction
    obj = jit_object(module, name)
    if not isinstance(obj, JITFunction):
        raise TypeError(f"{module}.{name} is no triton.jit function")
    return obj


#: module-level constexprs whose value is the machine's, not the source's (the interpreter flag, a Triton-version
#: switch): a fingerprint takes their names only
_MACHINE_CONSTEXPRS = frozenset({"INTERPRETED", "_ROWS_FIRST"})


_JIT_TYPES = frozenset({"JITFunction", "InterpretedFunction"})  # triton.jit's object, compiled or interpreted


def jit_object(module: str, name: str):
    """The ``triton.jit`` object named ``name`` in ``module`` (through an autotuner or heuristics over it), compiled or
    under Triton's interpreter (kernel_function needs the compiled kind)."""
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    while type(obj).__name__ not in _JIT_TYPES and hasattr(obj, "fn"):
        obj = obj.fn
    if type(obj).__name__ not in _JIT_TYPES:
        raise TypeError(f"{module}.{name} is no triton.jit function")
    return obj


def source_fingerprint(jit) -> str:
    """A hash of what Triton's own source hash (``JITFunction.cache_key``) covers, the same under every Triton version
    and under its interpreter: the kernel's source from ``def`` and its starting line, those of every ``triton.jit``
    function of this package it calls (by the global names its source reads, transitively; Triton's own by name)
    and the constexpr globals it reads.
    Recorded beside the source hash, it lets a test without the recording's Triton tell that a kernel changed since
    (tests/test_precompile.py)."""
    import ast
    import inspect
    import re
    import textwrap

    parts: dict[str, str] = {}

    def visit(obj) -> None:
        fn = obj.fn
        key = f"{fn.__module__}:{fn.__qualname__}"
        if key in parts:
            return
        parts[key] = ""
        lines, start = inspect.getsourcelines(fn)
        src = textwrap.dedent("".join(lines))
        src = src[re.search(r"^def\s+\w+\s*\(", src, re.MULTILINE).start():]
        text = [key, str(start), src]
        tree = ast.parse(src)
        names = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
                       | {f"{n.value.id}.{n.attr}" for n in ast.walk(tree)
                          if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)})
        for name in names:
            head, _, attr = name.partition(".")
            value = fn.__globals__.get(head)
            if attr:
                value = getattr(value, attr, None) if inspect.ismodule(value) else None
            if type(value).__name__ in _JIT_TYPES:
                if value.fn.__module__.startswith(PACKAGE):  # Triton's own (tl.sum, ...) differ by its version
                    visit(value)
                text.append(f"calls {name}")
            elif isinstance(value, triton.language.constexpr):
                text.append(name if name in _MACHINE_CONSTEXPRS else f"{name}={value.value!r}")
        parts[key] = hashlib.sha256("\n".join(text).encode()).hexdigest()

    visit(jit)
    return hashlib.sha256("\n".join(f"{k} {v}" for k, v in sorted(parts.items())).encode()).hexdigest()


# ---- recording ----------------------------------------------------------------------------------------------------

class Recording:
    """The specializations of this package's kernels that Triton compiled (or loaded from its cache) while active,
    in first-use order, each once; ``skipped``: this package's kernels that could not be written (a constant of
    another type, a kernel made inside a function), which then compile on first use; ``unfaithful``: entries left
    out because compiling them elsewhere would not give the kernel compiled here (with what differs); ``sources``:
    each kernel's source hash ("module:name"), for the compile to skip a kernel edited since; ``fingerprints``: each
    kernel's source_fingerprint, for a test to tell the same without this Triton."""

    def __init__(self):
        self.entries: list[dict] = []
        self.skipped: set[str] = set()
        self.target: dict | None = None
        self.unfaithful: list[dict] = []
        self.sources: dict[str, str] = {}
        self.fingerprints: dict[str, str] = {}
        self.environment = _environment()
        self._seen: set[str] = set()

    def __call__(self, *, fn, compile, **_):
        entry = entry_from_hook(fn, compile)
        if entry is None:
            if fn.module.startswith(PACKAGE):
                self.skipped.add(f"{fn.module}.{fn.name}")
            return None
        if self.target is None:
            from triton.runtime.driver import driver
            t = driver.active.get_current_target()
            self.target = {"backend": t.backend, "arch": t.arch, "warp_size": t.warp_size}
        text = json.dumps(entry, sort_keys=True)
        if text in self._seen:
            return None
        self._seen.add(text)
        kernel = fn.jit_function.device_caches[compile["device"]][0].get(compile["key"])
        try:
            why = (unfaithful(entry, fn.jit_function, compile, kernel.hash, self.target) if kernel is not None
                   else None) or []
        except Exception as e:  # noqa: BLE001 (the recording must not stop the run it watches)
            why = [f"the entry does not rebuild: {type(e).__name__}: {e}"]
        name, source = f"{fn.module}:{fn.name}", fn.jit_function.cache_key
        if self.sources.setdefault(name, source) != source:
            why.append(f"function: its hash changed during the recording ({self.sources[name]} then {source})")
        self.fingerprints.setdefault(name, source_fingerprint(fn.jit_function))
        env = _environment()
        if env != self.environment:
            why.append(f"environment: cache-invalidating variables {env} at this compile, {self.environment} when "
                       "the recording started (a precompile process has the latter)")
        if why:
            self.unfaithful.append({"kernel": f"{fn.module}.{fn.name}", "differs": why})
        else:
            self.entries.append(entry)
        return None

    def manifest(self, **about) -> dict:
        """The manifest document of what was recorded (``about``: what to note in it: job, command, date)."""
        return {"format": FORMAT, "triton": triton.__version__, "target": self.target, **about,
                "not_recorded": sorted(self.skipped), "unfaithful": self.unfaithful, "sources": self.sources,
                "fingerprints": self.fingerprints, "kernels": self.entries}


@contextlib.contextmanager
def recording():
    """``with recording() as rec:`` run kernels; ``rec.manifest()`` lists what they compiled. Chains a hook that was
    set before."""
    from triton import knobs
    rec = Recording()
    before = knobs.runtime.jit_post_compile_hook

    def hook(**kwargs):
        rec(**kwargs)
        return before(**kwargs) if before is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield rec
    finally:
        knobs.runtime.jit_post_compile_hook = before


def merge(manifests: list[dict]) -> dict:
    """One manifest of several recordings of one target and Triton version (first-use order, each entry once)."""
    if not manifests:
        raise ValueError("merge: no manifest")
    first = manifests[0]
    seen, kernels = set(), []
    for m in manifests:
        if (m["triton"], m["target"]) != (first["triton"], first["target"]):
            raise ValueError(f"merge: a manifest for Triton {m['triton']} on {m['target']} among ones for Triton "
                             f"{first['triton']} on {first['target']}")
        for entry in m["kernels"]:
            text = identity(entry)  # a recording's entry and an annotated one of the same kernel: the first kept
            if text not in seen:
                seen.add(text)
                kernels.append(entry)
    not_recorded = sorted({k for m in manifests for k in m.get("not_recorded", [])})
    bad = [u for m in manifests for u in m.get("unfaithful", [])]
    sources, fingerprints = {}, {}
    for m in manifests:
        for k, v in m.get("sources", {}).items():
            if sources.setdefault(k, v) != v:
                raise ValueError(f"merge: {k} was recorded from two versions of its source")
        for k, v in m.get("fingerprints", {}).items():
            fingerprints.setdefault(k, v)
    return {**first, "not_recorded": not_recorded, "unfaithful": bad, "sources": sources,
            "fingerprints": fingerprints, "kernels": kernels}


# ---- reading and compiling ------------------------------------------------------------------------------------------

def load(path: Path) -> dict:
    """A manifest file, its layout checked (ValueError naming the file and what is wrong)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"kernel manifest {path}: not readable JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("kernels"), list) \
            or not isinstance(doc.get("triton"), str):
        raise ValueError(f"kernel manifest {path}: expected an object with \"format\": {FORMAT}, \"triton\" (the "
                         f"version) and a \"kernels\" list")
    if doc["kernels"] and not (isinstance(doc.get("target"), dict)
                               and set(doc["target"]) == {"backend", "arch", "warp_size"}):
        raise ValueError(f"kernel manifest {path}: expected \"target\": {{\"backend\", \"arch\", \"warp_size\"}}, "
                         f"got {doc.get('target')!r}")
    sources = doc.get("sources", {})
    if not (isinstance(sources, dict) and all(isinstance(k, str) and ":" in k and isinstance(v, str)
                                              for k, v in sources.items())):
        raise ValueError(f"kernel manifest {path}: \"sources\" must map \"module:kernel\" to a source hash")
    fingerprints = doc.get("fingerprints", {})
    if not (isinstance(fingerprints, dict) and all(isinstance(k, str) and ":" in k and isinstance(v, str)
                                                   for k, v in fingerprints.items())):
        raise ValueError(f"kernel manifest {path}: \"fingerprints\" must map \"module:kernel\" to a source fingerprint")
    for i, entry in enumerate(doc["kernels"]):
        if not isinstance(entry, dict) or not ENTRY_KEYS <= set(entry) <= ENTRY_KEYS | set(ANNOTATIONS):
            raise ValueError(f"kernel manifest {path}: kernel {i}: expected the keys {sorted(ENTRY_KEYS)} (and "
                             f"optionally {sorted(ANNOTATIONS)}), got "
                             f"{sorted(entry) if isinstance(entry, dict) else entry!r}")
        for key, types in ANNOTATIONS.items():
            value = entry.get(key)
            if key in entry and (type(value) not in types or (key == "compile_s" and not value >= 0)):
                raise ValueError(f"kernel manifest {path}: kernel {i}: \"{key}\" must be "
                                 f"{'true or false' if key == 'experts_only' else 'seconds (a number >= 0)'}, got "
                                 f"{value!r}")
    return doc


def manifest_path(gpu_class: str | None) -> Path | None:
    """The manifest serving a GPU class (None: switched off, or none shipped for the class)."""
    setting = os.environ.get(ENV, "1")
    if setting in ("", "0"):
        return None
    if setting != "1":
        if not Path(setting).is_file():
            raise ValueError(f"{ENV}={setting}: no such manifest file (0 turns the precompile off)")
        return Path(setting)
    from .shipped_tuning import TABLE_DIR
    path = TABLE_DIR / f"{gpu_class}.kernels.json" if gpu_class else None
    return path if path is not None and path.is_file() else None


def _compile_one(args: tuple[dict, dict]) -> str | None:
    """Compile one entry for ``target`` into Triton's cache (a pool task); None, or why it failed."""
    entry, target = args
    from triton.backends.compiler import GPUTarget
    step = ""
    try:
        src, options = source_and_options(entry)
        kernel = triton.compile(src, target=GPUTarget(target["backend"], target["arch"], target["warp_size"]),
                                options=options)
        step = "its launcher: "
        build_launcher(kernel)
        return None
    except Exception as e:  # noqa: BLE001 (reported; the first launch then compiles what is missing)
        first = str(e).splitlines()[0] if str(e) else ""
        return f"{entry['module']}.{entry['name']}: {step}{type(e).__name__}: {first}"


def build_launcher(kernel) -> bool:
    """Build ``kernel``'s C launcher into Triton's cache, the call its first launch makes (``_init_handles``): a gcc
    compile per signature, about a second each on the training process otherwise. False where no GPU driver is
    active (a CPU machine: the first launch builds it)."""
    from triton.runtime.driver import driver
    try:
        make = driver.active.launcher_cls
    except RuntimeError:  # "0 active drivers"
        return False
    make(kernel.src, kernel.metadata)
    return True


def in_cache(entry: dict, target: dict) -> bool:
    """Whether Triton's cache holds the kernel ``entry`` compiles to, looked up as ``triton.compile`` looks it up (the
    metadata file in the group of the entry's cache hash; Triton makes that hash's folder, as its compile does). The
    kernel's launcher is not looked at: where only it is missing, the first launch builds it (a gcc compile, about a
    second per kernel signature). False for an entry that does not rebuild here (the compile then reports why)."""
    from triton import knobs
    from triton.runtime.cache import get_cache_manager
    if knobs.compilation.always_compile:
        return False
    try:
        src, options = source_and_options(entry)
        key = cache_hash(src, options, target)
    except Exception:  # noqa: BLE001 (a module or kernel gone, an interpreted kernel: left to the compile)
        return False
    name = f"{src.name[:150]}.json"
    return (get_cache_manager(key).get_group(name) or {}).get(name) is not None


def longest_first(entries: list[dict]) -> list[dict]:
    """``entries`` by their measured compile time (``compile_s``), longest first; those without one after, in their
    order (first use): a pool that takes the longest compile last ends that much later."""
    return sorted(entries, key=lambda e: (0, -e["compile_s"]) if "compile_s" in e else (1, 0))


def compile_all(doc: dict, workers: int, only: list[int] | None = None) -> tuple[int, list[str]]:
    """Compile the entries of a manifest (``only``: those at these indices) on ``workers`` processes (forked after
    importing the kernels' modules, so each starts warm), longest first; (kernels compiled, failures). A module that
    does not import (its entries are skipped) or a worker that dies (the pool's remaining work is lost) is a failure
    line, not an exception."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool
    entries = doc["kernels"] if only is None else [doc["kernels"][i] for i in only]
    failures, missing = [], set()
    for module in dict.fromkeys(e["module"] for e in entries):
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 (a manifest naming a module this install lacks)
            missing.add(module)
            failures.append(f"{module}: {type(e).__name__}: {e} (its kernels skipped)")
    changed, compiled = set(), {f"{e['module']}:{e['name']}" for e in entries}
    # the recording's source fingerprint where the manifest has one: Triton's own source hash of a kernel depends on
    # the order the process hashed kernels sharing helpers in (the same source gave two hashes on Triton 3.6)
    fingerprints = doc.get("fingerprints", {})
    for kernel, key in {**doc.get("sources", {}), **fingerprints}.items():  # "module:name" → the recording's
        if kernel not in compiled:
            continue
        module, name = kernel.split(":", 1)
        try:
            if module in missing:
                now = key
            elif kernel in fingerprints:
                now = source_fingerprint(jit_object(module, name))
            else:
                now = kernel_function(module, name).cache_key
        except (AttributeError, TypeError):  # the kernel is gone from its module
            now = None
        if now != key:
            changed.add((module, name))
            failures.append(f"{module}.{name}: its source (with what it calls) is not the one the manifest was "
                            f"recorded from (its entries skipped)")
    tasks = [(e, doc["target"]) for e in longest_first(entries) if e["module"] not in missing
             and (e["module"], e["name"]) not in changed]
    if workers <= 1 or len(tasks) <= 1:
        results = [_compile_one(t) for t in tasks]
    else:
        try:
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
                results = list(pool.map(_compile_one, tasks))  # taken in this order
        except BrokenProcessPool as e:
            return 0, failures + [f"a compile process died ({e}): the kernels compile on first use"]
    errors = [r for r in results if r is not None]
    return len(tasks) - len(errors), failures + errors


def default_workers() -> int:
    """All but one of this process's CPUs, at most 16."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(_MAX_WORKERS, n - 1))


# ---- starting it from a training process ----------------------------------------------------------------------------

_started: dict = {}


def wanted(experts: bool = True) -> bool:
    """Whether ``start`` may have work: not switched off, not interpreting, not started yet (or started for a model
    without NVFP4 experts, and now ``experts``); checks that need no GPU, so that a caller asks for the device, which
    initializes CUDA, only then."""
    done = _started.get("experts")
    return ((done is None or (experts and not done)) and os.environ.get(ENV, "1") not in ("", "0")
            and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))


def start(device_index: int | None, log=LOG, experts: bool = True):
    """Fork the background compile (precompile_process.py) of the manifest for ``device_index``'s GPU class, once per
    process and only on a node's first rank (the others find the kernels in the same cache); the process, or None
    when there is nothing to do (a CPU run, switched off, the interpreter, no manifest for this class, another Triton
    version, or every kernel already in Triton's cache: said in one log line). Only the entries missing from the
    cache are compiled.
    ``experts``: whether the model has NVFP4 grouped-expert layers; without them the entries only those launch are
    left out, and a later call with ``experts`` (the experts converted after the Linears) compiles those.

    Where TRITON_CACHE_DIR is unset, it is set (on every rank) to Triton's default folder: otherwise inductor, on its
    first compile, points this process at a per-device folder of its own, where the precompiled kernels are not."""
    if not wanted(experts):
        return _started.get("proc")
    adding = "experts" in _started  # started without the experts' entries: now those
    _started["experts"] = experts
    _started.setdefault("proc", None)
    if not adding:
        _started["manifest"] = _manifest(device_index, log)
    if _started.get("manifest") is None or int(os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID")
                                               or 0) != 0:
        return None
    path, doc = _started["manifest"]
    picked = [i for i, e in enumerate(doc["kernels"])
              if (e.get("experts_only") is True if adding else experts or e.get("experts_only") is not True)]
    t0 = time.perf_counter()
    missing = [i for i in picked if not in_cache(doc["kernels"][i], doc["target"])]
    checked = (f"{'the NVFP4 experts: ' if adding else ''}{len(picked) - len(missing)} of {len(picked)} in the cache, "
               f"checked in {time.perf_counter() - t0:.2f} s")
    if not adding and len(picked) < len(doc["kernels"]):
        checked += f"; {len(doc['kernels']) - len(picked)} only NVFP4 grouped experts launch left out"
    cache = os.environ["TRITON_CACHE_DIR"]
    if not missing:
        log.info(f"NVFP4: nothing to precompile: Triton's cache {cache} holds every kernel specialization of "
                 f"{path.name} this model launches ({checked})")
        return _started["proc"]
    from .precompile_process import fork  # (it imports this module)
    workers = min(default_workers(), len(missing))
    proc = fork(doc, workers, missing if len(missing) < len(doc["kernels"]) else None)
    atexit.register(_stop, proc)
    _started["patience"] = _started.get("patience", 0.0) + patience([doc["kernels"][i] for i in missing], workers)
    if _started["proc"] is not None:
        _started.setdefault("earlier", []).append(_started["proc"])
    _started["proc"] = proc
    log.info(f"NVFP4: precompiling {len(missing)} Triton kernel specializations on {workers} processes in the "
             f"background into {cache} ({path.name}: {checked}; {ENV}=0 turns it off)")
    return proc


def _manifest(device_index: int | None, log) -> tuple[Path, dict] | None:
    """(path, document) of the manifest serving ``device_index``'s GPU class, with TRITON_CACHE_DIR set; None when
    there is none to compile (a CPU run, none for the class, an empty one, or one of another Triton version)."""
    if device_index is None:
        return None
    from .shipped_tuning import gpu_class
    path = manifest_path(gpu_class(device_index))
    if path is None:
        return None
    doc = load(path)
    if not doc["kernels"]:
        return None
    if doc["triton"] != triton.__version__:
        log.info(f"NVFP4: kernels not precompiled: {path} lists Triton {doc['triton']}'s specializations, this is "
                 f"Triton {triton.__version__} (they compile on first use)")
        return None
    if os.environ.get("TRITON_CACHE_DIR") is None:
        from triton import knobs
        os.environ["TRITON_CACHE_DIR"] = knobs.cache.dir
    return path, doc


#: Seconds assumed for an entry without a measured compile time, and the slack of ``patience``.
_UNTIMED_S, _SLACK_S = 5.0, 60.0


def patience(entries: list[dict], workers: int) -> float:
    """How long a first launch waits for the compile of ``entries`` on ``workers`` processes before it gives up on it
    (a compile that hangs then costs a minute or two, not the step): four times the longest of the per-worker share
    of the entries' measured compile times (``compile_s``) and the slowest entry's, plus a minute."""
    times = [e.get("compile_s", _UNTIMED_S) for e in entries] or [0.0]
    return _SLACK_S + 4 * max(sum(times) / max(workers, 1), max(times))


def wait(log=LOG, timeout: float | None = None) -> None:
    """Called before this process compiles its first kernel: let the background precompiles it started finish (once),
    so that kernels come from the cache rather than from compiles of its own racing the pool for the CPUs; at most
    ``timeout`` seconds (default: the started compiles' ``patience``)."""
    if timeout is None:
        timeout = _started.get("patience", 300.0)
    procs = [p for p in (*_started.get("earlier", ()), _started.get("proc")) if p is not None]
    if not procs or _started.get("waited"):
        return
    _started["waited"] = True
    running = [p for p in procs if p.poll() is None]
    if not running:
        return
    t0 = time.monotonic()
    try:
        for p in running:
            p.wait(max(0.0, timeout - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        log.warning(f"NVFP4: the background precompile still runs after {timeout:.0f} s: kernels compile on first use")
        return
    log.info(f"NVFP4: the first kernel launch waited {time.monotonic() - t0:.1f} s for the background precompile")


def _stop(proc) -> None:
    """At exit: end a background compile still running (its pool too; the fork itself if it has not yet made its
    own session)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                os.kill(proc.pid, signal.SIGTERM)
