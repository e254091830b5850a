"""Shared comparison of a quantizer's output with the reference (SPEC.md section 1 tolerances)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from jaxfp8 import reference as ref

INPUT_DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}


def random_activations(rng: np.random.Generator, shape, dtype, *, spread: bool = True) -> np.ndarray:
  """Normal data whose rows span several orders of magnitude (so scales differ per group), never all zeros."""
  x = rng.standard_normal(shape).astype(np.float32)
  if spread:
    x *= np.exp2(rng.integers(-6, 8, size=shape[:-1] + (1,))).astype(np.float32)
  return x.astype(dtype)


def scales_bits(s) -> np.ndarray:
  s = np.asarray(s)
  return s.view(np.uint32) if s.dtype == np.float32 else s.astype(np.int64)


def assert_matches_reference(q, s, ref_q, ref_s, *, exact_codes: bool, scale_ulps: int = 0, context: str = ""):
  """Shapes equal; scales bit-exact (or within `scale_ulps` float32 ulps); codes within one fp8 step on at most
  1e-4 of the elements (exact when `exact_codes`); pad rows are part of the comparison."""
  q = np.asarray(q)
  s = np.asarray(s)
  assert q.dtype == ref.FP8, f"{context}: q dtype {q.dtype}"
  assert q.shape == ref_q.shape, f"{context}: q shape {q.shape} != reference {ref_q.shape}"
  assert s.shape == ref_s.shape, f"{context}: s shape {s.shape} != reference {ref_s.shape}"
  assert s.dtype == ref_s.dtype, f"{context}: s dtype {s.dtype} != reference {ref_s.dtype}"
  if scale_ulps == 0 or s.dtype != np.float32:
    bad = scales_bits(s) != scales_bits(ref_s)
    nan_both = np.isnan(s) & np.isnan(ref_s) if s.dtype == np.float32 else np.zeros_like(bad)
    bad &= ~nan_both
    assert not bad.any(), (
        f"{context}: {bad.sum()} of {bad.size} scales differ, first at {np.argwhere(bad)[0]}: "
        f"{s[tuple(np.argwhere(bad)[0])]} vs reference {ref_s[tuple(np.argwhere(bad)[0])]}")
  else:
    ordinal = lambda v: v.view(np.int32).astype(np.int64)
    both_nan = np.isnan(s) & np.isnan(ref_s)
    dist = np.where(both_nan, 0, np.abs(ordinal(s) - ordinal(ref_s)))
    assert (np.isnan(s) == np.isnan(ref_s)).all(), f"{context}: NaN scales differ"
    assert dist.max(initial=0) <= scale_ulps, f"{context}: scales differ by {dist.max()} ulps"
  dist = ref.fp8_code_distance(q, ref_q)
  if exact_codes:
    assert not dist.any(), f"{context}: {np.count_nonzero(dist)} codes differ (max {dist.max()} steps), must be exact"
  else:
    assert dist.max(initial=0) <= 1, f"{context}: codes differ by up to {dist.max()} fp8 steps"
    allowed = math.ceil(1e-4 * dist.size)
    assert np.count_nonzero(dist) <= allowed, f"{context}: {np.count_nonzero(dist)} codes off by one step (> {allowed})"
