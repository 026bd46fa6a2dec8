"""tests/interp_memo.py, the replay of interpreted launches: a launch on the same inputs stores the bytes its run
stored and no others; a changed loaded byte or a changed module global runs the kernel again. (The whole suite also
passed with every replay checked against a run: TITAN_NVFP4_TEST_INTERP_MEMO=verify, docs/development.md.)"""

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from triton.runtime import interpreter  # noqa: E402

import interp_memo  # noqa: E402

if not getattr(interpreter.GridExecutor.__call__, "interp_memo", False):
    pytest.skip("the replay is on in Triton's CPU interpreter only (conftest.py)", allow_module_level=True)

SCALE = tl.constexpr(2.0)


@triton.jit
def _scaled_copy(X, Y, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    tl.store(Y + i, tl.load(X + i, mask=m) * SCALE + 1.0, mask=m)


def _counts():
    s = interp_memo.STATS.get(f"{_scaled_copy.fn.__module__}:_scaled_copy", {})
    return s.get("hits", 0), s.get("runs", 0)


def _launch(x, y):
    _scaled_copy[(1,)](x, y, x.numel(), BLOCK=16)


def _x(seed):
    return torch.randn(8, generator=torch.Generator().manual_seed(seed))


def test_a_launch_on_the_same_inputs_is_replayed_with_the_runs_bytes():
    x = _x(0)
    y1, y2 = torch.full((8,), float("nan")), torch.full((8,), -3.0)  # what the outputs held does not matter
    hits, runs = _counts()
    _launch(x, y1)
    _launch(x.clone(), y2)  # another tensor with the same bytes
    assert _counts() == (hits + 1, runs + 1)
    assert torch.equal(y1, x * 2 + 1) and torch.equal(y2, y1)


def test_a_changed_loaded_byte_runs_the_kernel_again():
    x, y = _x(1), torch.empty(8)
    hits, runs = _counts()
    _launch(x, y)
    x[7] += 1
    _launch(x, y)
    assert _counts() == (hits, runs + 2)
    assert torch.equal(y, x * 2 + 1)


def test_a_replay_stores_only_the_bytes_its_run_stored():
    """A view into a larger buffer: the bytes around the stored ones keep what they hold now, not what they held
    when the run was recorded (the buffer is not loaded from, so its other bytes are no input)."""
    x, buf = _x(2), torch.zeros(24)
    hits, runs = _counts()
    _launch(x, buf[8:16])
    buf[:8], buf[8:16], buf[16:] = 5.0, -1.0, 7.0
    _launch(x, buf[8:16])
    assert _counts() == (hits + 1, runs + 1)
    assert torch.equal(buf, torch.cat([torch.full((8,), 5.0), x * 2 + 1, torch.full((8,), 7.0)]))


def test_a_changed_module_global_runs_the_kernel_again(monkeypatch):
    x, y = _x(3), torch.empty(8)
    _launch(x, y)
    hits, runs = _counts()
    monkeypatch.setattr(f"{__name__}.SCALE", tl.constexpr(3.0))
    _launch(x, y)
    assert _counts() == (hits, runs + 1)
    assert torch.equal(y, x * 3 + 1)


@triton.jit
def _reciprocal_of(Y, c, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(Y + i, 1.0 / (tl.full([BLOCK], 1.0, tl.float32) * c))


def test_scalars_equal_under_python_but_not_in_bits_are_different_launches():
    """0.0 and -0.0 compare equal in Python, yet 1 / c tells them apart: the second launch runs."""
    ys = [torch.empty(16) for _ in range(2)]
    for y, c in zip(ys, (0.0, -0.0)):
        _reciprocal_of[(1,)](y, c, BLOCK=16)
    assert torch.equal(ys[0], torch.full((16,), float("inf"))) and torch.equal(ys[1], torch.full((16,), -float("inf")))
