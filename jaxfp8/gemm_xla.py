"""Block-scaled FP8 GEMM (SPEC.md section 2) in plain jnp, for every backend; plus the baselines the benchmark compares against.

`block_fp8_matmul_xla` is the portable implementation behind `implementation="xla"`. It dequantizes both operands by their
scales into float32 and runs one float32 GEMM at `Precision.HIGHEST`:

    C = (a_q * a_s[m, k // gk]) @ (b_q * b_s[n // gn, k // gk])^T

which is the SPEC sum regrouped, so nothing of size (K/gk, M, N) is ever built. An fp8 value has 4 significant bits, so
each dequantized element is one float32 rounding away from exact (relative 2^-24): far inside the 2e-4 bound of SPEC.md for
float32 output. With power-of-two scales (the exactness check) the dequantized values, every product and every partial sum
are exact in float32, so the result is bit-exact whatever the summation order. `Precision.HIGHEST` matters on GPUs, where
XLA's default float32 dot may run in TF32 (10-bit mantissa operands), and on TPUs (bf16 passes).

Baselines (for benchmarks; not exact enough to serve as implementations):
  * `dequant_bf16_matmul_baseline`: what users write today: dequantize to bfloat16, bf16 GEMM with f32 accumulation.
  * `per_tensor_fp8_matmul_baseline`: an fp8 `dot_general` with one scale per tensor, the cuBLASLt FP8 ceiling without
    block scales (it computes a different, coarser quantization, so it is a speed reference only).
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp


def _row_major_a_scales(a_s: jax.Array, m: int, a_s_column_major: bool) -> jax.Array:
  """(M, G) float32 whatever the layout (a column-major (G, M') array is sliced to its M live columns)."""
  return a_s[:, :m].T if a_s_column_major else a_s[:m]


def fp8_values(q: jax.Array) -> jax.Array:
  """float32 values of fp8 codes q, as codes, whatever produced q in the same program.

  XLA's GPU compiler (simplify-fp-conversions, on by default with xla_allow_excess_precision) folds a chain of
  float converts x -> fp8 -> f32 into x: when a quantizer and this dequantization are jitted together, the GEMM would
  multiply the unrounded x / s instead of the codes (the XLA linear on the H200: 43% error at M=1, N=1). An
  optimization barrier keeps the fp8 values.
  """
  return lax.optimization_barrier(q).astype(jnp.float32)


def _dequantize(q: jax.Array, s: jax.Array, rows_per_scale: int, cols_per_scale: int, dtype) -> jax.Array:
  """q (R, C) times its block scales s (ceil(R/rows_per_scale), ceil(C/cols_per_scale)), in `dtype`."""
  r, c = q.shape
  s_full = jnp.repeat(s, rows_per_scale, axis=0, total_repeat_length=r) if rows_per_scale > 1 else s[:r]
  s_full = jnp.repeat(s_full, cols_per_scale, axis=1, total_repeat_length=c)
  return (fp8_values(q) * s_full.astype(jnp.float32)).astype(dtype)


def _contract_k(a: jax.Array, b: jax.Array, **kwargs) -> jax.Array:
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), **kwargs)


def block_fp8_matmul_xla(
    a_q: jax.Array, b_q: jax.Array, a_s: jax.Array, b_s: jax.Array, bias: jax.Array | None, *,
    block_size: tuple[int, int], a_s_column_major: bool, out_dtype,
) -> jax.Array:
  """SPEC 2 on validated arrays: C (M, N) in out_dtype. See the module docstring for the numerics."""
  m, _ = a_q.shape
  gn, gk = block_size
  a_f32 = _dequantize(a_q, _row_major_a_scales(a_s, m, a_s_column_major), 1, gk, jnp.float32)
  b_f32 = _dequantize(b_q, b_s, gn, gk, jnp.float32)
  if m == 1:
    # XLA's CPU dot takes a matrix-vector path for one row, whose f32 summation order differs from the matrix path:
    # a second (zero) row keeps a row's result independent of how many rows share the call (SPEC 3: padded and
    # unpadded calls agree bit for bit).
    a_f32 = jnp.concatenate([a_f32, jnp.zeros_like(a_f32)], axis=0)
  acc = _contract_k(a_f32, b_f32, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)[:m]
  if bias is not None:
    acc = acc + bias.astype(jnp.float32)[None, :]
  return acc.astype(out_dtype)


def dequant_bf16_matmul_baseline(
    a_q: jax.Array, b_q: jax.Array, a_s: jax.Array, b_s: jax.Array, bias: jax.Array | None = None, *,
    block_size: tuple[int, int], a_s_column_major: bool = False, out_dtype=jnp.bfloat16,
) -> jax.Array:
  """BASELINE, not an implementation: dequantize both operands to bfloat16, then a bf16 GEMM with f32 accumulation.

  This is what a JAX user without a block-FP8 kernel writes today. Rounding the dequantized values to bf16 (8 significant
  bits) costs about 2^-9 relative error per element, outside SPEC.md's float32-output tolerance.
  """
  m, _ = a_q.shape
  gn, gk = block_size
  a_bf16 = _dequantize(a_q, _row_major_a_scales(a_s, m, a_s_column_major), 1, gk, jnp.bfloat16)
  b_bf16 = _dequantize(b_q, b_s, gn, gk, jnp.bfloat16)
  acc = _contract_k(a_bf16, b_bf16, preferred_element_type=jnp.float32)
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
  acc = _contract_k(a_q, b_q, preferred_element_type=out_dtype)
  return acc * (a_scale * b_scale).astype(out_dtype)
