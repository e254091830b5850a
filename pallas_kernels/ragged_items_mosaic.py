"""The ragged grouped GEMM's work-item table for decode-sized calls in one Pallas Mosaic GPU kernel (Hopper, sm_90):
group sizes (E,) -> the table `grouped_gemm_mosaic.ragged_items` builds, bit for bit, for M <= 64 rows.

XLA builds that table (the grouped GEMM launch's prologue) in three or four dependent kernels: the groups' row
ranges (a prefix sum), each range's first item (a second one), each item's range (a search) and the fields' stack.
At decode those kernels cost more than the GEMM's own start. Here one warpgroup does the same levels as masked row
sums over (64, 64) register tiles, 64 segments a tile (a segment is a group's row range, or the zero rows after
them): segments along the rows, every segment along the columns for the prefix sums; the items along the rows for
the pick. A level's row vectors reach the next level's columns through shared memory (`vector_tiles`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .grouped_gemm_mosaic import ITEM_FIELDS, ZERO_GROUP
from .vector_tiles import TILE, load_columns, load_rows, row_vector, tile_iota

MAX_ROWS = 64  # M: the items then fit in one tile
MAX_SEGMENTS = 512  # the groups and the zero segment


@dataclasses.dataclass(frozen=True)
class RaggedItemsConfig:
  """tile_m: the grouped GEMM's row tile; zero_unowned_rows: the rows past the groups are a segment of their own
  (their zeros stored by the GEMM)."""
  tile_m: int
  zero_unowned_rows: bool = True


def problems(m: int, groups: int, config: RaggedItemsConfig, num_items: int) -> list[str]:
  """What keeps this kernel from building the table of `groups` group sizes over M = m rows (empty: nothing)."""
  found = []
  if not 0 < m <= MAX_ROWS:
    found.append(f"M={m} rows must be in [1, {MAX_ROWS}]")
  if groups % 4 or not 0 < groups + int(config.zero_unowned_rows) <= MAX_SEGMENTS:
    found.append(f"E={groups} groups must be a positive multiple of 4 (16-byte copies) with at most {MAX_SEGMENTS} "
                 "segments")
  if config.tile_m < 1:
    found.append(f"tile_m={config.tile_m} must be positive")
  if not 0 < num_items <= TILE or num_items % 4:
    found.append(f"num_items={num_items} table columns must be a positive multiple of 4 up to {TILE}")
  return found


def _prefix_sums(col_smem, tiles: int, inclusive: bool) -> list[jax.Array]:
  """Per tile of segments, the sums of col_smem's entries (tiles, 64) up to each segment (or before it)."""
  row, col = tile_iota(0), tile_iota(1)
  sums = []
  for c in range(tiles):
    total = None
    for d in range(c + 1):
      values = load_columns(col_smem.at[d])
      if d == c:
        values = jnp.where(col <= row if inclusive else col < row, values, 0)
      part = jnp.sum(values, axis=1)
      total = part if total is None else total + part
    sums.append(total)
  return sums


def ragged_items(group_sizes: jax.Array, *, m: int, num_items: int, config: RaggedItemsConfig,
                 interpret: bool = False) -> jax.Array:
  """int32 (ITEM_FIELDS, num_items): `grouped_gemm_mosaic.ragged_items(group_sizes, m, tile_m, zero_unowned_rows)`
  with the items past its static count all zero. The caller checks `problems`."""
  e = group_sizes.shape[0]
  tile_m = config.tile_m
  tiles = pl.cdiv(e + int(config.zero_unowned_rows), TILE)

  def body(sizes_gmem, table_gmem, sizes_smem, size_cols, count_cols, first_cols, seg_smem, table_smem, barrier):
    for c in range(tiles):
      sizes_smem.at[c][...] = row_vector(0)  # the segments past E: empty
    plgpu.commit_smem()
    copies = [(c, min(TILE, e - c * TILE)) for c in range(tiles) if e > c * TILE]
    for c, n in copies:
      plgpu.copy_gmem_to_smem(sizes_gmem.at[pl.ds(c * TILE, n)], sizes_smem.at[c, pl.ds(0, n)], barrier.at[c])
    for c, _ in copies:
      plgpu.barrier_wait(barrier.at[c])
    index = plgpu.broadcasted_iota(jnp.int32, (TILE,), 0, layout=plgpu.Layout.WGMMA.reduce(1))
    segment = [index + c * TILE for c in range(tiles)]
    sizes = [jnp.clip(load_rows(sizes_smem.at[c]), 0, m) for c in range(tiles)]
    for c in range(tiles):
      size_cols.at[c][...] = sizes[c]
    # 1. each group's rows [lo, hi) (clipped at M), the zero segment [the groups' end, M), the item counts
    inclusive = _prefix_sums(size_cols, tiles, True)
    for c in range(tiles):
      start, end = jnp.minimum(inclusive[c] - sizes[c], m), jnp.minimum(inclusive[c], m)
      zero = segment[c] == e
      seg_lo = jnp.where(zero, end, start)
      seg_hi = jnp.where(zero, m if config.zero_unowned_rows else end, jnp.where(segment[c] < e, end, start))
      count_cols.at[c][...] = jnp.where(
          seg_hi > seg_lo, (jnp.maximum(seg_hi, 1) - 1) // tile_m - seg_lo // tile_m + 1, 0)
      group = jnp.where(zero, ZERO_GROUP, segment[c])
      for f, value in enumerate((seg_lo, seg_hi, group)):
        seg_smem.at[f, c][...] = value
    # 2. each segment's first item
    first = _prefix_sums(count_cols, tiles, False)
    for c in range(tiles):
      first_cols.at[c][...] = first[c]
    # 3. the table: item i's fields from its segment (one hit per item, none for an item past the last)
    item = tile_iota(0)
    fields = None
    for c in range(tiles):
      seg_first, seg_count = load_columns(first_cols.at[c]), load_columns(count_cols.at[c])
      seg_lo, seg_hi = load_columns(seg_smem.at[0, c]), load_columns(seg_smem.at[1, c])
      hit = (seg_first <= item) & (item < seg_first + seg_count)
      block = seg_lo // tile_m + item - seg_first
      parts = (load_columns(seg_smem.at[2, c]), block, jnp.maximum(seg_lo, block * tile_m),
               jnp.minimum(seg_hi, (block + 1) * tile_m))
      sums = [jnp.sum(jnp.where(hit, value, 0), axis=1) for value in parts]
      fields = sums if fields is None else [a + b for a, b in zip(fields, sums)]
    table_smem.at[0][...] = row_vector(0)
    for f, value in enumerate(fields):
      table_smem.at[f + 1][...] = value
    plgpu.commit_smem()
    for f in range(ITEM_FIELDS):
      plgpu.copy_smem_to_gmem(table_smem.at[f, pl.ds(0, num_items)], table_gmem.at[f])
    plgpu.wait_smem_to_gmem(0)

  interpret_params: Any = plgpu.InterpretGPUParams() if interpret else None
  per_tile = plgpu.SMEM((tiles, TILE), jnp.int32)
  f = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((ITEM_FIELDS, num_items), jnp.int32),
      grid=(1,),
      grid_names=("block",),
      # sizes (loaded as rows), then along the columns: the clipped sizes, the item counts, the first items, and
      # each segment's (lo, hi, group)
      scratch_types=[per_tile, per_tile, per_tile, per_tile, plgpu.SMEM((3, tiles, TILE), jnp.int32),
                     plgpu.SMEM((ITEM_FIELDS, TILE), jnp.int32), plgpu.Barrier(num_barriers=tiles)],
      interpret=interpret_params,
  )
  return f(group_sizes.astype(jnp.int32))


__all__ = ["MAX_ROWS", "MAX_SEGMENTS", "RaggedItemsConfig", "problems", "ragged_items"]
