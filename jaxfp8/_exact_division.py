"""x / s correctly rounded in plain jnp: the XLA quantizer, weight quantization, and the Triton quantizer interpreted.

XLA rewrites a division by a broadcast into a multiply by the reciprocal (on CPU and GPU), which leaves a quantized
code one fp8 step off now and then; SPEC.md asks for the correctly rounded quotient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _split(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Veltkamp split of f32 a into hi + lo, each with at most 12 significant bits, so products of halves are exact."""
  c = a * 4097.0  # 2**12 + 1
  hi = c - (c - a)
  return hi, a - hi


def divide_correctly_rounded(x: jax.Array, s: jax.Array) -> jax.Array:
  """x / s correctly rounded, however XLA compiles division.

  XLA rewrites a division by a broadcast into a multiply by the reciprocal (one fp8 step off, rarely). Here:
  q0 = x * (1/s); the residual x - q0 * s computed exactly by Dekker's error-free product (x - p is exact by
  Sterbenz, as p is within a factor 2 of x); one correction q0 + residual / s (Markstein). Groups whose scale is not
  finite, or so large that the split would overflow, keep the plain quotient (x/inf = 0, NaN stays NaN).
  """
  r = 1.0 / s
  q0 = x * r
  p = q0 * s
  q_hi, q_lo = _split(q0)
  s_hi, s_lo = _split(s)
  product_error = ((q_hi * s_hi - p) + q_hi * s_lo + q_lo * s_hi) + q_lo * s_lo
  residual = (x - p) - product_error
  corrected = q0 + residual * r
  return jnp.where(jnp.abs(s) < 1e30, corrected, x / s)
