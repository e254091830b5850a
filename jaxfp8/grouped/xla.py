"""The XLA grouped GEMM: docs/CONTRACT.md §7 in plain jnp, on any platform.

Both layouts run the decomposition of the Mosaic kernel (pallas_kernels/grouped_gemm_mosaic.py): each expert's rows
are a segment of a buffer (the ragged layout's sorted rows; the masked layout's own buffer per expert), cut at
row-tile boundaries into (expert, row tile) work items, and only the items that exist run: a loop over the experts
that hold rows (each one's weight converted once), and in it a loop over that expert's row tiles. An item is the
dense XLA GEMM's block-scaled dot (jaxfp8/gemm/xla.py `block_scaled_dot`: per K group g, in order, the float32
products of the codes, scaled, added into a float32 accumulator) of one row tile against its own expert's weight, of
which only the expert's own rows are kept. So a row depends on its own activation row and its
own expert's weight and scales, nothing else: a NaN in one expert's weights reaches that expert's live rows only,
and the work follows the routed rows, not E. (`jax.lax.ragged_dot` cannot promise that: on CPU it multiplies
every row by every expert's weight and masks the sum, where 0 * NaN poisons every row and the time grows with E.)
With the contract's exactness inputs every partial sum is exact, so the result is bit-exact on CPU.

Also the backend interface the planner asks (`unavailable`, `unsupported`, `default_config_for`, `launch`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxfp8.gemm import xla as gemm_xla
from jaxfp8.gemm.xla import fp8_values

CONFIG_CLASS = None  # no kernel, nothing to configure


def ragged_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
  """(starts, ends) of the groups' rows (docs/CONTRACT.md §7: negative sizes count as 0, the groups are cut at M)."""
  sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, m)  # clipped first: the cumulative sum cannot overflow
  ends = jnp.minimum(jnp.cumsum(sizes), m)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]]), ends


def row_tile(rows_per_expert: int, rows: int) -> int:
  """The rows of a work item (at most `rows`, a buffer's): each expert's last tile is partly wasted, and each tile
  costs a loop step, so about half an expert's rows, a power of two in [4, 64] (on CPU, over 64 to 16384 rows and
  8 to 256 experts, within a few tens of percent of the best tile)."""
  tile = 1 << (max(rows_per_expert // 2, 1) - 1).bit_length()  # the least power of two >= rows_per_expert / 2
  return max(min(max(tile, 4), 64, rows), 1)


def _grouped_rows(a_q, a_scales, b_q, b_s, buffer, lo, hi, *, block_size, tile: int, operands) -> jax.Array:
  """Expert e's rows [lo[e], hi[e]) of buffer buffer[e] of a_q (B, R, K) (scales a_scales (B, R, G) float32, R >=
  tile) against its weight b_q[e], every other row 0: (B, R, N) float32.

  The experts that hold rows go first (a stable sort, so in order); a loop over them converts each one's weight
  once, and an inner loop runs its row tiles. The counts of both loops are traced: nothing runs for an empty
  expert, and the work is that of the routed rows."""
  _, rows, k = a_q.shape
  n = b_q.shape[1]
  gn, gk = block_size
  normal = gemm_xla.products_normal(a_scales, b_s)  # over every expert's scales: one branch for the whole call
  holding = hi > lo
  experts = jnp.argsort(~holding, stable=True).astype(jnp.int32)
  # XLA's CPU compiler widens fp8 to f16 for a dynamic slice, over the whole operand, and hoists that out of the
  # loop (every expert's weights converted on every call); a barrier tied to the loop index keeps each conversion
  # to the loop step's own expert or rows.
  fixed = lambda x, i: lax.optimization_barrier((x, i))[0]

  def expert_step(j, out):
    e = experts[j]
    b = fp8_values(fixed(b_q, j)[e])
    b_scales = jnp.repeat(b_s[e], gn, axis=0, total_repeat_length=n)  # (N, G)

    def tile_step(t, out):
      first = t * tile
      # A buffer's last tile, when its rows are no multiple of the tile, is read ending at its last row.
      at = (buffer[e], jnp.minimum(first, rows - tile), 0)
      a_tile = fp8_values(lax.dynamic_slice(fixed(a_q, t), at, (1, tile, k))[0])
      a_tile_scales = lax.dynamic_slice(a_scales, at, (1, tile, a_scales.shape[2]))[0]
      y = gemm_xla.block_scaled_dot(a_tile, b, a_tile_scales, b_scales, gk, normal)
      row = at[1] + jnp.arange(tile, dtype=jnp.int32)
      # Only the expert's own rows of this tile: the others belong to other experts (or to its previous tile).
      own = (row >= jnp.maximum(lo[e], first)) & (row < jnp.minimum(hi[e], first + tile))
      kept = jnp.where(own[:, None], y, lax.dynamic_slice(out, at, (1, tile, n))[0])
      return lax.dynamic_update_slice(out, kept[None], at)

    return lax.fori_loop(lo[e] // tile, (hi[e] + tile - 1) // tile, tile_step, out)

  zero = gemm_xla.zeros_like_operands((a_q.shape[0], rows, n), jnp.float32, *operands)
  return lax.fori_loop(0, jnp.sum(holding, dtype=jnp.int32), expert_step, zero)


def ragged_block_fp8_matmul_xla(a_q, b_q, a_s, b_s, group_sizes, *, block_size, a_s_column_major: bool,
                                out_dtype) -> jax.Array:
  """The ragged layout on validated arrays: (M, N) of out_dtype. One buffer of M rows; group e's rows a segment."""
  m = a_q.shape[0]
  num_groups = b_q.shape[0]
  tile = row_tile(m // num_groups, m)
  starts, ends = ragged_bounds(group_sizes, m)
  a_scales = gemm_xla.row_major_a_scales(a_s, m, a_s_column_major).astype(jnp.float32)
  out = _grouped_rows(a_q[None], a_scales[None], b_q, b_s, jnp.zeros((num_groups,), jnp.int32), starts, ends,
                      block_size=block_size, tile=tile, operands=(a_q, b_q, a_s, b_s, group_sizes))
  return out[0].astype(out_dtype)


def masked_block_fp8_matmul_xla(a_q, b_q, a_s, b_s, masked_m, *, block_size, a_s_column_major: bool,
                                out_dtype) -> jax.Array:
  """The masked layout on validated arrays: (E, T, N) of out_dtype. Expert e's live rows are its buffer's segment."""
  num_groups, rows, _ = a_q.shape
  tile = row_tile(rows, rows)
  a_scales = jnp.swapaxes(a_s[:, :, :rows], 1, 2) if a_s_column_major else a_s
  experts = jnp.arange(num_groups, dtype=jnp.int32)
  out = _grouped_rows(a_q, a_scales.astype(jnp.float32), b_q, b_s, experts, jnp.zeros_like(experts),
                      jnp.clip(masked_m.astype(jnp.int32), 0, rows), block_size=block_size, tile=tile,
                      operands=(a_q, b_q, a_s, b_s, masked_m))
  return out.astype(out_dtype)


# ---- the backend interface the planner asks -------------------------------------------------------------------------

# No kernel, nothing it cannot run: the dense XLA backend's answers.
config_class, unavailable, unsupported = gemm_xla.config_class, gemm_xla.unavailable, gemm_xla.unsupported


def default_config_for(problem, device):
  del problem, device
  return None, "XLA has no kernel config"


def config_problem(problem, config) -> str | None:
  del problem, config
  return None


def items_key(problem, config):
  """XLA needs no work-item table: its `prepare` is the counts themselves."""
  del config
  return ("xla", problem.layout, problem.groups, problem.rows)


def prepare(counts, problem, config, interpret: bool = False):
  del problem, config, interpret
  return counts


def prepare_from_rows(groups, rows, within, group_sizes, problem, config, with_order: bool = False):
  del groups, rows, within, problem, config
  return (group_sizes, None) if with_order else group_sizes


def launch(a_q, b_q, a_s, b_s, counts, problem, config, interpret: bool, device, prepared: bool = False):
  del config, interpret, device, prepared  # prepared counts are the counts
  f = ragged_block_fp8_matmul_xla if problem.layout == "ragged" else masked_block_fp8_matmul_xla
  return f(a_q, b_q, a_s, b_s, counts, block_size=tuple(problem.block_size),
           a_s_column_major=problem.a_s_column_major, out_dtype=problem.out_dtype)
