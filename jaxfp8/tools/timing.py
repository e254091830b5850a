"""CUPTI kernel times: device time of the kernels a call launches, without launch gaps or Python dispatch.

JAX's `profiler.measure` jits what it is given, so it cannot time a PyTorch baseline; this module talks to the same
CUPTI hooks directly so that JAX kernels and torch kernels are timed the same way in one process.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax


def _cupti_ext():
  try:
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib
  except ImportError:
    mosaic_gpu_lib = None
  if mosaic_gpu_lib is None:
    raise RuntimeError("CUPTI kernel timing needs a GPU build of jaxlib (jax-cuda plugin)")
  return mosaic_gpu_lib._mosaic_gpu_ext


def kernel_records(
    run: Callable[[int], Any], *, iterations: int, sync: Callable[[Any], None] = jax.block_until_ready,
    warmup: int = 2,
) -> list[tuple[str, float]]:
  """Calls `run(i)` for i in range(iterations) under CUPTI; returns every kernel launched, as (name, microseconds).
  `sync` waits for what `run` returns.

  CUPTI records the kernels of every GPU of the process, and jaxlib's recorder keeps only each kernel's name and
  duration, not its device. With several GPUs the records of different devices interleave in the list, so only
  totals over all calls (or per kernel name) mean something there, not slices per call.
  """
  ext = _cupti_ext()
  for i in range(warmup):
    sync(run(i))
  ext._cupti_init()
  try:
    outputs = [run(i) for i in range(iterations)]
    for out in outputs:
      sync(out)
  finally:
    timings = ext._cupti_get_timings(True)
  if not timings:
    raise RuntimeError("no kernel was recorded")
  return [(name, ms * 1e3) for name, ms in timings]


def cupti_times_us(
    run: Callable[[int], Any], *, iterations: int, sync: Callable[[Any], None] = jax.block_until_ready,
    warmup: int = 2,
) -> list[float]:
  """Calls `run(i)` for i in range(iterations) under CUPTI; returns each call's summed kernel time in microseconds.

  `run` must launch the same kernels on every call, on one GPU (see `kernel_records` for several).
  """
  return _per_call_totals(kernel_records(run, iterations=iterations, sync=sync, warmup=warmup), iterations)


def _per_call_totals(records: list[tuple[str, float]], iterations: int) -> list[float]:
  if len(records) % iterations:
    raise RuntimeError(f"{len(records)} kernels recorded over {iterations} iterations: not the same kernels each call")
  per_call = len(records) // iterations
  return [sum(us for _, us in records[i * per_call:(i + 1) * per_call]) for i in range(iterations)]


def median_kernel_us(
    fn: Callable[..., Any], arg_sets: Sequence[tuple], *, iterations: int = 30,
    sync: Callable[[Any], None] = jax.block_until_ready,
) -> float:
  """Median CUPTI time of `fn(*args)`, rotating through `arg_sets` so that a small weight is not timed from L2."""
  times = cupti_times_us(lambda i: fn(*arg_sets[i % len(arg_sets)]), iterations=iterations, sync=sync)
  return statistics.median(times)


def median_kernel_us_by_name(
    fn: Callable[..., Any], arg_sets: Sequence[tuple], *, iterations: int = 30,
    sync: Callable[[Any], None] = jax.block_until_ready,
) -> tuple[float, dict[str, float]]:
  """`median_kernel_us` of `fn`, and beside it the median time of each kernel it launches, by kernel name (e.g. a
  split-K GEMM's Pallas kernel apart from XLA's reduction of its partials)."""
  records = kernel_records(lambda i: fn(*arg_sets[i % len(arg_sets)]), iterations=iterations, sync=sync)
  by_name: dict[str, list[float]] = {}
  for name, us in records:
    by_name.setdefault(name, []).append(us)
  return (statistics.median(_per_call_totals(records, iterations)),
          {name: statistics.median(times) for name, times in by_name.items()})


def kernel_breakdown(records: list[tuple[str, float]], iterations: int) -> list[dict]:
  """The kernels of `iterations` calls' records by name, most time first: launches and microseconds per call."""
  by_name: dict[str, list] = {}
  for name, us in records:
    entry = by_name.setdefault(name, [0, 0.0])
    entry[0] += 1
    entry[1] += us
  return [dict(name=name, launches_per_call=count / iterations, us_per_call=us / iterations)
          for name, (count, us) in sorted(by_name.items(), key=lambda item: -item[1][1])]


def median_kernel_us_and_kernels(
    fn: Callable[..., Any], arg_sets: Sequence[tuple], *, iterations: int = 30,
    sync: Callable[[Any], None] = jax.block_until_ready,
) -> tuple[float, list[dict]]:
  """`median_kernel_us` of `fn`, and its kernels (`kernel_breakdown`): where a step's time goes."""
  records = kernel_records(lambda i: fn(*arg_sets[i % len(arg_sets)]), iterations=iterations, sync=sync)
  return statistics.median(_per_call_totals(records, iterations)), kernel_breakdown(records, iterations)


def timed(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, iterations: int,
          timer: Callable[..., float] | None = None) -> tuple[float, list[dict] | None]:
  """(us, kernels): CUPTI's median and the kernels (`median_kernel_us_and_kernels`) when `timer` is None (a GPU),
  else `timer`'s time and None."""
  if timer is not None:
    return timer(fn, arg_sets, iterations=iterations), None
  return median_kernel_us_and_kernels(fn, arg_sets, iterations=iterations)


def kernel_names(fn: Callable[..., Any], args: tuple, *,
                 sync: Callable[[Any], None] = jax.block_until_ready) -> list[str]:
  """Names of the kernels one call of `fn(*args)` launches (to check that a timed call ran what we think)."""
  ext = _cupti_ext()
  sync(fn(*args))
  ext._cupti_init()
  try:
    sync(fn(*args))
  finally:
    timings = ext._cupti_get_timings(True)
  return [name for name, _ in timings]


def median_wall_us(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, iterations: int = 30,
                   sync: Callable[[Any], None] = jax.block_until_ready) -> float:
  """Median wall time of `fn(*args)` + sync, after one warm-up (compile) call: the CPU stand-in for CUPTI (it
  measures dispatch and host work too)."""
  sync(fn(*arg_sets[0]))
  times = []
  for i in range(iterations):
    start = time.perf_counter()
    sync(fn(*arg_sets[i % len(arg_sets)]))
    times.append((time.perf_counter() - start) * 1e6)
  return statistics.median(times)
