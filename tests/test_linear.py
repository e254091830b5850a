"""jaxfp8.linear: w8a8_block_fp8_linear against the float64 reference, dispatch, the lowered programs, eager compile
caching, and the benchmark's plumbing.

On CPU the default path is XLA; the Pallas paths run in interpret mode on small shapes (Mosaic at N = K = 256), and
the real GPU programs are lowered for CUDA on CPU (`jax.export` under `abstract_h200()`) to check what runs around the
kernels. GPU tests (marked) run the real kernels at shapes.json sizes.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers

from jaxfp8 import _platform, gemm, linear, quant, shapes
from jaxfp8 import reference as ref
from jaxfp8.linear import w8a8_block_fp8_linear

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
TOLERANCE = {jnp.dtype(F32): 2e-4, jnp.dtype(BF16): 5e-3, jnp.dtype(F16): 5e-3}
ON_GPU = _platform.gpu_compute_capability() is not None


def make_weight(rng, n: int, k: int, block_size=(128, 128)):
  """(w_q, w_s) NumPy: random weights whose blocks differ in magnitude, quantized by the reference (docs/CONTRACT.md §4)."""
  gn, gk = block_size
  w = rng.standard_normal((n, k)).astype(np.float32)
  factors = np.exp2(rng.uniform(-4, 4, (ref.ceil_div(n, gn), ref.ceil_div(k, gk))))
  w *= np.repeat(np.repeat(factors, gn, 0), gk, 1)[:n, :k].astype(np.float32)
  return ref.quantize_weight_blockwise(w, block_size)


def make_x(rng, shape, dtype):
  """Activations with per-row magnitudes over several octaves (different scales per group), never zeros."""
  x = rng.standard_normal(shape).astype(np.float32)
  x *= np.exp2(rng.integers(-4, 6, shape[:-1] + (1,))).astype(np.float32)
  return jnp.asarray(x, dtype)


def expected(x, w_q, w_s, block_size, bias=None, out_dtype=None) -> np.ndarray:
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  return ref.cast_output(ref.w8a8_block_fp8_linear(np.asarray(x), w_q, w_s, block_size, bias=bias), out_dtype)


def assert_close(out, x, w_q, w_s, block_size, bias=None, out_dtype=None):
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  want = expected(x, w_q, w_s, block_size, bias, out_dtype)
  assert out.shape == want.shape, (out.shape, want.shape)
  assert out.dtype == out_dtype, out.dtype
  got = np.asarray(out)
  assert not np.isnan(got.astype(np.float32)).any(), "NaN in the output"
  err = ref.relative_error(got, want)
  assert err <= TOLERANCE[out_dtype], f"relative error {err:.3g} > {TOLERANCE[out_dtype]}"


def bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.fixture(autouse=True)
def _fresh_cache():
  linear.cache_clear()
  previous = linear.set_row_buckets(None)
  yield
  linear.set_row_buckets(previous)


# ---- numerics against the reference ----------------------------------------------------------------------------------

# (x shape, N, block_size, x dtype, bias): N-D and 1-D x, partial N blocks, every block size of shapes.json.
CASES = [
    ((5, 256), 200, (128, 128), BF16, True),
    ((2, 3, 384), 130, (128, 128), F32, False),
    ((1, 192), 96, (64, 64), F16, True),
    ((7, 256), 300, (128, 64), F32, True),
    ((3, 1, 2, 256), 64, (32, 32), BF16, False),
    ((256,), 136, (128, 128), BF16, True),
]


@pytest.mark.parametrize("x_shape, n, block_size, dtype, bias", CASES)
@pytest.mark.parametrize("implementation", [None, "xla"])
def test_xla_matches_reference(rng, x_shape, n, block_size, dtype, bias, implementation):
  w_q, w_s = make_weight(rng, n, x_shape[-1], block_size)
  x = make_x(rng, x_shape, dtype)
  b = (rng.standard_normal(n) * 4).astype(np.float32) if bias else None
  out = w8a8_block_fp8_linear(x, w_q, w_s, block_size, b, implementation=implementation)
  assert_close(out, x, w_q, w_s, block_size, b)
  # Under jit (traced inline, no row bucket): the same bits, except XLA's own GPU dot, which picks its algorithm (and
  # so its sum order) by row count: eager calls run at the padded bucket's rows (seen on the H200).
  jitted = jax.jit(lambda x: w8a8_block_fp8_linear(x, w_q, w_s, block_size, b, implementation=implementation))(x)
  if implementation == "xla" and jax.default_backend() == "gpu":
    assert_close(jitted, x, w_q, w_s, block_size, b)
  else:
    np.testing.assert_array_equal(bits(jitted), bits(out))


@pytest.mark.parametrize("x_shape, n, block_size, dtype, bias", [CASES[0], CASES[2], CASES[4]])
def test_triton_interpret_matches_reference(rng, x_shape, n, block_size, dtype, bias):
  w_q, w_s = make_weight(rng, n, x_shape[-1], block_size)
  x = make_x(rng, x_shape, dtype)
  b = (rng.standard_normal(n) * 4).astype(np.float32) if bias else None
  out = jax.jit(lambda x: w8a8_block_fp8_linear(x, w_q, w_s, block_size, b, implementation="triton",
                                                interpret=True))(x)
  assert_close(out, x, w_q, w_s, block_size, b)


@pytest.mark.parametrize("x_shape, bias_dtype, out_dtype", [((1, 256), F32, None), ((2, 5, 256), BF16, F32)])
def test_mosaic_interpret_matches_reference(rng, x_shape, bias_dtype, out_dtype):
  # M = 1: the quantizer pads to 4 rows; M = 10: to 16 (the Mosaic TMA needs M % 8 == 0 or M < 8).
  w_q, w_s = make_weight(rng, 256, 256)
  x = make_x(rng, x_shape, BF16)
  b = jnp.asarray(rng.standard_normal(256) * 4, bias_dtype)
  out = jax.jit(lambda x: w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), b, out_dtype=out_dtype,
                                                implementation="mosaic", interpret=True))(x)
  assert_close(out, x, w_q, w_s, (128, 128), np.asarray(b.astype(F32)), out_dtype)


# ---- valid_rows: a traced live-row count ---------------------------------------------------------------------------

@pytest.mark.parametrize("implementation, x_shape", [("xla", (3, 50, 256)), ("triton", (70, 256)),
                                                     ("mosaic", (2, 65, 256)), ("mosaic", (13, 256))])
def test_valid_rows_computes_the_live_rows_with_one_compile(rng, implementation, x_shape):
  """A linear jitted once for a bucket of rows: every count gives the live rows of the whole call (the same plan,
  so bit for bit) and zeros past them, whatever x holds there (NaN here)."""
  if implementation == "mosaic" and not helpers.MOSAIC_GEMM_IMPORTABLE:
    pytest.skip("pallas_kernels.gemm_mosaic not importable")
  n, k = 256, x_shape[-1]
  w_q, w_s = make_weight(rng, n, k)
  bias = jnp.asarray(rng.standard_normal(n), F32)
  x = make_x(rng, x_shape, BF16)
  m = int(np.prod(x_shape[:-1]))
  config = helpers.mosaic_interpret_config() if implementation == "mosaic" else None
  kwargs = dict(implementation=implementation, config=config, out_dtype=F32, interpret=True)
  traces = []

  @jax.jit
  def f(x, valid_rows):
    traces.append(1)
    return w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), bias, valid_rows=valid_rows, **kwargs)

  whole = np.asarray(f(x, jnp.int32(m)))  # the plan of every count below (the GEMM's plan takes valid_rows)
  f(x, jnp.int32(m))  # (a first Pallas lowering may register JAX config options: one more trace)
  traces.clear()
  assert_close(whole.reshape(*x_shape[:-1], n), x, w_q, w_s, (128, 128), np.asarray(bias), F32)
  for valid in sorted({0, 1, int(rng.integers(2, m)), m - 1}):
    poisoned = x.reshape(m, k).at[valid:].set(jnp.nan).reshape(x_shape)
    out = np.asarray(f(poisoned, jnp.int32(valid))).reshape(m, n)
    np.testing.assert_array_equal(bits(out[:valid]), bits(whole.reshape(m, n)[:valid]), err_msg=f"{valid}")
    assert (out[valid:] == 0).all(), f"valid_rows={valid}: a row past it is not 0"
  # int32 counts outside [0, M] reach the kernels unclipped (no clip kernel): each consumer clips them
  for count, live in ((-2**31, 0), (-1, 0), (m + 1, m), (2**31 - 1, m)):
    out = np.asarray(f(x, jnp.int32(count))).reshape(m, n)
    np.testing.assert_array_equal(bits(out[:live]), bits(whole.reshape(m, n)[:live]), err_msg=f"{count}")
    assert (out[live:] == 0).all(), f"valid_rows={count}: a row past {live} is not 0"
  assert not traces, "a new count recompiled"


@pytest.mark.parametrize("backward", ["fp8", "bf16"])
def test_valid_rows_gradient_is_the_live_rows_gradient(rng, backward):
  """dx of the live rows is dx of the linear on those rows alone; past them dx is 0, and dbias sums the live rows."""
  n, k, m, valid = 384, 256, 24, 9
  w_q, w_s = make_weight(rng, n, k)
  bias = jnp.asarray(rng.standard_normal(n), F32)
  x = make_x(rng, (m, k), F32)
  dy = jnp.asarray(rng.standard_normal((m, n)), F32)
  kwargs = dict(implementation="xla", backward=backward)

  def loss(x, bias, v):
    return jnp.sum(w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), bias, valid_rows=v, **kwargs) * dy[:x.shape[0]])

  dx, dbias = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, bias, jnp.int32(valid))
  live_dx, live_dbias = jax.grad(
      lambda x, bias: jnp.sum(w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), bias, **kwargs) * dy[:valid]),
      argnums=(0, 1))(x[:valid], bias)
  # Equal up to float32 summation order (XLA's CPU dot and reduction order depend on the row count).
  assert ref.relative_error(np.asarray(dx[:valid]), np.asarray(live_dx)) <= 1e-5
  assert (np.asarray(dx[valid:]) == 0).all()
  assert ref.relative_error(np.asarray(dbias), np.asarray(live_dbias)) <= 1e-5


def test_valid_rows_eager_call_and_nnx_layer(rng):
  n, k, m, valid = 256, 256, 30, 11
  w_q, w_s = make_weight(rng, n, k)
  x = make_x(rng, (m, k), BF16)
  whole = np.asarray(w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), implementation="xla"))
  eager = np.asarray(w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), implementation="xla", valid_rows=valid))
  np.testing.assert_array_equal(bits(eager[:valid]), bits(whole[:valid]))
  assert (eager[valid:] == 0).all()
  nnx = pytest.importorskip("flax.nnx")
  del nnx
  from jaxfp8.nn import Fp8Linear
  layer = Fp8Linear.from_weights(jnp.asarray(w_q), jnp.asarray(w_s), block_size=(128, 128), implementation="xla")
  out = np.asarray(jax.jit(lambda x, v: layer(x, valid_rows=v))(x, jnp.int32(valid)))
  np.testing.assert_array_equal(bits(out[:valid]), bits(whole[:valid]))
  assert (out[valid:] == 0).all()


@pytest.mark.parametrize("valid_rows, error, match", [
    (31, ValueError, r"valid_rows must be in \[0, 30\].*got 31"),
    (True, TypeError, "valid_rows must be an int"),
    (jnp.zeros((2,), jnp.int32), ValueError, r"valid_rows must be a scalar"),
    (jnp.float32(3), TypeError, "of dtype float32"),
])
def test_valid_rows_is_validated(rng, valid_rows, error, match):
  w_q, w_s = make_weight(rng, 128, 128)
  with pytest.raises(error, match=match):
    w8a8_block_fp8_linear(jnp.ones((3, 10, 128), BF16), w_q, w_s, (128, 128), valid_rows=valid_rows)


def test_out_dtype_and_bias_dtypes(rng):
  w_q, w_s = make_weight(rng, 200, 256)
  x = make_x(rng, (4, 256), BF16)
  for bias_dtype in (BF16, F16, F32):
    b = jnp.asarray(rng.standard_normal(200), bias_dtype)
    out = w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), b, out_dtype=F32)
    assert_close(out, x, w_q, w_s, (128, 128), np.asarray(b.astype(F32)), F32)


@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)])
def test_zero_rows(rng, lead):
  w_q, w_s = make_weight(rng, 200, 256)
  x = jnp.zeros((*lead, 256), BF16)
  bias = np.ones(200, np.float32)
  for out in (w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), bias),
              jax.jit(lambda x: w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), bias))(x)):
    assert out.shape == (*lead, 200) and out.dtype == jnp.bfloat16
  assert linear.cache_info().misses == 0


# ---- docs/CONTRACT.md section 3: padded rows never change the live rows ------------------------------------------------

def _call(x, w_q, w_s, implementation, row_alignment=None, config=None):
  # float32 output: a last-bit difference of the accumulation would survive the output cast.
  return jax.jit(lambda x: w8a8_block_fp8_linear(
      x, w_q, w_s, (128, 128), out_dtype=F32, implementation=implementation, row_alignment=row_alignment,
      config=config, interpret=True))(x)


def _one_schedule(implementation: str, n: int, k: int):
  """A kernel config every row count of these tests can run: with it, calls of different padding run one schedule."""
  if implementation == "triton":
    return gemm.TritonGemmConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3,
                                 swap_ab=True)
  if implementation == "mosaic":
    return gemm.mosaic.default_config(16, n, k, F32, num_sms=132)
  return None  # XLA has one schedule on CPU


PADDING_CASES = [
    ("xla", 2, (1, 4, 8)), ("xla", 5, (1, 8)), ("xla", 13, (1, 4, 16)),
    ("xla", 1, (1, 4)),
    ("triton", 1, (1, 4, 8)), ("triton", 5, (1, 4)), ("triton", 13, (1, 8)),
    ("mosaic", 1, (None,)), ("mosaic", 5, (None,)), ("mosaic", 13, (None, 8)),
]


@pytest.mark.parametrize("implementation, m, alignments", PADDING_CASES)
def test_padded_rows_give_bit_identical_live_rows(rng, implementation, m, alignments):
  """One schedule (implementation and kernel config): the rows past M never change a live row, bit for bit."""
  if implementation == "xla" and _platform.gpu_compute_capability() is not None:
    pytest.skip("XLA's GPU dot picks its algorithm per M, so its bits may differ between row counts; the property "
                "is our kernels' (interpreted here, native in test_gpu_padded_rows_give_bit_identical_live_rows)")
  n, k = (256, 256) if implementation == "mosaic" else (200, 384)
  w_q, w_s = make_weight(rng, n, k)
  x_all = make_x(rng, (16, k), BF16)
  config = _one_schedule(implementation, n, k)
  # The same rows inside a 16-row call (no padding at all): the "unpadded path".
  superset = np.asarray(_call(x_all, w_q, w_s, implementation, config=config))[:m]
  for alignment in alignments:
    out = _call(x_all[:m], w_q, w_s, implementation, alignment, config)
    assert out.shape == (m, n)
    np.testing.assert_array_equal(bits(out), bits(superset), err_msg=f"row_alignment={alignment}")


@pytest.mark.parametrize("implementation, m, alignments", PADDING_CASES)
def test_padding_that_selects_another_schedule_stays_within_tolerance(rng, implementation, m, alignments):
  """Default configs: padding may select another schedule (the Mosaic GEMM picks its tile width by the rows it reads),
  whose float32 summation order may differ in the last bits (the interpreter's dots follow the host CPU's blocking).
  The contract is then the GEMM's tolerance against the float64 reference, for every padding."""
  n, k = (256, 256) if implementation == "mosaic" else (200, 384)
  w_q, w_s = make_weight(rng, n, k)
  x_all = make_x(rng, (16, k), BF16)
  assert_close(_call(x_all, w_q, w_s, implementation)[:m], x_all[:m], w_q, w_s, (128, 128), out_dtype=F32)
  for alignment in alignments:
    out = _call(x_all[:m], w_q, w_s, implementation, alignment)
    assert_close(out, x_all[:m], w_q, w_s, (128, 128), out_dtype=F32)


# ---- dispatch ------------------------------------------------------------------------------------------------------

def _shape(m, k, dtype=BF16):
  return jax.ShapeDtypeStruct((m, k), dtype)


def _weight_shape(n, k):
  return jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn)


@pytest.mark.parametrize("capability, m, n, k, block_size, impl, alignment, reason", [
    ((9, 0), 1, 256, 256, (128, 128), "triton", 1, "decode M=1 <= 4"),
    ((9, 0), 4, 256, 256, (128, 128), "triton", 1, "decode M=4 <= 4"),
    ((9, 0), 5, 256, 256, (128, 128), "mosaic", 64, "Hopper"),
    ((9, 0), 16, 256, 256, (128, 128), "mosaic", 64, "Hopper"),
    ((9, 0), 17, 256, 256, (128, 128), "mosaic", 64, "Hopper"),  # below 64 rows: one whole decode tile
    ((9, 0), 29, 256, 256, (128, 128), "mosaic", 64, "Hopper"),
    ((9, 0), 64, 256, 256, (128, 128), "mosaic", 1, "Hopper"),
    ((9, 0), 65, 256, 256, (128, 128), "mosaic", 8, "Hopper"),   # 65 -> 72 (68 is not a TMA-tileable row count)
    ((9, 0), 100, 256, 256, (128, 128), "mosaic", 8, "Hopper"),  # 100 -> 104
    ((9, 0), 132, 256, 256, (128, 128), "mosaic", 8, "Hopper"),  # 132 -> 136
    ((9, 0), 20, 200, 256, (128, 128), "triton", 1, "partial column tile"),  # few tiles: Triton measured faster
    ((9, 0), 4096, 200, 256, (128, 128), "mosaic", 1, "Hopper"),  # 64 tiles: Mosaic
    ((9, 0), 20, 196, 256, (128, 128), "triton", 1, "cannot take this problem"),
    ((9, 0), 20, 256, 256, (64, 64), "mosaic", 64, "Hopper"),
    ((9, 0), 20, 256, 256, (64, 128), "triton", 1, "not yet timed"),
    ((8, 9), 5, 256, 256, (128, 128), "triton", 1, "sm_89"),
    ((8, 0), 5, 256, 256, (128, 128), "xla", 1, "no FP8 conversions"),
    ((9, 0), 5, 256, 256, (128, 16), "xla", 1, "no Triton config can serve"),
    (None, 5, 256, 256, (128, 128), "xla", 1, "no NVIDIA GPU"),
])
def test_default_dispatch(capability, m, n, k, block_size, impl, alignment, reason):
  if impl == "mosaic" and not helpers.MOSAIC_GEMM_IMPORTABLE:
    pytest.skip("pallas_kernels.gemm_mosaic is not importable here")
  plan = linear.planner.plan(m, n, k, block_size, BF16, BF16, linear.LinearOptions(interpret=False),
                             device=helpers.fake_device(capability))
  assert (plan.implementation, plan.row_alignment) == (impl, alignment), str(plan)
  assert reason in plan.reason, plan.reason
  assert plan.scale_layout == ("row" if impl == "xla" else "col")
  expected_quant = {"mosaic": "mosaic" if helpers.MOSAIC_QUANT_IMPORTABLE else "triton"}.get(impl, impl)
  assert plan.quant_implementation == expected_quant
  assert plan.padded_rows == -(-m // alignment) * alignment and str(plan).startswith(impl)
  # The plan names the kernel configs that run (none for XLA), each with its reason.
  assert (plan.config is None) == (impl == "xla") and (plan.quant_config is None) == (expected_quant == "xla")
  if plan.config is not None:
    assert type(plan.config).__name__ in str(plan) and plan.gemm.config_reason in str(plan)


@pytest.mark.parametrize("m, alignment", [(1, 64), (4, 64), (13, 64), (63, 64), (64, 1), (65, 8), (68, 8),
                                          (100, 8), (132, 8), (4095, 8), (4096, 1)])
def test_mosaic_row_alignment(m, alignment):
  # Below 64 rows: one whole decode tile. From 64 on, the least padding the kernel reads as is: 65 -> 72 and 68 -> 72
  # (65 and 68 rows are not TMA-tileable), 132 -> 136, 4095 -> 4096.
  assert gemm.row_alignment("mosaic", m)[0] == alignment


def test_explicit_implementations_are_honoured_or_refused(monkeypatch):
  x, w = _shape(5, 256), _weight_shape(200, 256)
  plan = linear.explain(x, w, (128, 128), implementation="triton", interpret=True)
  assert plan.implementation == "triton" and "asked for" in plan.reason and plan.interpret
  with pytest.raises(ValueError, match="implementation='mosaic' cannot run M=5, N=196"):
    linear.explain(x, _weight_shape(196, 256), (128, 128), implementation="mosaic", interpret=True)
  with pytest.raises(ValueError, match="implementation must be one of"):
    linear.explain(x, w, (128, 128), implementation="cuda")
  with pytest.raises(ValueError, match="quant_implementation must be one of"):
    linear.explain(x, w, (128, 128), quant_implementation="cuda")
  plan = linear.explain(x, w, (128, 128), implementation="xla", quant_implementation="triton", interpret=True)
  assert (plan.implementation, plan.quant_implementation) == ("xla", "triton")
  if not ON_GPU:
    for name in ("triton", "mosaic"):
      with pytest.raises(ValueError, match=f"implementation='{name}' needs"):
        linear.explain(_shape(8, 256), _weight_shape(256, 256), (128, 128), implementation=name, interpret=False)
    with pytest.raises(ValueError, match="quant_implementation='triton' needs"):
      linear.explain(x, w, (128, 128), quant_implementation="triton", interpret=False)


def _valid():
  return dict(x=np.ones((5, 256), np.float32), w_q=np.ones((200, 256), ref.FP8), w_s=np.ones((2, 2), np.float32),
              block_size=(128, 128))


@pytest.mark.parametrize("change, error, match", [
    (dict(x=np.ones((5, 256), np.int32)), TypeError, "x must be bfloat16, float16 or float32, got dtype int32"),
    (dict(x=[[1.0]]), TypeError, "x must be an array"),
    (dict(x=np.ones((), np.float32)), ValueError, "at least 1 dimension"),
    (dict(x=np.ones((5, 128), np.float32)), ValueError, "must share K"),
    (dict(x=np.ones((5, 200), np.float32), w_q=np.ones((64, 200), ref.FP8), w_s=np.ones((1, 2), np.float32)),
     ValueError, "K=200 must be a multiple of block_size"),
    (dict(w_q=np.ones((200, 256), np.float32)), TypeError, "w_q must have dtype float8_e4m3fn"),
    (dict(w_s=np.ones((2, 3), np.float32)), ValueError, r"w_s must have shape \(ceil\(N/gn\), ceil\(K/gk\)\) = \(2, 2\)"),
    (dict(w_s=np.ones((2, 2), np.float16)), TypeError, "w_s must have dtype float32"),
    (dict(bias=np.ones(201, np.float32)), ValueError, r"bias must have shape \(N,\) = \(200,\)"),
    (dict(bias=np.ones(200, np.int32)), TypeError, "bias must have dtype"),
    (dict(block_size=(128, 0)), ValueError, "gk=0"),
    (dict(out_dtype=jnp.int8), ValueError, "out_dtype must be bfloat16, float16 or float32"),
    (dict(row_alignment=0), ValueError, "row_alignment must be a positive integer, got 0"),
    (dict(implementation="xla", config=gemm.TritonGemmConfig()), ValueError, "config applies to"),
])
def test_validation_errors(change, error, match):
  args = {**_valid(), **change}
  with pytest.raises(error, match=match):
    w8a8_block_fp8_linear(args.pop("x"), args.pop("w_q"), args.pop("w_s"), args.pop("block_size"), **args)


# ---- the lowered programs: nothing copies activations or scales outside the kernels ----------------------------------

_FLOAT_TYPES = ("f8E4M3FN", "bf16", "f16", "f32")


def activation_copies(text: str) -> list[str]:
  """StableHLO lines that pad (with a non-zero width), concatenate or transpose floating-point arrays."""
  found = []
  for line in text.splitlines():
    op = re.search(r"stablehlo\.(pad|concatenate|transpose)\b", line)
    if not op:
      continue
    if not any(re.search(rf"x{t}>", line) for t in _FLOAT_TYPES):
      continue  # index vectors (e.g. of jnp.repeat) are not data
    if op.group(1) == "pad" and not re.search(r"(low|high|interior) = \[[^\]]*[1-9]", line):
      continue  # an all-zero pad is a no-op that XLA removes
    found.append(line.strip()[:200])
  return found


def _gpu_program(implementation, m, n, k, **kwargs) -> tuple[str, linear.LinearPlan]:
  from jax.experimental.pallas import triton as plt
  args = [_shape(m, k), _weight_shape(n, k), jax.ShapeDtypeStruct((ref.ceil_div(n, 128), ref.ceil_div(k, 128)), F32),
          jax.ShapeDtypeStruct((n,), F32)]
  f = lambda x, w_q, w_s, b: w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), b, implementation=implementation,
                                                  **kwargs)
  with _platform.abstract_h200():
    plan = linear.explain(args[0], args[1], (128, 128), implementation=implementation, **kwargs)
    exported = jax.export.export(
        jax.jit(f), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(plt.CUSTOM_CALL_TARGET_NAME)])(*args)
  return exported.mlir_module(), plan


def test_lowered_xla_program_has_no_activation_copies():
  args = (_shape(13, 384, F32), _weight_shape(200, 384), jax.ShapeDtypeStruct((2, 3), F32))
  text = jax.jit(lambda x, w_q, w_s: w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), implementation="xla")
                 ).lower(*args).as_text()
  assert "dot_general" in text
  assert not activation_copies(text), activation_copies(text)
  # XLA's GPU compiler folds x -> fp8 -> f32 convert chains (simplify-fp-conversions), which skipped the activations'
  # fp8 rounding in the jitted XLA linear on the H200 (43% error at M=1, N=1). That pass does not run on CPU, so the
  # check is on the program: both fp8 operands go through an optimization barrier before they are widened.
  barriers = [line for line in text.splitlines() if "stablehlo.optimization_barrier" in line]
  assert len(barriers) == 2 and all("xf8E4M3FN>" in line for line in barriers), barriers
  # The detector sees what it looks for.
  bad = jax.jit(lambda x: jnp.concatenate([jnp.pad(x, ((0, 3), (0, 0))).T, x.T], axis=1)).lower(args[0]).as_text()
  assert sorted(line.split("=")[1].split()[0] for line in activation_copies(bad)) == [
      "stablehlo.concatenate", "stablehlo.pad", "stablehlo.transpose", "stablehlo.transpose"]


_MOSAIC_AROUND = {"custom_call", "reshape", "slice", "constant", "broadcast_in_dim", "return"}


@pytest.mark.skipif(not helpers.MOSAIC_GEMM_IMPORTABLE, reason="pallas_kernels.gemm_mosaic not importable")
@pytest.mark.parametrize("m, n, k", [(1, 1536, 7168), (5, 1536, 7168), (13, 7168, 2048), (64, 7168, 2048),
                                     (300, 24576, 1536)])
def test_lowered_mosaic_program_is_two_kernels_back_to_back(m, n, k):
  text, plan = _gpu_program(None if m > gemm.TRITON_DECODE_MAX_M else "mosaic", m, n, k)
  assert plan.implementation == "mosaic"
  assert not activation_copies(text), activation_copies(text)
  ops = re.findall(r"stablehlo\.([a-z_]+)", text)
  # The quantizer's kernel and the GEMM's, and nothing between them but free reshapes; no slice of the output even
  # where the quantizer padded the rows (the GEMM computes the live rows only).
  assert ops.count("custom_call") == 2 and text.count("mosaic_gpu") >= 2, ops
  assert set(ops) <= _MOSAIC_AROUND, set(ops) - _MOSAIC_AROUND
  assert "slice" not in ops, (plan, ops)
  assert m >= 64 or plan.padded_rows == 64, plan


@pytest.mark.skipif(not helpers.MOSAIC_GEMM_IMPORTABLE, reason="pallas_kernels.gemm_mosaic not importable")
@pytest.mark.parametrize("m, n, k", [(40, 1536, 7168), (4096, 24576, 7168), (300, 7168, 2048)])
def test_lowered_valid_rows_program_is_the_dense_kernel_with_its_live_rows(m, n, k):
  """With a traced valid_rows the Mosaic linear lowers for the H200 to the quantizer (masked) and the dense kernel
  with its live-row count, which adds the bias itself: no float32 (M, N) result is written and cast afterwards."""
  from jax.experimental.pallas import triton as plt
  args = [_shape(m, k), _weight_shape(n, k), jax.ShapeDtypeStruct((ref.ceil_div(n, 128), ref.ceil_div(k, 128)), F32),
          jax.ShapeDtypeStruct((n,), F32), jax.ShapeDtypeStruct((), jnp.int32)]
  f = lambda x, w_q, w_s, b, v: w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), b, implementation="mosaic",
                                                     valid_rows=v)
  with _platform.abstract_h200():
    plan = linear.explain(args[0], args[1], (128, 128), implementation="mosaic", valid_rows=True)
    text = jax.export.export(
        jax.jit(f), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(plt.CUSTOM_CALL_TARGET_NAME)])(*args).mlir_module()
  assert plan.masked and plan.gemm.skips_dead_rows, str(plan)
  assert not plan.quant.problem.pad_rows_written and "pad rows past valid_rows unspecified" in str(plan), str(plan)
  assert "the row tiles past valid_rows are skipped" in plan.gemm.config_reason, str(plan)
  schedules = plan.gemm.config
  assert len(schedules.table) == -(-m // 64) and schedules.ranges()[-1][1] >= m
  kernels = len(re.findall(r"stablehlo\.custom_call @mosaic_gpu", text))
  assert kernels == len(schedules.configs) + 1, ("the quantizer's kernel and one GEMM kernel per live-row schedule",
                                                 kernels)
  assert f"x{n}xf32>" not in text, "a float32 (M, N) intermediate: the bias went in outside the kernel"


@pytest.mark.skipif(not helpers.MOSAIC_GEMM_IMPORTABLE, reason="pallas_kernels.gemm_mosaic not importable")
def test_lowered_program_check_catches_a_launcher_copy():
  # 12 rows (a multiple of 4, not of 8): the Mosaic GEMM's launcher pads a_q to 16 rows, a copy the test must see.
  text, plan = _gpu_program("mosaic", 12, 1536, 7168, row_alignment=1)
  assert plan.padded_rows == 12
  assert any("stablehlo.pad" in line for line in activation_copies(text))


@pytest.mark.parametrize("m, n, k", [(1, 576, 7168), (13, 2112, 7168), (300, 1088, 512)])
def test_lowered_triton_program_has_no_activation_copies(m, n, k):
  text, plan = _gpu_program(None if n % 128 else "triton", m, n, k)  # N % 128 != 0: Triton by default
  assert plan.implementation == "triton" and plan.padded_rows == m
  assert not activation_copies(text), activation_copies(text)
  ops = re.findall(r"stablehlo\.([a-z_]+)", text)
  assert ops.count("custom_call") == 2 and "slice" not in ops, ops


# ---- eager calls: row buckets and the executable cache --------------------------------------------------------------


@pytest.mark.skipif(ON_GPU, reason="platform-independent cache logic; its ~600 tiny glue compilations take a minute "
                                   "on a GPU")
def test_eager_m_1_to_300_compiles_one_executable_per_bucket(rng):
  n, k = 64, 128
  w_q, w_s = (jnp.asarray(a) for a in make_weight(rng, n, k))
  x_host = np.asarray(make_x(rng, (300, k), BF16))
  xs = [jax.device_put(x_host[:m]) for m in range(1, 301)]  # device arrays of every M (transfers, not compilations)
  buckets = linear.get_row_buckets().buckets_for(range(1, 301))
  assert buckets == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
  outs = {}
  with helpers.count_compilations() as compiled:
    for m, x in enumerate(xs, start=1):
      outs[m] = w8a8_block_fp8_linear(x, w_q, w_s, (128, 128))
  linear_compiles = [name for name in compiled if "jaxfp8_linear_bucket" in name]
  info = linear.cache_info()
  assert len(linear_compiles) == len(buckets) == info.misses == info.executables, (linear_compiles, info)
  assert info.hits == 300 - len(buckets) and info.buckets == buckets
  # What else compiled is the row pad / slice glue around the executable: on a GPU at most one of each per distinct
  # M; on CPU none (the host pads and slices arrays that live in its memory).
  glue = [name for name in compiled if "jaxfp8_linear_bucket" not in name]
  if jax.default_backend() == "cpu":
    assert not glue, sorted(set(glue))
  else:
    assert len(glue) <= 2 * 300 and all("rows_" in name for name in glue), sorted(set(glue))
  for m in (1, 3, 100, 257, 300):
    jitted = jax.jit(lambda x: w8a8_block_fp8_linear(x, w_q, w_s, (128, 128)))(xs[m - 1])
    np.testing.assert_array_equal(bits(outs[m]), bits(jitted), err_msg=f"M={m}")


def test_numpy_inputs_are_padded_on_the_host(rng):
  # No pad glue and no staging of the input: one executable per bucket, and an output slice for each M that is not
  # a bucket size (M = 1, 2, 4, 8, 16, 32 compile nothing but their bucket's executable).
  w_q, w_s = (jnp.asarray(a) for a in make_weight(rng, 64, 128))
  x_host = np.asarray(make_x(rng, (40, 128), F32))
  with helpers.count_compilations() as compiled:
    for m in range(1, 41):
      out = w8a8_block_fp8_linear(x_host[:m], w_q, w_s, (128, 128))
      assert out.shape == (m, 64)
  assert compiled.count("jit(jaxfp8_linear_bucket)") == 7, compiled  # buckets 1, 2, 4, ..., 64
  slices = 0 if jax.default_backend() == "cpu" else 40 - 6  # (CPU outputs are sliced on the host)
  assert compiled.count("jit(_rows_from_bucket_jit)") == slices and len(compiled) == 7 + slices, compiled


@pytest.mark.skipif(ON_GPU, reason="the host pad and slice serve arrays on a CPU device")
def test_cpu_row_counts_compile_their_glue_from_the_second_call(rng):
  """A row count's first eager call pads and slices on the host (no compilation); its second compiles the pad and
  the slice once (a compiled copy dispatches faster than a host copy and transfer); later calls compile nothing.
  Every call returns the same bits."""
  w_q, w_s = (jnp.asarray(a) for a in make_weight(rng, 64, 128))
  x = jax.device_put(np.asarray(make_x(rng, (2, 7, 128), F32)))  # 14 rows, bucket 16, leading dimensions
  linear.cache_clear()
  outs, compiled = [], []
  for _ in range(3):
    with helpers.count_compilations() as names:
      outs.append(np.asarray(w8a8_block_fp8_linear(x, w_q, w_s, (128, 128))))
    compiled.append(sorted(names))
  assert compiled == [["jit(jaxfp8_linear_bucket)"], ["jit(_rows_from_bucket_jit)", "jit(_rows_to_bucket_jit)"], []]
  assert outs[0].shape == (2, 7, 64)
  for out in outs[1:]:
    np.testing.assert_array_equal(bits(out), bits(outs[0]))


def test_cache_clear_drops_the_glue_too(rng):
  # The compile counts above hold only if cache_clear also drops the row slice glue an earlier test compiled for the
  # same shapes (under pytest-xdist a worker's earlier tests vary: this once failed CI with 33 slices instead of 34).
  w_q, w_s = (jnp.asarray(a) for a in make_weight(rng, 64, 128))
  x_host = np.asarray(make_x(rng, (3, 128), F32))
  w8a8_block_fp8_linear(x_host, w_q, w_s, (128, 128))
  linear.cache_clear()
  with helpers.count_compilations() as compiled:
    w8a8_block_fp8_linear(x_host, w_q, w_s, (128, 128))
  glue = [] if jax.default_backend() == "cpu" else ["jit(_rows_from_bucket_jit)"]
  assert sorted(compiled) == sorted(glue + ["jit(jaxfp8_linear_bucket)"]), compiled


def test_outer_jit_adds_no_compilations(rng):
  w1, s1 = (jnp.asarray(a) for a in make_weight(rng, 256, 128))
  w2, s2 = (jnp.asarray(a) for a in make_weight(rng, 128, 256))

  @jax.jit
  def mlp(x):
    h = jax.nn.gelu(w8a8_block_fp8_linear(x, w1, s1, (128, 128)))
    return w8a8_block_fp8_linear(h, w2, s2, (128, 128))

  x = make_x(rng, (2, 7, 128), BF16)
  with helpers.count_compilations() as compiled:
    first = mlp(x)
    again = mlp(x)
  assert compiled == ["jit(mlp)"], compiled
  x_short = x[:, :3]
  with helpers.count_compilations() as compiled:
    mlp(x_short)
  assert compiled == ["jit(mlp)"], compiled
  assert linear.cache_info()[:3] == (0, 0, 0)
  np.testing.assert_array_equal(bits(first), bits(again))
  h = jax.nn.gelu(w8a8_block_fp8_linear(x, w1, s1, (128, 128)))
  np.testing.assert_array_equal(bits(first), bits(w8a8_block_fp8_linear(h, w2, s2, (128, 128))))


def test_row_bucket_configuration(rng):
  assert linear.RowBuckets().bucket(300) == 512 and linear.RowBuckets().bucket(257) == 512
  assert linear.RowBuckets().bucket(0) == 0 and linear.RowBuckets(sizes=(), step=1).bucket(77) == 77
  with pytest.raises(ValueError, match="strictly increasing"):
    linear.RowBuckets(sizes=(8, 4))
  with pytest.raises(ValueError, match="step must be a positive int"):
    linear.RowBuckets(step=0)
  w_q, w_s = (jnp.asarray(a) for a in make_weight(rng, 64, 128))
  with linear.row_buckets([8, 32]) as buckets:
    assert buckets == linear.RowBuckets(sizes=(8, 32), step=32)
    for m in (1, 7, 9, 33, 40):
      w8a8_block_fp8_linear(np.ones((m, 128), np.float32), w_q, w_s, (128, 128))
    assert linear.cache_info().buckets == (8, 32, 64)
  assert linear.get_row_buckets() == linear.RowBuckets()
  linear.cache_clear()
  assert linear.cache_info()[:4] == (0, 0, 0, ())


def test_pad_to_bucket():
  x = np.arange(2 * 5 * 3, dtype=np.float32).reshape(2, 5, 3)
  padded, size = linear.pad_to_bucket(x, axis=1)
  assert size == 5 and padded.shape == (2, 8, 3) and isinstance(padded, np.ndarray)
  np.testing.assert_array_equal(padded[:, :5], x)
  assert not padded[:, 5:].any()
  padded_jax, size = linear.pad_to_bucket(jnp.asarray(x), axis=-2)
  np.testing.assert_array_equal(np.asarray(padded_jax), padded)
  same, size = linear.pad_to_bucket(x[:, :4], axis=1)
  assert same.shape == (2, 4, 3) and size == 4
  assert linear.pad_to_bucket(np.ones((300, 2)), buckets=linear.RowBuckets(sizes=(), step=100))[0].shape == (300, 2)


def test_cache_keys_separate_implementations_and_options(rng):
  w_q, w_s = (jnp.asarray(a) for a in make_weight(rng, 200, 256))
  x = make_x(rng, (5, 256), BF16)
  a = w8a8_block_fp8_linear(x, w_q, w_s, (128, 128))
  b = w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), implementation="triton", interpret=True)
  c = w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), out_dtype=F32)
  w8a8_block_fp8_linear(x[:4], w_q, w_s, (128, 128), out_dtype=F32)
  x_six = make_x(rng, (6, 256), BF16)
  assert linear.cache_info()[:3] == (0, 4, 4)
  w8a8_block_fp8_linear(x_six, w_q, w_s, (128, 128), implementation="triton", interpret=True)
  assert linear.cache_info()[:3] == (1, 4, 4)  # 6 rows: the bucket of 8 that the 5-row call compiled
  assert ref.relative_error(a, b) <= 5e-3 and ref.relative_error(a, c) <= 5e-3


def test_concurrent_eager_calls_compile_each_bucket_once(rng):
  w_q, w_s = (jnp.asarray(a) for a in make_weight(rng, 128, 256))
  x_host = np.asarray(make_x(rng, (32, 256), BF16))
  ms = [3, 4, 3, 20, 30, 17, 4, 32] * 4
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    outs = list(pool.map(lambda m: w8a8_block_fp8_linear(x_host[:m], w_q, w_s, (128, 128)), ms))
  info = linear.cache_info()
  assert info.misses == info.executables == 2 and info.hits == len(ms) - 2 and info.buckets == (4, 32)
  for m, out in zip(ms, outs):
    np.testing.assert_array_equal(bits(out), bits(outs[ms.index(m)]))
  assert_close(outs[3], jnp.asarray(x_host[:20]), np.asarray(w_q), np.asarray(w_s), (128, 128))


def test_failed_compilations_are_not_cached(rng, monkeypatch):
  w_q, w_s = (jnp.asarray(a) for a in make_weight(rng, 64, 128))
  x = np.ones((3, 128), np.float32)
  real_apply = linear.planner.apply
  monkeypatch.setattr(linear.planner, "apply", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
  with pytest.raises(RuntimeError, match="boom"):
    w8a8_block_fp8_linear(x, w_q, w_s, (128, 128))
  assert linear.cache_info().executables == 0
  monkeypatch.setattr(linear.planner, "apply", real_apply)
  assert w8a8_block_fp8_linear(x, w_q, w_s, (128, 128)).shape == (3, 64)


# ---- GPU: the real kernels at model sizes -------------------------------------------------------------------------

GPU_SHAPES = [("deepseek_v3", "q_a_proj"), ("deepseek_v3", "kv_a_proj_with_mqa"), ("deepseek_v3", "o_proj"),
              ("qwen3_32b", "qkv_proj"), ("unaligned_for_fallback_tests", "n_tail")]


@pytest.mark.gpu
@pytest.mark.parametrize("model, layer", GPU_SHAPES)
def test_gpu_full_size_matches_reference(model, layer, rng):
  n, k = shapes.load()[model][layer]
  w_q, w_s = make_weight(rng, n, k)
  w_q_dev, w_s_dev = jnp.asarray(w_q), jnp.asarray(w_s)
  bias = (rng.standard_normal(n) * 4).astype(np.float32)
  for x_shape, dtype in (((1, k), BF16), ((3, 5, k), BF16), ((64, k), F32), ((257, k), BF16)):
    x = make_x(rng, x_shape, dtype)
    eager = w8a8_block_fp8_linear(x, w_q_dev, w_s_dev, (128, 128), bias)
    jitted = jax.jit(lambda x: w8a8_block_fp8_linear(x, w_q_dev, w_s_dev, (128, 128), bias))(x)
    assert_close(jitted, x, w_q, w_s, (128, 128), bias)
    assert_close(eager, x, w_q, w_s, (128, 128), bias)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["mosaic", "triton"])  # XLA's own dot may pick other algorithms per M
def test_gpu_padded_rows_give_bit_identical_live_rows(implementation, rng):
  if implementation == "mosaic" and not _platform.is_hopper():
    pytest.skip("the Mosaic kernel needs a Hopper GPU")
  n, k = 1536, 7168
  w_q, w_s = (jnp.asarray(a) for a in make_weight(rng, n, k))
  x_all = make_x(rng, (64, k), BF16)
  # One config for every M: the tuned table picks configs (and split-K) per M bucket, which changes the summation order.
  config = None if implementation == "mosaic" else gemm.TritonGemmConfig(
      block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3, swap_ab=True)
  f = lambda x, a=None: jax.jit(lambda x: w8a8_block_fp8_linear(
      x, w_q, w_s, (128, 128), out_dtype=F32, implementation=implementation, row_alignment=a, config=config))(x)
  superset = np.asarray(f(x_all))
  for m in (1, 3, 5, 13, 33):
    for alignment in (None, 8, 16):
      np.testing.assert_array_equal(bits(f(x_all[:m], alignment)), bits(superset[:m]), err_msg=f"M={m} {alignment}")


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("m", [1, 8, 16, 64, 300])
def test_gpu_linear_is_quantizer_then_gemm(m, rng):
  # Decode fusion: one jitted linear launches the quantizer, then exactly the kernels of the GEMM called alone on its
  # output (the Triton decode GEMM adds an f32 -> bf16 convert of its own), and nothing else: the slice of padded
  # output rows launches no kernel (seen on the H200 at M=1 and M=300).
  from jaxfp8.tools import timing
  n, k = 1536, 7168
  w_q, w_s = (jnp.asarray(a) for a in make_weight(rng, n, k))
  bias = jnp.asarray(rng.standard_normal(n), F32)
  x = make_x(rng, (m, k), BF16)
  f = jax.jit(lambda x: w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), bias))
  plan = linear.explain(x, w_q, (128, 128))
  names = timing.kernel_names(f, (x,))
  assert plan.scale_layout == "col", str(plan)
  a_q, a_s = quant.per_token_group_quant_fp8_row_padded(
      x, 128, row_alignment=plan.row_alignment, implementation=plan.quant_implementation)
  gemm_alone = jax.jit(lambda a_q, a_s: gemm.w8a8_block_fp8_matmul(
      a_q, w_q, a_s, w_s, (128, 128), a_s_column_major=True, bias=bias, implementation=plan.implementation,
      config=plan.config))
  gemm_names = timing.kernel_names(gemm_alone, (a_q, a_s))
  assert "quant" in names[0] and names[1:] == gemm_names, (str(plan), names, gemm_names)


@pytest.mark.gpu
def test_gpu_dispatch_matches_the_device():
  # Hopper: the Mosaic GEMM for aligned shapes, except decode (M <= gemm.TRITON_DECODE_MAX_M), where the Triton
  # kernel measured faster.
  for m in (5, 64):
    plan = linear.explain(_shape(m, 7168), _weight_shape(1536, 7168), (128, 128))
    hopper_choice = "triton" if m <= gemm.TRITON_DECODE_MAX_M else "mosaic"
    assert plan.implementation == (hopper_choice if _platform.is_hopper() else "triton"), str(plan)
  plan = linear.explain(_shape(5, 7168), _weight_shape(2112, 7168), (128, 128))
  assert plan.implementation == "triton", str(plan)


# ---- the benchmark's plumbing on CPU (a fake timer; the real numbers come from the GPU) -----------------------------

def test_bench_linear_plumbing(monkeypatch, tmp_path):
  from jaxfp8.tools import bench_linear, timing

  def fake_median(fn, arg_sets, *, iterations=30, sync=jax.block_until_ready):
    sync(fn(*arg_sets[0]))
    return 2.0

  monkeypatch.setattr(timing, "median_kernel_us", fake_median)
  monkeypatch.setattr(timing, "kernel_names", lambda fn, args, **_: ["quant", "gemm"])
  out = tmp_path / "linear.json"
  result = bench_linear.run([("small", 200, 256)], [3, 70], bench_linear.CONTENDERS, str(out), iterations=2,
                            log=lambda *_: None)
  rows = {(r["m"], r["contender"]): r for r in result["rows"]}
  for m in (3, 70):
    for name in ("linear", "gemm", "dequant_bf16", "w8a16_bf16"):
      assert rows[(m, name)]["within_bf16_bound"], rows[(m, name)]
    assert rows[(m, "linear")]["rel_err"] <= 5e-3 and rows[(m, "linear_vs_gemm")]["ratio"] == 1.0
  assert rows[(3, "linear")]["kernels"] == ["quant", "gemm"] and rows[(3, "linear_vs_gemm")]["meets_decode_target"]
  assert "meets_decode_target" not in rows[(70, "linear_vs_gemm")]
  assert json.loads(out.read_text())["rows"] and (tmp_path / "linear.md").read_text().count("| small |") == 2
  assert len(bench_linear.default_shapes()) == 15
