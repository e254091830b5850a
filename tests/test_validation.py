"""Validation rules of the public entry points that the per-module tests do not cover: one test per rule.

Rules already tested elsewhere (not repeated here):
  per_token_group_quant_fp8: tests/test_quant.py ERROR_CASES (x dtype/rank, group_size, row_alignment, eps, pack without
    ue8m0, tma without column-major, odd SiLU width, masked_m shape/dtype/rank, implementation name) and
    test_kernel_without_gpu_needs_interpret; Mosaic group sizes: tests/test_quant_mosaic.py.
  w8a8_block_fp8_matmul: tests/test_gemm.py test_validation_errors (array types, ranks, K, a_s/b_s shapes in both
    layouts, block_size, out_dtype, bias, implementation, Triton configs), test_configs_that_cannot_run_are_rejected,
    test_mosaic_rejects_unaligned_m, test_gpu_implementations_without_interpret_on_cpu_are_rejected.
  w8a8_block_fp8_linear / explain: tests/test_linear.py test_validation_errors, test_explicit_implementations_are_*.
  quantize/dequantize_weight_blockwise, load_hf_fp8_linears, save_hf_fp8_linears, config.json: tests/test_weights.py
    (weight dtype beside block scales, scales without weight, malformed block size or config, what save refuses).
  column/row_parallel_linear: tests/test_sharding.py (shares of N/K, axis name, Explicit-sharded x).
  nn.Fp8Linear: tests/test_nn.py (w_s shape, in_features % gk, parallel without mesh, from_linear type, a bias that
    use_bias=False would drop).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfp8
from jaxfp8 import gemm, linear, reference as ref, weights

FP8 = ref.FP8


def _x(shape=(4, 128), dtype=jnp.float32):
  return jnp.ones(shape, dtype)


# ---- per_token_group_quant_fp8 -------------------------------------------------------------------------------------

def test_quant_x_must_be_an_array():
  with pytest.raises(TypeError, match="x must be an array, got list"):
    jaxfp8.per_token_group_quant_fp8([[1.0] * 128], 128)


def test_quant_x_float8_is_refused():
  with pytest.raises(TypeError, match="x must be bfloat16, float16 or float32, got dtype float8_e4m3fn"):
    jaxfp8.per_token_group_quant_fp8(_x(dtype=jnp.float8_e4m3fn), 128)


def test_quant_group_size_must_not_be_bool_or_float():
  with pytest.raises(ValueError, match="group_size must be a positive integer, got True"):
    jaxfp8.per_token_group_quant_fp8(_x(), True)
  with pytest.raises(ValueError, match="group_size must be a positive integer, got 128.0"):
    jaxfp8.per_token_group_quant_fp8(_x(), 128.0)


def test_quant_eps_must_be_finite_number():
  for eps in (float("nan"), float("inf"), True, "1e-10"):
    with pytest.raises(ValueError, match="eps must be a positive finite number"):
      jaxfp8.per_token_group_quant_fp8(_x(), 128, eps=eps)


@pytest.mark.parametrize("flag", ["column_major_scales", "scale_tma_aligned", "scale_ue8m0", "pack_ue8m0",
                                  "fuse_silu_and_mul"])
def test_quant_flags_must_be_bools(flag):
  # A truthy string such as "no" must not silently switch an option on.
  with pytest.raises(TypeError, match=f"{flag} must be a bool, got 'no'"):
    jaxfp8.per_token_group_quant_fp8(_x(), 64, **{flag: "no"})


def test_quant_flags_accept_numpy_bools():
  q, s = jaxfp8.per_token_group_quant_fp8(_x(), 128, column_major_scales=np.bool_(True))
  assert s.shape == (1, 4)


def test_quant_interpret_must_be_none_or_bool():
  with pytest.raises(TypeError, match="interpret must be None or a bool, got 'yes'"):
    jaxfp8.per_token_group_quant_fp8(_x(), 128, interpret="yes")


def test_quant_config_is_refused_for_xla():
  with pytest.raises(ValueError, match="config applies to the 'triton' and 'mosaic' implementations, not 'xla'"):
    jaxfp8.per_token_group_quant_fp8(_x(), 128, implementation="xla", config=object())


@pytest.mark.parametrize("implementation, name", [("triton", "QuantTritonConfig"), ("mosaic", "QuantMosaicConfig")])
def test_quant_config_must_match_the_implementation(implementation, name):
  with pytest.raises(TypeError, match=f"config for implementation='{implementation}' must be a {name}, got object"):
    jaxfp8.per_token_group_quant_fp8(_x(), 128, implementation=implementation, interpret=True, config=object())


def test_quant_masked_m_must_be_an_array():
  with pytest.raises(TypeError, match="masked_m must be an int32 array, got list"):
    jaxfp8.per_token_group_quant_fp8(_x((2, 4, 128)), 128, masked_m=[1, 2])


def test_row_padded_quant_validates_like_the_general_one():
  with pytest.raises(ValueError, match="row_alignment must be a positive integer, got 0"):
    jaxfp8.per_token_group_quant_fp8_row_padded(_x(), 128, row_alignment=0)
  with pytest.raises(ValueError, match="K=128 must be a multiple of group_size=100"):
    jaxfp8.per_token_group_quant_fp8_row_padded(_x(), 100)


# ---- w8a8_block_fp8_matmul -----------------------------------------------------------------------------------------

def _gemm_args(m=8, n=256, k=256):
  return (np.ones((m, k), FP8), np.ones((n, k), FP8), np.ones((m, k // 128), np.float32),
          np.ones((n // 128, k // 128), np.float32), (128, 128))


def test_gemm_a_s_column_major_must_be_a_bool():
  with pytest.raises(TypeError, match="a_s_column_major must be a bool, got 'False'"):
    jaxfp8.w8a8_block_fp8_matmul(*_gemm_args(), a_s_column_major="False")


def test_gemm_interpret_must_be_none_or_bool():
  with pytest.raises(TypeError, match="interpret must be None or a bool, got 1"):
    jaxfp8.w8a8_block_fp8_matmul(*_gemm_args(), interpret=1)


def test_gemm_mosaic_config_type():
  with pytest.raises(TypeError, match="config for implementation='mosaic' must be a MosaicGemmConfig, got Triton"):
    jaxfp8.w8a8_block_fp8_matmul(*_gemm_args(), implementation="mosaic", interpret=True,
                                 config=gemm.TritonGemmConfig())


def test_gemm_other_fp8_formats_are_refused():
  a_q, *rest = _gemm_args()
  with pytest.raises(TypeError, match="a_q must have dtype float8_e4m3fn, got float8_e5m2"):
    jaxfp8.w8a8_block_fp8_matmul(a_q.astype(jnp.float8_e5m2), *rest)


def test_gemm_block_size_array_is_refused():
  *arrays, _ = _gemm_args()
  with pytest.raises(TypeError, match="block_size must be a pair"):
    jaxfp8.w8a8_block_fp8_matmul(*arrays, np.array([128, 128]))


def test_gemm_scalar_bias_is_refused():
  with pytest.raises(ValueError, match=r"bias must have shape \(N,\) = \(256,\), got \(\)"):
    jaxfp8.w8a8_block_fp8_matmul(*_gemm_args(), bias=np.float32(1.0))


# ---- w8a8_block_fp8_linear, explain, parallel linears --------------------------------------------------------------

def _linear_args():
  return np.ones((5, 256), np.float32), np.ones((200, 256), FP8), np.ones((2, 2), np.float32), (128, 128)


def test_linear_weight_ranks():
  x, w_q, w_s, bs = _linear_args()
  with pytest.raises(ValueError, match=r"w_q must be 2-D, got shape \(256,\)"):
    jaxfp8.w8a8_block_fp8_linear(x, w_q[0], w_s, bs)
  with pytest.raises(ValueError, match=r"w_s must be 2-D, got shape \(2, 2, 1\)"):
    jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s[..., None], bs)


def test_linear_interpret_must_be_none_or_bool():
  with pytest.raises(TypeError, match="interpret must be None or a bool, got 'no'"):
    jaxfp8.w8a8_block_fp8_linear(*_linear_args(), interpret="no")


def test_linear_out_dtype_not_a_dtype():
  with pytest.raises(TypeError, match="out_dtype must be a floating dtype .* got"):
    jaxfp8.w8a8_block_fp8_linear(*_linear_args(), out_dtype="nope")


@pytest.mark.parametrize("row_alignment", [1, 3])
def test_linear_mosaic_takes_any_row_alignment_eagerly_and_under_jit(row_alignment):
  """Rows the Mosaic GEMM does not read fastest (13 or 15 of them) still run, the same eagerly, under jit and in
  `explain`: the backend pads the TMA view itself."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((13, 256)), jnp.float32)
  w_q, w_s = jaxfp8.quantize_weight_blockwise(jnp.asarray(rng.standard_normal((256, 256)), jnp.float32))
  call = lambda x: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), row_alignment=row_alignment,
                                                implementation="mosaic", interpret=True)
  plan = linear.explain(x, w_q, (128, 128), row_alignment=row_alignment, implementation="mosaic", interpret=True)
  assert plan.padded_rows == -(-13 // row_alignment) * row_alignment and "asked for" in plan.row_reason
  eager, jitted = np.asarray(call(x)), np.asarray(jax.jit(call)(x))
  want = jaxfp8.reference.w8a8_block_fp8_linear(np.asarray(x), np.asarray(w_q), np.asarray(w_s), (128, 128))
  for out in (eager, jitted):
    assert jaxfp8.reference.relative_error(out, want) <= 2e-4


def test_explain_checks_weight_dtype_and_rank():
  x = jax.ShapeDtypeStruct((5, 256), jnp.bfloat16)
  with pytest.raises(TypeError, match="w_q must be an array or a jax.ShapeDtypeStruct, got list"):
    linear.explain(x, [[1]], (128, 128))
  with pytest.raises(TypeError, match="w_q must have dtype float8_e4m3fn, got float32"):
    linear.explain(x, jax.ShapeDtypeStruct((200, 256), jnp.float32), (128, 128))
  with pytest.raises(ValueError, match=r"w_q must be 2-D, got shape \(1, 200, 256\)"):
    linear.explain(x, jax.ShapeDtypeStruct((1, 200, 256), jnp.float8_e4m3fn), (128, 128))


def test_parallel_linear_mesh_must_be_a_mesh():
  x, w_q, w_s, bs = _linear_args()
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh, got str"):
    linear.column_parallel_linear(x, w_q, w_s, bs, mesh="tp", axis_name="tp")
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh, got str"):
    linear.row_parallel_linear(x, w_q, w_s, bs, mesh="tp", axis_name="tp")


def test_parallel_linear_validates_x():
  x, w_q, w_s, bs = _linear_args()
  mesh = jax.make_mesh((1,), ("tp",))
  with pytest.raises(TypeError, match="x must be bfloat16, float16 or float32, got dtype int32"):
    linear.row_parallel_linear(x.astype(np.int32), w_q, w_s, bs, mesh=mesh, axis_name="tp")


def test_weight_spec_names():
  with pytest.raises(ValueError, match="parallel must be one of"):
    linear.weight_spec("diagonal", "tp", "w_q")
  with pytest.raises(ValueError, match="field must be 'w_q', 'w_s' or 'bias', got 'b'"):
    linear.weight_spec("column", "tp", "b")


def test_row_buckets_sizes_must_be_positive():
  with pytest.raises(ValueError, match=r"RowBuckets.sizes must be positive ints, got \(0,\)"):
    linear.RowBuckets(sizes=(0,))
  with pytest.raises(ValueError, match="needs at least one size"):
    linear.set_row_buckets([])


# ---- weights -------------------------------------------------------------------------------------------------------

def test_quantize_weight_accepts_numpy_eps_and_refuses_lists():
  w_q, w_s = jaxfp8.quantize_weight_blockwise(np.ones((4, 4), np.float32), (128, 128), eps=np.float32(1e-10))
  assert w_s.shape == (1, 1)
  with pytest.raises(TypeError, match="w must be an array, got list"):
    jaxfp8.quantize_weight_blockwise([[1.0]], (128, 128))


def test_dequantize_dtype_must_be_floating():
  w_q, w_s = np.ones((4, 4), FP8), np.ones((1, 1), np.float32)
  with pytest.raises(ValueError, match="dtype must be bfloat16, float16 or float32, got int8"):
    jaxfp8.dequantize_weight_blockwise(w_q, w_s, (128, 128), dtype=jnp.int8)
  with pytest.raises(TypeError, match="dtype must be a floating dtype .* got 'nope'"):
    jaxfp8.dequantize_weight_blockwise(w_q, w_s, (128, 128), dtype="nope")


def test_dequantize_w_q_must_be_fp8_2d():
  with pytest.raises(TypeError, match="w_q must have dtype float8_e4m3fn, got float32"):
    jaxfp8.dequantize_weight_blockwise(np.ones((4, 4), np.float32), np.ones((1, 1), np.float32), (128, 128))
  with pytest.raises(ValueError, match=r"w_q must be 2-D, got shape \(1, 4, 4\)"):
    jaxfp8.dequantize_weight_blockwise(np.ones((1, 4, 4), FP8), np.ones((1, 1), np.float32), (128, 128))


def test_load_checkpoint_path_type():
  with pytest.raises(TypeError, match="path must be a file or directory path or a list of file paths, got None"):
    weights.load_hf_fp8_linears(None)
  with pytest.raises(ValueError, match="path is an empty list"):
    weights.load_hf_fp8_linears([])


def test_load_checkpoint_select_type(tmp_path):
  # A string would select by substring ("in"), silently loading the wrong layers.
  for select in (3, "model.layers.0"):
    with pytest.raises(TypeError, match="select must be None, a predicate or a collection of prefixes"):
      weights.load_hf_fp8_linears(tmp_path, select=select, block_size=(128, 128))


def test_load_checkpoint_as_numpy_must_be_a_bool(tmp_path):
  pytest.importorskip("safetensors")
  with pytest.raises(TypeError, match="as_numpy must be a bool, got 'no'"):
    weights.load_hf_fp8_linears(tmp_path, as_numpy="no")


# ---- nn.Fp8Linear --------------------------------------------------------------------------------------------------

nn = pytest.importorskip("jaxfp8.nn")


@pytest.mark.parametrize("name, value", [("in_features", 0), ("out_features", -1), ("in_features", 128.0),
                                         ("out_features", True)])
def test_fp8_linear_features_must_be_positive_ints(name, value):
  kwargs = dict(in_features=128, out_features=64)
  kwargs[name] = value
  with pytest.raises(ValueError, match=f"{name} must be a positive integer, got {value!r}"):
    nn.Fp8Linear(kwargs["in_features"], kwargs["out_features"])


def test_fp8_linear_implementation_names_are_checked_at_construction():
  with pytest.raises(ValueError, match="implementation must be one of .* got 'cuda'"):
    nn.Fp8Linear(128, 64, implementation="cuda")
  with pytest.raises(ValueError, match="quant_implementation must be one of .* got 'cuda'"):
    nn.Fp8Linear(128, 64, quant_implementation="cuda")


def test_fp8_linear_mesh_must_be_a_mesh():
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh, got str"):
    nn.Fp8Linear(128, 128, parallel="column", mesh="m", axis_name="tp")


def test_fp8_linear_from_weights_bias_shape():
  with pytest.raises(ValueError, match=r"bias must have shape \(N,\) = \(4,\), got \(5,\)"):
    nn.Fp8Linear.from_weights(np.ones((4, 128), FP8), np.ones((1, 1), np.float32), bias=np.ones(5))


def test_fp8_linear_dtypes_must_be_float_dtypes():
  with pytest.raises(ValueError, match="param_dtype must be bfloat16, float16 or float32, got int8"):
    nn.Fp8Linear(128, 64, param_dtype=jnp.int8)
  with pytest.raises(TypeError, match="dtype must be a floating dtype .* got 'nope'"):
    nn.Fp8Linear(128, 64, dtype="nope")
