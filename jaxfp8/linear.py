"""`w8a8_block_fp8_linear` (SPEC.md section 3): y = x @ (w_q * w_s)^T + bias with FP8 activations and weights.

    y (..., N) = linear(x (..., K) in bf16 / fp16 / fp32, w_q (N, K) e4m3fn, w_s (ceil(N/gn), ceil(K/gk)) f32)

One call quantizes the M = prod(...) rows of x per token group of gk (`jaxfp8.quant`) straight into the buffers the
block GEMM (`jaxfp8.gemm`) reads as they are, runs the GEMM, and returns the live rows in x.dtype.

Dispatch (`explain` says which path a call takes and why):
  * Hopper GPU, N % 128 == 0, K % 128 == 0, block (128, 128): the Mosaic GPU GEMM, with the Mosaic quantizer.
    Below 64 rows the quantizer pads M to one whole 64-row tile, which the GEMM reads faster than it has TMA fill
    the missing rows; from 64 rows on, only as far as the GEMM's tiled TMA view of a_q needs (a multiple of 8). The
    quantizer writes the padded rows itself (q = 0, scale = 1.0), so no activation is ever copied, and the GEMM
    computes only the M live rows (`out_rows`), so no output is sliced either.
  * Other sm >= 8.9 GPUs, or shapes the Mosaic kernel does not take: the portable Pallas-Triton GEMM and quantizer.
    It masks partial tiles, so nothing is padded: the quantizer writes (M, K) codes and column-major scales.
  * CPU and everything else: plain XLA, row-major scales (nothing to pad or transpose).
  An explicit `implementation` is honoured, or refused with a ValueError that says why.

Eager calls and compile caching. Under an outer `jax.jit` (any tracer among the arguments) the call is traced inline
and compiles nothing of its own. An eager call pads its M rows up to a *row bucket* (`RowBuckets`: by default the
powers of two up to 256, then multiples of 256) and runs one compiled executable per (bucket, shapes, dtypes,
shardings, implementation, config), kept in a process-wide, thread-safe cache (`cache_info()`, `cache_clear()`). The
pad of x to its bucket and the slice of the output back to M rows are small XLA copies outside that executable (one
tiny compilation each per distinct input shape; none when M is a bucket and x is 2-D; NumPy inputs are padded on the
host). `set_row_buckets` configures the buckets; `pad_to_bucket` pads a batch for users who jit whole models per
bucket.

Sharding (JAX's own SPMD): `column_parallel_linear` (N split over a mesh axis: every device multiplies replicated
activations by its N/P weight rows) and `row_parallel_linear` (K split: every device quantizes and multiplies its K/P
slice of the activations, the float32 partial outputs are summed with `psum`, the bias is added once), both through
`jax.shard_map`; `weight_sharding` gives the matching NamedSharding of each weight array.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib
import logging
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxfp8 import _checks, gemm, quant

logger = logging.getLogger(__name__)

IMPLEMENTATIONS = gemm.IMPLEMENTATIONS
INPUT_DTYPES = quant.INPUT_DTYPES
OUT_DTYPES = gemm.OUT_DTYPES
FP8 = jnp.dtype(jnp.float8_e4m3fn)
F32 = jnp.dtype(jnp.float32)
EPS = 1e-10  # SPEC 1's default floor of a group's absolute maximum
# The Mosaic GEMM describes the TMA of a_q through an (8, 128)-tiled view, which exists when M % 8 == 0 or M < 8;
# other M make its launcher copy a_q into a padded buffer.
_MOSAIC_TMA_ROWS = 8
_QUANT_MOSAIC_MODULE = "pallas_kernels.quant_mosaic"


# ---- row buckets ---------------------------------------------------------------------------------------------------

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
  buckets = buckets or get_row_buckets()
  if not hasattr(x, "shape"):
    x = np.asarray(x)
  axis = axis % len(x.shape) if len(x.shape) else 0
  size = int(x.shape[axis])
  rows = max(buckets.bucket(size), size)
  if rows == size:
    return x, size
  if isinstance(x, np.ndarray):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, rows - size)
    return np.pad(x, widths), size
  return _pad_axis(x, axis=axis, rows=rows), size


# ---- dispatch ------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LinearPlan:
  """What a linear call runs and why (`explain` returns it; `str(plan)` is one line for logs)."""
  m: int
  n: int
  k: int
  block_size: tuple[int, int]
  out_dtype: str
  implementation: str           # the GEMM: "mosaic", "triton" or "xla"
  quant_implementation: str     # the activation quantizer
  row_alignment: int            # the quantizer pads M up to a multiple of this
  scale_layout: str             # "col": column-major TMA-aligned (K/gk, M_pad') scales; "row": (M, K/gk)
  interpret: bool
  reason: str
  config: Any = None            # the GEMM config asked for (None: the GEMM's table or heuristic)

  @property
  def padded_rows(self) -> int:
    """Rows of the quantized activations (the GEMM computes only the first M of them)."""
    return _checks.round_up(self.m, self.row_alignment)

  @property
  def gemm_out_rows(self) -> int | None:
    """The GEMM's `out_rows`: M where the quantizer padded the rows, else None."""
    return self.m if self.padded_rows != self.m else None

  def __str__(self) -> str:
    pallas = self.implementation != "xla" or self.quant_implementation != "xla"
    mode = " (interpreted)" if self.interpret and pallas else ""
    rows = (f"M={self.m} padded to {self.padded_rows} rows by the quantizer, the GEMM computes {self.m}"
            if self.padded_rows != self.m else f"M={self.m}, no padding")
    layout = "column-major" if self.scale_layout == "col" else "row-major"
    return (f"{self.implementation} GEMM + {self.quant_implementation} quantizer{mode}; {rows}; {layout} scales; "
            f"N={self.n}, K={self.k}, block_size={self.block_size}, out {self.out_dtype}: {self.reason}")


def _quant_mosaic_error() -> str | None:
  try:
    importlib.import_module(_QUANT_MOSAIC_MODULE)
  except Exception as e:  # a broken or missing kernel module must not break the other paths
    return f"{type(e).__name__}: {e}"
  return None


def _default_reason(implementation: str, capability, interpret: bool, m_rows: int, n: int, k: int,
                    block_size: tuple[int, int], m_live: int) -> str:
  where = gemm._device_kind()
  if implementation == "mosaic":
    return f"Hopper GPU ({where}), N and K multiples of 128, block_size (128, 128): the Mosaic GPU kernel"
  if implementation == "triton":
    if capability[0] == 9 and m_live <= gemm.TRITON_DECODE_MAX_M:
      return (f"Hopper GPU ({where}), decode M={m_live} <= {gemm.TRITON_DECODE_MAX_M}: the tuned Triton kernel (measured "
              "faster than the Mosaic small-M kernel there)")
    if capability[0] == 9:
      why = gemm.mosaic_unsupported_reason(m_rows, n, k, block_size) or (
          f"{gemm._MOSAIC_MODULE} cannot be imported ({gemm._mosaic_import_error()})")
      return f"Hopper GPU ({where}), but the Mosaic kernel cannot take this problem ({why}): the portable Triton kernel"
    return f"sm_{capability[0]}{capability[1]} GPU ({where}): the portable Triton kernel"
  if interpret and capability is not None:
    return "interpret=True and no implementation named: XLA (name one to interpret its kernel)"
  if capability is None:
    return f"no NVIDIA GPU (default device {where!r}): XLA"
  if capability < (8, 9):
    return f"sm_{capability[0]}{capability[1]} GPU ({where}) has no FP8 conversions: XLA"
  return f"no Triton GEMM config serves block_size={block_size} (gk must be a multiple of 32): XLA"


def _mosaic_row_alignment(m: int, n: int, k: int, block_size: tuple[int, int]) -> int:
  """The quantizer's row padding for the Mosaic GEMM: below 64 rows, a whole 64-row decode tile, which the GEMM reads
  faster than it has TMA fill the missing rows with zeros (H200, session 5: 38.6 vs 43.4 us at M=16 N=7168 K=18432,
  46.3 vs 54.7 us at M=16 N=24576 K=7168); else the least padding with which it reads the quantizer's buffers as they
  are."""
  decode_rows = gemm.MOSAIC_DECODE_ROWS
  if 0 < m < decode_rows and gemm.mosaic_unsupported_reason(decode_rows, n, k, block_size) is None:
    return decode_rows
  for alignment in (1, 4, _MOSAIC_TMA_ROWS):
    rows = _checks.round_up(m, alignment)
    tma_ok = rows % _MOSAIC_TMA_ROWS == 0 or rows < _MOSAIC_TMA_ROWS
    if rows and tma_ok and gemm.mosaic_unsupported_reason(rows, n, k, block_size) is None:
      return alignment
  return _MOSAIC_TMA_ROWS


def _check_quant_implementation(name: str, capability, interpret: bool) -> None:
  if name not in quant.IMPLEMENTATIONS:
    raise ValueError(f"quant_implementation must be one of {quant.IMPLEMENTATIONS} or None, got {name!r}")
  where = f"the default device is {gemm._device_kind()!r}"
  if name == "mosaic":
    if not interpret and (capability is None or capability[0] != 9):
      raise ValueError(f"quant_implementation='mosaic' needs a Hopper (sm_90) GPU, but {where}; "
                       "pass interpret=True to simulate it")
    if error := _quant_mosaic_error():
      raise ValueError(f"quant_implementation='mosaic' is not available: {_QUANT_MOSAIC_MODULE} cannot be imported "
                       f"({error})")
  if name == "triton" and not interpret and (capability is None or capability < (8, 9)):
    raise ValueError(f"quant_implementation='triton' needs an NVIDIA GPU with sm >= 8.9, but {where}; "
                     "pass interpret=True to simulate it")


@dataclasses.dataclass(frozen=True)
class _Options:
  """What the caller asked for, besides the arrays (hashable: part of the executable cache key)."""
  implementation: str | None = None
  quant_implementation: str | None = None
  row_alignment: int | None = None
  config: Any = None
  interpret: bool | None = None

  def __post_init__(self):
    object.__setattr__(self, "interpret", _checks.interpret(self.interpret))


def _plan(m: int, n: int, k: int, block_size: tuple[int, int], out_dtype, options: _Options) -> LinearPlan:
  interpret = gemm._resolve_interpret(options.interpret)
  capability = gemm._capability()
  # The rows the Mosaic GEMM would see (>= 8: the quantizer pads), so that alignment never decides against Mosaic; the
  # live rows decide only the decode rule (gemm.TRITON_DECODE_MAX_M).
  m_live = max(m, 1)
  m_rows = max(_checks.round_up(m_live, _MOSAIC_TMA_ROWS), _MOSAIC_TMA_ROWS)
  implementation = options.implementation
  if implementation == "mosaic" and (why := gemm.mosaic_unsupported_reason(m_rows, n, k, block_size)):
    raise ValueError(f"implementation='mosaic' cannot run a linear with N={n}, K={k}, block_size={block_size}: {why}; "
                     "use implementation='triton' or 'xla' (or None to choose)")
  resolved = gemm.resolve_implementation(
      implementation, config=options.config, interpret=interpret, m=m_rows, n=n, k=k, block_size=block_size,
      live_rows=m_live)
  if implementation is not None:
    reason = f"implementation={implementation!r} was asked for"
  elif options.config is not None:
    reason = f"a {type(options.config).__name__} was given"
  else:
    reason = _default_reason(resolved, capability, interpret, m_rows, n, k, block_size, m_live)
  if resolved == "xla" and options.config is not None:
    raise ValueError(f"config applies to the 'triton' and 'mosaic' implementations, not 'xla'; got {options.config!r}")

  quant_implementation = options.quant_implementation
  if quant_implementation is None:
    # Each family quantizes with its own kernel; Mosaic falls back to the Triton quantizer if its own is missing.
    quant_implementation = resolved
    if resolved == "mosaic" and _quant_mosaic_error() is not None:
      quant_implementation = "triton"
  else:
    _check_quant_implementation(quant_implementation, capability, interpret)

  if options.row_alignment is not None:
    row_alignment = _checks.positive_int("row_alignment", options.row_alignment)
  elif resolved == "mosaic":
    row_alignment = _mosaic_row_alignment(m, n, k, block_size)
  else:
    row_alignment = 1  # the Triton kernel masks partial tiles; XLA needs nothing
  scale_layout = "row" if resolved == "xla" else "col"
  return LinearPlan(m=m, n=n, k=k, block_size=block_size, out_dtype=jnp.dtype(out_dtype).name,
                    implementation=resolved, quant_implementation=quant_implementation, row_alignment=row_alignment,
                    scale_layout=scale_layout, interpret=interpret, reason=reason, config=options.config)


# ---- validation ----------------------------------------------------------------------------------------------------

def _validate(x, w_q, w_s, bias, block_size, out_dtype) -> tuple[tuple[int, int], jnp.dtype]:
  """Checks the arguments of a linear call; returns (block_size, out_dtype)."""
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"x must be an array, got {type(x).__name__}")
  if jnp.dtype(x.dtype) not in INPUT_DTYPES:
    raise TypeError(f"x must be bfloat16, float16 or float32, got dtype {x.dtype}")
  if len(x.shape) < 1:
    raise ValueError(f"x must have at least 1 dimension (..., K), got shape {tuple(x.shape)}")
  _checks.array("w_q", w_q, (FP8,))
  _checks.array("w_s", w_s, (F32,))
  gn, gk = _checks.block_size(block_size)
  n, k = w_q.shape
  if x.shape[-1] != k:
    raise ValueError(f"x (..., K) and w_q (N, K) must share K: x has shape {tuple(x.shape)}, "
                     f"w_q has shape {tuple(w_q.shape)}")
  if k % gk:
    raise ValueError(f"K={k} must be a multiple of block_size[1]={gk}: activations are quantized in groups of gk")
  expected = (-(-n // gn), -(-k // gk))
  if tuple(w_s.shape) != expected:
    raise ValueError(f"w_s must have shape (ceil(N/gn), ceil(K/gk)) = {expected} for N={n}, K={k}, "
                     f"block_size={(gn, gk)}; got {tuple(w_s.shape)}")
  if bias is not None:
    _checks.array("bias", bias, OUT_DTYPES, ndim=None)
    if tuple(bias.shape) != (n,):
      raise ValueError(f"bias must have shape (N,) = ({n},), got {tuple(bias.shape)}")
  out_dtype = jnp.dtype(x.dtype) if out_dtype is None else _checks.float_dtype("out_dtype", out_dtype)
  return (gn, gk), out_dtype


def _as_device_array(a):
  """NumPy arrays go to the default device (`jax.device_put`: a transfer; `jnp.asarray` would compile a staging
  function per shape); JAX arrays and tracers stay as they are."""
  if a is None or isinstance(a, (jax.Array, jax.core.Tracer)):
    return a
  return jax.device_put(np.asarray(a))


def _explicitly_sharded_axes(a) -> tuple[str, ...]:
  """Mesh axes of the Explicit type that array `a` is typed as sharded over (none for NumPy / unsharded arrays)."""
  if a is None or isinstance(a, np.ndarray):
    return ()
  try:
    sharding = jax.typeof(a).sharding
  except Exception:  # not a JAX value
    return ()
  mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
  if mesh is None or spec is None:
    return ()
  types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ())))
  names = [name for entry in spec if entry is not None for name in (entry if isinstance(entry, tuple) else (entry,))]
  return tuple(name for name in names if types.get(name) == jax.sharding.AxisType.Explicit)


def _check_not_explicitly_sharded(**arrays) -> None:
  for name, a in arrays.items():
    if axes := _explicitly_sharded_axes(a):
      raise ValueError(
          f"{name} is sharded over the Explicit mesh axes {axes} ({jax.typeof(a).sharding.spec}); the FP8 kernels "
          "run on whole per-device arrays: use column_parallel_linear / row_parallel_linear, your own jax.shard_map, "
          "or jax.reshard the operands to replicated")


def _is_traced(*arrays) -> bool:
  return any(isinstance(a, jax.core.Tracer) for a in arrays)


def explain(
    x, w_q, block_size: tuple[int, int], *, out_dtype=None, implementation: str | None = None,
    quant_implementation: str | None = None, row_alignment: int | None = None, config=None,
    interpret: bool | None = None,
) -> LinearPlan:
  """Which path `w8a8_block_fp8_linear` takes for these arguments here, and why (traced calls; eager calls use the
  plan of their row bucket). x and w_q may be arrays or `jax.ShapeDtypeStruct`s. Raises what the call would raise
  for an implementation that cannot run."""
  for name, a in (("x", x), ("w_q", w_q)):
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
      raise TypeError(f"{name} must be an array or a jax.ShapeDtypeStruct, got {type(a).__name__}")
  block_size = _checks.block_size(block_size)
  w_s = jax.ShapeDtypeStruct((-(-w_q.shape[0] // block_size[0]), -(-w_q.shape[1] // block_size[1])), F32)
  block_size, out_dtype = _validate(x, w_q, w_s, None, block_size, out_dtype)
  options = _Options(implementation, quant_implementation, row_alignment, config, interpret)
  return _plan(math.prod(x.shape[:-1]), w_q.shape[0], w_q.shape[1], block_size, out_dtype, options)


# ---- the traced computation ----------------------------------------------------------------------------------------

def _apply(x, w_q, w_s, bias, plan: LinearPlan):
  """Quantize (into the GEMM's buffers, padded by the quantizer itself), GEMM, live rows, (..., N). Traceable."""
  lead = tuple(x.shape[:-1])
  k = x.shape[-1]
  m = math.prod(lead)
  n = w_q.shape[0]
  col = plan.scale_layout == "col"
  q, s = quant._quantize(
      jnp.reshape(x, (1, m, k)), None, group_size=plan.block_size[1], eps=EPS, row_alignment=plan.row_alignment,
      scale_layout=plan.scale_layout, scale_tma_aligned=col, scale_ue8m0=False, fuse_silu_and_mul=False,
      implementation=plan.quant_implementation, interpret=plan.interpret, config=None)
  out = gemm.w8a8_block_fp8_matmul(
      q, w_q, s, w_s, plan.block_size, a_s_column_major=col, out_dtype=plan.out_dtype, bias=bias,
      implementation=plan.implementation, config=plan.config, interpret=plan.interpret, out_rows=plan.gemm_out_rows)
  return out.reshape(*lead, n)


# ---- eager calls: row buckets and the executable cache ---------------------------------------------------------------

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


def _rows_to_bucket(x, rows: int):
  """x (..., K) as (rows, K) with zero rows appended."""
  if isinstance(x, np.ndarray):
    x2 = x.reshape(-1, x.shape[-1])
    return jax.device_put(np.pad(x2, ((0, rows - x2.shape[0]), (0, 0))))
  if x.ndim == 2 and x.shape[0] == rows:
    return x
  return _rows_to_bucket_jit(x, rows=rows)


def _rows_from_bucket(out, lead: tuple[int, ...]):
  if len(lead) == 1 and out.shape[0] == lead[0]:
    return out
  return _rows_from_bucket_jit(out, lead=lead)


def _empty_output(x, lead, n, out_dtype):
  """(..., N) with no rows: made on the host and transferred, so it compiles nothing."""
  empty = np.zeros((*lead, n), out_dtype)
  devices = getattr(x, "devices", None)
  return jax.device_put(empty, next(iter(devices())) if devices else None)


def _run_eager(name: str, key, make_body: Callable[[int], Callable], x, rest: tuple, n: int, out_dtype,
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


def _named(fn: Callable, name: str) -> Callable:
  """fn under a fixed name: the name XLA compilations of it are logged and monitored under."""
  def body(*args):
    return fn(*args)
  body.__name__ = body.__qualname__ = name
  return body


# ---- the public linear -------------------------------------------------------------------------------------------

def w8a8_block_fp8_linear(
    x: jax.Array,
    w_q: jax.Array,
    w_s: jax.Array,
    block_size: tuple[int, int],
    bias: jax.Array | None = None,
    *,
    out_dtype=None,
    implementation: str | None = None,
    quant_implementation: str | None = None,
    row_alignment: int | None = None,
    config=None,
    interpret: bool | None = None,
) -> jax.Array:
  """y = quantize(x) @ (w_q * w_s)^T + bias, with block-FP8 activations and weights (SPEC.md section 3).

  Args:
    x: (..., K) bfloat16, float16 or float32 activations; K a multiple of block_size[1].
    w_q: (N, K) float8_e4m3fn weight (the Hugging Face `weight`).
    w_s: (ceil(N/gn), ceil(K/gk)) float32 weight block scales (`weight_scale_inv`).
    block_size: (gn, gk) of the weight scales; gk is also the activations' group size.
    bias: optional (N,) bfloat16, float16 or float32, added in float32 before the output cast.
    out_dtype: the output dtype (bfloat16, float16 or float32); None: x.dtype.
    implementation: the GEMM, "mosaic", "triton", "xla", or None for the best one here (see the module docstring and
      `explain`).
    quant_implementation: the activation quantizer; None: the GEMM's family (Mosaic, Triton or XLA).
    row_alignment: pad the quantized rows to a multiple of this; None: what the GEMM needs (see `explain`).
    config: a GEMM config (TritonGemmConfig or the Mosaic kernel's); None: the GEMM's table or heuristic.
    interpret: run Pallas kernels in interpret mode; None: when there is no GPU.

  Returns:
    (..., N) in out_dtype (x.dtype by default).

  Eager calls pad M to a row bucket and reuse one compiled executable per bucket (`cache_info()`); inside `jax.jit`
  the call is traced inline and compiles nothing of its own.
  """
  block_size, out_dtype = _validate(x, w_q, w_s, bias, block_size, out_dtype)
  _check_not_explicitly_sharded(x=x, w_q=w_q, w_s=w_s, bias=bias)
  w_q, w_s, bias = (_as_device_array(a) for a in (w_q, w_s, bias))
  options = _Options(implementation, quant_implementation, row_alignment, config, interpret)
  n, k = w_q.shape
  if _is_traced(x, w_q, w_s, bias):
    plan = _plan(math.prod(x.shape[:-1]), n, k, block_size, out_dtype, options)
    return _apply(x, w_q, w_s, bias, plan)
  if not isinstance(x, (np.ndarray, jax.Array)):
    x = np.asarray(x)
  # Plan (and refuse) before padding anything; the executable is planned for its bucket.
  _plan(max(get_row_buckets().bucket(math.prod(x.shape[:-1])), 1), n, k, block_size, out_dtype, options)

  def make_body(bucket: int):
    plan = _plan(bucket, n, k, block_size, out_dtype, options)
    return _named(lambda x2, wq, ws, b: _apply(x2, wq, ws, b, plan), "jaxfp8_linear_bucket")

  key = (block_size, out_dtype.name, options)
  return _run_eager("linear", key, make_body, x, (w_q, w_s, bias), n, out_dtype)


# ---- sharding ------------------------------------------------------------------------------------------------------

PARALLEL_MODES = ("column", "row")


def _axis_size(mesh, axis_name: str) -> int:
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh; its axes are {mesh.axis_names}")
  return int(mesh.shape[axis_name])


def weight_spec(parallel: str, axis_name: str, field: str) -> PartitionSpec:
  """The PartitionSpec of a weight array ("w_q", "w_s" or "bias") for column- or row-parallel use."""
  if parallel not in PARALLEL_MODES:
    raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
  if field not in ("w_q", "w_s", "bias"):
    raise ValueError(f"field must be 'w_q', 'w_s' or 'bias', got {field!r}")
  if parallel == "column":  # N split: weight rows, scale rows, bias entries
    return PartitionSpec(axis_name) if field == "bias" else PartitionSpec(axis_name, None)
  return PartitionSpec() if field == "bias" else PartitionSpec(None, axis_name)  # K split; the bias is added once


def weight_sharding(mesh, axis_name: str, parallel: str, field: str) -> NamedSharding:
  """NamedSharding of a weight array for `column_parallel_linear` / `row_parallel_linear` (usable as the `sharding`
  callable of `jaxfp8.weights.load_hf_fp8_linears`: `lambda prefix, field, shape: weight_sharding(mesh, "tp",
  "column", field)`)."""
  _axis_size(mesh, axis_name)
  return NamedSharding(mesh, weight_spec(parallel, axis_name, field))


def shard_linear_weights(w_q, w_s, bias=None, *, mesh, axis_name: str, parallel: str):
  """Places (w_q, w_s, bias) on the mesh as `parallel` ("column" or "row") use wants them; returns the placed arrays."""
  placed = [None if a is None else jax.device_put(a, weight_sharding(mesh, axis_name, parallel, field))
            for field, a in (("w_q", w_q), ("w_s", w_s), ("bias", bias))]
  return tuple(placed)


def _has_explicit_axes(mesh) -> bool:
  return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _specs(parallel: str, ndim: int, has_bias: bool, axis_name: str):
  """(in_specs, out_spec) of the shard_map-ped linear for x of `ndim` dimensions."""
  lead = (None,) * (ndim - 1)
  if parallel == "column":
    x_spec, out_spec = PartitionSpec(), PartitionSpec(*lead, axis_name)
  else:
    x_spec, out_spec = PartitionSpec(*lead, axis_name), PartitionSpec()
  in_specs = (x_spec, weight_spec(parallel, axis_name, "w_q"), weight_spec(parallel, axis_name, "w_s"))
  if has_bias:
    in_specs += (weight_spec(parallel, axis_name, "bias"),)
  return in_specs, out_spec


def _parallel_fn(parallel: str, ndim: int, has_bias: bool, *, mesh, axis_name: str, block_size, out_dtype,
                 gather_output: bool, options: _Options) -> Callable:
  """The shard_map-ped linear for x of `ndim` dimensions (traceable)."""
  linear_kwargs = dict(implementation=options.implementation, quant_implementation=options.quant_implementation,
                       row_alignment=options.row_alignment, config=options.config, interpret=options.interpret)

  if parallel == "column":
    def per_shard(x, w_q, w_s, *bias):
      return w8a8_block_fp8_linear(x, w_q, w_s, block_size, *bias, out_dtype=out_dtype, **linear_kwargs)
  else:
    def per_shard(x, w_q, w_s, *bias):
      # float32 partial sums over this device's K slice, summed over the axis, then the bias once and the cast.
      partial = w8a8_block_fp8_linear(x, w_q, w_s, block_size, out_dtype=jnp.float32, **linear_kwargs)
      y = jax.lax.psum(partial, axis_name)
      if bias:
        y = y + bias[0].astype(jnp.float32)
      return y.astype(out_dtype)
  in_specs, out_spec = _specs(parallel, ndim, has_bias, axis_name)
  # check_vma=False: the Pallas launchers declare their outputs with plain ShapeDtypeStructs, which carry no
  # varying-manual-axes type; the specs above say how each value varies (the row-parallel output is psum-ed).
  mapped = jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)
  explicit = _has_explicit_axes(mesh)

  def call(*args):
    if explicit:  # arrays typed with Explicit mesh axes must already have the specs shard_map is given
      args = [jax.reshard(a, NamedSharding(mesh, spec)) for a, spec in zip(args, in_specs)]
    y = mapped(*args)
    if gather_output:  # replicating the N-sharded output: an all-gather
      replicated = NamedSharding(mesh, PartitionSpec())
      y = jax.reshard(y, replicated) if explicit else jax.lax.with_sharding_constraint(y, replicated)
    return y

  return call


def _parallel_linear(parallel: str, x, w_q, w_s, block_size, bias, *, mesh, axis_name, gather_output, out_dtype,
                     options: _Options):
  block_size, out_dtype = _validate(x, w_q, w_s, bias, block_size, out_dtype)
  devices = _axis_size(mesh, axis_name)
  n, k = w_q.shape
  gn, gk = block_size
  if parallel == "column" and (n % devices or (n // devices) % gn):
    raise ValueError(f"column-parallel use splits N={n} over the {devices} devices of mesh axis {axis_name!r}: each "
                     f"share must be whole weight-scale blocks (a multiple of gn={gn}), but N / {devices} = "
                     f"{n / devices:g}")
  if parallel == "row" and (k % devices or (k // devices) % gk):
    raise ValueError(f"row-parallel use splits K={k} over the {devices} devices of mesh axis {axis_name!r}: each "
                     f"share must be whole scale groups (a multiple of gk={gk}), but K / {devices} = {k / devices:g}")
  fn_kwargs = dict(mesh=mesh, axis_name=axis_name, block_size=block_size, out_dtype=out_dtype,
                   gather_output=gather_output, options=options)
  if _is_traced(x, w_q, w_s, bias):
    rest = tuple(_as_device_array(a) for a in (w_q, w_s, bias) if a is not None)
    return _parallel_fn(parallel, len(x.shape), bias is not None, **fn_kwargs)(x, *rest)

  # Eager: every operand goes to the mesh with the sharding the shard_map wants (a transfer, or nothing when it is
  # there already), so that the executable of a bucket always sees the same input shardings.
  in_specs, _ = _specs(parallel, 2, bias is not None, axis_name)
  rest = tuple(jax.device_put(a, NamedSharding(mesh, spec))
               for a, spec in zip([w_q, w_s] + ([bias] if bias is not None else []), in_specs[1:]))
  if not isinstance(x, (np.ndarray, jax.Array)):
    x = np.asarray(x)
  x_sharding = NamedSharding(mesh, in_specs[0])

  def make_body(bucket: int):
    del bucket  # each device plans its own shard when the body is traced
    return _named(_parallel_fn(parallel, 2, bias is not None, **fn_kwargs), f"jaxfp8_{parallel}_parallel_bucket")

  key = (mesh, axis_name, gather_output, block_size, out_dtype.name, options)
  return _run_eager(f"{parallel}_parallel_linear", key, make_body, x, rest, n, out_dtype,
                    place_rows=lambda x_rows: jax.device_put(x_rows, x_sharding))


def column_parallel_linear(
    x, w_q, w_s, block_size: tuple[int, int], bias=None, *, mesh: jax.sharding.Mesh, axis_name: str,
    gather_output: bool = False, out_dtype=None, implementation: str | None = None,
    quant_implementation: str | None = None, row_alignment: int | None = None, config=None,
    interpret: bool | None = None,
) -> jax.Array:
  """The linear with N split over mesh axis `axis_name` (`jax.shard_map`).

  Every device quantizes the whole (replicated) x and multiplies it by its N/P rows of the weight (w_q, w_s and bias
  sharded along N: `weight_sharding(mesh, axis_name, "column", field)`); N/P must be a multiple of gn. The output
  (..., N) is sharded along its last axis, or all-gathered with gather_output=True. Other arguments as in
  `w8a8_block_fp8_linear`; results equal the unsharded call's bit for bit when every shard runs the same kernels.
  """
  options = _Options(implementation, quant_implementation, row_alignment, config, interpret)
  return _parallel_linear("column", x, w_q, w_s, block_size, bias, mesh=mesh, axis_name=axis_name,
                          gather_output=gather_output, out_dtype=out_dtype, options=options)


def row_parallel_linear(
    x, w_q, w_s, block_size: tuple[int, int], bias=None, *, mesh: jax.sharding.Mesh, axis_name: str,
    out_dtype=None, implementation: str | None = None, quant_implementation: str | None = None,
    row_alignment: int | None = None, config=None, interpret: bool | None = None,
) -> jax.Array:
  """The linear with K split over mesh axis `axis_name` (`jax.shard_map`), as after a column-parallel layer.

  x (..., K) is sharded along K and w_q, w_s along their K axis (`weight_sharding(mesh, axis_name, "row", field)`);
  K/P must be a multiple of gk, so every device's groups are exactly the unsharded call's groups and its
  quantization is the same. Each device computes float32 partial outputs over its K slice; `psum` adds them, then the
  (replicated) bias is added once and the result cast. The output is replicated. It differs from the unsharded call
  only by the float32 summation order of the K slices.
  """
  options = _Options(implementation, quant_implementation, row_alignment, config, interpret)
  return _parallel_linear("row", x, w_q, w_s, block_size, bias, mesh=mesh, axis_name=axis_name,
                          gather_output=False, out_dtype=out_dtype, options=options)


__all__ = [
    "w8a8_block_fp8_linear", "explain", "LinearPlan", "RowBuckets", "get_row_buckets", "set_row_buckets",
    "row_buckets", "pad_to_bucket", "cache_info", "cache_clear", "CacheInfo", "column_parallel_linear",
    "row_parallel_linear", "weight_spec", "weight_sharding", "shard_linear_weights", "IMPLEMENTATIONS",
]
