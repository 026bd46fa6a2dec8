"""The NVFP4 math in one place: element formats, NVFP4 and MXFP8 block quantization, the RHT, MS-EDEN."""

from .formats import E2M1_GRID, F4_E2M1_MAX, F8_E4M3_MAX, e2m1_decode, pack_nibbles, unpack_nibbles
from .ms_eden import quantize_ms_eden
from .mxfp8 import MX_BLOCK, MXFP8Tensor, quantize_mxfp8
from .nvfp4 import BLOCK, BLOCK_SHAPES, NVFP4Tensor, global_encode_scale, quantize_nvfp4
from .rht import RHT_SIZE, hadamard_matrix, rht, rht_matrix, rht_signs

__all__ = [
    "BLOCK",
    "BLOCK_SHAPES",
    "E2M1_GRID",
    "F4_E2M1_MAX",
    "F8_E4M3_MAX",
    "MX_BLOCK",
    "MXFP8Tensor",
    "NVFP4Tensor",
    "RHT_SIZE",
    "e2m1_decode",
    "global_encode_scale",
    "hadamard_matrix",
    "pack_nibbles",
    "quantize_ms_eden",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "rht",
    "rht_matrix",
    "rht_signs",
    "unpack_nibbles",
]
