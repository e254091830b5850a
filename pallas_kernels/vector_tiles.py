"""What the one-warpgroup Mosaic GPU kernels that count over (64, 64) register tiles share (the MoE decode dispatch,
the ragged grouped GEMM's table): vectors of 64 int32 as the rows or the columns of a tile.

A row vector (one value per row, the layout a row sum gives) reaches another level's columns through shared memory,
and Mosaic's layout inference takes that only when each buffer is loaded in one layout; a column vector is broadcast
to the whole tile before any other op (a (1, 64) one beside a constant finds no layout); a constant gets the row
layout before it is stored (a splat of 64 elements cannot be stored).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas.mosaic_gpu as plgpu

TILE = 64  # the rows of one warpgroup's register tile


def load_rows(ref) -> jax.Array:
  """A (64,) shared-memory vector as a row vector: entry i in row i."""
  return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)


def load_columns(ref) -> jax.Array:
  """A (64,) shared-memory vector along the columns: entry j in column j of every row of a (64, 64) tile."""
  vector = plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
  return lax.broadcast_in_dim(vector, (TILE, TILE), (1,))


def row_vector(value: int) -> jax.Array:
  """A constant int32 row vector, with the row layout so that it can be stored."""
  return plgpu.layout_cast(jnp.full((TILE,), value, jnp.int32), plgpu.Layout.WGMMA.reduce(1))


def tile_iota(dimension: int) -> jax.Array:
  """A (64, 64) int32 tile of each element's row (dimension 0) or column (1)."""
  return plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (TILE, TILE), dimension), plgpu.Layout.WGMMA)


def count(mask: jax.Array) -> jax.Array:
  """Per row of a (64, 64) mask, its true entries."""
  return jnp.sum(jnp.where(mask, 1, 0), axis=1)
