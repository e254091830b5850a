"""Row buckets: the row counts eager linear calls pad M up to, one compiled executable per bucket.

`pad_to_bucket` pads a batch the same way for users who jit whole models once per bucket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import numbers
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxfp8 import _checks


@dataclasses.dataclass(frozen=True)
class RowBuckets:
  """Row counts that eager calls pad M up to: the smallest of `sizes` >= M, beyond the last one the next multiple of
  `step`. The default, (1, 2, 4, ..., 256) then multiples of 256, pads fewer than half of the rows (at decode sizes
  the GEMM streams the weight and extra rows are nearly free; beyond 256 rows the waste falls as M grows) and
  M = 1..300 touches 10 buckets, M = 1..8192 40. `RowBuckets(sizes=(), step=1)` compiles every M exactly.
  """
  sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
  step: int = 256

  def __post_init__(self):
    sizes = tuple(self.sizes)
    if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s <= 0 for s in sizes):
      raise ValueError(f"RowBuckets.sizes must be positive ints, got {sizes!r}")
    if list(sizes) != sorted(set(sizes)):
      raise ValueError(f"RowBuckets.sizes must be strictly increasing, got {sizes!r}")
    if isinstance(self.step, bool) or not isinstance(self.step, numbers.Integral) or self.step <= 0:
      raise ValueError(f"RowBuckets.step must be a positive int, got {self.step!r}")
    object.__setattr__(self, "sizes", tuple(int(s) for s in sizes))

  def bucket(self, m: int) -> int:
    """The row count M pads up to (0 stays 0)."""
    if m <= 0:
      return 0
    for size in self.sizes:
      if m <= size:
        return size
    return _checks.round_up(m, self.step)

  def buckets_for(self, ms) -> tuple[int, ...]:
    """The distinct buckets a set of row counts touches, ascending."""
    return tuple(sorted({self.bucket(m) for m in ms if m > 0}))


_row_buckets = RowBuckets()
_config_lock = threading.Lock()


def get_row_buckets() -> RowBuckets:
  """The row buckets eager calls use now."""
  return _row_buckets


def set_row_buckets(buckets: RowBuckets | Sequence[int] | None) -> RowBuckets:
  """Sets the row buckets of eager calls (process-wide); returns the previous setting.

  `buckets`: a RowBuckets, a strictly increasing sequence of sizes (beyond the last one: multiples of it), or None for
  the default. Executables compiled for other buckets stay cached (`cache_clear()` drops them).
  """
  global _row_buckets
  if buckets is None:
    new = RowBuckets()
  elif isinstance(buckets, RowBuckets):
    new = buckets
  else:
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence):
      raise TypeError(f"buckets must be a RowBuckets, a sequence of row counts or None, got {buckets!r}")
    sizes = tuple(buckets)
    if not sizes:
      raise ValueError("set_row_buckets needs at least one size (or RowBuckets(sizes=(), step=...))")
    new = RowBuckets(sizes=sizes, step=sizes[-1])
  with _config_lock:
    previous, _row_buckets = _row_buckets, new
  return previous


@contextlib.contextmanager
def row_buckets(buckets: RowBuckets | Sequence[int] | None):
  """`with row_buckets(...):` sets the row buckets for the block (process-wide, not per thread)."""
  previous = set_row_buckets(buckets)
  try:
    yield get_row_buckets()
  finally:
    set_row_buckets(previous)


@functools.partial(jax.jit, static_argnames=("axis", "rows"))
def _pad_axis(x, *, axis: int, rows: int):
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, rows - x.shape[axis])
  return jnp.pad(x, widths)


def pad_to_bucket(x, axis: int = 0, *, buckets: RowBuckets | None = None):
  """Pads `axis` of x with zeros up to its row bucket; returns (padded, original size).

  For users who jit whole models once per bucket: pad the batch (or token) axis here, run the jitted model, and keep
  the first `size` entries of its outputs. NumPy inputs are padded on the host (no compilation); JAX arrays by a small
  jitted pad (one compilation per input shape).
  """
  if buckets is None:
    buckets = get_row_buckets()
  elif not isinstance(buckets, RowBuckets):
    raise TypeError(f"buckets must be a RowBuckets or None, got {buckets!r}")
  if not hasattr(x, "shape"):
    x = np.asarray(x)
  ndim = len(x.shape)
  if ndim == 0:
    raise ValueError(f"x must have at least one dimension to pad, got a scalar {x!r}")
  if isinstance(axis, bool) or not isinstance(axis, numbers.Integral) or not -ndim <= axis < ndim:
    raise ValueError(f"axis must be an int in [-{ndim}, {ndim}) for x of shape {tuple(x.shape)}, got {axis!r}")
  axis = int(axis) % ndim
  size = int(x.shape[axis])
  rows = max(buckets.bucket(size), size)
  if rows == size:
    return x, size
  if isinstance(x, np.ndarray):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, rows - size)
    return np.pad(x, widths), size
  return _pad_axis(x, axis=axis, rows=rows), size
