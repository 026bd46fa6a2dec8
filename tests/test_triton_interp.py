"""tests/triton_interp.py (Triton's CPU interpreter without its redundant re-patching, its dtype table kept)
changes no bit: a kernel whose nested calls reach triton.language.core (tl.randint's Philox) gives the same outputs
as under Triton's own behaviour (TITAN_NVFP4_TEST_TRITON_REPATCH=1), each in a fresh interpreter."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("the helper patches Triton's CPU interpreter only", allow_module_level=True)

CODE = """
import sys, torch
sys.path.insert(0, {tests!r})
import triton_interp
from triton.runtime import interpreter
from titan_nvfp4.kernels.ms_eden import ms_eden_quantize_tensors
x = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
outs = [ms_eden_quantize_tensors(x, None, 7, 2**40 + 3, None, size=size, staged=staged)
        for size, staged in ((16, False), (32, True))]
print(getattr(interpreter._patch_lang, "_titan_nvfp4", False))
print(" ".join(t.view(torch.uint8).numpy().tobytes().hex() for out in outs for t in out))
"""


def _run(repatch: str) -> list[str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "TITAN_NVFP4_TEST_TRITON_REPATCH": repatch}
    out = subprocess.run([sys.executable, "-c", CODE.format(tests=str(Path(__file__).parent))], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split("\n")


def test_the_patched_interpreter_gives_tritons_bits():
    patched, own = _run("0"), _run("1")
    assert patched[0] == "True" and own[0] == "False"  # the helper patched one run and not the other
    assert patched[1] == own[1] and len(patched[1]) > 1000
