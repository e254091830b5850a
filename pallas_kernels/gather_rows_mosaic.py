"""Row gather for Hopper (sm_90) in Pallas Mosaic GPU: out[r] = x[src[r]] for the rows r below a traced count.

The MoE layer's permute: each routed row's token codes copied into expert order. The buffer has a static size (every
routed slot), but only its first `count` rows belong to some expert; an XLA gather writes every row of it, where this
kernel moves only the live ones. Each CTA takes a block of rows; for each live row one TMA copy brings the source row
into shared memory and a second stores it, so a row costs its bytes once each way. Blocks past the count load and
store nothing, and the rows of the output from the count on are never written (the caller never reads them).

Rows are copied as (K / 128, 128) boxes (TMA moves at most 256 elements along each dimension), so K must be a
multiple of 128 and the row's bytes a multiple of 16.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

LANE = 128  # elements of the box's inner dimension
MAX_BOX = 256  # TMA's most elements along one dimension
SMEM_BYTES = 232448  # per-block shared memory on H100/H200 (227 KiB)


@dataclasses.dataclass(frozen=True)
class GatherRowsConfig:
  """block_rows: rows per CTA (their copies are in flight together)."""
  block_rows: int = 8

  def __post_init__(self):
    if not isinstance(self.block_rows, int) or isinstance(self.block_rows, bool) or not 1 <= self.block_rows <= 64:
      raise ValueError(f"GatherRowsConfig.block_rows must be an int in [1, 64], got {self.block_rows!r}")


def problems(k: int, dtype, config: GatherRowsConfig) -> list[str]:
  """What keeps this kernel from gathering rows of K elements of dtype (empty: nothing)."""
  found = []
  if k % LANE or not 0 < k // LANE <= MAX_BOX:
    found.append(f"K={k} must be a positive multiple of {LANE} up to {LANE * MAX_BOX}")
  if (smem := config.block_rows * k * jnp.dtype(dtype).itemsize) > SMEM_BYTES:
    found.append(f"block_rows={config.block_rows} rows of {k} x {jnp.dtype(dtype).name} need {smem} bytes of shared "
                 f"memory > {SMEM_BYTES}")
  return found


def gather_rows(x: jax.Array, src: jax.Array, count: jax.Array, *, config: GatherRowsConfig,
                src_divisor: int = 1, interpret: bool = False) -> jax.Array:
  """(R, K): row r < count is x[src[r] // src_divisor]; rows from count on are not written. x (T, K); src int32 (R,)
  with every src[r] // src_divisor for r < count in [0, T); count an int32 scalar (clipped to [0, R] in the kernel:
  a clip before the launch would be a kernel of its own). The caller checks `problems`."""
  t, k = x.shape
  rows = src.shape[0]
  bm = config.block_rows
  x3 = x.reshape(t, k // LANE, LANE)  # free: splits the last dimension

  def body(x_gmem, src_gmem, count_gmem, out_gmem, smem, barriers):
    row0 = lax.axis_index("block") * bm
    live = jnp.minimum(jnp.maximum(count_gmem[0], 0), rows)

    @pl.when(row0 < live)
    def _block():
      for i in range(bm):
        @pl.when(row0 + i < live)
        def _load(i=i):
          src_row = src_gmem[row0 + i] if src_divisor == 1 else lax.div(src_gmem[row0 + i], jnp.int32(src_divisor))
          plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(src_row, 1)], smem.at[pl.ds(i, 1)], barriers.at[i])

      for i in range(bm):
        @pl.when(row0 + i < live)
        def _store(i=i):
          plgpu.barrier_wait(barriers.at[i])
          plgpu.copy_smem_to_gmem(smem.at[pl.ds(i, 1)], out_gmem.at[pl.ds(row0 + i, 1)])

      plgpu.wait_smem_to_gmem(0)

  interpret_params: Any = plgpu.InterpretGPUParams() if interpret else None
  f = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((rows, k // LANE, LANE), x.dtype),
      grid=(max(pl.cdiv(rows, bm), 1),),
      grid_names=("block",),
      scratch_types=[plgpu.SMEM((bm, k // LANE, LANE), x.dtype), plgpu.Barrier(num_barriers=bm)],
      interpret=interpret_params,
  )
  return f(x3, src.astype(jnp.int32), jnp.asarray(count).astype(jnp.int32).reshape(1)).reshape(rows, k)


__all__ = ["GatherRowsConfig", "gather_rows", "problems"]
