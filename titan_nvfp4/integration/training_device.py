"""Stop a TorchTitan training run on a machine without a GPU with one clear message.

TorchTitan 0.2 trains on CUDA or ROCm only: on a CPU-only machine it fails deep in its device set-up
with a long traceback. The job config module (imported while TorchTitan parses the job file, before
any device set-up) calls ``require_training_device`` so the user reads what to do instead.
"""

from __future__ import annotations

import sys

import torch

CPU_TRAINING_MESSAGE = """\
titan-nvfp4: TorchTitan training needs a CUDA or ROCm GPU, and this machine has none
({why}).
On a CPU-only machine titan-nvfp4 runs:
  - the test suite:            python -m pytest -q -n 2 tests
  - the reference numerics:    python -c "import torch, titan_nvfp4; print(titan_nvfp4.quantize_nvfp4(torch.randn(4, 32)).dequantize())"
  - the tools, on logs from a GPU machine: python -m titan_nvfp4.tools.loss_log --help
Run the training command on a machine with an NVIDIA (sm_80+) or AMD GPU."""


TRAINING_ENTRY_POINTS = ("torchtitan.train", "titan_nvfp4.tools.emulated_dp")


def _running_training() -> bool:
    main = sys.modules.get("__main__")
    return getattr(getattr(main, "__spec__", None), "name", None) in TRAINING_ENTRY_POINTS


def missing_gpu_reason() -> str | None:
    """Why this process cannot train on a GPU, or None when it can."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None and torch.version.hip is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return f"torch {torch.__version__} finds no GPU"


def require_training_device() -> None:
    """Exit with CPU_TRAINING_MESSAGE when ``python -m torchtitan.train`` (or torchrun) runs without a GPU."""
    if not _running_training():
        return
    why = missing_gpu_reason()
    if why is not None:
        print(CPU_TRAINING_MESSAGE.format(why=why), file=sys.stderr, flush=True)
        raise SystemExit(2)
