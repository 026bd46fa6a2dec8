"""scripts/save_kernel_cache.sh packs the device's Triton and inductor caches for the next session, a cache over the
16 MiB a file may come back from the device in 15 MiB parts; scripts/device_setup.sh unpacks either form."""

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _unpack_function(root: Path) -> Path:
    """device_setup.sh's __device_kernel_cache alone, as a script under ``root``/scripts (it finds .kernel_cache from
    there); the rest of the setup installs packages."""
    text = (REPO / "scripts/device_setup.sh").read_text()
    body = re.search(r"^__device_kernel_cache\(\) \{\n.*?^\}\n", text, re.S | re.M).group(0)
    script = root / "scripts" / "unpack.sh"
    script.parent.mkdir(parents=True)
    script.write_text(body + "__device_kernel_cache\n")
    return script


def _save_kernel_cache(env: dict) -> subprocess.CompletedProcess:
    """scripts/save_kernel_cache.sh run with ``env``."""
    return subprocess.run(["bash", str(REPO / "scripts/save_kernel_cache.sh")], env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_large_cache_comes_back_in_parts_and_unpacks_whole(tmp_path):
    triton, inductor, out = tmp_path / "triton", tmp_path / "inductor", tmp_path / "out"
    for d in (triton / "ab", inductor, out):
        d.mkdir(parents=True)
    big = os.urandom(3 * 2**20 + 2**19)  # incompressible: 3.5 MiB packed, over the 3 MiB limit set below
    (triton / "ab" / "kernel.cubin").write_bytes(big)
    (triton / "ab" / "kernel.json").write_text('{"name": "k"}')
    (inductor / "graph.py").write_text("print('graph')\n")
    env = {**os.environ, "OUT": str(out), "TRITON_CACHE_DIR": str(triton), "TORCHINDUCTOR_CACHE_DIR": str(inductor),
           "KERNEL_CACHE_LIMIT_MIB": "3"}  # the device tool's 16 MiB, scaled down: parts of 2 MiB
    r = _save_kernel_cache(env)
    assert r.returncode == 0, r.stderr
    assert "kernel cache triton: in 2 parts" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["inductor.tar.xz", "triton.tar.xz.part0", "triton.tar.xz.part1"]
    assert all(p.stat().st_size <= 3 * 2**20 for p in out.iterdir())

    root = tmp_path / "next_session"
    (root / ".kernel_cache").mkdir(parents=True)
    for p in out.iterdir():
        (root / ".kernel_cache" / p.name).write_bytes(p.read_bytes())
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    r = subprocess.run(["bash", str(_unpack_function(root))], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (root / ".kernel_cache/triton/ab/kernel.cubin").read_bytes() == big
    assert (root / ".kernel_cache/triton/ab/kernel.json").read_text() == '{"name": "k"}'
    assert (root / ".kernel_cache/inductor/graph.py").read_text() == "print('graph')\n"
    assert "(2 cached files)" in r.stdout and "(1 cached files)" in r.stdout


@pytest.mark.parametrize("value", ["1", "16M", "-3"])
def test_a_limit_that_is_not_a_whole_number_of_mib_is_refused_naming_it(tmp_path, value):
    env = {**os.environ, "OUT": str(tmp_path), "TRITON_CACHE_DIR": str(tmp_path), "KERNEL_CACHE_LIMIT_MIB": value}
    r = _save_kernel_cache(env)
    assert r.returncode == 2 and "KERNEL_CACHE_LIMIT_MIB" in r.stderr, (r.returncode, r.stderr)
    assert not list(tmp_path.iterdir())  # nothing packed
