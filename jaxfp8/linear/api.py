"""The public linear, `w8a8_block_fp8_linear` (docs/CONTRACT.md §3), and `explain`.

    y (..., N) = linear(x (..., K) in bf16 / fp16 / fp32, w_q (N, K) e4m3fn, w_s (ceil(N/gn), ceil(K/gk)) f32)

One call quantizes the M = prod(...) rows of x per token group of gk straight into the buffers the block GEMM reads
as they are, runs the GEMM, and returns the live rows in x.dtype. Where it runs and why: `explain` (the GEMM's and the
quantizer's plans, kernel configs included). Under an outer `jax.jit` the call is traced inline; eager calls pad M to
a row bucket and reuse one compiled executable per bucket (`jaxfp8.linear.eager`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxfp8 import _checks, gemm, quant
from jaxfp8.linear import eager, planner
from jaxfp8.linear.buckets import get_row_buckets
from jaxfp8.weights import Fp8LinearWeight

IMPLEMENTATIONS = gemm.IMPLEMENTATIONS
INPUT_DTYPES = quant.INPUT_DTYPES
OUT_DTYPES = gemm.OUT_DTYPES
FP8 = jnp.dtype(jnp.float8_e4m3fn)
F32 = jnp.dtype(jnp.float32)


def unpack_weight(w_q, w_s, block_size, bias, w_q_t):
  """(w_q, w_s, block_size, bias, w_q_t) from separate arguments or from an `Fp8LinearWeight` in place of w_q."""
  if not isinstance(w_q, Fp8LinearWeight):
    if w_s is None or block_size is None:
      raise TypeError("w8a8_block_fp8_linear needs w_q, w_s and block_size (or an Fp8LinearWeight in place of w_q)")
    return w_q, w_s, block_size, bias, w_q_t
  given = [name for name, value in (("w_s", w_s), ("block_size", block_size), ("bias", bias), ("w_q_t", w_q_t))
           if value is not None]
  if given:
    raise TypeError(f"w_q is an Fp8LinearWeight, which holds w_s, block_size, bias and w_q_t; do not also pass {given}")
  return w_q.w_q, w_q.w_s, w_q.block_size, w_q.bias, w_q.w_q_t


def check_transposed_codes(w_q_t, w_q, block_size) -> None:
  if w_q_t is None:
    return
  _checks.array("w_q_t", w_q_t, (FP8,))
  n, k = w_q.shape
  expected = (k, _checks.round_up(n, block_size[0]))
  if tuple(w_q_t.shape) != expected:
    raise ValueError(f"w_q_t must be w_q's codes transposed and padded to whole gn groups, of shape (K, "
                     f"round_up(N, gn)) = {expected}; got {tuple(w_q_t.shape)} (Fp8LinearWeight.with_transpose "
                     "builds it)")


def validate(x, w_q, w_s, bias, block_size, out_dtype) -> tuple[tuple[int, int], jnp.dtype]:
  """Checks the arguments of a linear call; returns (block_size, out_dtype)."""
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"x must be an array, got {type(x).__name__}")
  if jnp.dtype(x.dtype) not in INPUT_DTYPES:
    raise TypeError(f"x must be bfloat16, float16 or float32, got dtype {x.dtype}")
  if len(x.shape) < 1:
    raise ValueError(f"x must have at least 1 dimension (..., K), got shape {tuple(x.shape)}")
  _checks.array("w_q", w_q, (FP8,))
  _checks.array("w_s", w_s, (F32,))
  gn, gk = _checks.block_size(block_size)
  n, k = w_q.shape
  if x.shape[-1] != k:
    raise ValueError(f"x (..., K) and w_q (N, K) must share K: x has shape {tuple(x.shape)}, "
                     f"w_q has shape {tuple(w_q.shape)}")
  if k % gk:
    raise ValueError(f"K={k} must be a multiple of block_size[1]={gk}: activations are quantized in groups of gk")
  expected = (-(-n // gn), -(-k // gk))
  if tuple(w_s.shape) != expected:
    raise ValueError(f"w_s must have shape (ceil(N/gn), ceil(K/gk)) = {expected} for N={n}, K={k}, "
                     f"block_size={(gn, gk)}; got {tuple(w_s.shape)}")
  if bias is not None:
    _checks.array("bias", bias, OUT_DTYPES, ndim=None)
    if tuple(bias.shape) != (n,):
      raise ValueError(f"bias must have shape (N,) = ({n},), got {tuple(bias.shape)}")
  out_dtype = jnp.dtype(x.dtype) if out_dtype is None else _checks.float_dtype("out_dtype", out_dtype)
  return (gn, gk), out_dtype


def as_device_array(a):
  """NumPy arrays go to the default device (`jax.device_put`: a transfer; `jnp.asarray` would compile a staging
  function per shape); JAX arrays and tracers stay as they are."""
  if a is None or isinstance(a, (jax.Array, jax.core.Tracer)):
    return a
  return jax.device_put(np.asarray(a))


def _explicitly_sharded_axes(a) -> tuple[str, ...]:
  """Mesh axes of the Explicit type that array `a` is typed as sharded over (none for NumPy / unsharded arrays)."""
  if a is None or isinstance(a, np.ndarray):
    return ()
  try:
    sharding = jax.typeof(a).sharding
  except Exception:  # not a JAX value
    return ()
  mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
  if mesh is None or spec is None:
    return ()
  types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ())))
  names = [name for entry in spec if entry is not None for name in (entry if isinstance(entry, tuple) else (entry,))]
  return tuple(name for name in names if types.get(name) == jax.sharding.AxisType.Explicit)


def check_not_explicitly_sharded(**arrays) -> None:
  for name, a in arrays.items():
    if axes := _explicitly_sharded_axes(a):
      raise ValueError(
          f"{name} is sharded over the Explicit mesh axes {axes} ({jax.typeof(a).sharding.spec}); the FP8 kernels "
          "run on whole per-device arrays: use column_parallel_linear / row_parallel_linear, your own jax.shard_map, "
          "or jax.reshard the operands to replicated")


def is_traced(*arrays) -> bool:
  return any(isinstance(a, jax.core.Tracer) for a in arrays)


def explain(
    x, w_q, block_size: tuple[int, int] | None = None, *, out_dtype=None, implementation: str | None = None,
    quant_implementation: str | None = None, row_alignment: int | None = None, config=None,
    interpret: bool | None = None, valid_rows: bool = False,
) -> planner.LinearPlan:
  """Which path `w8a8_block_fp8_linear` takes for these arguments here, and why (traced calls; eager calls use the
  plan of their row bucket). x and w_q may be arrays or `jax.ShapeDtypeStruct`s, or w_q an `Fp8LinearWeight`. The
  plan names both kernels and their configs, and why each was chosen (`print(plan)`). Raises what the call would
  raise for an implementation that cannot run. valid_rows: whether the call passes a `valid_rows`."""
  if isinstance(w_q, Fp8LinearWeight):
    w_q, block_size, has_bias = w_q.w_q, w_q.block_size, w_q.bias is not None
  else:
    has_bias = False
  for name, a in (("x", x), ("w_q", w_q)):
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
      raise TypeError(f"{name} must be an array or a jax.ShapeDtypeStruct, got {type(a).__name__}")
  block_size = _checks.block_size(block_size)
  w_s = jax.ShapeDtypeStruct((-(-w_q.shape[0] // block_size[0]), -(-w_q.shape[1] // block_size[1])), F32)
  block_size, out_dtype = validate(x, w_q, w_s, None, block_size, out_dtype)
  options = planner.LinearOptions(implementation, quant_implementation, row_alignment, config, interpret)
  return planner.plan(math.prod(x.shape[:-1]), w_q.shape[0], w_q.shape[1], block_size, out_dtype, x.dtype, options,
                      has_bias=has_bias, masked=_checks.flag("valid_rows", valid_rows))


def w8a8_block_fp8_linear(
    x: jax.Array,
    w_q: jax.Array | Fp8LinearWeight,
    w_s: jax.Array | None = None,
    block_size: tuple[int, int] | None = None,
    bias: jax.Array | None = None,
    *,
    out_dtype=None,
    implementation: str | None = None,
    quant_implementation: str | None = None,
    row_alignment: int | None = None,
    config=None,
    interpret: bool | None = None,
    backward: str = "fp8",
    w_q_t: jax.Array | None = None,
    valid_rows: jax.Array | int | None = None,
) -> jax.Array:
  """y = quantize(x) @ (w_q * w_s)^T + bias, with block-FP8 activations and weights (docs/CONTRACT.md §3).

  Args:
    x: (..., K) bfloat16, float16 or float32 activations; K a multiple of block_size[1].
    w_q: (N, K) float8_e4m3fn weight (the Hugging Face `weight`), or an `Fp8LinearWeight` holding w_q, w_s, the
      bias and the block size (then w_s, block_size and bias are not given).
    w_s: (ceil(N/gn), ceil(K/gk)) float32 weight block scales (`weight_scale_inv`).
    block_size: (gn, gk) of the weight scales; gk is also the activations' group size.
    bias: optional (N,) bfloat16, float16 or float32, added in float32 before the output cast.
    out_dtype: the output dtype (bfloat16, float16 or float32); None: x.dtype.
    implementation: the GEMM, "mosaic", "triton", "xla", or None for the best one here (see the module docstring and
      `explain`).
    quant_implementation: the activation quantizer; None: the GEMM's family (Mosaic, Triton or XLA).
    row_alignment: pad the quantized rows to a multiple of this; None: what the GEMM needs (see `explain`).
    config: a GEMM config (TritonGemmConfig or the Mosaic kernel's); None: the GEMM's table or heuristic.
    interpret: run Pallas kernels in interpret mode; None: when there is no GPU.
    backward: the gradient's mode under jax.grad / jax.vjp (docs/CONTRACT.md §6): "fp8" (dy quantized per 1 x gn
      group, the block-FP8 GEMM against W^T) or "bf16" (dy against the dequantized weight). The weights are frozen:
      their cotangents are zeros.
    w_q_t: the transposed codes the "fp8" backward multiplies by, (K, round_up(N, gn)) (`Fp8LinearWeight.
      with_transpose`); None: transposed in every backward pass.
    valid_rows: the live rows among the M = prod(x.shape[:-1]) rows of x (in row-major order), an int32 scalar
      that may be traced: a model jitted once for a bucket of rows computes only the tokens it has. Rows from
      valid_rows on are neither quantized nor multiplied (on the Mosaic GEMM; the other GEMMs compute every row) and
      come out 0, whatever x holds there; their gradient is 0 and they add nothing to the bias's. A traced count is
      clipped to [0, M]; a Python int must lie there.

  Returns:
    (..., N) in out_dtype (x.dtype by default).

  Eager calls pad M to a row bucket and reuse one compiled executable per bucket (`cache_info()`); inside `jax.jit`
  the call is traced inline and compiles nothing of its own.
  """
  w_q, w_s, block_size, bias, w_q_t = unpack_weight(w_q, w_s, block_size, bias, w_q_t)
  block_size, out_dtype = validate(x, w_q, w_s, bias, block_size, out_dtype)
  check_transposed_codes(w_q_t, w_q, block_size)
  check_not_explicitly_sharded(x=x, w_q=w_q, w_s=w_s, bias=bias)
  w_q, w_s, bias, w_q_t = (as_device_array(a) for a in (w_q, w_s, bias, w_q_t))
  options = planner.LinearOptions(implementation, quant_implementation, row_alignment, config, interpret, backward)
  n, k = w_q.shape
  has_bias = bias is not None
  valid_rows = _checks.valid_rows(valid_rows, math.prod(x.shape[:-1]))
  masked = valid_rows is not None

  def plan_for(m: int) -> planner.LinearPlan:
    return planner.plan(m, n, k, block_size, out_dtype, x.dtype, options, has_bias=has_bias, masked=masked)

  if is_traced(x, w_q, w_s, bias, w_q_t, valid_rows):
    return planner.apply(x, w_q, w_s, bias, plan_for(math.prod(x.shape[:-1])), w_q_t, valid_rows)
  if not isinstance(x, (np.ndarray, jax.Array)):
    x = np.asarray(x)
  # Plan (and refuse) before padding anything; the executable is planned for its bucket.
  plan_for(max(get_row_buckets().bucket(math.prod(x.shape[:-1])), 1))

  def make_body(bucket: int):
    plan = plan_for(bucket)
    return eager.named(lambda x2, wq, ws, b, v: planner.apply(x2, wq, ws, b, plan, None, v), "jaxfp8_linear_bucket")

  key = (block_size, out_dtype.name, options, masked)
  return eager.run_eager("linear", key, make_body, x, (w_q, w_s, bias, valid_rows), n, out_dtype)
