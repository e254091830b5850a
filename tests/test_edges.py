"""Edges where an earlier version answered silently wrong or with a bare error: each test here failed on it.

Extreme eps, scales at both ends of float32's range, float16 subnormals through the fused SiLU, caller-given GEMM
scales near 1e36, out-of-range axes, traced static arguments, configs of the wrong type. Checkpoint and Flax edges
live in tests/test_weights.py and tests/test_nn.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jaxfp8
from helpers import assert_matches_reference
from jaxfp8 import _checks, linear
from jaxfp8 import reference as ref

IMPLEMENTATIONS = ["xla", "triton", "mosaic"]


def _interpret(implementation):
  return None if implementation == "xla" else not helpers.ON_GPU


# ---- eps --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("eps", [5e-36, 1e-50, 1e-45, 4e-33])
def test_an_eps_whose_scale_is_too_small_is_refused(eps):
  x = jnp.zeros((2, 128), jnp.float32)
  with pytest.raises(ValueError, match=rf"eps must be at least 5.39\d*e-33.*got {eps!r}"):
    jaxfp8.per_token_group_quant_fp8(x, 128, eps=eps)
  with pytest.raises(ValueError, match="eps must be at least"):
    jaxfp8.quantize_weight_blockwise(jnp.zeros((128, 128), jnp.float32), eps=eps)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_the_smallest_eps_gives_finite_scales_and_exact_codes(implementation, rng):
  """At the smallest eps an all-zero group's scale is 2**-116-ish, never 0, and subnormal inputs quantize to 0."""
  helpers.runnable(implementation)
  x = np.zeros((3, 256), np.float32)
  x[1, :128] = np.float32(1e-40)  # float32 subnormals, which some hardware flushes to zero
  x[2] = rng.standard_normal(256).astype(np.float32) * np.float32(1e-30)
  options = dict(eps=_checks.MIN_EPS, implementation=implementation, interpret=_interpret(implementation))
  q, s = jaxfp8.per_token_group_quant_fp8(jnp.asarray(x), 128, **options)
  ref_q, ref_s = ref.per_token_group_quant_fp8(x, 128, eps=_checks.MIN_EPS)
  assert np.isfinite(np.asarray(s)).all() and (np.asarray(s) > 0).all()
  assert_matches_reference(q, s, ref_q, ref_s, exact_codes=helpers.exact_codes(implementation))
  w_q, w_s = jaxfp8.quantize_weight_blockwise(jnp.zeros((128, 128), jnp.float32), eps=_checks.MIN_EPS)
  assert np.isfinite(np.asarray(w_s)).all() and not np.isnan(np.asarray(w_q).astype(np.float32)).any()


# ---- scales across float32's range --------------------------------------------------------------------------------

def _assert_codes_exact_but_subnormals(q, ref_q, x):
  """Codes exact, a zero's sign aside, except that a float32-subnormal input may be one step off (docs/CONTRACT.md
  §1: hardware that flushes subnormals, XLA's CPU included, reads it as 0, which matters where the group's scale is
  below 2**-116)."""
  dist = ref.fp8_code_distance(np.asarray(q), ref_q)
  subnormal = np.abs(x) < np.finfo(np.float32).tiny
  assert not dist[~subnormal].any(), f"{np.count_nonzero(dist[~subnormal])} codes of normal inputs differ"
  assert dist.max(initial=0) <= 1


@pytest.mark.parametrize("exponent", [-110, -60, 30, 105, 110, 120])
def test_codes_are_exact_at_any_scale(exponent, rng):
  """Groups whose scale is near either end of float32: the correctly rounded quotient everywhere (the division used
  to fall back to a reciprocal multiply for scales >= 1e30, leaving 12-14% of such codes one step off)."""
  x = (rng.standard_normal((64, 512)) * np.exp2(np.float64(exponent))).astype(np.float32)
  q, s = jaxfp8.per_token_group_quant_fp8(jnp.asarray(x), 128, implementation="xla")
  ref_q, ref_s = ref.per_token_group_quant_fp8(x, 128)
  np.testing.assert_array_equal(np.asarray(s).view(np.uint32), ref_s.view(np.uint32))
  _assert_codes_exact_but_subnormals(q, ref_q, x)
  w_q, w_s = jaxfp8.quantize_weight_blockwise(jnp.asarray(x[:, :256]), (32, 128))
  ref_wq, ref_ws = ref.quantize_weight_blockwise(x[:, :256], (32, 128))
  np.testing.assert_array_equal(np.asarray(w_s).view(np.uint32), ref_ws.view(np.uint32))
  _assert_codes_exact_but_subnormals(w_q, ref_wq, x[:, :256])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fused_silu_of_float16_subnormals_is_exact(implementation, rng):
  """silu(gate) * up in float16's subnormal range (gate in [-20, -8]): rounded to float16 subnormals like the
  reference (the XLA path's rounding idiom was folded away, 45 of 256 codes off), and a negative zero stays -0."""
  helpers.runnable(implementation)
  gate = rng.uniform(-20, -8, (4, 256)).astype(np.float16)
  up = rng.uniform(-3, 3, (4, 256)).astype(np.float16)
  up[0, :8] = -0.0  # products that are exactly -0
  x = np.concatenate([gate, up], axis=1)
  q, s = jaxfp8.per_token_group_quant_fp8(jnp.asarray(x), 128, fuse_silu_and_mul=True, eps=1e-30,
                                          implementation=implementation, interpret=_interpret(implementation))
  ref_q, ref_s = ref.per_token_group_quant_fp8(x, 128, fuse_silu_and_mul=True, eps=1e-30)
  v = ref.silu_and_mul(x)
  assert (np.abs(v[np.isfinite(v) & (v != 0)]) < np.finfo(np.float16).smallest_normal).mean() > 0.3
  # exp() differs between math libraries by an ulp (docs/CONTRACT.md §1); XLA's on this CPU is NumPy's here.
  exact = implementation == "xla" or not helpers.ON_GPU
  assert_matches_reference(q, s, ref_q, ref_s, exact_codes=exact, scale_ulps=0 if exact else 2)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gemm_with_scales_near_the_float32_limit_is_finite(implementation, rng):
  """a_s near 1e36 with b_s near 1e-36: the exact result is ordinary, and so is every implementation's (the XLA GEMM
  used to multiply the codes by their scales first, overflowing to inf)."""
  helpers.runnable(implementation)
  m, n, k = 8, 256, 256
  a_q = np.clip(rng.standard_normal((m, k)) * 100, -448, 448).astype(ref.FP8)
  b_q = np.clip(rng.standard_normal((n, k)) * 100, -448, 448).astype(ref.FP8)
  a_s = (np.exp2(rng.uniform(118, 120, (m, 2)))).astype(np.float32)   # up to 1.3e36
  b_s = (np.exp2(rng.uniform(-122, -120, (2, 2)))).astype(np.float32)
  out = jaxfp8.w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, (128, 128), out_dtype=jnp.float32,
                                     implementation=implementation, interpret=_interpret(implementation))
  want = ref.block_fp8_matmul(a_q, b_q, a_s, b_s, (128, 128))
  assert np.isfinite(np.asarray(out)).all()
  assert ref.relative_error(np.asarray(out), want) <= 2e-4


# ---- arguments that used to pass through ----------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [5, 3, -4, 1.0, True])
def test_pad_to_bucket_refuses_an_axis_out_of_range(axis):
  x = np.ones((3, 5, 7), np.float32)
  with pytest.raises(ValueError, match=r"axis must be an int in \[-3, 3\) for x of shape \(3, 5, 7\)"):
    linear.pad_to_bucket(x, axis=axis)


@pytest.mark.parametrize("axis, padded", [(0, (4, 5, 7)), (1, (3, 8, 7)), (-1, (3, 5, 8)), (-3, (4, 5, 7))])
def test_pad_to_bucket_pads_the_axis_asked_for(axis, padded):
  out, size = linear.pad_to_bucket(np.ones((3, 5, 7), np.float32), axis=axis)
  assert out.shape == padded and size == (3, 5, 7)[axis]


def test_pad_to_bucket_and_set_row_buckets_name_their_argument():
  with pytest.raises(ValueError, match="x must have at least one dimension to pad, got a scalar"):
    linear.pad_to_bucket(3.0)
  with pytest.raises(TypeError, match="buckets must be a RowBuckets, a sequence of row counts or None, got 5"):
    linear.set_row_buckets(5)
  with pytest.raises(TypeError, match="buckets must be a RowBuckets or None"):
    linear.pad_to_bucket(np.ones((3, 2)), buckets=(1, 2, 4))


def _weight(rng, n=256, k=256):
  return jaxfp8.quantize_weight_blockwise(jnp.asarray(rng.standard_normal((n, k)), jnp.float32))


def test_jit_over_block_size_says_it_must_be_static(rng):
  w_q, w_s = _weight(rng)
  x = jnp.ones((2, 256), jnp.bfloat16)
  with pytest.raises(TypeError, match="block_size must be static Python ints.*static_argnames"):
    jax.jit(jaxfp8.w8a8_block_fp8_linear)(x, w_q, w_s, (128, 128))
  out = jax.jit(jaxfp8.w8a8_block_fp8_linear, static_argnames="block_size")(x, w_q, w_s, block_size=(128, 128))
  assert out.shape == (2, 256)


def test_the_linear_takes_an_fp8_linear_weight(rng):
  w_q, w_s = _weight(rng)
  bias = jnp.asarray(rng.standard_normal(256), jnp.float32)
  weight = jaxfp8.Fp8LinearWeight(w_q, w_s, bias, (128, 128))
  x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
  want = jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), bias)
  np.testing.assert_array_equal(np.asarray(jaxfp8.w8a8_block_fp8_linear(x, weight)), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(jax.jit(jaxfp8.w8a8_block_fp8_linear)(x, weight)), np.asarray(want))
  with pytest.raises(TypeError, match=r"holds w_s, block_size, bias and w_q_t; do not also pass \['bias'\]"):
    jaxfp8.w8a8_block_fp8_linear(x, weight, bias=bias)
  with pytest.raises(TypeError, match="needs w_q, w_s and block_size"):
    jaxfp8.w8a8_block_fp8_linear(x, w_q)


def test_a_config_of_the_wrong_type_names_itself(rng):
  w_q, w_s = _weight(rng)
  x = jnp.ones((2, 256), jnp.bfloat16)
  with pytest.raises(TypeError, match="config must be a GEMM kernel config.*got dict"):
    jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), config={"block_m": 16})
  a_q, a_s = jaxfp8.per_token_group_quant_fp8(x, 128)
  with pytest.raises(TypeError, match="config must be a TritonGemmConfig or a MosaicGemmConfig, got dict"):
    jaxfp8.w8a8_block_fp8_matmul(a_q, w_q, a_s, w_s, (128, 128), config={"block_m": 16})
  with pytest.raises(TypeError, match="config must be a QuantTritonConfig or a QuantMosaicConfig, got dict"):
    jaxfp8.per_token_group_quant_fp8(x, 128, config={"block_rows": 4})
