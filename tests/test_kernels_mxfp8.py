"""The Triton MXFP8 kernel (titan_nvfp4/kernels/mxfp8.py) against its twin, numerics/mxfp8.py, and
against TorchAO's RCEIL quantizer: bytes identical on random and adversarial inputs. Runs in Triton's
interpreter on the CPU and compiled on a GPU."""

import pytest
import torch
import torch.nn.functional as F

from titan_nvfp4.numerics.mxfp8 import quantize_mxfp8
from titan_nvfp4.ops.backends import interpreting

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")

from titan_nvfp4.kernels.mxfp8 import quantize_mxfp8_operand  # noqa: E402


def _bytes(t):
    return t.view(torch.uint8).cpu()


def _check(x):
    """Row and column operands of the kernel equal the reference on x and on x zero-padded, transposed."""
    row, col = quantize_mxfp8_operand(x, rowwise=True, colwise=True)
    ref_row = quantize_mxfp8(x.cpu())
    assert torch.equal(_bytes(row.data), _bytes(ref_row.data)), "row elements"
    assert torch.equal(_bytes(row.scale), _bytes(ref_row.scale)), "row scales"
    xt = F.pad(x.cpu().float().t(), (0, (-x.shape[0]) % 32)).to(x.dtype)
    ref_col = quantize_mxfp8(xt.contiguous())
    assert torch.equal(_bytes(col.data), _bytes(ref_col.data)), "column elements"
    assert torch.equal(_bytes(col.scale), _bytes(ref_col.scale)), "column scales"
    _, col_alone = quantize_mxfp8_operand(x, rowwise=False, colwise=True)  # the columns-only kernel
    assert torch.equal(_bytes(col_alone.data), _bytes(ref_col.data)), "column elements, columns alone"
    assert torch.equal(_bytes(col_alone.scale), _bytes(ref_col.scale)), "column scales, columns alone"
    # staged: the dequantized values in BF16, bit for bit the reference's wherever they are BF16 normals
    # (or 0, ±inf, NaN); below 2^-126 the BF16 subnormal rounding of the two conversions may differ
    from titan_nvfp4.kernels.mxfp8 import quantize_mxfp8_tensors

    srd, srs, scd, scs = quantize_mxfp8_tensors(x, True, True, staged=True)
    assert srd.dtype == scd.dtype == torch.bfloat16 and srs.numel() == scs.numel() == 0
    scd_alone = quantize_mxfp8_tensors(x, False, True, staged=True)[2]
    for got, ref, what in ((srd, ref_row, "staged rows"), (scd, ref_col, "staged columns"),
                           (scd_alone, ref_col, "staged columns alone")):
        want = ref.dequantize(torch.float32)
        got = got.cpu().contiguous()
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), what
        normal = (~(want.abs() < 2.0**-126) | (want == 0)) & ~nan
        want16 = want.to(torch.bfloat16).contiguous().view(torch.int16)
        assert torch.equal(got.view(torch.int16)[normal], want16[normal]), what
    return row, col


def _rand(m, k, dtype, seed, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g) * spread)
    return x.to(DEV, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(64, 128), (40, 96), (7, 32)], ids=["aligned", "ragged_m", "tiny"])
def test_random_inputs_bit_identical(dtype, shape):
    _check(_rand(*shape, dtype, seed=shape[0]))


def test_adversarial_inputs_bit_identical():
    x = _rand(64, 128, torch.float32, seed=5)
    x[0, :32] = 0.0  # a zero row block
    x[:32, 40] = 0.0  # a zero column block
    x[1, 32:64] = -0.0  # negative zeros keep their sign
    x[2, :32] = torch.linspace(-1e-40, 1e-40, 32)  # subnormal inputs: the scale clamps at 2^-127
    x[3, :32] = 3e38  # huge: the scale clamps at 2^127
    x[4, 64:96] = 448.0 * 2.0 ** torch.arange(-16, 16).float()  # exact powers of two: ceil(log2) == log2
    # E4M3 ties: 1 + k/16 for odd k lies halfway between two E4M3 values in [1, 2)
    x[5, :32] = torch.tensor([1 + (2 * i + 1) / 16 for i in range(8)] * 4) * torch.tensor([1.0, -1.0] * 16)
    x[5, 31] = 448.0  # pins the block scale to 2^0 so the ties stay ties
    x[6, 3] = float("nan")
    x[7, 100] = float("inf")
    x[8, 70] = float("-inf")
    x[60, 5] = float("nan")  # a NaN in a column block
    x[9, 10] = -float("nan")  # a negative NaN: stored as the one NaN byte 0x7F, as on the GPU
    row, col = _check(x)
    assert torch.isnan(row.dequantize()[6, :32]).all() and torch.isfinite(row.dequantize()[6, 32:]).all()
    assert _bytes(row.data)[9, 10] == 0x7F and _bytes(col.data)[10, 9] == 0x7F


def test_strided_input_and_single_operands():
    x = _rand(96, 64, torch.bfloat16, seed=9).t()  # a transposed view: strides (1, 64)
    _check(x)
    row, col = quantize_mxfp8_operand(x, rowwise=True, colwise=False)
    assert col is None and torch.equal(_bytes(row.data), _bytes(quantize_mxfp8(x.cpu()).data))
    row, col = quantize_mxfp8_operand(x, rowwise=False, colwise=True)
    assert row is None and col.data.shape == (96, 64)  # the columns-only kernel: checked in _check


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 32, got shape \\(4, 48\\)"):
        quantize_mxfp8_operand(torch.randn(4, 48, device=DEV))
    with pytest.raises(ValueError, match="2D floating-point"):
        quantize_mxfp8_operand(torch.ones(4, 32, dtype=torch.int32, device=DEV))


def test_matches_torchao_rceil():
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    x = _rand(64, 256, torch.bfloat16, seed=11)
    row, _ = quantize_mxfp8_operand(x)
    scale, data = mx.to_mx(x.cpu(), torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    assert torch.equal(_bytes(row.scale), _bytes(scale))
    assert torch.equal(_bytes(row.data), _bytes(data))


@pytest.mark.parametrize("staged", [False, True])
def test_columns_kernel_every_tile_config_bit_identical(staged):
    """Each config the columns-only kernel's autotuner may pick (G row blocks, BK features, warps), run
    directly on a ragged input with NaN, inf and zero blocks, against the reference's column operand."""
    from titan_nvfp4.kernels import mxfp8 as k

    x = _rand(72, 96, torch.float32, seed=21)  # ragged rows and features: partial tiles on both axes
    x[0:32, 5] = 0.0
    x[40, 7] = float("nan")
    x[70, 90] = float("-inf")
    M, K, Mpad = 72, 96, 96
    ref = quantize_mxfp8(F.pad(x.cpu().t(), (0, Mpad - M)).contiguous())
    for cfg in k._cols_autotuned.configs:
        g, bk = cfg.kwargs["G"], cfg.kwargs["BK"]
        cd = torch.empty((K, Mpad), dtype=torch.bfloat16 if staged else torch.float8_e4m3fn, device=DEV)
        cs = torch.empty((K, Mpad // 32), dtype=torch.uint8, device=DEV)
        k._mxfp8_cols_kernel[k._cols_grid(Mpad, K, g, bk)](x, M, K, x.stride(0), x.stride(1), cd, cs, Mpad, G=g, BK=bk,
                                                           STAGED=staged, HW=k.hardware_e4m3(x.device),
                                                           num_warps=cfg.num_warps)
        if staged:
            want, got = ref.dequantize(torch.float32), cd.float().cpu()
            assert torch.equal(got.isnan(), want.isnan()), cfg
            assert torch.equal(got[~want.isnan()], want[~want.isnan()]), cfg  # exact: no BF16 subnormals here
        else:
            assert torch.equal(_bytes(cd), _bytes(ref.data)) and torch.equal(cs.cpu(), _bytes(ref.scale)), cfg


@pytest.mark.skipif(DEV == "cpu", reason="autotuned tiles run compiled only")
def test_large_input_autotuned_bit_identical():
    _check(_rand(4096, 2048, torch.bfloat16, seed=13))
