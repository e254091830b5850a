"""The checks of `python -m jaxfp8 tp`: each sharded output against the single-device one and the float64 reference.

  single          no NaN/Inf; relative Frobenius error vs the float64 reference (`jaxfp8.reference`) on sampled rows
                  and column blocks <= 5e-3 (docs/CONTRACT.md §2, bf16 output).
  column(_gather) the output sharded along N (replicated with gather); bit-identical to single (each device runs the
                  unsharded computation on its columns); vs the float64 reference <= 5e-3.
  row             the output replicated; no NaN/Inf; vs single <= 1e-3 (only the float32 summation order of the K
                  slices differs, which flips a few bf16 roundings by one ulp: far below 1e-3 in Frobenius norm); vs
                  the float64 reference <= 5e-3.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxfp8 import reference as ref
from jaxfp8.tools import results as results_io

BF16_BOUND = 5e-3            # docs/CONTRACT.md §2: relative Frobenius error of a bf16 output vs the float64 reference
ROW_VS_SINGLE_BOUND = 1e-3   # see the module docstring


@jax.jit
def _diff_stats(out, expected) -> dict:
  """How `out` differs from `expected` (same shape, dtype and device), computed on the device."""
  uint = {2: jnp.uint16, 4: jnp.uint32}[out.dtype.itemsize]
  o, e = out.astype(jnp.float32), expected.astype(jnp.float32)
  d = o - e
  differing = jax.lax.bitcast_convert_type(out, uint) != jax.lax.bitcast_convert_type(expected, uint)
  return dict(max_abs_diff=jnp.max(jnp.abs(d)), elements_differing=jnp.sum(differing),
              err_sq=jnp.sum(d * d), ref_sq=jnp.sum(e * e), nonfinite=jnp.sum(~jnp.isfinite(o)))


def compare(out: jax.Array, expected: jax.Array) -> dict:
  """max |out - expected|, bitwise-differing elements, relative Frobenius error (float32 sums) and NaN/Inf count of
  `out`, which is first copied to `expected`'s device (the sharded output onto device 0)."""
  stats = {key: float(v) for key, v in jax.device_get(_diff_stats(jax.device_put(out, expected.sharding),
                                                                  expected)).items()}
  err_sq, ref_sq = stats.pop("err_sq"), stats.pop("ref_sq")
  stats["rel_err"] = math.sqrt(err_sq / ref_sq) if ref_sq else math.sqrt(err_sq)
  stats["elements_differing"] = int(stats["elements_differing"])
  stats["nonfinite"] = int(stats["nonfinite"])
  return stats


def _check(checks: list[dict], name: str, value, bound, passed: bool, about: str) -> None:
  checks.append(dict(name=name, value=value, bound=bound, passed=bool(passed), about=about))


class Sample:
  """The float64 reference of one layer on sampled rows and whole column blocks (`results.sample_rows_and_blocks`).

  The weight's sampled rows are fetched to the host once per shape; per M only the sampled rows of x are."""

  def __init__(self, w_q, w_s, bias, block_size: tuple[int, int]):
    n = w_q.shape[0]
    gn = block_size[0]
    _, self.blocks = results_io.sample_rows_and_blocks(1, n, gn)
    self.cols = np.concatenate([np.arange(j * gn, min(n, (j + 1) * gn)) for j in self.blocks])
    self.w_q = np.asarray(w_q[jnp.asarray(self.cols)])
    self.w_s = np.asarray(w_s[jnp.asarray(self.blocks)])
    self.bias = np.asarray(bias)[self.cols]
    self.block_size = block_size

  def rel_err(self, out_on_device0: jax.Array, x: jax.Array, with_bias: bool) -> float:
    m = x.shape[0]
    rows, _ = results_io.sample_rows_and_blocks(m, 1, 1)
    x_rows = np.asarray(x[jnp.asarray(rows)])
    expected = ref.w8a8_block_fp8_linear(x_rows, self.w_q, self.w_s, self.block_size,
                                         bias=self.bias if with_bias else None)
    got = np.asarray(out_on_device0[jnp.asarray(rows)][:, jnp.asarray(self.cols)]).astype(np.float32)
    return ref.relative_error(got, expected)


def check_output(mode: str, out: jax.Array, single: jax.Array | None, mesh, sample: Sample, x: jax.Array,
                 with_bias: bool) -> tuple[list[dict], dict]:
  """The checks of one output (see the module docstring); returns (checks, measured differences vs single)."""
  checks: list[dict] = []
  if mode == "single":
    stats = compare(out, out)
    _check(checks, "finite", stats["nonfinite"], 0, stats["nonfinite"] == 0, "NaN/Inf outputs")
    on_device0 = out
    diffs = {}
  else:
    if mode == "column":
      want = NamedSharding(mesh, PartitionSpec(None, mesh.axis_names[0]))
      _check(checks, "sharded_along_n", str(out.sharding), str(want), out.sharding.is_equivalent_to(want, out.ndim),
             "the output stays sharded along N")
    else:
      _check(checks, "replicated", str(out.sharding), "fully replicated", out.sharding.is_fully_replicated,
             "the output is on every device")
    stats = compare(out, single)
    diffs = dict(max_abs_diff_vs_single=stats["max_abs_diff"], elements_differing_vs_single=stats["elements_differing"],
                 rel_err_vs_single=stats["rel_err"])
    if mode in ("column", "column_gather"):
      _check(checks, "bit_identical_to_single", stats["elements_differing"], 0, stats["elements_differing"] == 0,
             f"elements whose bits differ from the single-device output (max |diff| {stats['max_abs_diff']:.3g})")
    else:
      _check(checks, "finite", stats["nonfinite"], 0, stats["nonfinite"] == 0, "NaN/Inf outputs")
      _check(checks, "rel_err_vs_single", stats["rel_err"], ROW_VS_SINGLE_BOUND,
             stats["rel_err"] <= ROW_VS_SINGLE_BOUND,
             "relative Frobenius error vs the single-device output (float32 sum order of the K slices)")
    on_device0 = jax.device_put(out, single.sharding)
  err = sample.rel_err(on_device0, x, with_bias)
  _check(checks, "rel_err_vs_reference", err, BF16_BOUND, err <= BF16_BOUND,
         "relative Frobenius error vs the float64 reference on sampled rows and column blocks (docs/CONTRACT.md §2, "
         "bf16 out)")
  return checks, diffs
