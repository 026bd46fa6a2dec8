import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # test-only helpers such as nvfp4_twin

import inspect_cache  # noqa: E402,F401  (a class's source read once per file state: TorchTitan's config parses)

# Every cached kernel launch is checked against the kernel Triton itself would launch
# (titan_nvfp4/kernels/launch.py, CHECK): a cache key that misses a specialization fails the test.
os.environ.setdefault("TITAN_NVFP4_LAUNCH_CHECK", "1")

# pytest-xdist runs about one worker per core, and the distributed tests start gloo ranks beside them:
# one intra-op thread per process (the ranks inherit it) keeps torch from oversubscribing the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Without a GPU the Triton kernels run in Triton's CPU interpreter; this must be set before triton is
# imported anywhere (titan_nvfp4 imports it lazily, the first time a kernel is used).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        import triton_interp  # noqa: F401  (the interpreter without its redundant re-patching)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
except ImportError:  # pragma: no cover
    pass


@pytest.fixture
def cpu_histc(monkeypatch):
    """torch.histc counting integer indices on the CPU, for TorchTitan's MoE routers (moe_helpers.histc_for_cpu)."""
    from moe_helpers import histc_for_cpu

    monkeypatch.setattr(torch, "histc", histc_for_cpu())


def pytest_collection_modifyitems(config, items):
    """Tests marked ``long`` (10 s or more on a 2-core CPU) run first: started last, one of them would keep
    one xdist worker busy after the other has run out of tests. Tests marked ``slow`` (the slow tier, left out
    of CI's 15 minutes: a second variant of a case CI runs, or a device tool's stand-in run) run only with
    TITAN_NVFP4_SLOW_TESTS=1 (docs/development.md)."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: otherwise collection order
    if os.environ.get("TITAN_NVFP4_SLOW_TESTS", "") in ("", "0"):
        for item in items:
            slow = item.get_closest_marker("slow")
            if slow is not None:
                why = slow.kwargs.get("reason", "")
                item.add_marker(pytest.mark.skip(reason=f"slow tier ({why}): TITAN_NVFP4_SLOW_TESTS=1 runs it"))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of small batched ops, which only lose time to thread hand-offs on a shared CPU
    (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def transformers_logs_through_logging():
    """transformers binds a stderr handler on its first log record; bound inside a capsys test it would write to
    that test's closed stream in later tests ('--- Logging error ---'). Its records go to the root logger instead
    (``pytestmark = pytest.mark.usefixtures("transformers_logs_through_logging")``)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    yield
