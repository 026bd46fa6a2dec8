"""The background precompile (titan_nvfp4/kernels/precompile.py), on the CPU: Triton compiles for an sm_90 target
without a GPU (its wheel carries ptxas), so a stand-in driver lets the real JIT path specialize, compile and record
two of the package's kernels. What is checked: the specializations the background process compiles are the ones
the first use then asks for (it adds nothing to Triton's cache; a changed constant would), the manifest is
recorded in first-use order once each, start() runs it in the background and is off where it should be, and a bad
manifest is refused naming the file. The GPU twin (tests/test_gpu.py) does the same for a real NVFP4 step."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from titan_nvfp4.kernels import precompile  # noqa: E402
# The kernels' modules as the rest of the suite has them (interpreted on the CPU), before tests below set
# TRITON_INTERPRET=0 as on a GPU: start() imports them to look their entries up in the cache.
from titan_nvfp4.kernels import expert_map, gemm, grouped_gemm, quantize, swiglu  # noqa: E402,F401

ROOT = Path(__file__).resolve().parent.parent


def _pythonpath() -> str:
    """The checkout first, then the caller's PYTHONPATH (a device machine's wheel folder)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def _can_compile_sm90() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton.backends.nvidia") is not None


needs_ptxas = pytest.mark.skipif(not _can_compile_sm90(), reason="this Triton has no NVIDIA backend to compile with")


def _first_use(cache: Path, block: int = 128, record: Path | None = None) -> set[str]:
    """A new training process on Triton cache folder ``cache`` meets two package kernels
    (tests/precompile_first_use.py; ``record``: write the manifest of what compiled); the entries it added there."""
    cache.mkdir(exist_ok=True)
    before = _entries(cache)
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": _pythonpath()}
    cmd = [sys.executable, str(ROOT / "tests" / "precompile_first_use.py"), "--block", str(block)]
    r = subprocess.run(cmd + (["--record", str(record)] if record else []), env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return _entries(cache) - before


def _entries(cache: Path) -> set[str]:
    return set(os.listdir(cache))


def _precompile_cli(manifest: Path, cache: Path, workers: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": _pythonpath(), "TRITON_INTERPRET": "0"}
    return subprocess.run([sys.executable, "-m", "titan_nvfp4.tools.precompile_kernels", str(manifest), "--workers",
                           str(workers)], env=env, capture_output=True, text=True, timeout=300)


def _tool(manifest: Path, cache: Path, monkeypatch, capsys) -> tuple[int, str]:
    """The precompile tool run in this process (its checks and messages; no compile forks here): (exit, stderr)."""
    from titan_nvfp4.tools import precompile_kernels
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    capsys.readouterr()
    rc = precompile_kernels.main([str(manifest), "--workers", "1"])
    return rc, capsys.readouterr().err


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(manifest, cache folder) of one stand-in training process's first use, recorded."""
    tmp = tmp_path_factory.mktemp("recorded")
    manifest = tmp / "sm90.kernels.json"
    assert len(_first_use(tmp / "cache", record=manifest)) == 3
    return manifest, tmp / "cache"


@needs_ptxas
def test_precompiled_kernels_are_the_ones_the_first_use_asks_for(recorded, tmp_path):
    manifest, first = recorded
    doc = precompile.load(manifest)
    assert [e["name"] for e in doc["kernels"]] == ["_block_experts_kernel", "_amax_kernel", "_dequant_kernel"]
    assert doc["unfaithful"] == [] and doc["not_recorded"] == []
    assert doc["target"] == {"backend": "cuda", "arch": 90, "warp_size": 32} and doc["triton"] == triton.__version__
    install = str(Path(triton.__file__).resolve().parent)
    assert install not in manifest.read_text()  # no path of this install (libdevice's): usable by any other

    cache = tmp_path / "precompiled"
    r = _precompile_cli(manifest, cache)
    assert r.returncode == 0, r.stderr
    assert "3 of 3 kernel specializations in Triton's cache" in r.stderr
    filled = _entries(cache) - {"titan_nvfp4_precompile.lock"}
    assert len(filled) == 3 and filled == _entries(first)  # the cache keys the first use made
    assert _first_use(cache) == set()  # a new training process finds every kernel: nothing compiled


@needs_ptxas
def test_a_changed_constant_precompiles_that_kernel_and_a_missing_one_compiles_on_first_use(recorded, tmp_path):
    """The manifest's constants reach the compile: an entry changed to BLOCK 64 serves a first use with BLOCK 64;
    the amax and dequantization kernels, left out of that manifest, are compiled by the first use itself."""
    manifest, _ = recorded
    doc = precompile.load(manifest)
    entry = doc["kernels"][0]
    changed = {**entry, "constants": [[p, {"v": 64} if v == {"v": 128} else v] for p, v in entry["constants"]]}
    assert changed != entry
    other = tmp_path / "m.json"
    other.write_text(json.dumps({**doc, "kernels": [changed]}))
    cache = tmp_path / "other"
    assert _precompile_cli(other, cache, workers=1).returncode == 0
    added = _first_use(cache, block=64)
    assert len(added) == 2  # the amax and dequantization kernels; the block-64 one was there


_FIDELITY = """
import json, sys
from titan_nvfp4.kernels import precompile
entry = precompile.load(sys.argv[1])["kernels"][2]
src, options = precompile.source_and_options(entry)
target = {"backend": "cuda", "arch": 90, "warp_size": 32}
compiled = precompile.cache_hash(src, options, target)
hook = {"signature": src.signature, "constants": src.constants, "configs": [src.attrs]}
changed = {**entry, "constants": [[p, {"v": 512} if v == {"v": 256} else v] for p, v in entry["constants"]]}
print(json.dumps([precompile.unfaithful(e, src.fn, hook, compiled, target) for e in (entry, changed)]))
"""


@needs_ptxas
def test_an_entry_that_would_compile_another_kernel_is_named_with_what_differs(recorded):
    """The recorder checks each entry against the kernel Triton compiled: the entry as recorded rebuilds its cache
    hash; one whose constant changed does not, and the difference is named (compiled kernels: no interpreter)."""
    manifest, _ = recorded
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", _FIDELITY, str(manifest)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    same, changed = json.loads(r.stdout)
    assert same is None
    assert len(changed) == 1 and changed[0].startswith("constants: ") and "512" in changed[0]


_MIDWAY = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import torch
from triton.runtime.driver import driver
from tests.precompile_first_use import Sm90Driver
driver.set_active(Sm90Driver())
from titan_nvfp4.kernels import expert_map, precompile
kernel = expert_map._block_experts_kernel
offsets, out = torch.zeros(8, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
with precompile.recording() as rec:
    kernel.warmup(offsets, 8, out, 64, EP2=8, BLOCK=128, grid=(1,))
    if sys.argv[2] == "env":  # a cache-invalidating variable, set by the process midway
        os.environ["TRITON_DEFAULT_FP_FUSION"] = "0"
    elif sys.argv[2] == "source":  # the kernel's source replaced midway (what Triton allows through this method)
        kernel._unsafe_update_src(kernel.src + "\\n")
    else:  # no longer reachable by module and name (a precompile process could not find it)
        del expert_map._block_experts_kernel
    kernel.warmup(offsets, 8, out, 64, EP2=8, BLOCK=64, grid=(1,))
print(json.dumps(rec.manifest()))
"""


def _record_midway(tmp_path, change: str) -> dict:
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_DEFAULT_FP_FUSION", None)
    r = subprocess.run([sys.executable, "-c", _MIDWAY, str(ROOT), change], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert len(doc["kernels"]) == 1 and len(doc["unfaithful"]) == 1  # BLOCK 128 kept, BLOCK 64 left out
    assert doc["unfaithful"][0]["kernel"] == "titan_nvfp4.kernels.expert_map._block_experts_kernel"
    return doc


@needs_ptxas
@pytest.mark.parametrize("change, needle", [("env", "environment: "), ("source", "function: its hash changed"),
                                            ("gone", "the entry does not rebuild: AttributeError")])
def test_a_compile_after_the_process_changed_its_key_inputs_is_left_out(tmp_path, change, needle):
    """A precompile process has the environment and the kernel sources the training process started with: a kernel
    compiled after the process changed a cache-invalidating variable, or the kernel's source, would be precompiled
    under another key, and one no longer reachable by its name could not be precompiled; each is listed with the
    reason, not kept, and the recorded run goes on."""
    doc = _record_midway(tmp_path, change)
    assert any(d.startswith(needle) for d in doc["unfaithful"][0]["differs"]), doc["unfaithful"]
    if change == "env":
        assert any("TRITON_DEFAULT_FP_FUSION" in d for d in doc["unfaithful"][0]["differs"])


@needs_ptxas
@pytest.mark.parametrize("recorded_as", ["fingerprints", pytest.param("sources", marks=pytest.mark.slow(
    reason="10 s on 2 cores; a manifest of before the fingerprints: today's in CI"))])
def test_a_kernel_whose_source_changed_since_the_recording_is_skipped_by_name(recorded, tmp_path, recorded_as):
    """An edited kernel would compile under another key than the training process asks for: its entries are skipped
    (a failure line naming it), the others compile. The compile compares the recorded source fingerprint, or in a
    manifest without fingerprints (recorded before them) Triton's source hash."""
    manifest, _ = recorded
    doc = precompile.load(manifest)
    kernels = {"titan_nvfp4.kernels.expert_map:_block_experts_kernel", "titan_nvfp4.kernels.quantize:_amax_kernel",
               "titan_nvfp4.kernels.gemm:_dequant_kernel"}
    assert set(doc["sources"]) == kernels and set(doc["fingerprints"]) == kernels
    if recorded_as == "sources":
        del doc["fingerprints"]
    doc[recorded_as]["titan_nvfp4.kernels.quantize:_amax_kernel"] = "0" * 64
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps(doc))
    r = _precompile_cli(stale, tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    assert "titan_nvfp4.kernels.quantize._amax_kernel: its source" in r.stderr
    assert "2 of 3 kernel specializations in Triton's cache" in r.stderr and "(1 failed" in r.stderr


_LAUNCHERS = """
import json, sys
sys.path.insert(0, sys.argv[1])
from triton.runtime.driver import driver
from tests.precompile_first_use import Sm90Driver, first_use
seen = []
class Recording(Sm90Driver):
    def launcher_cls(self, src, metadata):  # what a launcher's C source is generated from
        seen.append([src.fn.__name__, [[str(k), str(v)] for k, v in src.signature.items()],
                     [[str(k), str(v)] for k, v in src.constants.items()], metadata.name])
driver.set_active(Recording())
from titan_nvfp4.kernels import precompile
with precompile.recording() as rec:
    for k in first_use(128):
        driver.active.launcher_cls(k.src, k.metadata)  # what the first launch does (CompiledKernel._init_handles)
first = list(seen)
done, failures = precompile.compile_all(json.loads(json.dumps(rec.manifest())), 1)
print(json.dumps([first, seen[len(first):], done, failures]))
"""


@needs_ptxas
def test_the_precompile_builds_the_launchers_the_first_launches_build(tmp_path):
    """Each kernel's C launcher (a gcc compile per signature on a GPU, about a second each) is built by the precompile
    from the same source and metadata a first launch builds it from, so the training process finds it cached."""
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", _LAUNCHERS, str(ROOT)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    first, precompiled, done, failures = json.loads(r.stdout)
    assert done == 3 and failures == []
    assert len(first) == 3 and sorted(precompiled) == sorted(first)


def test_no_gpu_driver_leaves_the_launcher_to_the_first_launch():
    if torch.cuda.is_available():
        pytest.skip("a GPU machine has an active driver")
    assert precompile.build_launcher(object()) is False


def test_the_first_compile_waits_for_the_background_precompile_once(monkeypatch, caplog):
    """A training process about to compile its first kernel lets its running background precompile finish (its
    kernels then come from the cache), once; a finished or absent one costs nothing."""
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    monkeypatch.setattr(precompile, "_started", {"proc": slow})
    with caplog.at_level(logging.INFO, logger="titan_nvfp4"):
        precompile.wait()
    assert slow.poll() == 0 and "waited" in caplog.text and "for the background precompile" in caplog.text
    again = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        monkeypatch.setattr(precompile, "_started", {**precompile._started, "proc": again})
        t0 = time.monotonic()
        precompile.wait()  # once per process
        assert time.monotonic() - t0 < 1 and again.poll() is None
    finally:
        again.kill()
        again.wait()
    monkeypatch.setattr(precompile, "_started", {"proc": None})
    precompile.wait()  # none started (a CPU run, switched off): nothing to wait for


#: The start of a stand-in training process on the GPU class "sm90" (argv[1]: the checkout), its log lines in ``logs``.
_TRAINING_PROCESS = """
import json, logging, os, sys
sys.path.insert(0, sys.argv[1])
from titan_nvfp4.kernels import precompile, shipped_tuning
shipped_tuning.gpu_class = lambda device_index: "sm90"
logs = []
handler = logging.Handler()
handler.emit = lambda record: logs.append(record.getMessage())
precompile.LOG.addHandler(handler)
precompile.LOG.setLevel(logging.INFO)
"""

_ONCE = _TRAINING_PROCESS + """
print("before the fork")  # buffered (stdout is a pipe): the fork must not write it a second time
proc = precompile.start(0)
same = precompile.start(0) is proc
print(json.dumps({"forked": type(proc).__name__, "same": same, "rc": proc.wait(timeout=300), "logs": logs}))
"""


@needs_ptxas
def test_start_compiles_in_the_background_once(recorded, tmp_path):
    """A training process (here one with the kernels imported uninterpreted, as on a GPU) forks the compile once; the
    fork fills the cache with what the first use compiles."""
    manifest, first = recorded
    cache = tmp_path / "bg"
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache),
           "TITAN_NVFP4_PRECOMPILE": str(manifest)}
    env.pop("LOCAL_RANK", None)
    env.pop("PYTHONUNBUFFERED", None)
    r = subprocess.run([sys.executable, "-c", _ONCE, str(ROOT)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("before the fork") == 1
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["forked"] == "ForkedCompile" and out["same"] and out["rc"] == 0  # once per process
    assert "precompiling 3 Triton kernel specializations" in out["logs"][0] and f"into {cache}" in out["logs"][0]
    assert "3 of 3 kernel specializations in Triton's cache" in r.stderr
    assert _entries(cache) - {"titan_nvfp4_precompile.lock"} == _entries(first)


def test_the_first_launch_gives_up_on_a_compile_after_its_patience(monkeypatch, caplog):
    """A compile that outlives what its entries' measured times allow (a hang) is left behind after its patience,
    with a warning: the kernels then compile on first use."""
    entries = [{"compile_s": 2.0}, {"compile_s": 9.0}, {}]  # untimed: 5 s
    assert precompile.patience(entries, 2) == 60 + 4 * 9.0 and precompile.patience(entries, 1) == 60 + 4 * 16.0
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        monkeypatch.setattr(precompile, "_started", {"proc": stuck, "patience": 0.5})
        t0 = time.monotonic()
        with caplog.at_level(logging.INFO, logger="titan_nvfp4"):
            precompile.wait()
        assert time.monotonic() - t0 < 5 and "still runs after 0 s" in caplog.text and stuck.poll() is None
    finally:
        stuck.kill()
        stuck.wait()


def test_a_fork_reaped_elsewhere_counts_as_ended():
    """poll() of a compile another waitpid already reaped (SIGCHLD ignored, a waitpid(-1)) ends it, not the caller."""
    from titan_nvfp4.kernels.precompile_process import ForkedCompile
    gone = ForkedCompile(os.getpid(), None)  # not a child of this process: waitpid raises ChildProcessError
    assert gone.poll() == -1 and gone.wait(timeout=1) == -1


def test_start_points_every_rank_at_one_cache_folder(monkeypatch, tmp_path):
    """Where TRITON_CACHE_DIR is unset, start sets it to Triton's default on every rank (inductor would otherwise
    move the training process to a per-device folder of its own); a set one is kept."""
    from triton import knobs
    manifest = tmp_path / "m.json"
    entry = {"module": "titan_nvfp4.kernels.expert_map", "name": "_block_experts_kernel", "signature": {},
             "constants": [], "attrs": [], "options": {}}
    manifest.write_text(json.dumps({"format": 1, "triton": triton.__version__, "kernels": [entry],
                                    "target": {"backend": "cuda", "arch": 90, "warp_size": 32}}))
    monkeypatch.setenv("TITAN_NVFP4_PRECOMPILE", str(manifest))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("LOCAL_RANK", "1")  # not the node's first rank: nothing launched
    monkeypatch.setattr("titan_nvfp4.kernels.shipped_tuning.gpu_class", lambda device_index: "sm90")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    default = knobs.cache.dir
    monkeypatch.setattr(precompile, "_started", {})
    assert precompile.start(0) is None and os.environ["TRITON_CACHE_DIR"] == default
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setattr(precompile, "_started", {})
    assert precompile.start(0) is None and os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def test_the_compile_ends_with_the_process_that_started_it(tmp_path):
    """A training process killed (torchrun ends its process group; the compile runs in its own session) takes its
    background compile with it: --stop-with watches the parent."""
    pid_file = tmp_path / "pid"
    child = ("import os, sys, time; from titan_nvfp4.kernels.precompile_process import stop_with; "
             f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); stop_with(os.getppid()); time.sleep(120)")
    parent = ("import subprocess, sys, time; "
              f"subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True); time.sleep(120)")
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    p = subprocess.Popen([sys.executable, "-c", parent], env=env)
    deadline = time.monotonic() + 120
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.2)
    pid = int(pid_file.read_text())
    os.kill(pid, 0)  # running
    p.kill()  # SIGKILL: no atexit, no cleanup in the parent
    p.wait()
    while _alive(pid):
        assert time.monotonic() < deadline, "the compile outlived its training process"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) is gone
        return f.read().split(") ")[-1][0] != "Z"


def test_one_compile_per_cache_folder_and_a_missing_module_is_a_failure_line(tmp_path, monkeypatch, capsys):
    import fcntl
    manifest = tmp_path / "m.json"
    entry = {"module": "titan_nvfp4.kernels.no_such_module", "name": "k", "signature": {}, "constants": [],
             "attrs": [], "options": {}}
    manifest.write_text(json.dumps({"format": 1, "triton": triton.__version__, "kernels": [entry],
                                    "target": {"backend": "cuda", "arch": 90, "warp_size": 32}}))
    cache = tmp_path / "cache"
    cache.mkdir()
    with open(cache / "titan_nvfp4_precompile.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        rc, err = _tool(manifest, cache, monkeypatch, capsys)
    assert rc == 0 and "another precompile is filling" in err
    rc, err = _tool(manifest, cache, monkeypatch, capsys)
    assert rc == 0 and "failed: titan_nvfp4.kernels.no_such_module: ModuleNotFoundError" in err
    assert "0 of 1 kernel specializations" in err


def test_start_is_off_on_the_cpu_when_switched_off_and_off_rank_zero(monkeypatch, tmp_path):
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"format": 1, "triton": triton.__version__, "target": None, "kernels": []}))
    monkeypatch.setattr("titan_nvfp4.kernels.shipped_tuning.gpu_class", lambda device_index: "sm90")
    cases = [({"TITAN_NVFP4_PRECOMPILE": str(manifest)}, None),  # a CPU run
             ({"TITAN_NVFP4_PRECOMPILE": "0"}, 0),
             ({"TITAN_NVFP4_PRECOMPILE": str(manifest), "LOCAL_RANK": "1"}, 0),
             ({"TITAN_NVFP4_PRECOMPILE": str(manifest), "TRITON_INTERPRET": "1"}, 0),  # nothing compiles
             ({"TITAN_NVFP4_PRECOMPILE": str(manifest)}, 0)]  # an empty manifest: nothing to do
    for env, device in cases:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        monkeypatch.setattr(precompile, "_started", {})
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert precompile.start(device) is None, env
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("TITAN_NVFP4_PRECOMPILE", "1")
    assert precompile.manifest_path("sm12345") is None  # no manifest shipped for that class
    monkeypatch.setenv("TITAN_NVFP4_PRECOMPILE", str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match=r"TITAN_NVFP4_PRECOMPILE=.*nope\.json: no such manifest file"):
        precompile.manifest_path("sm90")


def test_another_triton_versions_manifest_is_skipped_with_a_log_line(monkeypatch, tmp_path, caplog, capsys):
    manifest = tmp_path / "m.json"
    entry = {"module": "titan_nvfp4.kernels.expert_map", "name": "_block_experts_kernel", "signature": {},
             "constants": [], "attrs": [], "options": {}}
    manifest.write_text(json.dumps({"format": 1, "triton": "0.0.1", "target": {"backend": "cuda", "arch": 90,
                                                                                 "warp_size": 32}, "kernels": [entry]}))
    monkeypatch.setenv("TITAN_NVFP4_PRECOMPILE", str(manifest))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(precompile, "_started", {})
    monkeypatch.setattr("titan_nvfp4.kernels.shipped_tuning.gpu_class", lambda device_index: "sm90")
    with caplog.at_level(logging.INFO, logger="titan_nvfp4"):
        assert precompile.start(0) is None
    assert "lists Triton 0.0.1's specializations" in caplog.text and "compile on first use" in caplog.text
    rc, err = _tool(manifest, tmp_path / "cache", monkeypatch, capsys)
    assert rc == 2 and "is for Triton 0.0.1" in err


@pytest.mark.parametrize("text, match", [
    ("{", "not readable JSON"),
    (json.dumps({"format": 2, "kernels": []}), "expected an object with \"format\": 1"),
    (json.dumps({"format": 1, "triton": "x", "target": {"arch": 90}, "kernels": [{}]}), "expected \"target\""),
    (json.dumps({"format": 1, "triton": "x", "target": {"backend": "cuda", "arch": 90, "warp_size": 32},
                 "kernels": [{"module": "m"}]}), "kernel 0: expected the keys"),
    (json.dumps({"format": 1, "triton": "x", "sources": {"m.k": "h"}, "kernels": []}), "\"sources\" must map"),
    (json.dumps({"format": 1, "triton": "x", "target": {"backend": "cuda", "arch": 90, "warp_size": 32},
                 "kernels": [{"module": "m", "name": "k", "signature": {}, "constants": [], "attrs": [], "options": {},
                              "experts_only": 1}]}), "kernel 0: \"experts_only\" must be true or false, got 1"),
    (json.dumps({"format": 1, "triton": "x", "target": {"backend": "cuda", "arch": 90, "warp_size": 32},
                 "kernels": [{"module": "m", "name": "k", "signature": {}, "constants": [], "attrs": [], "options": {},
                              "compile_s": -1}]}), "kernel 0: \"compile_s\" must be seconds"),
])
def test_a_bad_manifest_is_refused_naming_the_file(tmp_path, text, match):
    path = tmp_path / "bad.kernels.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"kernel manifest {path}: {match}"):
        precompile.load(path)


def test_the_tool_refuses_a_bad_manifest_in_one_line(tmp_path, monkeypatch, capsys):
    path = tmp_path / "bad.kernels.json"
    path.write_text("{")
    rc, err = _tool(path, tmp_path / "cache", monkeypatch, capsys)
    assert rc == 2 and str(path) in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "cache").exists()


def test_merge_keeps_first_use_order_once_and_refuses_mixed_targets():
    t = {"backend": "cuda", "arch": 90, "warp_size": 32}
    a, b, c = ({"module": "m", "name": n, "signature": {}, "constants": [], "attrs": [], "options": {}} for n in "abc")
    m = precompile.merge([{"format": 1, "triton": "3", "target": t, "kernels": [a, b]},
                          {"format": 1, "triton": "3", "target": t, "kernels": [b, c]}])
    assert [e["name"] for e in m["kernels"]] == ["a", "b", "c"]
    timed = {**m, "kernels": [{**e, "compile_s": 1.0, "experts_only": False} for e in m["kernels"]]}
    again = precompile.merge([timed, {**m, "kernels": [a, c]}])  # a timed manifest and a new recording
    assert again["kernels"] == timed["kernels"]  # each entry once, its annotations kept
    with pytest.raises(ValueError, match="among ones for Triton 3"):
        precompile.merge([m, {**m, "target": {**t, "arch": 100}}])


def test_conversion_starts_it_on_a_cuda_gpu_unless_the_backend_is_the_reference(monkeypatch):
    """titan_nvfp4.convert (and TorchTitan's converters, through convert_dense / the 0.3 converter) call start with
    the current CUDA device, after converting something: the Linears' call without the experts' kernels, the routed
    experts' call with them."""
    import titan_nvfp4
    from titan_nvfp4 import conversion
    calls = []
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(conversion.precompile, "_started", {})
    monkeypatch.setattr(conversion.precompile, "start",
                        lambda device, log=None, experts=True: calls.append((device, experts)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(conversion, "require_backend_runs_here", lambda recipe, section: None)
    titan_nvfp4.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), filter_fqns=[])
    assert calls == [(3, False)]
    titan_nvfp4.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), filter_fqns=[], gemm_backend="reference")
    assert calls == [(3, False)]

    class Experts(torch.nn.Module):  # a routed-expert module of a registered class, converted in place
        @classmethod
        def convert(cls, mod, recipe, layer_id, name, lora_rank):
            pass
    monkeypatch.setitem(conversion.EXPERT_CLASSES, Experts, Experts)
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(64, 64), "experts": Experts()})
    titan_nvfp4.convert(model, filter_fqns=[], experts=True)
    assert calls == [(3, False), (3, False), (3, True)]  # (start runs once per scope: a stand-in here)


# ---- what start compiles: only what is missing, only what the model launches, the longest first --------------------

def _kernel_folder(cache: Path, name: str) -> str:
    """The cache folder holding kernel ``name``'s compile."""
    return next(d for d in os.listdir(cache) if (cache / d / f"{name}.json").exists())


def _compiled(cache: Path) -> set[str]:
    """The cache's kernel folders (its lock files left out)."""
    return {d for d in _entries(cache) if not d.startswith("titan_nvfp4_precompile")}


_START = _TRAINING_PROCESS + """
dense = precompile.start(0, experts=False)  # the Linears converted first
moe = precompile.start(0, experts=True)  # then the routed experts: the kernels only they launch
precompile.wait()
precompile._started.clear()  # a new training process on the now complete cache
again = precompile.start(0, experts=True)
print(json.dumps({"only": [p.only if p else None for p in (dense, moe)], "rc": [dense.returncode, moe.returncode],
                  "again": again is None, "logs": logs}))
"""


@needs_ptxas
def test_start_compiles_only_the_missing_kernels_the_model_launches(recorded, tmp_path):
    """A training process's start looks each entry up in Triton's cache: of the recorded three (the block-to-expert
    map, which only grouped experts launch, the amax and the dequantization kernels), a dense model's start leaves
    the first out and compiles only the amax kernel, the one missing; the routed experts' start then adds the first;
    each compiles what it was given (the dequantization kernel is not compiled again), and a new start on the
    complete cache starts no process at all."""
    import shutil
    manifest, first = recorded
    cache = tmp_path / "cache"
    shutil.copytree(first, cache)
    for name in ("_block_experts_kernel", "_amax_kernel"):
        shutil.rmtree(cache / _kernel_folder(cache, name))
    kept = cache / _kernel_folder(cache, "_dequant_kernel")
    stamps = {f: f.stat().st_mtime_ns for f in kept.iterdir()}
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache),
           "TITAN_NVFP4_PRECOMPILE": str(manifest)}
    env.pop("LOCAL_RANK", None)
    r = subprocess.run([sys.executable, "-c", _START, str(ROOT)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["only"] == [[1], [0]]  # the amax kernel; the block-to-expert map
    assert out["rc"] == [0, 0]
    logs = "\n".join(out["logs"])
    assert "precompiling 1 Triton kernel specializations" in out["logs"][0] and "1 of 2 in the cache" in logs
    assert "1 only NVFP4 grouped experts launch left out" in out["logs"][0]
    assert out["again"] and "nothing to precompile" in out["logs"][-1] and "3 of 3 in the cache" in out["logs"][-1]
    assert _compiled(cache) == _compiled(first)
    assert {f: f.stat().st_mtime_ns for f in kept.iterdir()} == stamps


def _gone(name: str, **annotations) -> dict:
    return {"module": "titan_nvfp4.kernels.expert_map", "name": name, "signature": {}, "constants": [], "attrs": [],
            "options": {}, **annotations}


def test_the_pool_takes_the_longest_compiles_first():
    """Entries with a measured compile time go first, longest first, then the others in first-use order (the order
    the compiles are taken shows in the order of their failure lines: these kernels do not exist)."""
    doc = {"format": 1, "triton": triton.__version__, "target": {"backend": "cuda", "arch": 90, "warp_size": 32},
           "kernels": [_gone("a", compile_s=0.5), _gone("b"), _gone("c", compile_s=9.0), _gone("d"),
                       _gone("e", compile_s=2.0)]}
    done, failures = precompile.compile_all(doc, 1)
    assert done == 0 and [f.split(":")[0].rsplit(".", 1)[1] for f in failures] == ["c", "e", "a", "b", "d"]
    done, failures = precompile.compile_all(doc, 1, only=[3, 0, 1])
    assert [f.split(":")[0].rsplit(".", 1)[1] for f in failures] == ["a", "d", "b"]


def test_the_tool_refuses_a_bad_selection_in_one_line(tmp_path, monkeypatch, capsys):
    from titan_nvfp4.tools import precompile_kernels
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"format": 1, "triton": triton.__version__, "kernels": [_gone(n) for n in "abc"],
                                    "target": {"backend": "cuda", "arch": 90, "warp_size": 32}}))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for bad in ("3", "0,0", "x", "-1"):
        capsys.readouterr()
        assert precompile_kernels.main([str(manifest), "--only", bad]) == 2
        err = capsys.readouterr().err
        assert f"--only {bad}: expected distinct indices of the manifest's 3 kernels" in err
        assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "cache").exists()


@needs_ptxas
def test_time_writes_each_compile_time_into_the_manifest(recorded, tmp_path, monkeypatch, capsys):
    """--time compiles each entry serially into a throwaway folder (not the cache in use) and writes compile_s and
    experts_only into the manifest, the rest as it was; an entry that does not compile leaves the file untouched."""
    manifest, _ = recorded
    doc = precompile.load(manifest)
    entry = {k: v for k, v in doc["kernels"][0].items() if k != "experts_only"}  # a manifest from before the field
    one = tmp_path / "one.kernels.json"
    one.write_text(json.dumps({**doc, "kernels": [entry]}))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "c"),
           "TMPDIR": str(tmp)}
    r = subprocess.run([sys.executable, "-m", "titan_nvfp4.tools.precompile_kernels", str(one), "--time"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    timed = precompile.load(one)
    (got,) = timed["kernels"]
    assert got["compile_s"] > 0 and got["experts_only"] is True
    assert {k: v for k, v in got.items() if k not in ("compile_s", "experts_only")} == entry
    assert {k: v for k, v in timed.items() if k != "kernels"} == {k: v for k, v in doc.items() if k != "kernels"}
    assert os.listdir(tmp) == [] and not (tmp_path / "c").exists()
    assert sorted(os.listdir(tmp_path)) == sorted(["one.kernels.json", "tmp"])  # no temporary file beside it

    from titan_nvfp4.tools import precompile_kernels
    broken = tmp_path / "broken.kernels.json"
    broken.write_text(json.dumps({**doc, "kernels": [_gone("nope")]}))
    before = broken.read_bytes()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    capsys.readouterr()
    assert precompile_kernels.main([str(broken), "--time"]) == 2
    err = capsys.readouterr().err
    assert "a kernel did not compile (AttributeError" in err and "nothing written" in err
    assert broken.read_bytes() == before


def test_every_kernel_is_classified_and_the_shipped_manifests_record_it():
    """Every Triton kernel of the package (a triton.jit function named *_kernel) is classified, a GROUPED-flagged one
    has that flag, and each entry of the shipped manifests carries the class the code gives it (tools' --time
    rewrites it)."""
    import ast
    from titan_nvfp4.kernels import expert_kernels as ek
    from titan_nvfp4.kernels.shipped_tuning import TABLE_DIR
    found, flags = set(), {}
    for path in sorted((ROOT / "titan_nvfp4" / "kernels").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") \
                    and any("jit" in ast.unparse(d) for d in node.decorator_list):
                name = f"titan_nvfp4.kernels.{path.stem}:{node.name}"
                found.add(name)
                flags[name] = "GROUPED" in {a.arg for a in node.args.args}
    assert found == ek.EXPERTS_ONLY | ek.GROUPED_FLAG | ek.DENSE
    assert {k for k, v in flags.items() if v} == ek.GROUPED_FLAG
    manifests = sorted(TABLE_DIR.glob("*.kernels.json"))
    assert manifests
    for path in manifests:
        kernels = precompile.load(path)["kernels"]
        for i, entry in enumerate(kernels):
            assert "experts_only" in entry and precompile.classified(entry) == entry, \
                f"{path.name} kernel {i} ({entry['name']})"


def test_each_launch_of_a_dense_and_a_grouped_layer_is_classified_as_its_path(monkeypatch):
    """An NVFP4 linear (forward and backward) launches no kernel classified expert-only; NVFP4 grouped experts (the
    SwiGLU block, forward and backward) launch only expert-only ones besides the shared staging kernel. In Triton's
    interpreter (CPU tensors: the block-to-expert map, a CUDA launch, runs in torch there)."""
    from titan_nvfp4.ops.backends import interpreting
    if not interpreting():
        pytest.skip("records launches in Triton's interpreter")
    import inspect
    from triton.runtime.interpreter import InterpretedFunction
    from titan_nvfp4 import NVFP4Recipe
    from titan_nvfp4.autograd.grouped_function import nvfp4_grouped_mm_shared, nvfp4_grouped_swiglu
    from titan_nvfp4.autograd.linear_function import nvfp4_linear, sr_counter
    from titan_nvfp4.kernels import expert_kernels as ek
    seen, run = [], InterpretedFunction.run

    def recorded_run(self, *args, grid, warmup, **kwargs):
        bound = inspect.signature(self.fn).bind_partial(*args, **{k: v for k, v in kwargs.items()
                                                                  if k not in ("num_warps", "num_stages")})
        seen.append((f"{self.fn.__module__}:{self.fn.__name__}", bound.arguments))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recorded_run)
    recipe = NVFP4Recipe(gemm_backend="emulated")  # RHT, stochastic rounding, 16x16 weight blocks
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(32, 32, generator=g).bfloat16().requires_grad_() for _ in range(2))
    nvfp4_linear(x, w, None, recipe).sum().backward()
    dense = list(seen)
    seen.clear()
    offsets = torch.tensor([16, 32], dtype=torch.int32)
    x = torch.randn(48, 32, generator=g).bfloat16().requires_grad_()
    w1, w3, w2 = (torch.randn(2, 32, 32, generator=g).bfloat16().requires_grad_() for _ in range(3))
    c = [sr_counter(recipe, i, "cpu") for i in range(3)]
    h, h_amax = nvfp4_grouped_swiglu(x, w1, w3, offsets, recipe, (c[0], c[2]), aligned=True)
    (y,) = nvfp4_grouped_mm_shared(h, (w2,), offsets, (None,), recipe, (c[1],), aligned=True, x_amax=h_amax)
    y.sum().backward()
    grouped = seen
    assert dense and grouped
    assert {k: ek.experts_only(k, a) for k, a in dense} == {k: False for k, _ in dense}
    assert {k for k, a in grouped if not ek.experts_only(k, a)} == {"titan_nvfp4.kernels.gemm:_dequant_kernel"}
    assert {k for k, _ in grouped} & ek.GROUPED_FLAG and {k for k, _ in grouped} - ek.GROUPED_FLAG - ek.DENSE


def test_the_shipped_manifests_were_recorded_from_todays_kernel_sources():
    """Each shipped manifest's recorded kernels have the source fingerprint of today's source (precompile.source_
    fingerprint: the same under every Triton and its interpreter, where the manifest's own source hashes need the
    recording's Triton). An edit to a recorded kernel, to a function of this package it calls, or above it in its file
    (Triton's hash covers the starting line) makes the background precompile skip that kernel on every GPU: rehash
    the manifest, or record it again when the kernel's parameters changed."""
    from titan_nvfp4.kernels.shipped_tuning import TABLE_DIR
    for path in sorted(TABLE_DIR.glob("*.kernels.json")):
        doc = precompile.load(path)
        assert set(doc.get("fingerprints", {})) == set(doc["sources"]), f"{path.name}: fingerprints and sources differ"
        stale = [k for k, v in sorted(doc["fingerprints"].items())
                 if precompile.source_fingerprint(precompile.jit_object(*k.split(":", 1))) != v]
        assert not stale, (f"{path.name} was recorded from another source of {', '.join(stale)}: with Triton "
                           f"{doc['triton']} installed, run `python -m titan_nvfp4.tools.precompile_kernels "
                           f"titan_nvfp4/kernels/tuned/{path.name} --rehash` (same parameters) or record it again "
                           "(scripts/tune_kernels.py)")


def test_a_fingerprint_follows_the_source_its_start_line_and_its_callees(tmp_path, monkeypatch):
    """source_fingerprint changes with a kernel's body, with its starting line (a line added above it) and with a
    function of this package it calls; not with a blank line below it."""
    import importlib
    import textwrap

    monkeypatch.setattr(precompile, "PACKAGE", "titan_nvfp4_fp_probe")  # its functions count as this package's

    def fingerprint(text: str, version: int) -> str:
        folder = tmp_path / f"v{version}"  # one module name in a folder per version: the key names the module
        folder.mkdir()
        (folder / "titan_nvfp4_fp_probe.py").write_text(textwrap.dedent(text))
        monkeypatch.syspath_prepend(str(folder))
        sys.modules.pop("titan_nvfp4_fp_probe", None)
        importlib.import_module("titan_nvfp4_fp_probe")
        return precompile.source_fingerprint(precompile.jit_object("titan_nvfp4_fp_probe", "_k"))

    base = """
        import triton
        import triton.language as tl
        C = tl.constexpr(3)

        @triton.jit
        def helper(x):
            return x * C

        @triton.jit
        def _k(X):
            tl.store(X, helper(tl.load(X)))
        """
    ref = fingerprint(base, 0)
    assert fingerprint(base + "\n\n", 1) == ref
    assert fingerprint(base.replace("C = tl.constexpr(3)", "# a comment\n        C = tl.constexpr(3)"), 2) != ref
    assert fingerprint(base.replace("return x * C", "return x * C + 1"), 3) != ref
    assert fingerprint(base.replace("tl.constexpr(3)", "tl.constexpr(4)"), 4) != ref
    assert fingerprint(base.replace("tl.load(X)))", "tl.load(X)) + 0)"), 5) != ref
    sys.modules.pop("titan_nvfp4_fp_probe", None)
