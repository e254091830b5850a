"""x / s correctly rounded in plain jnp, however XLA compiles division.

XLA rewrites a division by a broadcast into a multiply by the reciprocal (on CPU and GPU), which leaves a quantized
code one fp8 step off now and then; quantization promises the correctly rounded quotient (docs/CONTRACT.md §1). The
XLA quantizer, weight quantization and the interpreted kernels use this; the compiled GPU kernels divide in hardware.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_EXPONENT_MASK = 0x7F800000
_EXPONENT_BIAS = 127


def _split(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Veltkamp split of f32 a into hi + lo, each with at most 12 significant bits, so products of halves are exact."""
  c = a * 4097.0  # 2**12 + 1
  hi = c - (c - a)
  return hi, a - hi


def _power_of_two(exponent: jax.Array) -> jax.Array:
  """2**exponent as float32 for integer exponents in [-126, 127]."""
  return lax.bitcast_convert_type((exponent + _EXPONENT_BIAS) << 23, jnp.float32)


def _normalize(x: jax.Array, s: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(x * 2**e, s * 2**e) with s * 2**e in [1, 2): the same quotient, in a range where nothing below overflows.

  The factor goes on in two halves, each a normal float32, so that neither half nor any intermediate is subnormal.
  x * 2**e may still underflow, but only when |x / s| < 2**-126, far below the smallest fp8 step: its code is 0.
  """
  biased = (lax.bitcast_convert_type(s, jnp.int32) & _EXPONENT_MASK) >> 23
  shift = _EXPONENT_BIAS - biased  # in [-127, 127] for finite, normal s
  half = shift // 2
  f1, f2 = _power_of_two(half), _power_of_two(shift - half)
  return (x * f1) * f2, (s * f1) * f2


def divide_correctly_rounded(x: jax.Array, s: jax.Array) -> jax.Array:
  """x / s correctly rounded for every finite, normal s (and the IEEE quotient for s = +-inf or NaN).

  After `_normalize`, q0 = x * (1/s) is within an ulp of the quotient; the residual x - q0 * s is computed exactly
  by Dekker's error-free product (x - p is exact by Sterbenz, as p is within a factor 2 of x), and one correction
  q0 + residual / s rounds to the correctly rounded quotient (Markstein). Normalizing first keeps the splits from
  overflowing (huge s) and the partial products from underflowing (tiny s). Scales here are always normal: eps is
  refused where eps / 448 would not be (`jaxfp8._checks.eps`).
  """
  finite = jnp.abs(s) < jnp.inf
  xn, sn = _normalize(x, jnp.where(finite, s, 1.0))
  r = 1.0 / sn
  q0 = xn * r
  p = q0 * sn
  q_hi, q_lo = _split(q0)
  s_hi, s_lo = _split(sn)
  product_error = ((q_hi * s_hi - p) + q_hi * s_lo + q_lo * s_hi) + q_lo * s_lo
  residual = (xn - p) - product_error
  corrected = q0 + residual * r  # a zero's sign may be lost (the residual of an exact zero is +0): no code depends on it
  return jnp.where(finite, corrected, x / s)
