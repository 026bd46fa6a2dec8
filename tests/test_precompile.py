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
def test_a_kernel_whose_source_changed_since_the_recording_is_skipped_by_name(recorded, tmp_path):
    """An edited kernel would compile under another key than the training process asks for: its entries are skipped
    (a failure line naming it), the others compile."""
    manifest, _ = recorded
    doc = precompile.load(manifest)
    assert set(doc["sources"]) == {"titan_nvfp4.kernels.expert_map:_block_experts_kernel",
                                   "titan_nvfp4.kernels.quantize:_amax_kernel", "titan_nvfp4.kernels.gemm:_dequant_kernel"}
    doc["sources"]["titan_nvfp4.kernels.quantize:_amax_kernel"] = "0" * 64
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


@needs_ptxas
def test_start_compiles_in_the_background_once(recorded, tmp_path, monkeypatch, caplog):
    manifest, first = recorded
    cache = tmp_path / "bg"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.setenv("TITAN_NVFP4_PRECOMPILE", str(manifest))
    monkeypatch.setenv("PYTHONPATH", _pythonpath())
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a GPU (the suite interprets kernels on the CPU)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(precompile, "_started", {})
    monkeypatch.setattr("titan_nvfp4.kernels.shipped_tuning.gpu_class", lambda device_index: "sm90")
    with caplog.at_level(logging.INFO, logger="titan_nvfp4"):
        proc = precompile.start(0)
    assert proc is not None and precompile.start(0) is proc  # once per process
    assert proc.wait(timeout=300) == 0
    assert "precompiling 3 Triton kernel specializations" in caplog.text and f"into {cache}" in caplog.text
    assert _entries(cache) - {"titan_nvfp4_precompile.lock"} == _entries(first)


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
    child = ("import os, sys, time; from titan_nvfp4.tools.precompile_kernels import _stop_with; "
             f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); _stop_with(os.getppid()); time.sleep(120)")
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
    with pytest.raises(ValueError, match="among ones for Triton 3"):
        precompile.merge([m, {**m, "target": {**t, "arch": 100}}])


def test_conversion_starts_it_on_a_cuda_gpu_unless_the_backend_is_the_reference(monkeypatch):
    """titan_nvfp4.convert (and TorchTitan's converters, through convert_dense / the 0.3 converter) call start with
    the current CUDA device, after converting something."""
    import titan_nvfp4
    from titan_nvfp4 import conversion
    calls = []
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(conversion.precompile, "_started", {})
    monkeypatch.setattr(conversion.precompile, "start", lambda device, log=None: calls.append(device))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(conversion, "require_backend_runs_here", lambda recipe, section: None)
    titan_nvfp4.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), filter_fqns=[])
    assert calls == [3]
    titan_nvfp4.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), filter_fqns=[], gemm_backend="reference")
    assert calls == [3]
