"""Baselines the benchmarks time beside jaxfp8's GEMM (speed references, not implementations: not exact enough).

  * `dequant_bf16_matmul_baseline`: what users write today: dequantize to bfloat16, bf16 GEMM with f32 accumulation.
  * `per_tensor_fp8_matmul_baseline`: an fp8 `dot_general` with one scale per tensor, the cuBLASLt FP8 ceiling without
    block scales (it computes a different, coarser quantization, so it is a speed reference only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfp8.gemm.xla import contract_k, dequantize, row_major_a_scales


def dequant_bf16_matmul_baseline(
    a_q: jax.Array, b_q: jax.Array, a_s: jax.Array, b_s: jax.Array, bias: jax.Array | None = None, *,
    block_size: tuple[int, int], a_s_column_major: bool = False, out_dtype=jnp.bfloat16,
) -> jax.Array:
  """BASELINE, not an implementation: dequantize both operands to bfloat16, then a bf16 GEMM with f32 accumulation.

  This is what a JAX user without a block-FP8 kernel writes today. Rounding the dequantized values to bf16 (8
  significant bits) costs about 2^-9 relative error per element, outside the float32-output tolerance of
  docs/CONTRACT.md §2.
  """
  m, _ = a_q.shape
  gn, gk = block_size
  a_bf16 = dequantize(a_q, row_major_a_scales(a_s, m, a_s_column_major), 1, gk, jnp.bfloat16)
  b_bf16 = dequantize(b_q, b_s, gn, gk, jnp.bfloat16)
  acc = contract_k(a_bf16, b_bf16, preferred_element_type=jnp.float32)
  if bias is not None:
    acc = acc + bias.astype(jnp.float32)[None, :]
  return acc.astype(out_dtype)


def per_tensor_fp8_matmul_baseline(
    a_q: jax.Array, b_q: jax.Array, a_scale: jax.Array, b_scale: jax.Array, *, out_dtype=jnp.bfloat16,
) -> jax.Array:
  """BASELINE, not an implementation: fp8 x fp8 `dot_general` with one float32 scale per operand.

  On NVIDIA GPUs XLA sends this to cuBLASLt's FP8 GEMM: the speed ceiling of a library GEMM without block scales.
  The product leaves cuBLASLt in out_dtype and is scaled afterwards (after its rounding; nothing checks this output):
  asking for a float32 product instead cost a float32 output and a cast of its own (see benchmarks/README.md).
  """
  acc = contract_k(a_q, b_q, preferred_element_type=out_dtype)
  return acc * (a_scale * b_scale).astype(out_dtype)
