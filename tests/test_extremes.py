"""docs/CONTRACT.md extremes: quantization of NaN, +-Inf, 1e-30, 1e30, subnormals and all-zero groups by every implementation
(exact scales, codes as the reference), and block GEMMs at +-448 with large K whose true result is finite but large
(the float32 accumulation must not overflow). On CPU the Pallas kernels are interpreted on small shapes; the
GPU-marked tests run the kernels natively at real sizes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import helpers

import jaxfp8
from jaxfp8 import _platform, reference as ref
from helpers import assert_matches_reference

ON_GPU = _platform.gpu_compute_capability() is not None
IMPLEMENTATIONS = ("xla", "triton", "mosaic")
G = 32
F32_SUBNORMAL = np.float32(1e-40)  # below float32's smallest normal (1.18e-38)



def extreme_rows(rng, rows: int, dtype) -> np.ndarray:
  """(rows, 9 * G): each row holds one group of each kind, in a row-dependent order, plus random values."""
  groups = []
  normal = rng.standard_normal(G).astype(np.float32)
  kinds = {
      "nan": np.where(np.arange(G) == 3, np.nan, normal),
      "+inf": np.where(np.arange(G) == 5, np.inf, normal),
      "-inf": np.where(np.arange(G) == 7, -np.inf, normal),
      "tiny": normal * np.float32(1e-30),          # amax below nothing: eps (1e-10) floors the scale
      "huge": normal * np.float32(1e30),           # scale ~ 1e30 / 448, codes as for normal data
      "subnormal": np.sign(normal) * F32_SUBNORMAL,
      "zero": np.zeros(G, np.float32),             # scale = eps * R, codes 0
      "max": np.where(np.arange(G) % 2, 3.0e38, -3.0e38),  # near float32's max: |x| / s stays finite
      "normal": normal,
  }
  names = list(kinds)
  for r in range(rows):
    order = np.roll(np.arange(len(names)), r)
    groups.append(np.concatenate([kinds[names[i]] for i in order]).astype(np.float32))
  x = np.stack(groups)
  with np.errstate(over="ignore"):
    return x.astype(dtype)  # bf16 keeps the range (1e30, 3e38); f16 turns them into inf, which is an extreme too


OPTIONS = [dict(), dict(column_major_scales=True, scale_tma_aligned=True, row_alignment=4),
           dict(scale_ue8m0=True, pack_ue8m0=True), dict(eps=1e-4)]


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_quant_extremes(implementation, dtype, rng):
  helpers.runnable(implementation)
  rows = 9 if (ON_GPU or implementation != "mosaic") else 3
  x = extreme_rows(rng, rows, np.dtype(dtype))
  for options in OPTIONS:
    if implementation == "mosaic" and not ON_GPU and options.get("eps"):
      continue  # interpreted Mosaic is slow: the eps floor is covered by the other implementations
    q, s = jaxfp8.per_token_group_quant_fp8(jnp.asarray(x), G, implementation=implementation, **options)
    ref_q, ref_s = ref.per_token_group_quant_fp8(x, G, **options)
    assert_matches_reference(q, s, ref_q, ref_s, exact_codes=helpers.exact_codes(implementation, ue8m0=options.get("scale_ue8m0", False)),
                             context=f"{implementation} {np.dtype(dtype).name} {options}")
    # docs/CONTRACT.md §1: a group that held a NaN has a NaN scale, never a finite one.
    if not options.get("pack_ue8m0"):
      s_rows = np.asarray(s).T if options.get("column_major_scales") else np.asarray(s)
      nan_groups = np.isnan(x.astype(np.float32).reshape(rows, -1, G)).any(-1)
      assert np.isnan(s_rows[:rows][nan_groups]).all()


def test_quant_extreme_values_by_hand():
  """The reference's own expectations, written out: zero / tiny / subnormal groups get scale eps * R and code 0."""
  x = np.zeros((1, 4 * G), np.float32)
  x[0, G:2 * G] = 1e-30
  x[0, 2 * G:3 * G] = F32_SUBNORMAL
  x[0, 3 * G] = np.inf
  q, s = ref.per_token_group_quant_fp8(x, G)
  floor = np.float32(np.float32(1e-10) * ref.R)
  np.testing.assert_array_equal(s[0, :3], [floor] * 3)
  assert np.isinf(s[0, 3]) and np.isnan(q[0, 3 * G].astype(np.float32)) and not q[0, 3 * G + 1:].astype(bool).any()
  assert not q[0, :3 * G].astype(np.float32).any()
  got_q, got_s = jaxfp8.per_token_group_quant_fp8(jnp.asarray(x), G, implementation="xla")
  np.testing.assert_array_equal(np.asarray(got_s).view(np.uint32), s.view(np.uint32))


# ---- GEMM at +-448 with large K ------------------------------------------------------------------------------------

def _saturated_problem(rng, m, n, k, target=1e37):
  """a_q, b_q at +-448 (random signs, plus rows/columns of all +448), scales chosen so that the largest true output
  is about `target`: finite in float32, but any accumulation order that applied the scales late to a sum of
  unscaled large products, or summed in lower precision, would overflow or lose it."""
  a = np.where(rng.random((m, k)) < 0.5, -448.0, 448.0).astype(np.float32)
  b = np.where(rng.random((n, k)) < 0.5, -448.0, 448.0).astype(np.float32)
  a[0] = 448.0
  b[0] = 448.0  # C[0, 0] = K * 448^2 * scales: the largest output
  groups = ref.ceil_div(k, 128)
  scale = np.float32(np.sqrt(target / (k * 448.0 * 448.0)))
  a_s = np.full((m, groups), scale, np.float32)
  b_s = np.full((ref.ceil_div(n, 128), groups), scale, np.float32)
  return a.astype(ref.FP8), b.astype(ref.FP8), a_s, b_s


def _check_saturated(implementation, m, n, k, out_dtype, rng):
  a_q, b_q, a_s, b_s = _saturated_problem(rng, m, n, k)
  out = np.asarray(jaxfp8.w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, (128, 128), out_dtype=out_dtype,
                                                implementation=implementation)).astype(np.float32)
  expected = ref.block_fp8_matmul(a_q, b_q, a_s, b_s, (128, 128))
  assert np.isfinite(expected).all() and abs(expected[0, 0]) > 1e36
  assert np.isfinite(out).all(), f"{implementation}: {np.count_nonzero(~np.isfinite(out))} non-finite outputs"
  tolerance = 2e-4 if out_dtype == jnp.float32 else 5e-3
  assert ref.relative_error(out, ref.cast_output(expected, out_dtype)) <= tolerance


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("implementation, m, n", [("xla", 33, 200), ("triton", 5, 40), ("mosaic", 4, 128)])
def test_gemm_saturated_inputs_large_k(implementation, m, n, out_dtype, rng):
  helpers.runnable(implementation)
  if implementation == "mosaic" and not ON_GPU and out_dtype != jnp.float32:
    pytest.skip("interpreted Mosaic is slow: one output dtype on CPU")
  _check_saturated(implementation, m, n, 7168, out_dtype, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["triton", "mosaic", None])
@pytest.mark.parametrize("m, n", [(64, 1536), (4096, 7168), (13, 2112)])
def test_gpu_gemm_saturated_inputs_real_sizes(implementation, m, n, rng):
  helpers.runnable(implementation or "xla")
  if implementation == "mosaic" and m % 4:
    pytest.skip("the Mosaic kernel takes M % 4 == 0")
  for out_dtype in (jnp.float32, jnp.bfloat16):
    _check_saturated(implementation, m, n, 7168, out_dtype, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gpu_quant_extremes_real_sizes(implementation, rng):
  helpers.runnable(implementation)
  x = np.tile(extreme_rows(rng, 9, np.dtype(jnp.bfloat16)), (455, 8))  # 4095 x 2304
  for options in OPTIONS:
    q, s = jaxfp8.per_token_group_quant_fp8(jnp.asarray(x), G, implementation=implementation, **options)
    ref_q, ref_s = ref.per_token_group_quant_fp8(x, G, **options)
    assert_matches_reference(q, s, ref_q, ref_s, exact_codes=helpers.exact_codes(implementation, ue8m0=options.get("scale_ue8m0", False)),
                             context=f"{implementation} {options}")
