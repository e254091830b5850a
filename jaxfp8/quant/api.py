"""Per-token-group FP8 quantization of activations (docs/CONTRACT.md §1): the public functions.

They validate their arguments once, ask `planner.plan` for the implementation and config, and run the plan. Three
implementations share one contract (x as (E, T, K_in), a vector of live rows per batch entry, the final padded
buffers written directly): "mosaic" (Pallas Mosaic GPU kernel, Hopper), "triton" (Pallas Triton-lowered kernel,
sm >= 8.9) and "xla" (jnp, any platform).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxfp8 import _checks
from jaxfp8 import _transforms as transforms
from jaxfp8.quant import planner

INPUT_DTYPES = _checks.FLOAT_DTYPES


def _validate_x(x) -> jax.Array:
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"x must be an array, got {type(x).__name__}")
  if jnp.dtype(x.dtype) not in INPUT_DTYPES:
    raise TypeError(f"x must be bfloat16, float16 or float32, got dtype {x.dtype}")
  if x.ndim < 2:
    raise ValueError(f"x must have at least 2 dimensions (..., K), got shape {tuple(x.shape)}")
  return x


def per_token_group_quant_fp8(
    x: jax.Array,
    group_size: int,
    *,
    eps: float = planner.DEFAULT_EPS,
    column_major_scales: bool = False,
    scale_tma_aligned: bool = False,
    scale_ue8m0: bool = False,
    pack_ue8m0: bool = False,
    row_alignment: int = 1,
    fuse_silu_and_mul: bool = False,
    masked_m: jax.Array | None = None,
    implementation: str | None = None,
    interpret: bool | None = None,
    config=None,
) -> tuple[jax.Array, jax.Array]:
  """Quantizes activations to float8_e4m3fn with one float32 scale per `group_size` consecutive values of a row.

  Args:
    x: (..., K) bf16, fp16 or fp32; leading dims are flattened into M rows. With `masked_m`: (E, T, K).
    group_size: values per scale; K % group_size == 0 (K after SiLU-and-mul halves it).
    eps: floor of each group's absolute maximum.
    column_major_scales: return scales as (K/G, M_pad) ("M-major"), the layout block GEMMs read, instead of (M_pad, K/G).
    scale_tma_aligned: pad the column-major scale rows to a multiple of 4 floats (16 bytes), as TMA copies need.
    scale_ue8m0: round each scale up to a power of two.
    pack_ue8m0: return the scales as int32 words of four exponent bytes, column-major (needs scale_ue8m0).
    row_alignment: pad the rows of the outputs to a multiple of this; pad rows hold q = 0 and scale = 1.0.
    fuse_silu_and_mul: quantize silu(x[..., :H]) * x[..., H:] (K = H).
    masked_m: int32 (E,): rows t >= masked_m[e] of expert e are pad rows.
    implementation: "mosaic", "triton", "xla", or None for the best one on this device.
    interpret: run Pallas kernels in interpret mode; None means True when there is no GPU.
    config: a kernel config dataclass of the chosen implementation (None: its heuristic).

  Returns:
    (q, s): q (M_pad, K) e4m3fn ((E, T_pad, K) with masked_m) and the scales in the asked layout
    (docs/CONTRACT.md §1).
  """
  x = _validate_x(x)
  column_major_scales, scale_tma_aligned, scale_ue8m0, pack_ue8m0, fuse_silu_and_mul = (
      _checks.flag(name, value) for name, value in (
          ("column_major_scales", column_major_scales), ("scale_tma_aligned", scale_tma_aligned),
          ("scale_ue8m0", scale_ue8m0), ("pack_ue8m0", pack_ue8m0), ("fuse_silu_and_mul", fuse_silu_and_mul)))
  interpret = _checks.interpret(interpret)
  group_size = _checks.positive_int("group_size", group_size)
  row_alignment = _checks.positive_int("row_alignment", row_alignment)
  eps = _checks.eps(eps)
  if pack_ue8m0 and not scale_ue8m0:
    raise ValueError("pack_ue8m0=True requires scale_ue8m0=True (only power-of-two scales pack into exponent bytes)")
  if scale_tma_aligned and not (column_major_scales or pack_ue8m0):
    raise ValueError("scale_tma_aligned=True applies to column-major scales: pass column_major_scales=True")
  k_in = x.shape[-1]
  if fuse_silu_and_mul and k_in % 2:
    raise ValueError(f"fuse_silu_and_mul=True needs an even last dimension (gate and up halves), got {k_in}")
  k = k_in // 2 if fuse_silu_and_mul else k_in
  if k % group_size:
    raise ValueError(f"the quantized width K={k} must be a multiple of group_size={group_size}")

  if masked_m is None:
    x3 = x.reshape(1, -1, k_in)
  else:
    if x.ndim != 3:
      raise ValueError(f"with masked_m, x must be (E, T, K), got shape {tuple(x.shape)}")
    if not hasattr(masked_m, "dtype") or jnp.dtype(masked_m.dtype) != jnp.int32:
      raise TypeError(f"masked_m must be an int32 array, got {getattr(masked_m, 'dtype', type(masked_m).__name__)}")
    if tuple(masked_m.shape) != (x.shape[0],):
      raise ValueError(f"masked_m must have shape (E,) = ({x.shape[0]},), got {tuple(masked_m.shape)}")
    x3 = x

  scale_layout = "col_packed" if pack_ue8m0 else ("col" if column_major_scales else "row")
  p = planner.problem(
      x3.shape[0], x3.shape[1], k_in, x.dtype, group_size=group_size, eps=eps, row_alignment=row_alignment,
      scale_layout=scale_layout, scale_tma_aligned=scale_tma_aligned, scale_ue8m0=scale_ue8m0,
      fuse_silu_and_mul=fuse_silu_and_mul)
  plan = planner.plan(p, implementation=implementation, config=config, interpret=interpret)
  return transformable(plan, config, masked=masked_m is not None)(x3, masked_m)


_NO_DERIVATIVE = ("its outputs are fp8 codes and their scales. Differentiate through jaxfp8.w8a8_block_fp8_linear, "
                  "whose backward is defined (docs/CONTRACT.md §6)")


def transformable(plan: planner.QuantPlan, config, *, masked: bool):
  """The quantization of `plan` as a function of (x3, masked_m) that JAX's transforms treat the same on every
  implementation: no derivative, and `jax.vmap` folded into the batch axis the kernels already take."""
  def run(x3, masked_m):
    return _quantize(x3, masked_m, plan=plan)

  def vmap_rule(axis_size, in_batched, x3, masked_m):
    x_batched, masked_batched = in_batched
    if not x_batched:
      x3 = jnp.broadcast_to(x3, (axis_size, *x3.shape))
    batch = plan.problem.batch
    folded_x = x3.reshape(axis_size * batch, *x3.shape[2:])
    folded_m = None
    if masked_m is not None:
      m = masked_m if masked_batched else jnp.broadcast_to(masked_m, (axis_size, batch))
      folded_m = m.reshape(axis_size * batch)
    folded_plan = planner.plan(
        dataclasses.replace(plan.problem, batch=axis_size * batch), implementation=plan.implementation,
        config=config, interpret=plan.interpret, reason=plan.reason)
    q, s = planner.run(folded_x, folded_m, plan=folded_plan)
    if masked_m is not None:
      q, s = q.reshape(axis_size, batch, *q.shape[1:]), s.reshape(axis_size, batch, *s.shape[1:])
    return (q, s), (True, True)

  if not masked:  # x3 has a unit batch axis, which vmap's axis replaces
    return lambda x3, masked_m: _transformable_unmasked(run, vmap_rule)(x3)
  return transforms.not_differentiable(transforms.batched(run, vmap_rule), "jaxfp8.per_token_group_quant_fp8",
                                       _NO_DERIVATIVE)


def _transformable_unmasked(run, vmap_rule):
  return transforms.not_differentiable(
      transforms.batched(lambda x3: run(x3, None), lambda n, b, x3: vmap_rule(n, (b[0], False), x3, None)),
      "jaxfp8.per_token_group_quant_fp8", _NO_DERIVATIVE)


@functools.partial(jax.jit, static_argnames=("plan",))
def _quantize(x3, masked_m, *, plan: planner.QuantPlan):
  q, s = planner.run(x3, masked_m, plan=plan)
  if masked_m is None:  # inside the jit, dropping the unit batch axis is a free bitcast, not a copy kernel
    return q[0], s[0]
  return q, s


def per_token_group_quant_fp8_row_padded(
    x: jax.Array,
    group_size: int,
    *,
    eps: float = planner.DEFAULT_EPS,
    row_alignment: int = 4,
    implementation: str | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Quantizes into buffers a block GEMM takes as they are: rows padded to `row_alignment` (4: TMA and cuBLAS need
  M % 4 == 0), column-major scales (K/G, round_up(M_pad, 4)). Pad rows hold q = 0 and scale = 1.0.
  """
  return per_token_group_quant_fp8(
      x, group_size, eps=eps, column_major_scales=True, scale_tma_aligned=True, row_alignment=row_alignment,
      implementation=implementation, interpret=interpret)
