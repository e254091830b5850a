"""The XLA GEMM: block-scaled FP8 GEMM (docs/CONTRACT.md §2) in plain jnp, on any platform.

`block_fp8_matmul_xla` computes what the kernels compute, in the same order: for each K group g, the float32 dot of
the codes, P_g = f32(a_q[:, group g]) @ f32(b_q[:, group g])^T at `Precision.HIGHEST`, then

    acc += P_g * (a_s[:, g] * b_s[n // gn, g])

over the groups in order (a `lax.fori_loop` carrying one (M, N) accumulator: nothing of size (K/gk, M, N) is built). The
scales multiply the products, never the operands (dequantizing first would overflow at scales near 1e36), and the
product of the two scales is never formed as a float32 number, which overflows (a_s = 1e30, b_s = 1e10) or
underflows where P_g * a_s * b_s does not: `scale_products` multiplies P_g by the product of the scales'
mantissas, then by their power of two in two halves of one sign, so that a term leaves float32's range only where
its exact value does (docs/CONTRACT.md §2). A call whose scale products are all normal float32 numbers (the usual
case) takes the plain P_g * (a_s * b_s) instead, which is then the same number. The products of fp8 codes are exact
in float32 and each group sums at most gk of them; with power-of-two scales and small integer codes (the exactness
check) every partial sum is exact, so the result is bit-exact. `Precision.HIGHEST` matters on GPUs, where XLA's
default float32 dot may run in TF32.

Also the backend interface the planner asks (`unavailable`, `unsupported`, `default_config_for`, `launch`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

CONFIG_CLASS = None  # no kernel, nothing to configure


def row_major_a_scales(a_s: jax.Array, m: int, a_s_column_major: bool) -> jax.Array:
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


def dequantize(q: jax.Array, s: jax.Array, rows_per_scale: int, cols_per_scale: int, dtype) -> jax.Array:
  """q (R, C) times its block scales s (ceil(R/rows_per_scale), ceil(C/cols_per_scale)), in `dtype`."""
  r, c = q.shape
  s_full = jnp.repeat(s, rows_per_scale, axis=0, total_repeat_length=r) if rows_per_scale > 1 else s[:r]
  s_full = jnp.repeat(s_full, cols_per_scale, axis=1, total_repeat_length=c)
  return (fp8_values(q) * s_full.astype(jnp.float32)).astype(dtype)


def exponent_split(s: jax.Array) -> tuple[jax.Array, jax.Array]:
  """float32 s as (mantissa, biased exponent), s = mantissa * 2**(exponent - 127): for a normal s, |mantissa| in
  [1, 2) and the exponent field in [1, 254]; a zero, subnormal, infinite or NaN s is its own mantissa, with 127."""
  bits = lax.bitcast_convert_type(s, jnp.int32)
  field = (bits >> 23) & 0xFF
  normal = (field > 0) & (field < 0xFF)
  mantissa = lax.bitcast_convert_type((bits & ~0x7F800000) | 0x3F800000, jnp.float32)
  return jnp.where(normal, mantissa, s), jnp.where(normal, field, 127)


def scale_products(partial: jax.Array, a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> jax.Array:
  """partial * a_s * b_s (broadcasting) for scales given by their `exponent_split`s a and b.

  The mantissas' product is rounded as float32 a_s * b_s would be, and partial is multiplied by it first; the power
  of two 2**(e_a + e_b), in [2**-252, 2**254], goes on in two halves of the same sign, each a normal float32 (biased
  exponents h = (f_a + f_b) // 2 and f_a + f_b - h, both in [1, 254]), so every intermediate lies between
  partial * m and the result: none overflows or underflows unless the result does.
  """
  (a_m, a_f), (b_m, b_f) = a, b
  total = a_f + b_f  # the biased exponent of the product plus 127
  half = total >> 1
  power = lambda field: lax.bitcast_convert_type(field << 23, jnp.float32)
  return partial * (a_m * b_m) * power(half) * power(total - half)


def contract_k(a: jax.Array, b: jax.Array, **kwargs) -> jax.Array:
  """a (M, K) . b (N, K) -> (M, N)."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), **kwargs)


def block_fp8_matmul_xla(
    a_q: jax.Array, b_q: jax.Array, a_s: jax.Array, b_s: jax.Array, bias: jax.Array | None, *,
    block_size: tuple[int, int], a_s_column_major: bool, out_dtype,
) -> jax.Array:
  """docs/CONTRACT.md §2 on validated arrays: C (M, N) in out_dtype. See the module docstring for the numerics."""
  m = a_q.shape[0]
  n = b_q.shape[0]
  gn, gk = block_size
  a = fp8_values(a_q)
  if m == 1:
    # XLA's CPU dot takes a matrix-vector path for one row, whose f32 summation order differs from the matrix path:
    # a second (zero) row keeps a row's result independent of how many rows share the call (docs/CONTRACT.md §3).
    a = jnp.concatenate([a, jnp.zeros_like(a)], axis=0)
  rows = a.shape[0]
  a_scales = row_major_a_scales(a_s, m, a_s_column_major).astype(jnp.float32)  # (M, G)
  a_scales = jnp.pad(a_scales, ((0, rows - m), (0, 0)))
  b_scales = jnp.repeat(b_s.astype(jnp.float32), gn, axis=0, total_repeat_length=n)  # (N, G)
  acc = block_scaled_dot(a, fp8_values(b_q), a_scales, b_scales, gk)[:m]
  if bias is not None:
    acc = acc + bias.astype(jnp.float32)[None, :]
  return acc.astype(out_dtype)


def products_normal(a_scales: jax.Array, b_scales: jax.Array) -> jax.Array:
  """Whether every product of a scale of a_scales with one of b_scales (float32 arrays) is a normal float32 (or 0,
  or not finite through a factor that is), judged on their exponents: a bool scalar."""
  (_, a_f), (_, b_f) = exponent_split(a_scales), exponent_split(b_scales)
  # The mantissas' product lies in [1, 4): the product's exponent is e_a + e_b or one more.
  return (jnp.max(a_f) + jnp.max(b_f) <= 127 + 2 * 127 - 1) & (jnp.min(a_f) + jnp.min(b_f) >= 2 * 127 - 126)


def block_scaled_dot(a: jax.Array, b: jax.Array, a_scales: jax.Array, b_scales: jax.Array, gk: int,
                     normal: jax.Array | None = None) -> jax.Array:
  """sum over K groups g, in order, of P_g * a_scales[:, g] * b_scales[:, g] with P_g the float32 dot of group g
  of a (R, K) and b (N, K) (code values): (R, N) float32; a_scales (R, G), b_scales (N, G). A partial last group is
  padded with zero codes, which add nothing.

  When every product of two scales is a normal float32 (`normal`, `products_normal` when not given), each term is
  P_g * float32(a_s * b_s), as in the kernels; otherwise each is `scale_products`' (equal to that, up to the
  rounding of terms below 2**-126, wherever a_s * b_s is normal), whose intermediates leave float32's range only
  where the term does. One branch runs (`lax.cond`): the ordinary case pays nothing for the other."""
  groups = -(-a.shape[1] // gk)
  a = jnp.pad(a, ((0, 0), (0, groups * gk - a.shape[1])))
  b = jnp.pad(b, ((0, 0), (0, groups * gk - b.shape[1])))
  # The accumulator starts as a zero of the operands' own type: under jax.shard_map (check_vma) a loop carry must
  # vary over the mesh axes its updates vary over.
  zero = zeros_like_operands((a.shape[0], b.shape[0]), jnp.float32, a, b, a_scales, b_scales)

  def accumulate(scaled, a_parts, b_parts):
    def group_step(g, acc):
      a_g = lax.dynamic_slice_in_dim(a, g * gk, gk, axis=1)
      b_g = lax.dynamic_slice_in_dim(b, g * gk, gk, axis=1)
      partial = contract_k(a_g, b_g, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
      a_column = tuple(lax.dynamic_slice_in_dim(x, g, 1, axis=1) for x in a_parts)  # (R, 1)
      b_column = tuple(lax.dynamic_index_in_dim(x, g, axis=1, keepdims=False) for x in b_parts)  # (N,)
      return acc + scaled(partial, a_column, b_column)

    return lax.fori_loop(0, groups, group_step, zero)

  plain = lambda: accumulate(lambda p, a_s, b_s: p * (a_s[0] * b_s[0]), (a_scales,), (b_scales,))
  split = lambda: accumulate(scale_products, exponent_split(a_scales), exponent_split(b_scales))
  return lax.cond(products_normal(a_scales, b_scales) if normal is None else normal, plain, split)


def zeros_like_operands(shape, dtype, *operands) -> jax.Array:
  """Zeros of `shape` typed like a value computed from `operands`: varying over every mesh axis any of them varies
  over under `jax.shard_map` (each `lax.full_like` keeps its operand's varying axes; outside shard_map there are
  none)."""
  zero = sum(lax.full_like(x, 0, dtype, shape=()) for x in operands)
  return jnp.broadcast_to(zero, shape)


def live_rows_only(out: jax.Array, valid_rows: jax.Array | None) -> jax.Array:
  """out (m, ...) with the rows from `valid_rows` on (clipped to [0, m]) set to zero; out itself for None."""
  if valid_rows is None:
    return out
  live = jnp.arange(out.shape[0], dtype=jnp.int32) < jnp.clip(valid_rows, 0, out.shape[0])
  return jnp.where(live.reshape(-1, *(1,) * (out.ndim - 1)), out, jnp.zeros((), out.dtype))


# ---- the backend interface the planner asks -------------------------------------------------------------------------

# With valid_rows, XLA computes every row; the planner zeroes the rows past it.
SKIPS_DEAD_ROWS = False


def config_class():
  return None


def unavailable(device, interpret: bool) -> str | None:
  del device, interpret
  return None  # runs wherever JAX does


def unsupported(problem) -> str | None:
  del problem
  return None


def row_alignment(m: int) -> tuple[int, str]:
  del m
  return 1, "XLA needs no padding"


def default_config_for(problem, device):
  del problem, device
  return None, "XLA has no kernel config"


def config_problem(problem, config) -> str | None:
  del problem, config
  return None


def launch(a_q, b_q, a_s, b_s, bias, problem, config, interpret: bool, device):
  del config, interpret, device
  m = problem.m
  # Slice the padding rows off (the kernels just leave them unread).
  a_q = a_q[:m]
  a_s = a_s if problem.a_s_column_major else a_s[:m]
  return block_fp8_matmul_xla(a_q, b_q, a_s, b_s, bias, block_size=tuple(problem.block_size),
                              a_s_column_major=problem.a_s_column_major, out_dtype=problem.out_dtype)
