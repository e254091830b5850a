"""The linear's gradient (docs/CONTRACT.md §6): dx through frozen block-FP8 weights.

    y = quantize(x) @ W^T + bias,   W = dequantize(w_q, w_s) (N, K)
    dx = dy @ W,   dbias = sum over rows of dy (float32),   d(w_q) = d(w_s) = 0 (the weights are frozen)

Two modes (`backward=`):
  "fp8"  (default; DeepSeek-V3's recipe): dy is quantized per 1 x gn group along N and multiplied by W^T on the same
         block-FP8 GEMM as the forward, which is itself a linear: x' = dy (M, N), weight W^T (K, N) whose block
         scales are exactly w_s^T with block size (gk, gn), so nothing is requantized. The tensor cores need W^T
         K-major, i.e. the transposed codes `w_q_t` (K, N): pass them (`Fp8LinearWeight.with_transpose`,
         `Fp8Linear(..., backward="fp8")` builds them once) or the backward transposes w_q every step.
  "bf16" dy against the dequantized weight in bfloat16 (float32 when dy is not bf16), float32 accumulation: exact to
         the GEMM's tolerance, slower.
The derivative of the derivative is refused (`_transforms.TransformError`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxfp8 import _checks
from jaxfp8 import _transforms as transforms
from jaxfp8.gemm.xla import fp8_values, live_rows_only

BACKWARDS = ("fp8", "bf16")


def dequantized(w_q, w_s, block_size, dtype) -> jax.Array:
  """W (N, K) = w_q * w_s per (gn, gk) block, in `dtype` (products exact in float32)."""
  n, k = w_q.shape
  gn, gk = block_size
  s = jnp.repeat(jnp.repeat(w_s, gn, axis=0, total_repeat_length=n), gk, axis=1, total_repeat_length=k)
  return (fp8_values(w_q) * s).astype(dtype)


def transposed_codes(w_q, block_size) -> jax.Array:
  """W^T's codes (K, N_pad), N padded with zero codes to whole gn groups (the fp8 backward's activation groups)."""
  n = w_q.shape[0]
  return jnp.pad(w_q, ((0, _checks.round_up(n, block_size[0]) - n), (0, 0))).T


def _bf16_dx(dy2, w_q, w_s, block_size):
  compute = jnp.bfloat16 if dy2.dtype == jnp.bfloat16 else jnp.float32
  w = dequantized(w_q, w_s, block_size, compute)
  return lax.dot(dy2.astype(compute), w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _fp8_dx(dy2, w_q, w_s, w_q_t, block_size, options, out_dtype, valid_rows=None):
  """dy2 (M, N) @ W through the block-FP8 linear: dy as the activations, W^T as the weight (with valid_rows, only
  the live rows)."""
  from jaxfp8.linear import planner  # the backward's own plan is a linear's plan
  gn, gk = block_size
  n, k = w_q.shape
  n_pad = _checks.round_up(n, gn)
  if w_q_t is None:
    w_q_t = transposed_codes(w_q, block_size)
  if n_pad != n:  # zero columns of dy meet the zero codes padded into W^T: nothing added
    dy2 = jnp.pad(dy2, ((0, 0), (0, n_pad - n)))
  backward_options = planner.LinearOptions(
      implementation=options.implementation, quant_implementation=options.quant_implementation,
      interpret=options.interpret)
  plan = planner.plan(dy2.shape[0], k, n_pad, (gk, gn), out_dtype, dy2.dtype, backward_options,
                      masked=valid_rows is not None)
  return planner.forward(dy2, w_q_t, w_s.T, None, plan, valid_rows)


def input_gradient(dy, x_shape, x_dtype, w_q, w_s, w_q_t, block_size, options, mode, out_dtype=None,
                   valid_rows=None):
  """dx (x_shape, in `out_dtype`, x's dtype by default) = dy @ W in the backward `mode` ("fp8" or "bf16"); with
  valid_rows, the rows past it are 0."""
  out_dtype = x_dtype if out_dtype is None else out_dtype
  # Past valid_rows the forward's output is a constant 0: no gradient flows there.
  dy2 = live_rows_only(dy.reshape(-1, dy.shape[-1]), valid_rows)
  if mode == "bf16":
    dx = _bf16_dx(dy2, w_q, w_s, block_size)
  else:
    dx = _fp8_dx(dy2, w_q, w_s, w_q_t, block_size, options, out_dtype, valid_rows)
  return dx.astype(out_dtype).reshape(x_shape)


def bias_gradient(dy, bias_dtype, valid_rows=None):
  """dbias: dy summed over every (live) row in float32, cast to the bias's dtype."""
  dy2 = live_rows_only(dy.reshape(-1, dy.shape[-1]), valid_rows)
  return jnp.sum(dy2.astype(jnp.float32), axis=0).astype(bias_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def linear(x, w_q, w_s, bias, w_q_t, valid_rows, plan, forward, static):
  """`forward(x, w_q, w_s, bias, plan[, valid_rows])` with the backward above; `static` = (x's shape, x's dtype,
  bias dtype, the mesh axes x and the bias vary over under jax.shard_map). valid_rows: None, or the masked plan's
  traced live-row count."""
  del w_q_t, static
  return forward(x, w_q, w_s, bias, plan, valid_rows)


FORWARD_MODE_HINT = ("its derivative is defined in reverse mode (jax.grad, jax.vjp; docs/CONTRACT.md §6), whose "
                     "backward quantizes dy")

SECOND_ORDER = ("jaxfp8.w8a8_block_fp8_linear's gradient",
                 "higher-order derivatives of the FP8 linear are not supported (its forward and backward quantize)")


def _linear_fwd(x, w_q, w_s, bias, w_q_t, valid_rows, plan, forward, static):
  del static
  # Differentiated only when a derivative of the gradient is asked for: refused with that reason.
  y = transforms.not_differentiable(lambda *args: forward(*args[:4], plan, args[4]), *SECOND_ORDER)(
      x, w_q, w_s, bias, valid_rows)
  return y, (w_q, w_s, w_q_t, valid_rows)


def _linear_bwd(plan, forward, static, residuals, dy):
  del forward
  x_shape, x_dtype, bias_dtype, x_axes, bias_axes = static
  w_q, w_s, w_q_t, valid_rows = residuals
  mode = plan.options.backward

  def grads(dy):
    dx = input_gradient(dy, x_shape, x_dtype, w_q, w_s, w_q_t, plan.block_size, plan.options, mode,
                        valid_rows=valid_rows)
    return dx, None if bias_dtype is None else bias_gradient(dy, bias_dtype, valid_rows)

  grads = transforms.not_differentiable(grads, *SECOND_ORDER)
  dx, dbias = grads(dy)
  # Under jax.shard_map with check_vma, each cotangent has its primal's type (dy may vary where x or the bias does
  # not: a shared bias's cotangent is the sum of every device's).
  dx = transforms.cotangent_like(dx, x_axes)
  dbias = None if dbias is None else transforms.cotangent_like(dbias, bias_axes)
  # The FP8 weights are frozen: zero cotangents for w_q, w_s and w_q_t; valid_rows is an integer count.
  return dx, None, None, dbias, None, None


linear.defvjp(_linear_fwd, _linear_bwd)
