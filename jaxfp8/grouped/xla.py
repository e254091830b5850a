"""The XLA grouped GEMM: docs/CONTRACT.md §7 in plain jnp, on any platform.

Per K group g, in order, the float32 products of the codes P_g (at `Precision.HIGHEST`) are scaled and added into one
float32 accumulator, as the dense XLA GEMM does (jaxfp8/gemm/xla.py): the ragged layout takes P_g from
`lax.ragged_dot_general` (each row against its own group's weight), the masked layout from one batched dot over the
experts. The weight scale of a row is its group's, gathered per row. With the contract's exactness inputs every
partial sum is exact, so the result is bit-exact on CPU.

Also the backend interface the planner asks (`unavailable`, `unsupported`, `default_config_for`, `launch`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxfp8.gemm import xla as gemm_xla
from jaxfp8.gemm.xla import fp8_values

CONFIG_CLASS = None  # no kernel, nothing to configure

_RAGGED_DIMS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def ragged_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
  """(starts, ends) of the groups' rows (docs/CONTRACT.md §7: negative sizes count as 0, the groups are cut at M)."""
  sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, m)
  ends = jnp.minimum(jnp.cumsum(sizes), m)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]]), ends


def _pad_k(x: jax.Array, groups: int, gk: int) -> jax.Array:
  """Zero codes up to whole K groups (they add nothing)."""
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, groups * gk - x.shape[-1])])


def ragged_block_fp8_matmul_xla(a_q, b_q, a_s, b_s, group_sizes, *, block_size, a_s_column_major: bool,
                                out_dtype) -> jax.Array:
  """The ragged layout on validated arrays: (M, N) of out_dtype."""
  m, k = a_q.shape
  num_groups, n = b_q.shape[:2]
  gn, gk = block_size
  groups = -(-k // gk)
  starts, ends = ragged_bounds(group_sizes, m)
  sizes = ends - starts
  rows = jnp.arange(m, dtype=jnp.int32)
  owned = rows < ends[-1]
  # The group of each row (rows past the last group take the last group's scales, then are zeroed).
  row_group = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), num_groups - 1)
  a = jnp.where(owned[:, None], _pad_k(fp8_values(a_q), groups, gk), 0.0)  # rows no group owns may hold anything
  b = _pad_k(fp8_values(b_q), groups, gk)
  a_scales = (a_s[:, :m].T if a_s_column_major else a_s[:m]).astype(jnp.float32)  # (M, G)
  b_scales = b_s.astype(jnp.float32)  # (E, ceil(N/gn), G)

  def group_step(g, acc):
    a_g = lax.dynamic_slice_in_dim(a, g * gk, gk, axis=1)
    b_g = lax.dynamic_slice_in_dim(b, g * gk, gk, axis=2)
    partial = lax.ragged_dot_general(a_g, b_g, sizes, _RAGGED_DIMS, precision=lax.Precision.HIGHEST,
                                     preferred_element_type=jnp.float32)
    w_scale = jnp.repeat(lax.dynamic_index_in_dim(b_scales, g, axis=2, keepdims=False)[row_group], gn, axis=1,
                         total_repeat_length=n)  # (M, N)
    return acc + partial * (lax.dynamic_slice_in_dim(a_scales, g, 1, axis=1) * w_scale)

  acc = lax.fori_loop(0, groups, group_step, jnp.zeros((m, n), jnp.float32))
  return jnp.where(owned[:, None], acc, 0.0).astype(out_dtype)


def masked_block_fp8_matmul_xla(a_q, b_q, a_s, b_s, masked_m, *, block_size, a_s_column_major: bool,
                                out_dtype) -> jax.Array:
  """The masked layout on validated arrays: (E, T, N) of out_dtype."""
  num_groups, rows, k = a_q.shape
  n = b_q.shape[1]
  gn, gk = block_size
  groups = -(-k // gk)
  live = jnp.arange(rows, dtype=jnp.int32)[None, :] < jnp.clip(masked_m.astype(jnp.int32), 0, rows)[:, None]
  a = jnp.where(live[:, :, None], _pad_k(fp8_values(a_q), groups, gk), 0.0)
  b = _pad_k(fp8_values(b_q), groups, gk)
  a_scales = (jnp.swapaxes(a_s[:, :, :rows], 1, 2) if a_s_column_major else a_s[:, :rows]).astype(jnp.float32)
  b_scales = jnp.repeat(b_s.astype(jnp.float32), gn, axis=1, total_repeat_length=n)  # (E, N, G)

  def group_step(g, acc):
    a_g = lax.dynamic_slice_in_dim(a, g * gk, gk, axis=2)
    b_g = lax.dynamic_slice_in_dim(b, g * gk, gk, axis=2)
    partial = lax.dot_general(a_g, b_g, (((2,), (2,)), ((0,), (0,))), precision=lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)  # (E, T, N)
    scale = (lax.dynamic_slice_in_dim(a_scales, g, 1, axis=2)
             * lax.dynamic_slice_in_dim(b_scales, g, 1, axis=2)[:, None, :, 0])
    return acc + partial * scale

  acc = lax.fori_loop(0, groups, group_step, jnp.zeros((num_groups, rows, n), jnp.float32))
  return jnp.where(live[:, :, None], acc, 0.0).astype(out_dtype)


# ---- the backend interface the planner asks -------------------------------------------------------------------------

# No kernel, nothing it cannot run: the dense XLA backend's answers.
config_class, unavailable, unsupported = gemm_xla.config_class, gemm_xla.unavailable, gemm_xla.unsupported


def default_config_for(problem, device):
  del problem, device
  return None, "XLA has no kernel config"


def config_problem(problem, config) -> str | None:
  del problem, config
  return None


def launch(a_q, b_q, a_s, b_s, counts, problem, config, interpret: bool, device):
  del config, interpret, device
  f = ragged_block_fp8_matmul_xla if problem.layout == "ragged" else masked_block_fp8_matmul_xla
  return f(a_q, b_q, a_s, b_s, counts, block_size=tuple(problem.block_size),
           a_s_column_major=problem.a_s_column_major, out_dtype=problem.out_dtype)
