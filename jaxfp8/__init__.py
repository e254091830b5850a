"""jaxfp8: DeepSeek-style block-scaled FP8 (1x128 activation scales, 128x128 weight scales) for JAX.

Pallas kernels for NVIDIA Hopper (Mosaic GPU), portable Pallas-Triton kernels for sm >= 8.9 GPUs, and jnp code for
every other platform, behind one API. `jaxfp8.reference` is the float64 NumPy oracle of the numerical contract.
"""

from jaxfp8 import checkpoints, gemm, grouped, linear, moe, quant, reference, weights
from jaxfp8.gemm import TritonGemmConfig, w8a8_block_fp8_matmul
from jaxfp8.grouped import masked_w8a8_block_fp8_matmul, ragged_w8a8_block_fp8_matmul
from jaxfp8.linear import w8a8_block_fp8_linear
from jaxfp8.quant import per_token_group_quant_fp8, per_token_group_quant_fp8_row_padded
from jaxfp8.checkpoints import load_hf_fp8_linears, save_hf_fp8_linears
from jaxfp8.weights import Fp8LinearWeight, dequantize_weight_blockwise, quantize_weight_blockwise

__version__ = "0.1.0"

__all__ = [
    "reference",
    "quant",
    "gemm",
    "checkpoints",
    "per_token_group_quant_fp8",
    "per_token_group_quant_fp8_row_padded",
    "w8a8_block_fp8_matmul",
    "TritonGemmConfig",
    "grouped",
    "ragged_w8a8_block_fp8_matmul",
    "masked_w8a8_block_fp8_matmul",
    "linear",
    "moe",
    "weights",
    "w8a8_block_fp8_linear",
    "quantize_weight_blockwise",
    "dequantize_weight_blockwise",
    "Fp8LinearWeight",
    "load_hf_fp8_linears",
    "save_hf_fp8_linears",
]
