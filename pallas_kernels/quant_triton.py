"""Per-token-group FP8 quantization as a Triton-lowered Pallas kernel (any sm >= 8.9 GPU).

Each program owns `block_rows` rows and `groups_per_block` consecutive groups of one batch entry. It writes the
padded FP8 rows and the scales straight into their final layout (row-major, column-major or packed UE8M0), pad rows
and TMA pad columns included, so no pad, transpose or concatenate runs around it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from . import exact_division
from ._jax_compat import out_struct

FP8_MAX = 448.0
# float32(1/448): scale = amax * R, a multiply every backend rounds identically (docs/CONTRACT.md §1).
R = float(np.float32(1.0 / 448.0))
SCALE_LAYOUTS = ("row", "col", "col_packed")


@dataclasses.dataclass(frozen=True)
class QuantTritonConfig:
  block_rows: int = 16
  groups_per_block: int = 4  # a multiple of 4 for the packed UE8M0 layout (one int32 word per 4 groups)
  num_warps: int = 4
  num_stages: int = 1

  def __post_init__(self):
    for name in ("block_rows", "groups_per_block"):
      value = getattr(self, name)
      if value <= 0 or value & (value - 1):
        raise ValueError(f"QuantTritonConfig.{name} must be a positive power of two, got {value}")


def _reciprocal(s: jax.Array, *, interpret: bool) -> jax.Array:
  """1/s correctly rounded (PTX rcp.rn; once per group, so its cost does not matter)."""
  if interpret:
    return 1.0 / s
  (out,) = plt.elementwise_inline_asm(
      "rcp.rn.f32 $0, $1;", args=[s], constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(s.shape, jnp.float32)])
  return out


def _divide(x: jax.Array, s: jax.Array, r: jax.Array, *, interpret: bool) -> jax.Array:
  """x / s correctly rounded, given r = RN(1/s).

  An IEEE divide per element (div.rn.f32) costs a long instruction sequence and made the kernel compute-bound;
  Triton's own f32 `/` is approximate. Instead: q0 = RN(x * r), the exact residual x - q0 * s by one FMA, and one
  FMA correction q0 + residual * r, which is the correctly rounded quotient when r = RN(1/s) (Markstein). Infinite
  scales (a group holding inf) take the plain quotient, whose x/inf = 0 and inf/inf = NaN are what IEEE gives.
  """
  if interpret:  # XLA executes the body: its `/` becomes a reciprocal multiply
    return exact_division.divide_correctly_rounded(x, s)
  (corrected,) = plt.elementwise_inline_asm(
      """{
      .reg .f32 q0, neg_q0, residual;
      mul.rn.f32 q0, $1, $3;
      neg.f32 neg_q0, q0;
      fma.rn.f32 residual, neg_q0, $2, $1;
      fma.rn.f32 $0, residual, $3, q0;
      }""",
      args=[x, s, r], constraints="=r,r,r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
  return jnp.where(jnp.abs(s) < jnp.inf, corrected, x / s)


def _ue8m0(s: jax.Array) -> jax.Array:
  """Smallest power of two >= s via exponent bits; NaN and inf pass through."""
  bits = lax.bitcast_convert_type(s, jnp.int32)
  exponent = bits & 0x7F800000
  rounded = jnp.where((bits & 0x007FFFFF) != 0, exponent + 0x00800000, exponent)
  return jnp.where(jnp.abs(s) < jnp.inf, lax.bitcast_convert_type(rounded, jnp.float32), s)


def _kernel(valid_ref, x_ref, q_ref, s_ref, *, group_size, padded_group, eps, out_rows, rows_in, scale_layout,
            scale_cols, scale_ue8m0, fuse_silu_and_mul, config, interpret):
  batch = pl.program_id(0)
  row_block = pl.program_id(1)
  group_block = pl.program_id(2)
  k = q_ref.shape[-1]
  groups = k // group_size
  valid_rows = jnp.minimum(valid_ref[batch], rows_in)

  # One (rows, groups, lanes) tile per program: a single wide load keeps many bytes in flight per SM.
  rows = row_block * config.block_rows + jnp.arange(config.block_rows)
  group_ids = group_block * config.groups_per_block + jnp.arange(config.groups_per_block)
  lanes = jnp.arange(padded_group)
  live_row = rows < valid_rows
  group_ok = group_ids < groups
  element_ok = group_ok[:, None] & (lanes < group_size)[None, :]  # (groups, lanes)
  cols = group_ids[:, None] * group_size + lanes[None, :]
  row_idx, col_idx = rows[:, None, None], cols[None, :, :]
  load_mask = live_row[:, None, None] & element_ok[None]

  x = plt.load(x_ref.at[batch, row_idx, col_idx], mask=load_mask, other=0).astype(jnp.float32)
  if fuse_silu_and_mul:
    up = plt.load(x_ref.at[batch, row_idx, col_idx + k], mask=load_mask, other=0).astype(jnp.float32)
    silu = (x / (1.0 + jnp.exp(-x))).astype(x_ref.dtype).astype(jnp.float32)
    x = (silu * up).astype(x_ref.dtype).astype(jnp.float32)

  # Triton's float max drops NaN (maxnumf): track NaN separately so a NaN group gets a NaN scale (docs/CONTRACT.md §1).
  group_has_nan = jnp.max(jnp.where(x != x, 1.0, 0.0), axis=2) > 0
  amax = jnp.maximum(jnp.max(jnp.abs(x), axis=2), eps)
  scale = jnp.where(group_has_nan, jnp.nan, amax * R)
  if scale_ue8m0:
    scale = _ue8m0(scale)
  scale = jnp.where(live_row[:, None], scale, 1.0)  # pad rows: scale 1.0 and q 0

  reciprocal = _reciprocal(scale, interpret=interpret)
  quotient = _divide(x, jnp.broadcast_to(scale[:, :, None], x.shape), jnp.broadcast_to(reciprocal[:, :, None], x.shape),
                     interpret=interpret)
  # Clipping through min/max would turn NaN into +-448 (minnumf/maxnumf): keep NaN explicitly.
  clipped = jnp.where(quotient != quotient, quotient, jnp.minimum(jnp.maximum(quotient, -FP8_MAX), FP8_MAX))
  q = jnp.where(live_row[:, None, None], clipped, 0.0).astype(q_ref.dtype)
  plt.store(q_ref.at[batch, row_idx, col_idx], q, mask=(rows < out_rows)[:, None, None] & element_ok[None])

  scale_rows_ok = rows < (out_rows if scale_layout == "row" else scale_cols)
  if scale_layout == "row":
    plt.store(s_ref.at[batch, rows[:, None], group_ids[None, :]], scale,
              mask=scale_rows_ok[:, None] & group_ok[None, :])
  elif scale_layout == "col":
    plt.store(s_ref.at[batch, group_ids[None, :], rows[:, None]], scale,
              mask=scale_rows_ok[:, None] & group_ok[None, :])
  else:
    # Exponent byte of group 4i+j goes to byte j of word i; the bytes never overlap, so a sum is an OR.
    exponent = jnp.where(group_ok[None, :], (lax.bitcast_convert_type(scale, jnp.int32) >> 23) & 0xFF, 0)
    words_per_block = config.groups_per_block // 4
    shifts = (jnp.arange(config.groups_per_block) % 4) * 8
    shifted = (exponent << shifts[None, :]).reshape(config.block_rows, words_per_block, 4)
    packed = jnp.sum(shifted, axis=2)
    word_ids = group_block * words_per_block + jnp.arange(words_per_block)
    plt.store(s_ref.at[batch, word_ids[None, :], rows[:, None]], packed,
              mask=scale_rows_ok[:, None] & (word_ids < s_ref.shape[1])[None, :])


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
    config: QuantTritonConfig,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Quantizes x (E, T, K_in) into q (E, out_rows, K) e4m3fn and scales in `scale_layout`.

  Arguments are validated by `jaxfp8.quant`; rows t >= valid_rows[e] (and t >= T) are pad rows.
  """
  batch, rows_in, k_in = x.shape
  k = k_in // 2 if fuse_silu_and_mul else k_in
  groups = k // group_size
  if scale_layout not in SCALE_LAYOUTS:
    raise ValueError(f"scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
  if scale_layout == "col_packed" and config.groups_per_block % 4:
    raise ValueError(f"the packed UE8M0 layout needs groups_per_block % 4 == 0, got {config.groups_per_block}")

  if scale_layout == "row":
    s_shape, s_dtype, rows_covered = (batch, out_rows, groups), jnp.float32, out_rows
  elif scale_layout == "col":
    s_shape, s_dtype, rows_covered = (batch, groups, scale_cols), jnp.float32, scale_cols
  else:
    s_shape, s_dtype, rows_covered = (batch, -(-groups // 4), scale_cols), jnp.int32, scale_cols
  grid = (batch, pl.cdiv(max(rows_covered, 1), config.block_rows), pl.cdiv(groups, config.groups_per_block))

  kernel = functools.partial(
      _kernel, group_size=group_size, padded_group=pl.next_power_of_2(group_size), eps=float(eps),
      out_rows=out_rows, rows_in=rows_in, scale_layout=scale_layout, scale_cols=scale_cols,
      scale_ue8m0=scale_ue8m0, fuse_silu_and_mul=fuse_silu_and_mul, config=config, interpret=interpret)
  return pl.pallas_call(
      kernel,
      out_shape=(out_struct((batch, out_rows, k), jnp.float8_e4m3fn, x, valid_rows),
                 out_struct(s_shape, s_dtype, x, valid_rows)),
      grid=grid,
      compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name="jaxfp8_quant_triton",
  )(valid_rows.astype(jnp.int32), x)
