"""The linear's gradient (docs/CONTRACT.md §6) against the float64 gradient of the dequantized linear.

backward="bf16": within the GEMM's tolerance, and `jax.test_util.check_vjp` of our VJP against finite differences of
the dequantized (smooth) linear. backward="fp8": dy quantized per 1 x gn group, within the contract's bound for
Gaussian dy, exact-to-tolerance where dy is representable in e4m3 with its group's scale. dbias is the float32 sum;
the frozen weights' cotangents are zeros. Under jit, vmap, remat and the tensor-parallel linears; second
derivatives are refused.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import test_util

import helpers
import jaxfp8
from jaxfp8 import reference as ref
from jaxfp8._transforms import TransformError

IMPLEMENTATIONS = ["xla", "triton", "mosaic"]
FP8_BOUND = 6e-2   # docs/CONTRACT.md §6: dy's e4m3 quantization error, Gaussian dy
GEMM_F32 = 2e-4


def _interpret(implementation):
  return None if implementation == "xla" else not helpers.ON_GPU


def _problem(rng, m=9, n=384, k=256, block_size=(128, 128), dtype=jnp.float32):
  w = rng.standard_normal((n, k)).astype(np.float32) * np.exp2(rng.uniform(-2, 2, (n, 1))).astype(np.float32)
  w_q, w_s = jaxfp8.quantize_weight_blockwise(jnp.asarray(w), block_size)
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
  dy = rng.standard_normal((m, n)).astype(np.float32)
  return x, w_q, w_s, bias, dy


def _exact_dx(dy, w_q, w_s, block_size=(128, 128)) -> np.ndarray:
  return np.asarray(dy, np.float64) @ ref.dequantize_weight_blockwise(np.asarray(w_q), np.asarray(w_s), block_size)


def _vjp(x, w_q, w_s, bias, dy, block_size=(128, 128), **options):
  f = lambda x, w_q, w_s, bias: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, block_size, bias, **options)
  _, vjp = jax.vjp(f, x, w_q, w_s, bias)
  return vjp(jnp.asarray(dy, f(x, w_q, w_s, bias).dtype))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("backward, bound", [("bf16", GEMM_F32), ("fp8", FP8_BOUND)])
def test_dx_dbias_and_frozen_weights(rng, implementation, backward, bound):
  helpers.runnable(implementation)
  x, w_q, w_s, bias, dy = _problem(rng)
  dx, dw_q, dw_s, dbias = _vjp(x, w_q, w_s, bias, dy, implementation=implementation, backward=backward,
                               interpret=_interpret(implementation))
  assert dx.shape == x.shape and dx.dtype == x.dtype
  assert ref.relative_error(np.asarray(dx), _exact_dx(dy, w_q, w_s)) <= bound
  # The float32 sum over rows, in the device's summation order.
  np.testing.assert_allclose(np.asarray(dbias), dy.astype(np.float64).sum(axis=0), rtol=1e-5, atol=1e-5)
  assert not np.asarray(dw_q).astype(np.float32).any() and not np.asarray(dw_s).any()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fp8_backward_is_exact_where_dy_is_representable(rng, implementation):
  """dy = e4m3 codes times a power of two per 128-column group: its quantization is exact, and so the FP8 backward
  is the dequantized product to the GEMM's float32 tolerance."""
  helpers.runnable(implementation)
  x, w_q, w_s, bias, _ = _problem(rng)
  codes = np.clip(rng.standard_normal((9, 384)) * 50, -448, 448).astype(ref.FP8).astype(np.float32)
  codes[:, ::128] = 448.0  # each group's max is 448, so its scale is exactly its power of two
  dy = codes * np.repeat(np.exp2(rng.integers(-6, 6, (9, 3))).astype(np.float32), 128, axis=1) / 448
  dx, *_ = _vjp(x, w_q, w_s, bias, dy, implementation=implementation, backward="fp8",
                interpret=_interpret(implementation))
  assert ref.relative_error(np.asarray(dx), _exact_dx(dy, w_q, w_s)) <= GEMM_F32


def test_bf16_backward_passes_check_vjp(rng):
  """jax.test_util.check_vjp: our VJP against the numerical derivative of the dequantized linear (the quantized
  forward is piecewise constant in x, so the numerical derivative is taken of the function whose gradient the
  backward promises)."""
  x, w_q, w_s, bias, _ = _problem(rng, m=3, n=256, k=256)
  w = jnp.asarray(ref.dequantize_weight_blockwise(np.asarray(w_q), np.asarray(w_s), (128, 128)), jnp.float32)
  smooth = lambda x: jnp.dot(x, w.T, precision=jax.lax.Precision.HIGHEST) + bias
  ours = lambda x: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), bias, backward="bf16")
  test_util.check_vjp(smooth, functools.partial(jax.vjp, ours), (x,), atol=1e-2, rtol=1e-2, eps=1e-2)


@pytest.mark.parametrize("backward", ["fp8", "bf16"])
def test_leading_dims_low_precision_and_jit(rng, backward):
  x, w_q, w_s, bias, _ = _problem(rng, m=12)
  x = x.reshape(3, 4, 256).astype(jnp.bfloat16)
  loss = lambda x, b: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), b, backward=backward).astype(
      jnp.float32).sum()
  dx, db = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, bias)
  assert dx.shape == x.shape and dx.dtype == jnp.bfloat16 and db.dtype == jnp.float32
  want = _exact_dx(np.ones((12, 384), np.float32), w_q, w_s).reshape(3, 4, 256)
  assert ref.relative_error(np.asarray(dx).astype(np.float32), want) <= FP8_BOUND
  np.testing.assert_array_equal(np.asarray(db), np.full(384, 12, np.float32))


def test_transposed_codes_give_the_same_gradient(rng):
  x, w_q, w_s, bias, dy = _problem(rng)
  weight = jaxfp8.Fp8LinearWeight(w_q, w_s, bias, (128, 128))
  with_t = weight.with_transpose()
  assert with_t.w_q_t.shape == (256, 384) and with_t.w_q_t.dtype == jnp.float8_e4m3fn
  f = lambda x, wt: jaxfp8.w8a8_block_fp8_linear(x, wt)
  dx_t = jax.vjp(lambda x: f(x, with_t), x)[1](jnp.asarray(dy))[0]
  dx = jax.vjp(lambda x: f(x, weight), x)[1](jnp.asarray(dy))[0]
  np.testing.assert_array_equal(np.asarray(dx_t), np.asarray(dx))
  with pytest.raises(ValueError, match=r"w_q_t must be .* \(256, 384\); got \(384, 256\)"):
    jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), w_q_t=w_q)


def test_an_unaligned_n_pads_the_backward(rng):
  """N = 200 (no whole gn groups): dy and W^T are padded with zeros to 256 columns, which add nothing."""
  x, w_q, w_s, bias, dy = _problem(rng, n=200)
  dx, *_ = _vjp(x, w_q, w_s, bias, dy, backward="fp8")
  assert ref.relative_error(np.asarray(dx), _exact_dx(dy, w_q, w_s)) <= FP8_BOUND


def test_vmap_and_remat_of_the_gradient(rng):
  x, w_q, w_s, bias, _ = _problem(rng)
  loss = lambda x: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), bias).sum()
  xs = jnp.stack([x, 2 * x])
  batched = jax.vmap(jax.grad(loss))(xs)
  for i in range(2):
    np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(jax.grad(loss)(xs[i])), rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(jax.grad(jax.checkpoint(loss))(x)), np.asarray(jax.grad(loss)(x)))


def test_second_derivatives_are_refused(rng):
  x, w_q, w_s, bias, _ = _problem(rng)
  loss = lambda x: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), bias).sum()
  with pytest.raises(TransformError, match="w8a8_block_fp8_linear's gradient is not differentiable"):
    jax.grad(lambda x: jax.grad(loss)(x).sum())(x)
  with pytest.raises(TransformError, match="w8a8_block_fp8_linear's gradient is not differentiable"):
    jax.hessian(loss)(x)


def test_backward_mode_is_validated(rng):
  x, w_q, w_s, bias, _ = _problem(rng)
  with pytest.raises(ValueError, match="backward must be one of \\('fp8', 'bf16'\\), got 'fp32'"):
    jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), backward="fp32")


_PARALLEL = r"""
import os, sys, numpy as np, jax, jax.numpy as jnp
import jaxfp8
from jaxfp8 import linear, reference as ref
rng = np.random.default_rng(int(sys.argv[1]))
mesh = jax.make_mesh((8,), ("tp",))
n, k = 1024, 1024
w_q, w_s = jaxfp8.quantize_weight_blockwise(jnp.asarray(rng.standard_normal((n, k)), jnp.float32))
bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
x = jnp.asarray(rng.standard_normal((6, k)), jnp.float32)
dy = jnp.asarray(rng.standard_normal((6, n)), jnp.float32)
for backward in ("fp8", "bf16"):
  single = lambda x, b: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), b, backward=backward)
  want = jax.vjp(single, x, bias)[1](dy)
  for mode in ("column", "row"):
    placed = linear.shard_linear_weights(w_q, w_s, bias, mesh=mesh, axis_name="tp", parallel=mode)
    fn = linear.column_parallel_linear if mode == "column" else linear.row_parallel_linear
    kw = dict(gather_output=True) if mode == "column" else {}
    par = lambda x, b: fn(x, placed[0], placed[1], (128, 128), b, mesh=mesh, axis_name="tp", backward=backward, **kw)
    got = jax.jit(lambda x, b: jax.vjp(par, x, b)[1](dy))(x, placed[2])
    err_dx = ref.relative_error(np.asarray(got[0]), np.asarray(want[0]))
    err_db = ref.relative_error(np.asarray(got[1]), np.asarray(want[1]))
    print(f"{backward} {mode} dx {err_dx:.3g} dbias {err_db:.3g}")
    # Row: each device's dx slice is the unsharded slice exactly (same dy groups, same blocks); column: the float32
    # partial dx summed over the devices in another order.
    assert err_dx <= (0.0 if mode == "row" else 1e-5) and err_db <= 1e-6, (backward, mode, err_dx, err_db)
# bf16 x with leading dimensions, no bias; the column output left sharded.
x3 = jnp.asarray(rng.standard_normal((2, 3, k)), jnp.bfloat16)
dy3 = jnp.asarray(rng.standard_normal((2, 3, n)), jnp.bfloat16)
for backward in ("fp8", "bf16"):
  want = jax.vjp(lambda x: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), backward=backward), x3)[1](dy3)[0]
  for mode in ("column", "row"):
    placed = linear.shard_linear_weights(w_q, w_s, mesh=mesh, axis_name="tp", parallel=mode)
    fn = linear.column_parallel_linear if mode == "column" else linear.row_parallel_linear
    par = lambda x: fn(x, placed[0], placed[1], (128, 128), mesh=mesh, axis_name="tp", backward=backward)
    got = jax.jit(lambda x: jax.vjp(par, x)[1](dy3)[0])(x3)
    assert got.shape == x3.shape and got.dtype == jnp.bfloat16, (got.shape, got.dtype)
    err = ref.relative_error(np.asarray(got, np.float32), np.asarray(want, np.float32))
    print(f"bf16 x {backward} {mode} dx {err:.3g}")
    assert err <= (0.0 if mode == "row" else 4e-3), (backward, mode, err)
print("ok")
"""


def test_tensor_parallel_gradients_equal_the_single_device_ones(tmp_path):
  """Column- and row-parallel linears on 8 simulated devices: dx and dbias equal the unsharded gradient (the
  backward's collectives mirror the forward's: a psum of dx over the column shards; dbias summed once); the
  row-parallel dx bit for bit, for seed 39 too (where a transposed psum once rounded dy and changed one code)."""
  script = tmp_path / "parallel_grad.py"
  script.write_text(_PARALLEL)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, str(script), os.environ.get("JAXFP8_TEST_SEED", "0")], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr[-3000:]
