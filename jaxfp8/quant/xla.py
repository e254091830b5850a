"""The XLA quantizer: per-token-group FP8 quantization in plain jnp, on any platform (docs/CONTRACT.md §1).

Also the backend interface the planner asks (`unavailable`, `unsupported`, `default_config`, `launch`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.exact_division import divide_correctly_rounded

CONFIG_CLASS = None  # no kernel, nothing to configure

FP8_MAX = 448.0
R = float(np.float32(1.0 / 448.0))


def _ue8m0(s: jax.Array) -> jax.Array:
  bits = lax.bitcast_convert_type(s, jnp.int32)
  exponent = bits & 0x7F800000
  rounded = jnp.where((bits & 0x007FFFFF) != 0, exponent + 0x00800000, exponent)
  return jnp.where(jnp.isfinite(s), lax.bitcast_convert_type(rounded, jnp.float32), s)


def _round_to(v: jax.Array, dtype) -> jax.Array:
  """Round f32 values to `dtype` (bf16 or f16) and back, subnormals included, as docs/CONTRACT.md §1's round_x does.

  A bare pair of converts is not enough: XLA's simplifier folds f32 -> f16 -> f32 into nothing (excess precision),
  and folds arithmetic rounding idioms such as (v + 0.5) - 0.5 too. An optimization barrier between the converts
  keeps the rounding, f16's subnormal range (which a SiLU of a large negative input reaches) included.
  """
  if jnp.dtype(dtype) == jnp.float32:
    return v
  return lax.optimization_barrier(v.astype(dtype)).astype(jnp.float32)


def per_token_group_quant(
    x: jax.Array,
    valid_rows: jax.Array,
    *,
    group_size: int,
    eps: float,
    out_rows: int,
    scale_layout: str,
    scale_cols: int,
    scale_ue8m0: bool,
    fuse_silu_and_mul: bool,
) -> tuple[jax.Array, jax.Array]:
  """x (E, T, K_in) -> q (E, out_rows, K) e4m3fn and scales in `scale_layout` ("row", "col", "col_packed")."""
  batch, rows_in, k_in = x.shape
  xf = x.astype(jnp.float32)
  if fuse_silu_and_mul:
    k = k_in // 2
    gate, up = xf[..., :k], xf[..., k:]
    silu = _round_to(gate / (1.0 + jnp.exp(-gate)), x.dtype)
    xf = _round_to(silu * up, x.dtype)
  k = xf.shape[-1]
  groups = k // group_size
  xg = xf.reshape(batch, rows_in, groups, group_size)

  amax = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1), eps)
  amax = jnp.where(jnp.any(jnp.isnan(xg), axis=-1), jnp.nan, amax)
  scale = amax * R
  if scale_ue8m0:
    scale = _ue8m0(scale)
  quotient = divide_correctly_rounded(xg, scale[..., None])
  q = jnp.where(jnp.isnan(quotient), quotient, jnp.clip(quotient, -FP8_MAX, FP8_MAX))
  q = q.astype(jnp.float8_e4m3fn).reshape(batch, rows_in, k)

  live = jnp.arange(rows_in)[None, :] < valid_rows[:, None]
  q = jnp.where(live[..., None], q, jnp.zeros((), q.dtype))
  scale = jnp.where(live[..., None], scale, 1.0)
  q = jnp.pad(q, ((0, 0), (0, out_rows - rows_in), (0, 0)))
  if scale_layout == "row":
    return q, jnp.pad(scale, ((0, 0), (0, out_rows - rows_in), (0, 0)), constant_values=1.0)
  scale_t = jnp.pad(jnp.swapaxes(scale, 1, 2), ((0, 0), (0, 0), (0, scale_cols - rows_in)), constant_values=1.0)
  if scale_layout == "col":
    return q, scale_t
  exponent = (lax.bitcast_convert_type(scale_t, jnp.int32) >> 23) & 0xFF
  words = -(-groups // 4)
  exponent = jnp.pad(exponent, ((0, 0), (0, words * 4 - groups), (0, 0))).reshape(batch, words, 4, scale_cols)
  # Group 4i+j in byte j of word i (little-endian).
  word = exponent[:, :, 0] | (exponent[:, :, 1] << 8) | (exponent[:, :, 2] << 16) | (exponent[:, :, 3] << 24)
  return q, word


def config_class():
  return None


def unavailable(device, interpret: bool) -> str | None:
  del device, interpret
  return None  # runs wherever JAX does


def unsupported(problem) -> str | None:
  del problem
  return None


def default_config_for(problem, device):
  del problem, device
  return None, "XLA has no kernel config"


def launch(x3, valid_rows, problem, config, interpret):
  del config, interpret
  return per_token_group_quant(
      x3, valid_rows, group_size=problem.group_size, eps=problem.eps, out_rows=problem.out_rows,
      scale_layout=problem.scale_layout, scale_cols=problem.scale_cols, scale_ue8m0=problem.scale_ue8m0,
      fuse_silu_and_mul=problem.fuse_silu_and_mul)
