"""Eager linear calls: rows padded to their bucket, one compiled executable per (bucket, shapes, options), kept in a
process-wide, thread-safe cache (`cache_info()`, `cache_clear()`).

The pad of x to its bucket and the slice of the output back to M rows happen outside that executable. XLA compiles
every program for fixed shapes, so on a GPU they are two small XLA copies, each compiled once per distinct input
shape (none when M is a bucket and x is 2-D). On one CPU device the host's memory is the device's, so the first
call of a row count pads and slices on the host and compiles nothing; its glue is compiled from its second call on,
since a host copy and `device_put` cost about 100 us where a compiled pad or slice dispatches in about 10. NumPy
inputs are always padded on the host. `scripts/eager_row_counts.py` (commit d804edd) on a 2-CPU machine (JAX
0.12.0.1, 512x256 weight, M = 1..300 once each into warm buckets): 582 compilations -> 0, median first call of a new
M 70-79 ms -> 1.3-1.7 ms; a repeated call of M=5 517 -> 366 us and of M=8 471 -> 356 us (plans are cached too),
where a jitted call takes 210-270 us.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfp8.linear.buckets import RowBuckets, get_row_buckets

logger = logging.getLogger("jaxfp8.linear")


class CacheInfo(NamedTuple):
  """Statistics of the eager executable cache (`cache_info()`)."""
  hits: int            # eager calls served by an executable compiled before (or being compiled by another thread)
  misses: int          # eager calls that compiled an executable
  executables: int     # executables held now
  buckets: tuple[int, ...]  # the distinct row buckets executables are held for
  row_buckets: RowBuckets   # the bucket setting in force


class _ExecutableCache:
  """Compiled executables by key; each key compiles once even when several threads miss it at the same time."""

  def __init__(self):
    self._lock = threading.Lock()
    self._entries: dict[Any, concurrent.futures.Future] = {}
    self._buckets: dict[Any, int] = {}
    self._hits = 0
    self._misses = 0

  def get(self, key, bucket: int, build: Callable[[], Any]):
    with self._lock:
      future = self._entries.get(key)
      owner = future is None
      if owner:
        future = concurrent.futures.Future()
        self._entries[key] = future
        self._buckets[key] = bucket
        self._misses += 1
      else:
        self._hits += 1
    if owner:
      try:
        future.set_result(build())
      except BaseException as e:
        with self._lock:  # a failed build is not cached: the next call tries again
          self._entries.pop(key, None)
          self._buckets.pop(key, None)
        future.set_exception(e)
        raise
    return future.result()

  def info(self) -> CacheInfo:
    with self._lock:
      return CacheInfo(self._hits, self._misses, len(self._entries), tuple(sorted(set(self._buckets.values()))),
                       get_row_buckets())

  def clear(self) -> None:
    with self._lock:
      self._entries.clear()
      self._buckets.clear()
      self._hits = self._misses = 0


_CACHE = _ExecutableCache()


def cache_info() -> CacheInfo:
  """Hits, misses, executables and compiled row buckets of the eager calls' executable cache."""
  return _CACHE.info()


def cache_clear() -> None:
  """Drops every cached executable (the row buckets' and the row pad / slice glue's) and zeroes the statistics."""
  _CACHE.clear()
  _rows_to_bucket_jit.clear_cache()
  _rows_from_bucket_jit.clear_cache()
  _SEEN_GLUE.clear()


def _signature(a):
  if a is None:
    return None
  sharding = getattr(a, "sharding", None)
  return (tuple(a.shape), jnp.dtype(a.dtype).name, bool(getattr(a, "weak_type", False)), sharding)


@functools.partial(jax.jit, static_argnames=("rows",))
def _rows_to_bucket_jit(x, *, rows: int):
  x2 = x.reshape(-1, x.shape[-1])
  return jnp.pad(x2, ((0, rows - x2.shape[0]), (0, 0)))


@functools.partial(jax.jit, static_argnames=("lead",))
def _rows_from_bucket_jit(out, *, lead: tuple[int, ...]):
  return out[:math.prod(lead)].reshape(*lead, out.shape[-1])


def _host_device(a):
  """The CPU device holding all of jax.Array `a`, or None (another platform, several devices, or not a jax.Array)."""
  if not isinstance(a, jax.Array) or not a.is_fully_addressable:
    return None
  devices = a.devices()
  if len(devices) != 1:
    return None
  device = next(iter(devices))
  return device if device.platform == "cpu" else None


_SEEN_GLUE: set = set()  # (direction, shape, dtype, target) of glue a CPU array has already needed once


def _first_sighting(key) -> bool:
  if key in _SEEN_GLUE:
    return False
  _SEEN_GLUE.add(key)
  return True


def _rows_to_bucket(x, rows: int):
  """x (..., K) as (rows, K) with zero rows appended."""
  if x.ndim == 2 and x.shape[0] == rows and not isinstance(x, np.ndarray):
    return x
  device = _host_device(x)
  if isinstance(x, np.ndarray) or (device is not None and
                                   _first_sighting(("to", tuple(x.shape), jnp.dtype(x.dtype).name, rows))):
    x2 = np.asarray(x).reshape(-1, x.shape[-1])
    padded = np.zeros((rows, x2.shape[1]), x2.dtype)
    padded[:x2.shape[0]] = x2
    return jax.device_put(padded, device)
  return _rows_to_bucket_jit(x, rows=rows)


def _rows_from_bucket(out, lead: tuple[int, ...]):
  if len(lead) == 1 and out.shape[0] == lead[0]:
    return out
  device = _host_device(out)
  if device is not None and _first_sighting(("from", tuple(out.shape), jnp.dtype(out.dtype).name, lead)):
    return jax.device_put(np.asarray(out)[:math.prod(lead)].reshape(*lead, out.shape[-1]), device)
  return _rows_from_bucket_jit(out, lead=lead)


def _empty_output(x, lead, n, out_dtype):
  """(..., N) with no rows: made on the host and transferred, so it compiles nothing."""
  empty = np.zeros((*lead, n), out_dtype)
  devices = getattr(x, "devices", None)
  return jax.device_put(empty, next(iter(devices())) if devices else None)


def run_eager(name: str, key, make_body: Callable[[int], Callable], x, rest: tuple, n: int, out_dtype,
               place_rows: Callable | None = None):
  """Pads x's rows to their bucket (then `place_rows` them), runs the cached executable of `make_body(bucket)` on
  (x_rows, *rest), and returns the live rows as (..., N)."""
  lead = tuple(x.shape[:-1])
  m = math.prod(lead)
  if m == 0:
    return _empty_output(x, lead, n, out_dtype)
  bucket = max(get_row_buckets().bucket(m), m)
  x_rows = _rows_to_bucket(x, bucket)
  if place_rows is not None:
    x_rows = place_rows(x_rows)
  args = (x_rows, *rest)
  full_key = (name, key, bucket, tuple(_signature(a) for a in args))

  def build():
    body = make_body(bucket)
    logger.info("jaxfp8.linear: compiling %s for a bucket of %d rows", name, bucket)
    return jax.jit(body).lower(*args).compile()

  executable = _CACHE.get(full_key, bucket, build)
  return _rows_from_bucket(executable(*args), lead)


def named(fn: Callable, name: str) -> Callable:
  """fn under a fixed name: the name XLA compilations of it are logged and monitored under."""
  def body(*args):
    return fn(*args)
  body.__name__ = body.__qualname__ = name
  return body
