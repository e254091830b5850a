"""The MoE layer's decode dispatch for Hopper (sm_90) in Pallas Mosaic GPU: R <= 64 routed slots' expert ids -> the
slots in expert order and the grouped GEMMs' work-item table, in one kernel of one warpgroup.

XLA runs the same counting sort (jaxfp8/moe/layer.py `dispatch`, `ragged_items_from_rows`) as three dependent
reductions over (R, R), each a kernel of its own (about a microsecond each at decode). Here each level is a masked
row sum over a (64, 64) register tile: the slots along the rows, every slot along the columns. A level's result is
a row vector (one value per slot); the next level reads it along the columns, so it goes through shared memory
(`vector_tiles`). The levels:

  1. each slot's key (its expert, or E for an id outside [0, E)), then its row in expert order (the slots of a
     lower key, and of its key at a lower slot), its index among its expert's slots, and the live count (the slots
     of some expert);
  2. the work items: a slot starts one where it is its expert's first or sits at a multiple of the row tile; an
     item's index is the count of starting slots before it, its end the next start (or the live count); and the
     slot at each row (the inverse of the rows);
  3. the table: item i's fields (batch 0, expert, row tile, first row, end) summed over the one slot that starts it
     (every field 0 for an item no slot starts: nothing to do).

The outputs are `ragged_items_from_rows`'s and the layer's dispatch's, bit for bit: rows (R,), order (R,), the live
count in every entry (R,), the table (5, num_items).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .grouped_gemm_mosaic import ITEM_FIELDS
from .vector_tiles import TILE, count, load_columns, load_rows, row_vector, tile_iota

MAX_SLOTS = TILE  # the rows of one warpgroup's register tile


@dataclasses.dataclass(frozen=True)
class DispatchConfig:
  """tile_m: the row tile of the grouped GEMMs' table (its items split at multiples of it)."""
  tile_m: int


def problems(slots: int, experts: int, config: DispatchConfig, num_items: int) -> list[str]:
  """What keeps this kernel from dispatching `slots` routed ids over `experts` (empty: nothing)."""
  tile_m = config.tile_m
  found = []
  if not 0 < slots <= MAX_SLOTS or slots % 4:
    found.append(f"R={slots} routed slots must be a positive multiple of 4 up to {MAX_SLOTS} (16-byte copies)")
  if experts < 1:
    found.append(f"E={experts} experts must be positive")
  if tile_m < 1:
    found.append(f"tile_m={tile_m} must be positive")
  if not 0 < num_items <= MAX_SLOTS or num_items % 4:
    found.append(f"num_items={num_items} table columns must be a positive multiple of 4 up to {MAX_SLOTS}")
  return found


def decode_dispatch(ids: jax.Array, *, experts: int, num_items: int, config: DispatchConfig, interpret: bool = False):
  """(rows (R,), order (R,), live (R,), table (ITEM_FIELDS, num_items)) of the routed ids (R,) int32: rows[s] the
  expert-order row of slot s, order[p] the slot at row p, live the slots of some expert (in every entry), the table
  `ragged_items_from_rows`' for row tiles of config.tile_m. The caller checks `problems`."""
  r = ids.shape[0]
  tile_m = config.tile_m

  def body(ids_gmem, rows_gmem, order_gmem, live_gmem, table_gmem,
           ids_smem, key_smem, rows_smem, start_smem, at_smem, fields_smem, out_smem, table_smem, barrier):
    row = tile_iota(0)
    col = tile_iota(1)
    # The slots past R: an id no expert has (they sort last, after the real slots of no expert).
    ids_smem[...] = row_vector(experts)
    plgpu.commit_smem()
    plgpu.copy_gmem_to_smem(ids_gmem, ids_smem.at[pl.ds(0, r)], barrier)
    plgpu.barrier_wait(barrier)
    ids_row = load_rows(ids_smem)
    key = jnp.where((ids_row >= 0) & (ids_row < experts), ids_row, experts)
    key_smem[...] = key
    key_col = load_columns(key_smem)
    # 1. rows in expert order, index among the expert's slots, live count
    same_earlier = (key_col == key[:, None]) & (col < row)
    rows = count((key_col < key[:, None]) | same_earlier)
    within = count(same_earlier)
    live = count(key_col < experts)  # the same in every row
    owned = key < experts
    start = jnp.where(owned & ((within == 0) | (rows % tile_m == 0)), 1, 0)
    rows_smem[...] = rows
    start_smem[...] = start
    rows_col = load_columns(rows_smem)
    starts_col = load_columns(start_smem) > 0
    # 2. the item each starting slot begins, the next start after each slot, the slot at each row
    index = count(starts_col & (rows_col < rows[:, None]))
    next_start = jnp.min(jnp.where(starts_col & (rows_col > rows[:, None]), rows_col, r), axis=1)
    order = jnp.sum(jnp.where(rows_col == row, col, 0), axis=1)
    at = jnp.where(start > 0, index, num_items)
    at_smem[...] = at
    fields = (row_vector(0), key, rows // tile_m, rows, jnp.minimum(next_start, live))
    for f, value in enumerate(fields):
      fields_smem.at[f][...] = value
    # 3. the table: item i's fields from the slot that starts it
    hit = load_columns(at_smem) == row
    for f in range(ITEM_FIELDS):
      table_smem.at[f][...] = jnp.sum(jnp.where(hit, load_columns(fields_smem.at[f]), 0), axis=1)
    for i, value in enumerate((rows, order, live)):
      out_smem.at[i][...] = value
    plgpu.commit_smem()
    for i, dst in enumerate((rows_gmem, order_gmem, live_gmem)):
      plgpu.copy_smem_to_gmem(out_smem.at[i, pl.ds(0, r)], dst)
    for f in range(ITEM_FIELDS):
      plgpu.copy_smem_to_gmem(table_smem.at[f, pl.ds(0, num_items)], table_gmem.at[f])
    plgpu.wait_smem_to_gmem(0)

  vector = plgpu.SMEM((MAX_SLOTS,), jnp.int32)
  interpret_params: Any = plgpu.InterpretGPUParams() if interpret else None
  f = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((r,), jnp.int32), jax.ShapeDtypeStruct((r,), jnp.int32),
                jax.ShapeDtypeStruct((r,), jnp.int32), jax.ShapeDtypeStruct((ITEM_FIELDS, num_items), jnp.int32)),
      grid=(1,),
      grid_names=("block",),
      scratch_types=[vector, vector, vector, vector, vector, plgpu.SMEM((ITEM_FIELDS, MAX_SLOTS), jnp.int32),
                     plgpu.SMEM((3, MAX_SLOTS), jnp.int32), plgpu.SMEM((ITEM_FIELDS, MAX_SLOTS), jnp.int32),
                     plgpu.Barrier()],
      interpret=interpret_params,
  )
  return f(ids.astype(jnp.int32))


__all__ = ["DispatchConfig", "MAX_SLOTS", "decode_dispatch", "problems"]
