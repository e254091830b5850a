"""Property-based tests (hypothesis): every public entry point and implementation against `jaxfp8.reference`.

Profiles (JAXFP8_FUZZ_PROFILE): "ci" (default; bounded so that this file takes about a minute on 2 CPU cores, the
Pallas kernels interpreted on tiny shapes) and "gpu" (many more examples, kernels run natively at up to M=300 and
larger N/K). Hypothesis prints the failing example and a `@reproduce_failure` blob; inputs are drawn from a NumPy
generator seeded by a hypothesis-drawn seed, so the printed example reproduces the data too.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import jaxfp8
from jaxfp8 import _checks, _platform, linear, reference as ref
from helpers import INPUT_DTYPES, assert_matches_reference, random_activations

settings.register_profile(
    "ci", max_examples=10, deadline=None, derandomize=False, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# GPU: no shrinking (each shrink step compiles a new shape, which can outlast a device call); the failing example is
# printed as drawn, and its seed reproduces the data.
settings.register_profile(
    "gpu", max_examples=200, deadline=None, derandomize=False, print_blob=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = os.environ.get("JAXFP8_FUZZ_PROFILE", "ci")
if PROFILE not in ("ci", "gpu"):
  raise ValueError(f"JAXFP8_FUZZ_PROFILE must be 'ci' or 'gpu', got {PROFILE!r}")
settings.load_profile(PROFILE)

ON_GPU = _platform.gpu_compute_capability() is not None
# Native kernels on the GPU take real sizes; interpreted kernels on CPU only tiny ones.
NATIVE = ON_GPU


# JAXFP8_FUZZ_GPU_SCALE scales the GPU profile's example counts (e.g. 0.5 to fit a short device call).
GPU_SCALE = float(os.environ.get("JAXFP8_FUZZ_GPU_SCALE", "1"))


def _examples(ci: int, gpu: int):
  """max_examples for one test under the active profile."""
  return settings(max_examples=ci if PROFILE == "ci" else max(1, round(gpu * GPU_SCALE)))



seeds = st.integers(0, 2**32 - 1)
dtype_names = st.sampled_from(sorted(INPUT_DTYPES))
out_dtypes = st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16])
# docs/CONTRACT.md §2 tolerances (fp16 output held to the bf16 bound).
GEMM_TOLERANCE = {jnp.dtype(jnp.float32): 2e-4, jnp.dtype(jnp.bfloat16): 5e-3, jnp.dtype(jnp.float16): 5e-3}


@st.composite
def quant_options(draw, *, packed_ok: bool = True, fuse_ok: bool = True) -> dict:
  """A valid combination of the quantizer's options."""
  options = {}
  layout = draw(st.sampled_from(["row", "col", "col_tma"] + (["packed", "packed_tma"] if packed_ok else [])))
  if layout.startswith("col"):
    options["column_major_scales"] = True
  if layout.startswith("packed"):
    options.update(scale_ue8m0=True, pack_ue8m0=True)
  elif draw(st.booleans()):
    options["scale_ue8m0"] = True
  if layout.endswith("tma"):
    options["scale_tma_aligned"] = True
  alignment = draw(st.sampled_from([1, 1, 2, 4, 8]))
  if alignment != 1:
    options["row_alignment"] = alignment
  if fuse_ok and draw(st.integers(0, 3)) == 0:
    options["fuse_silu_and_mul"] = True
  if draw(st.integers(0, 4)) == 0:
    options["eps"] = draw(st.sampled_from([1e-4, 1e-6, 1.0]))
  return options


def _activations(rng, shape, dtype, options):
  if options.get("fuse_silu_and_mul"):
    return _fused_activations(rng, shape, dtype)
  return random_activations(rng, shape, dtype)


def _fused_activations(rng, shape, dtype):
  """[gate | up] whose v = silu(gate) * up every math library computes exactly: gate is 0 or in [20, 60], where
  exp(-gate) < 2^-24 makes 1 + exp(-gate) round to 1 in float32, so silu(gate) == gate whatever exp() returns.

  Here the fused path's plumbing (halves, casts, layouts, padding) is held to the exact reference; how closely each
  kernel's exp() follows the SiLU curve is the contract's one-step bound, checked in tests/test_quant.py on ordinary inputs
  (on the GPU, exp() differs from NumPy's by an ulp, which moves scales by ulps and, rarely, UE8M0 scales by 2x).
  """
  half = shape[-1] // 2
  gate = np.where(rng.random(shape[:-1] + (half,)) < 0.2, 0.0, rng.uniform(20.0, 60.0, shape[:-1] + (half,)))
  up = random_activations(rng, shape[:-1] + (half,), np.float32)
  return np.concatenate([gate.astype(np.float32), up], axis=-1).astype(dtype)


def _check_quant(x, group_size, implementation, options, *, masked_m=None):
  kwargs = dict(options)
  if masked_m is not None:
    kwargs["masked_m"] = masked_m
  q, s = jaxfp8.per_token_group_quant_fp8(
      jnp.asarray(x), group_size, implementation=implementation,
      **{**kwargs, **({"masked_m": jnp.asarray(masked_m)} if masked_m is not None else {})})
  ref_q, ref_s = ref.per_token_group_quant_fp8(x, group_size, **kwargs)
  # Division by a power of two is exact: UE8M0 codes must match exactly (docs/CONTRACT.md §1). Fused inputs come from
  # _fused_activations, whose v is exact everywhere, so they are held to the same standard.
  assert_matches_reference(q, s, ref_q, ref_s, exact_codes=helpers.exact_codes(implementation, ue8m0=options.get("scale_ue8m0", False)),
                           context=f"{implementation} x{x.shape} {x.dtype} G={group_size} {options}")


# ---- quantization --------------------------------------------------------------------------------------------------

@_examples(ci=40, gpu=300)
@given(seed=seeds, m=st.integers(0, 300), group_size=st.sampled_from([16, 32, 64, 128]), groups=st.integers(1, 5),
       dtype=dtype_names, options=quant_options())
def test_quant_xla(seed, m, group_size, groups, dtype, options):
  k = group_size * groups * (2 if options.get("fuse_silu_and_mul") else 1)
  x = _activations(np.random.default_rng(seed), (m, k), INPUT_DTYPES[dtype], options)
  _check_quant(x, group_size, "xla", options)


def _check_quant_kernel(implementation, seed, data, group_size, dtype, options, *, interpreted_max_m):
  """A Pallas quantizer: real sizes natively on the GPU, tiny ones when interpreted on CPU."""
  helpers.runnable(implementation)
  m = data.draw(st.integers(0, 300 if NATIVE else interpreted_max_m), label="m")
  groups = data.draw(st.integers(1, 8 if NATIVE else 2), label="groups")
  k = group_size * groups * (2 if options.get("fuse_silu_and_mul") else 1)
  x = _activations(np.random.default_rng(seed), (m, k), INPUT_DTYPES[dtype], options)
  _check_quant(x, group_size, implementation, options)


@_examples(ci=6, gpu=200)
@given(seed=seeds, data=st.data(), group_size=st.sampled_from([16, 32, 64, 128]), dtype=dtype_names,
       options=quant_options())
def test_quant_triton(seed, data, group_size, dtype, options):
  _check_quant_kernel("triton", seed, data, group_size, dtype, options, interpreted_max_m=9)


@_examples(ci=6, gpu=100)
@given(seed=seeds, data=st.data(), group_size=st.sampled_from([16, 32, 64, 128]), dtype=dtype_names,
       options=quant_options())
def test_quant_mosaic(seed, data, group_size, dtype, options):
  _check_quant_kernel("mosaic", seed, data, group_size, dtype, options, interpreted_max_m=5)


@_examples(ci=6, gpu=100)
@given(seed=seeds, implementation=st.sampled_from(["xla", "triton"]), experts=st.integers(1, 3),
       tokens=st.integers(0, 12), dtype=dtype_names, options=quant_options(fuse_ok=False))
def test_quant_masked_m(seed, implementation, experts, tokens, dtype, options):
  helpers.runnable(implementation)
  rng = np.random.default_rng(seed)
  x = random_activations(rng, (experts, tokens, 128), INPUT_DTYPES[dtype])
  masked_m = rng.integers(-1, tokens + 2, experts).astype(np.int32)  # out-of-range counts are clipped (docs/CONTRACT.md §1)
  _check_quant(x, 64, implementation, options, masked_m=masked_m)


# ---- block GEMM ----------------------------------------------------------------------------------------------------

def _assert_within_spec(out, exact, bias, tolerance: float, context: str) -> None:
  """docs/CONTRACT.md §2: relative Frobenius error vs the float64 reference (`exact`, not rounded to the output dtype: rounding the
  reference too would turn a kernel error of 1e-4 near a bf16 rounding midpoint into a whole bf16 step, up to 7.8e-3).
  The error is the GEMM's, so it is measured against the product's size, which a bias of the opposite sign can cancel
  in the output (on the H200, fast FP8 accumulation of a K=128 dot left 1.1% of an output 0.088 = 0.756 - 0.668 at
  M=1, N=1: 1.3e-3 of the product)."""
  exact = np.asarray(exact, np.float64)
  product = exact - (0 if bias is None else np.asarray(bias, np.float64))
  scale = max(np.linalg.norm(exact), np.linalg.norm(product))
  error = np.linalg.norm(np.asarray(out, np.float64) - exact)
  assert error <= tolerance * scale, f"{context}: error {error:.3g} > {tolerance} x {scale:.3g}"


def _gemm_problem(rng, m, n, k, block_size, column_major, with_bias):
  gn, gk = block_size
  groups = ref.ceil_div(k, gk)
  a_q, a_s = ref.per_token_group_quant_fp8(rng.standard_normal((m, groups * gk)).astype(np.float32), gk)
  a_q = a_q[:, :k]
  b_q, b_s = ref.quantize_weight_blockwise(rng.standard_normal((n, k)).astype(np.float32), block_size)
  # Random factors per scale, so that a group read with the wrong scale shows.
  a_s = (a_s * np.exp2(rng.uniform(-3, 3, a_s.shape))).astype(np.float32)
  b_s = (b_s * np.exp2(rng.uniform(-3, 3, b_s.shape))).astype(np.float32)
  bias = (rng.standard_normal(n) * 10).astype(np.float32) if with_bias else None
  a_s_arg = a_s
  if column_major:  # the quantizer's padded layout, NaN in the pad columns (must be ignored)
    a_s_arg = np.full((groups, ref.round_up(m, 4) + 4), np.nan, np.float32)
    a_s_arg[:, :m] = a_s.T
  return a_q, b_q, a_s, a_s_arg, b_s, bias


def _check_gemm(rng, m, n, k, block_size, out_dtype, column_major, with_bias, implementation):
  a_q, b_q, a_s, a_s_arg, b_s, bias = _gemm_problem(rng, m, n, k, block_size, column_major, with_bias)
  out = jaxfp8.w8a8_block_fp8_matmul(a_q, b_q, a_s_arg, b_s, block_size, a_s_column_major=column_major,
                                     out_dtype=out_dtype, bias=bias, implementation=implementation)
  out = np.asarray(out)
  assert out.shape == (m, n) and out.dtype == jnp.dtype(out_dtype)
  expected = ref.block_fp8_matmul(a_q, b_q, a_s, b_s, block_size, bias=bias)
  assert np.isfinite(out.astype(np.float32)).all(), f"{implementation}: non-finite output"
  _assert_within_spec(out, expected, bias, GEMM_TOLERANCE[jnp.dtype(out_dtype)],
                      f"{implementation} M={m} N={n} K={k} block={block_size} {jnp.dtype(out_dtype).name} "
                      f"col={column_major} bias={with_bias}")


# One test per block size, so that every size gets its share of the examples and the GPU profile's 300 (50 each, every
# one a fresh XLA compilation) spread over pytest-xdist workers: as one test they outlasted a device call (session 5).
@pytest.mark.parametrize("block_size", [(128, 128), (64, 128), (128, 64), (32, 32), (96, 48), (1, 128)], ids=str)
@_examples(ci=7, gpu=50)
@given(seed=seeds, m=st.integers(0, 300), n=st.integers(1, 300), k=st.integers(1, 600),
       out_dtype=out_dtypes, column_major=st.booleans(), with_bias=st.booleans())
def test_gemm_xla(block_size, seed, m, n, k, out_dtype, column_major, with_bias):
  _check_gemm(np.random.default_rng(seed), m, n, k, block_size, out_dtype, column_major, with_bias, "xla")


@_examples(ci=6, gpu=200)
@given(seed=seeds, data=st.data(), block_size=st.sampled_from([(128, 128), (64, 64), (128, 32), (32, 128)]),
       out_dtype=out_dtypes, column_major=st.booleans(), with_bias=st.booleans())
def test_gemm_triton(seed, data, block_size, out_dtype, column_major, with_bias):
  helpers.runnable("triton")
  m = data.draw(st.integers(0, 300 if NATIVE else 20), label="m")
  n = data.draw(st.integers(1, 1100 if NATIVE else 72), label="n")
  k = data.draw(st.integers(1, 1100 if NATIVE else 200), label="k")
  _check_gemm(np.random.default_rng(seed), m, n, k, block_size, out_dtype, column_major, with_bias, "triton")


@_examples(ci=2, gpu=60)
@given(seed=seeds, data=st.data(), out_dtype=out_dtypes, column_major=st.booleans(), with_bias=st.booleans())
def test_gemm_mosaic(seed, data, out_dtype, column_major, with_bias):
  helpers.runnable("mosaic")
  # The Mosaic kernel takes blocks of 64 or 128, N a multiple of 8 (a partial last column tile), K a multiple of gk
  # and M % 4 == 0 (other shapes are refused).
  block_size = data.draw(st.sampled_from([(128, 128), (64, 64), (128, 64), (64, 128)]), label="block_size")
  m = 4 * data.draw(st.integers(1, 75 if NATIVE else 2), label="m / 4")
  n = 8 * data.draw(st.integers(1, 192 if NATIVE else 24), label="n / 8")
  k = block_size[1] * data.draw(st.integers(1, 12 if NATIVE else 2), label="k / gk")
  _check_gemm(np.random.default_rng(seed), m, n, k, block_size, out_dtype, column_major, with_bias, "mosaic")


# ---- the linear ----------------------------------------------------------------------------------------------------

@_examples(ci=15, gpu=150)
@given(seed=seeds, lead=st.lists(st.integers(0, 20), min_size=1, max_size=3).filter(lambda l: np.prod(l) <= 300),
       n=st.integers(1, 300), groups=st.integers(1, 3), block_size=st.sampled_from([(128, 128), (64, 64), (32, 128)]),
       dtype=dtype_names, with_bias=st.booleans(), implementation=st.sampled_from([None, "xla"]))
def test_linear(seed, lead, n, groups, block_size, dtype, with_bias, implementation):
  rng = np.random.default_rng(seed)
  k = groups * block_size[1]
  x = random_activations(rng, (*lead, k), INPUT_DTYPES[dtype], spread=False)
  w_q, w_s = ref.quantize_weight_blockwise(rng.standard_normal((n, k)).astype(np.float32), block_size)
  bias = (rng.standard_normal(n)).astype(np.float32) if with_bias else None
  out = np.asarray(jaxfp8.w8a8_block_fp8_linear(jnp.asarray(x), jnp.asarray(w_q), jnp.asarray(w_s), block_size,
                                                None if bias is None else jnp.asarray(bias),
                                                implementation=implementation))
  assert out.shape == (*lead, n) and out.dtype == x.dtype
  exact = ref.w8a8_block_fp8_linear(x, w_q, w_s, block_size, bias)
  _assert_within_spec(out, exact, bias, GEMM_TOLERANCE[jnp.dtype(x.dtype)],
                      f"{implementation} lead={lead} N={n} K={k} block={block_size} {dtype} bias={with_bias}")


# ---- the edges (docs/CONTRACT.md §1, §2, §4; tests/test_edges.py has one case of each) -----------------------------

MAGNITUDE_EXPONENTS = {"f32": (-120, 120), "bf16": (-120, 120), "f16": (-24, 15)}  # 2^-24: float16's subnormal floor


@_examples(ci=12, gpu=150)
@given(seed=seeds, data=st.data(), dtype=dtype_names, group_size=st.sampled_from([32, 128]),
       implementation=st.sampled_from(["xla", "triton", "mosaic"]),
       eps=st.sampled_from([_checks.MIN_EPS, 1e-30, 1e-10, 1.0, 1e30]), ue8m0=st.booleans())
def test_quant_magnitudes_across_the_dtype_range(seed, data, dtype, group_size, implementation, eps, ue8m0):
  """Rows scaled by 2^e across the input dtype's whole range (float16 subnormals included) under extreme eps: codes
  and scales as the reference's."""
  helpers.runnable(implementation)
  rng = np.random.default_rng(seed)
  m = data.draw(st.integers(1, 64 if (NATIVE or implementation == "xla") else 4), label="m")
  lo, hi = MAGNITUDE_EXPONENTS[dtype]
  exponents = rng.integers(lo, hi, (m, 1)).astype(np.float64)
  x = (rng.standard_normal((m, 2 * group_size)) * np.exp2(exponents)).astype(np.float32).astype(INPUT_DTYPES[dtype])
  options = dict(eps=eps, scale_ue8m0=ue8m0, column_major_scales=True)
  _check_quant(x, group_size, implementation, options)


@_examples(ci=10, gpu=100)
@given(seed=seeds, data=st.data(), implementation=st.sampled_from(["xla", "triton", "mosaic"]),
       out_dtype=out_dtypes, with_bias=st.booleans())
def test_gemm_caller_scales_across_the_float32_range(seed, data, implementation, out_dtype, with_bias):
  """Caller-given scales anywhere in float32's range whose products stay ordinary (a_s ~ 2^e, b_s ~ 2^-e): every
  implementation finite and within the GEMM's tolerance."""
  helpers.runnable(implementation)
  rng = np.random.default_rng(seed)
  small = not (NATIVE or implementation == "xla")
  m = data.draw(st.integers(1, 8 if small else 64), label="m")
  n = 128 * data.draw(st.integers(1, 1 if small else 4), label="n / 128")
  k = 128 * data.draw(st.integers(1, 2 if small else 8), label="k / 128")
  e = data.draw(st.integers(-115, 115), label="e")
  # Codes and scale spreads small enough that the exact result fits float16 (its limit is 65504).
  a_q = np.clip(rng.standard_normal((m, k)) * 8, -448, 448).astype(ref.FP8)
  b_q = np.clip(rng.standard_normal((n, k)) * 8, -448, 448).astype(ref.FP8)
  a_s = np.exp2(e + rng.uniform(-1, 1, (m, k // 128))).astype(np.float32)
  b_s = np.exp2(-e + rng.uniform(-1, 1, (n // 128, k // 128))).astype(np.float32)
  bias = (rng.standard_normal(n) * 10).astype(np.float32) if with_bias else None
  out = np.asarray(jaxfp8.w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, (128, 128), out_dtype=out_dtype, bias=bias,
                                                implementation=implementation))
  assert np.isfinite(out.astype(np.float32)).all(), f"{implementation} e={e}: non-finite output"
  _assert_within_spec(out, ref.block_fp8_matmul(a_q, b_q, a_s, b_s, (128, 128), bias=bias), bias,
                      GEMM_TOLERANCE[jnp.dtype(out_dtype)], f"{implementation} e={e}")


@_examples(ci=25, gpu=50)
@given(shape=st.lists(st.integers(0, 9), min_size=1, max_size=4), axis=st.integers(-6, 5))
def test_pad_to_bucket_axis(shape, axis):
  """Any axis in [-ndim, ndim) pads that axis to its bucket; any other is refused, naming it."""
  x = np.ones(shape, np.float32)
  if not -len(shape) <= axis < len(shape):
    with pytest.raises(ValueError, match=f"axis must be an int in \\[-{len(shape)}, {len(shape)}\\)"):
      linear.pad_to_bucket(x, axis=axis)
    return
  out, size = linear.pad_to_bucket(x, axis=axis)
  assert size == shape[axis]
  expected = list(shape)
  expected[axis] = max(linear.get_row_buckets().bucket(shape[axis]), shape[axis])
  assert list(out.shape) == expected and (np.asarray(out).sum() == x.sum())


@_examples(ci=6, gpu=20)
@given(seed=seeds, n=st.integers(1, 300), k=st.integers(1, 300), extra_tensors=st.integers(0, 3))
def test_checkpoint_rewritten_in_place_is_read_afresh(tmp_path_factory, seed, n, k, extra_tensors):
  """A checkpoint file rewritten with other contents (other offsets) and its old mtime put back (cp -p, rsync -t,
  tar) reads as what is there now."""
  pytest.importorskip("safetensors")
  rng = np.random.default_rng(seed)
  path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
  first = ref.quantize_weight_blockwise(rng.standard_normal((n, k)).astype(np.float32))
  jaxfp8.save_hf_fp8_linears(path, {"layer": jaxfp8.Fp8LinearWeight(*first)})
  stat = path.stat()
  second = ref.quantize_weight_blockwise(rng.standard_normal((n, k)).astype(np.float32) * 3)
  extra = {f"extra{i}.codes": second[0][: i + 1] for i in range(extra_tensors)}
  jaxfp8.save_hf_fp8_linears(path, {"layer": jaxfp8.Fp8LinearWeight(*second)}, extra=extra)
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  loaded = jaxfp8.load_hf_fp8_linears(path, as_numpy=True)["layer"]
  np.testing.assert_array_equal(np.asarray(loaded.w_q).view(np.uint8), second[0].view(np.uint8))
  np.testing.assert_array_equal(np.asarray(loaded.w_s), second[1])
