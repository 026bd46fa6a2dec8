"""``python -m torchtitan.train`` of TorchTitan 0.3 on the CPU, for tests (under torchrun, or with its environment variables): TorchTitan 0.3 picks
"cuda" where it finds no accelerator and asks its device module for memory statistics and device indices, so this
hands it the CPU (gloo) and a stand-in device module before TorchTitan is imported, then runs its entry point with the
same arguments. The parsed config's FlexAttention nodes (no backward on the CPU) become SDPA, as in the tests'
models, and with ``$CPU_TRAIN03_BLOCKS`` set the model keeps only its first that many transformer blocks."""

import os
import runpy
from types import SimpleNamespace

import torch
import torch._utils


class CpuDeviceModule:
    """torch.cpu, with what TorchTitan's memory monitor and process-group setup ask of torch.cuda."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:  # an index, for torch.distributed.barrier(device_ids=...)
        return 0

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        return SimpleNamespace(name="cpu", total_memory=1 << 40)

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


_device_module = torch._utils._get_device_module
torch._utils._get_available_device_type = lambda: "cpu"
torch._utils._get_device_module = lambda t: CpuDeviceModule() if t == "cpu" else _device_module(t)

if __name__ == "__main__":
    from torchtitan.config import ConfigManager
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    parse_args = ConfigManager.parse_args

    def parse_args_for_cpu(self, *args, **kwargs):
        config = parse_args(self, *args, **kwargs)
        model = config.model_spec.model
        if os.environ.get("CPU_TRAIN03_BLOCKS"):
            model.layers = model.layers[: int(os.environ["CPU_TRAIN03_BLOCKS"])]
        for _, _, parent, attr in list(model.traverse(FlexAttention.Config)):
            setattr(parent, attr, ScaledDotProductAttention.Config())
        return config

    ConfigManager.parse_args = parse_args_for_cpu
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
