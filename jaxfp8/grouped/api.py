"""Grouped block-scaled FP8 GEMM for mixture-of-experts layers (docs/CONTRACT.md §7): the public functions.

    ragged_w8a8_block_fp8_matmul(a_q (M, K), b_q (E, N, K), a_s, b_s, group_sizes (E,), block_size) -> (M, N)
    masked_w8a8_block_fp8_matmul(a_q (E, T, K), b_q (E, N, K), a_s, b_s, masked_m (E,), block_size) -> (E, T, N)

Each validates its arguments once, asks `planner.plan` for the implementation and kernel config, and runs the plan.
group_sizes and masked_m are traced arrays: routing changes never recompile. Implementations:
  "mosaic": Pallas Mosaic GPU kernel for Hopper (pallas_kernels/grouped_gemm_mosaic.py); gn and gk each 64 or 128
            (the default dispatch takes (128, 128)), N a multiple of 8, K of gk.
  "xla":    jnp (a loop over the experts that hold rows, per row tile the dense XLA GEMM), any platform
            (jaxfp8/grouped/xla.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfp8 import _checks, _platform
from jaxfp8 import _transforms as transforms
from jaxfp8.gemm.api import FP8
from jaxfp8.grouped import planner

F32 = jnp.dtype(jnp.float32)
I32 = jnp.dtype(jnp.int32)


def ragged_w8a8_block_fp8_matmul(
    a_q: jax.Array, b_q: jax.Array, a_s: jax.Array, b_s: jax.Array, group_sizes: jax.Array,
    block_size: tuple[int, int], *, a_s_column_major: bool = False, out_dtype=jnp.bfloat16,
    implementation: str | None = None, config=None, interpret: bool | None = None, zero_unowned_rows: bool = True,
) -> jax.Array:
  """Row r of group e: C[r] = (a_q[r] * a_s[r]) @ (b_q[e] * b_s[e])^T, block-scaled as docs/CONTRACT.md §2.

  Args:
    a_q: (M, K) float8_e4m3fn activations, rows sorted by group (expert).
    b_q: (E, N, K) float8_e4m3fn expert weights, each in the Hugging Face (N, K) layout.
    a_s: float32 activation scales (M, ceil(K/gk)), or with a_s_column_major=True the (ceil(K/gk), M') array the
      quantizer writes (M' >= M).
    b_s: (E, ceil(N/gn), ceil(K/gk)) float32 weight scales (each expert's `weight_scale_inv`).
    group_sizes: int32 (E,), traced: group e owns the group_sizes[e] rows after those of groups 0..e-1. Negative
      sizes count as 0 and the groups are cut at M; rows past the last group come out 0 (`jax.lax.ragged_dot`'s
      semantics), whatever a_q and a_s hold there.
    block_size: (gn, gk), the weights' scale block; gk is also the activations' group size.
    a_s_column_major, out_dtype, implementation, config, interpret: as for `jaxfp8.w8a8_block_fp8_matmul`
      (implementation "mosaic" or "xla"; a config is the Mosaic kernel's `MosaicGemmConfig`).
    zero_unowned_rows: True (default): the rows no group owns come out 0. False: they are unspecified (the Mosaic
      kernel neither computes nor stores them, which saves their stores and CTAs), for callers that never read them.

  Returns:
    (M, N) array of out_dtype.
  """
  p = _problem("ragged", a_q, b_q, a_s, b_s, group_sizes, block_size, a_s_column_major, out_dtype, zero_unowned_rows)
  plan = _plan(p, implementation, config, interpret, None)
  return transformable(plan)(a_q, b_q, a_s, b_s, group_sizes)


def masked_w8a8_block_fp8_matmul(
    a_q: jax.Array, b_q: jax.Array, a_s: jax.Array, b_s: jax.Array, masked_m: jax.Array,
    block_size: tuple[int, int], *, a_s_column_major: bool = False, out_dtype=jnp.bfloat16,
    implementation: str | None = None, config=None, interpret: bool | None = None, zero_unowned_rows: bool = True,
) -> jax.Array:
  """Expert e, row t < masked_m[e]: C[e, t] = (a_q[e, t] * a_s[e, t]) @ (b_q[e] * b_s[e])^T (docs/CONTRACT.md §7).

  Args:
    a_q: (E, T, K) float8_e4m3fn: each expert's rows, as `per_token_group_quant_fp8(x, ..., masked_m=masked_m)`
      writes them.
    b_q, b_s: as for `ragged_w8a8_block_fp8_matmul`.
    a_s: float32 (E, T, ceil(K/gk)), or with a_s_column_major=True (E, ceil(K/gk), T') (T' >= T), the quantizer's
      column-major scales with masked_m.
    masked_m: int32 (E,), traced: expert e's live rows. Rows t >= masked_m[e] are not computed and come out 0,
      whatever a_q and a_s hold there (negative counts are 0, counts past T are T).
    block_size, a_s_column_major, out_dtype, implementation, config, interpret, zero_unowned_rows: as for the
      ragged layout (with zero_unowned_rows=False the rows t >= masked_m[e] are unspecified: a fixed-shape decode
      step that reads only the live rows skips every empty expert's zero stores).

  Returns:
    (E, T, N) array of out_dtype.
  """
  p = _problem("masked", a_q, b_q, a_s, b_s, masked_m, block_size, a_s_column_major, out_dtype, zero_unowned_rows)
  plan = _plan(p, implementation, config, interpret, None)
  return transformable(plan)(a_q, b_q, a_s, b_s, masked_m)


def _op(layout: str) -> str:
  return f"jaxfp8.{layout}_w8a8_block_fp8_matmul"


def transformable(plan: planner.GroupedPlan):
  """The grouped GEMM of `plan` as a function of its arrays that JAX's transforms treat the same on every
  implementation: no derivative, no batching rule."""
  op = _op(plan.problem.layout)

  def run(a_q, b_q, a_s, b_s, counts):
    return planner.run(a_q, b_q, a_s, b_s, counts, plan=plan)

  return transforms.untransformable(
      run, op, vmap_hint="its rows are already grouped; call it once per batch, or put the batch's rows into the "
      "groups", derivative_hint="it multiplies quantized codes (gradients of an MoE layer go through its bf16 or "
      "dequantized experts)")


def _problem(layout, a_q, b_q, a_s, b_s, counts, block_size, a_s_column_major, out_dtype,
             zero_unowned_rows=True) -> planner.GroupedProblem:
  """The problem of a call, its arrays checked against each other (the calls' and `plan_for`'s one check)."""
  block_size, a_s_column_major, out_dtype = _validate(layout, a_q, b_q, a_s, b_s, counts, block_size,
                                                      a_s_column_major, out_dtype)
  return planner.problem(layout, b_q.shape[0], a_q.shape[-2], b_q.shape[1], a_q.shape[-1], block_size,
                         out_dtype=out_dtype, a_s_column_major=a_s_column_major,
                         zero_unowned_rows=_checks.flag("zero_unowned_rows", zero_unowned_rows))


def _plan(p: planner.GroupedProblem, implementation, config, interpret, device) -> planner.GroupedPlan:
  return planner.plan(p, implementation=implementation, config=config, interpret=_checks.interpret(interpret),
                      device=_checks.device(device))


def _validate(layout, a_q, b_q, a_s, b_s, counts, block_size, a_s_column_major, out_dtype):
  """Checks the arrays' dtypes and shapes against each other; returns (block_size, a_s_column_major, out_dtype)."""
  ragged = layout == "ragged"
  counts_name = "group_sizes" if ragged else "masked_m"
  gn, gk = _checks.block_size(block_size)
  _checks.array("a_q", a_q, (FP8,), ndim=2 if ragged else 3)
  _checks.array("b_q", b_q, (FP8,), ndim=3)
  _checks.array("a_s", a_s, (F32,), ndim=2 if ragged else 3)
  _checks.array("b_s", b_s, (F32,), ndim=3)
  _checks.array(counts_name, counts, (I32,), ndim=1)
  a_s_column_major = _checks.flag("a_s_column_major", a_s_column_major)
  out_dtype = _checks.float_dtype("out_dtype", out_dtype)
  num_groups, n, k_b = b_q.shape
  k = a_q.shape[-1]
  if k_b != k:
    raise ValueError(f"a_q and b_q (E, N, K) must share K: a_q has shape {tuple(a_q.shape)}, b_q has shape "
                     f"{tuple(b_q.shape)}")
  if tuple(counts.shape) != (num_groups,):
    raise ValueError(f"{counts_name} must have shape (E,) = ({num_groups},) for b_q of shape {tuple(b_q.shape)}, got "
                     f"{tuple(counts.shape)}")
  if not ragged and a_q.shape[0] != num_groups:
    raise ValueError(f"a_q (E, T, K) must have one buffer per expert of b_q (E={num_groups}), got shape "
                     f"{tuple(a_q.shape)}")
  groups = -(-k // gk)
  rows = a_q.shape[-2]
  lead = () if ragged else (num_groups,)
  rows_name = "M" if ragged else "T"
  if a_s_column_major:
    if tuple(a_s.shape[:-1]) != (*lead, groups) or a_s.shape[-1] < rows:
      want = ", ".join(["E"] * (not ragged) + ["ceil(K/gk)", f"{rows_name}'"])
      raise ValueError(f"column-major a_s must have shape ({want}) = ({', '.join(map(str, (*lead, groups)))}, "
                       f">= {rows}) for K={k}, gk={gk}, {rows_name}={rows}; got {tuple(a_s.shape)}")
  elif tuple(a_s.shape) != (*lead, rows, groups):
    want = ", ".join(["E"] * (not ragged) + [rows_name, "ceil(K/gk)"])
    hint = " (pass a_s_column_major=True for the column-major layout)" if a_s.shape[-2] == groups else ""
    raise ValueError(f"a_s must have shape ({want}) = {(*lead, rows, groups)} for K={k}, gk={gk}; got "
                     f"{tuple(a_s.shape)}{hint}")
  if tuple(b_s.shape) != (num_groups, -(-n // gn), groups):
    raise ValueError(f"b_s must have shape (E, ceil(N/gn), ceil(K/gk)) = {(num_groups, -(-n // gn), groups)} for "
                     f"b_q of shape {tuple(b_q.shape)} and block_size={(gn, gk)}; got {tuple(b_s.shape)}")
  return (gn, gk), a_s_column_major, out_dtype


def plan_for(a_q, b_q, block_size, *, out_dtype=jnp.bfloat16, a_s_column_major: bool = False,
             implementation: str | None = None, config=None, interpret: bool | None = None,
             device: _platform.Device | None = None, zero_unowned_rows: bool = True) -> planner.GroupedPlan:
  """The plan a grouped call runs for operands of these shapes (arrays or `jax.ShapeDtypeStruct`s) on `device`
  (default: the device programs are built for here): the ragged layout for a 2-D a_q (M, K), the masked one for a
  3-D a_q (E, T, K). Raises what the call raises for these operands: the same check, on stand-ins for the scales and
  counts (of the shapes the call needs)."""
  gn, gk = _checks.block_size(block_size)  # in the call's order: the block size, then the arrays
  _checks.array("a_q", a_q, (FP8,), ndim=None)
  if len(a_q.shape) not in (2, 3):
    raise ValueError(f"a_q must be 2-D (M, K) for the ragged layout or 3-D (E, T, K) for the masked one, got shape "
                     f"{tuple(a_q.shape)}")
  layout = "ragged" if len(a_q.shape) == 2 else "masked"
  b_shape = tuple(getattr(b_q, "shape", ()))
  groups = b_shape[0] if len(b_shape) == 3 else 0
  k_groups, rows = -(-a_q.shape[-1] // gk), a_q.shape[-2]
  lead = () if layout == "ragged" else (a_q.shape[0],)
  a_s = (*lead, k_groups, rows) if a_s_column_major is True else (*lead, rows, k_groups)
  b_s = (groups, -(-b_shape[1] // gn), -(-b_shape[2] // gk)) if len(b_shape) == 3 else ()
  p = _problem(layout, a_q, b_q, jax.ShapeDtypeStruct(a_s, F32), jax.ShapeDtypeStruct(b_s, F32),
               jax.ShapeDtypeStruct((groups,), I32), (gn, gk), a_s_column_major, out_dtype, zero_unowned_rows)
  return _plan(p, implementation, config, interpret, device)
