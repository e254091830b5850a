"""Block-scaled FP8 GEMM (docs/CONTRACT.md §2), `w8a8_block_fp8_matmul`: the public function.

    C[m, n] = out_dtype( bias[n] + sum_g a_s[m, g] * b_s[n // gn, g] * sum_{k in group g} f32(a_q[m, k]) * f32(b_q[n, k]) )

It validates its arguments once, asks `planner.plan` for the implementation and kernel config, and runs the plan.
Implementations:
  "mosaic": Pallas Mosaic GPU kernel for Hopper (pallas_kernels/gemm_mosaic.py); gn and gk each 64 or 128 (the
            default dispatch takes (128, 128)), N a multiple of 8, K of gk, any M.
  "triton": Pallas Triton-lowered kernel for any sm >= 8.9 GPU (pallas_kernels/gemm_triton.py); any M, N, K and gn,
            gk a multiple of 32 (its fp8 dots are 32 to 128 wide in K and never straddle two scale groups).
  "xla":    jnp, any platform (jaxfp8/gemm/xla.py).
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp

from jaxfp8 import _checks
from jaxfp8 import _transforms as transforms
from jaxfp8.gemm import planner, xla

OUT_DTYPES = _checks.FLOAT_DTYPES
FP8 = jnp.dtype(jnp.float8_e4m3fn)


def w8a8_block_fp8_matmul(
    a_q: jax.Array,
    b_q: jax.Array,
    a_s: jax.Array,
    b_s: jax.Array,
    block_size: tuple[int, int],
    *,
    a_s_column_major: bool = False,
    out_dtype=jnp.bfloat16,
    bias: jax.Array | None = None,
    implementation: str | None = None,
    config=None,
    out_rows: int | None = None,
    valid_rows: jax.Array | int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
  """C = (a_q * a_s) @ (b_q * b_s)^T with block scales, accumulated in float32 (docs/CONTRACT.md §2).

  Args:
    a_q: (M, K) float8_e4m3fn activations.
    b_q: (N, K) float8_e4m3fn weight (K contiguous, the Hugging Face `weight` layout).
    a_s: float32 activation scales, one per row and gk columns: (M, ceil(K/gk)), or with a_s_column_major=True the
      (ceil(K/gk), M') array the quantizer writes with column-major scales (M' >= M; columns past M are ignored).
    b_s: (ceil(N/gn), ceil(K/gk)) float32 weight scales (`weight_scale_inv`).
    block_size: (gn, gk), the weight's scale block; gk is also the activations' group size.
    a_s_column_major: whether a_s is the column-major (ceil(K/gk), M') array.
    out_dtype: bfloat16 (default), float16 or float32.
    bias: optional (N,) floating array, added in float32 before the cast.
    implementation: "mosaic", "triton", "xla", or None for the best one here (`plan_for` says which, and why).
    config: a TritonGemmConfig for "triton" (None: the tuned table or the heuristic), the Mosaic kernel's config
      for "mosaic"; must be None for "xla".
    out_rows: compute and return only the first out_rows rows; the later rows of a_q (and a_s) are padding, e.g.
      the zero rows of the quantizer's `row_alignment`, so that padded buffers go in without a slice. The Mosaic
      kernel reads them in whole 64-row tiles, which at M < 64 is faster than having TMA fill the missing rows
      (quantize with row_alignment=64 for that; `jaxfp8.linear` does).
    valid_rows: the live rows, an int32 scalar that may be traced (one compiled call serves every count): the rows
      from valid_rows on come out 0, whatever a_q, a_s and the bias hold (a traced count is clipped to [0, M]; a
      Python int must lie there). The Mosaic GEMM skips their row tiles; the others compute every row, then zero
      them (`plan_for(...)` says which).
    interpret: run Pallas kernels in interpret mode; None means True when there is no GPU.

  Returns:
    (M, N) array of out_dtype, or (out_rows, N).

  All arguments but the arrays are static: inside `jax.jit`, bind them with functools.partial or static_argnames.
  """
  block_size, a_s_column_major, out_dtype = _validate(
      a_q, b_q, a_s, b_s, bias, block_size, a_s_column_major, out_dtype, out_rows)
  interpret = _checks.interpret(interpret)
  m, k = a_q.shape
  n = b_q.shape[0]
  out_rows = None if out_rows is None or out_rows == m else int(out_rows)
  valid_rows = _checks.valid_rows(valid_rows, out_rows or m)

  p = planner.problem(out_rows or m, n, k, block_size, rows=m, out_dtype=out_dtype, a_s_column_major=a_s_column_major,
                      has_bias=bias is not None, masked=valid_rows is not None)
  plan = planner.plan(p, implementation=implementation, config=config, interpret=interpret)
  extra = tuple(a for a in (bias, valid_rows) if a is not None)
  return transformable(plan, config, has_bias=bias is not None)(a_q, b_q, a_s, b_s, *extra)


_OP = "jaxfp8.w8a8_block_fp8_matmul"
_NO_DERIVATIVE = ("it multiplies quantized codes. Differentiate through jaxfp8.w8a8_block_fp8_linear, whose "
                  "backward is defined (docs/CONTRACT.md §6)")


def transformable(plan: planner.GemmPlan, config, *, has_bias: bool):
  """The GEMM of `plan` as a function of its arrays (a_q, b_q, a_s, b_s, then the bias if `has_bias`, then
  valid_rows if the plan's problem is masked) that JAX's transforms treat the same on every implementation: no
  derivative, and `jax.vmap` over the activations folded into their rows (one launch on the same weight)."""
  masked = plan.problem.masked

  def split(extra):
    """(bias, valid_rows) from the arrays after b_s."""
    extra = list(extra)
    return extra.pop(0) if has_bias else None, extra.pop(0) if masked else None

  def run(a_q, b_q, a_s, b_s, *extra):
    return planner.run(a_q, b_q, a_s, b_s, *split(extra), plan=plan)

  def vmap_rule(axis_size, in_batched, a_q, b_q, a_s, b_s, *extra):
    a_batched, b_batched, sa_batched, sb_batched, *extra_batched = in_batched
    bias_batched, valid_batched = split(extra_batched)
    if b_batched or sb_batched or bias_batched:
      transforms.refuse_vmap(_OP, "the weight (b_q, b_s) or the bias",
                             "map over the activations only (their rows are folded into one call), or call once per "
                             "weight")
    bias, valid_rows = split(extra)
    p = plan.problem
    a_q = a_q if a_batched else jnp.broadcast_to(a_q, (axis_size, *a_q.shape))
    a_s = a_s if sa_batched else jnp.broadcast_to(a_s, (axis_size, *a_s.shape))
    # Row-major (rows, G) scales per batch entry, whatever the layout, so that the rows fold with a_q's.
    a_s = jnp.swapaxes(a_s[:, :, :p.rows], 1, 2) if p.a_s_column_major else a_s
    # Each batch entry's live rows are a prefix of its own rows, not of the folded ones: the folded call computes
    # every row and the rows past each entry's count are zeroed after it.
    folded = dataclasses.replace(p, m=axis_size * p.rows, rows=axis_size * p.rows, a_s_column_major=False,
                                 masked=False)
    folded_plan = planner.plan(folded, implementation=plan.implementation, config=config,
                               interpret=plan.interpret, reason=plan.reason)
    out = planner.run(a_q.reshape(-1, p.k), b_q, a_s.reshape(axis_size * p.rows, -1), b_s, bias,
                      plan=folded_plan)
    out = out.reshape(axis_size, p.rows, p.n)[:, :p.m]
    if masked:
      counts = valid_rows if valid_batched else jnp.broadcast_to(valid_rows, (axis_size,))
      out = jax.vmap(xla.live_rows_only)(out, counts)
    return out, True

  return transforms.not_differentiable(transforms.batched(run, vmap_rule), _OP, _NO_DERIVATIVE)


def _validate(a_q, b_q, a_s, b_s, bias, block_size, a_s_column_major, out_dtype, out_rows):
  """Checks the arrays' dtypes and shapes against each other; returns (block_size, a_s_column_major, out_dtype)."""
  _checks.array("a_q", a_q, (FP8,))
  _checks.array("b_q", b_q, (FP8,))
  _checks.array("a_s", a_s, (jnp.dtype(jnp.float32),))
  _checks.array("b_s", b_s, (jnp.dtype(jnp.float32),))
  gn, gk = _checks.block_size(block_size)
  block_size = (gn, gk)
  a_s_column_major = _checks.flag("a_s_column_major", a_s_column_major)
  out_dtype = _checks.float_dtype("out_dtype", out_dtype)
  m, k = a_q.shape
  n, k_b = b_q.shape
  if k_b != k:
    raise ValueError(f"a_q (M, K) and b_q (N, K) must share K: a_q has shape {tuple(a_q.shape)}, "
                     f"b_q has shape {tuple(b_q.shape)}")
  groups = -(-k // gk)
  n_blocks = -(-n // gn)
  if a_s_column_major:
    if a_s.shape[0] != groups or a_s.shape[1] < m:
      raise ValueError(
          f"column-major a_s must have shape (ceil(K/gk), M') = ({groups}, >= {m}) for K={k}, gk={gk}, M={m}; "
          f"got {tuple(a_s.shape)}")
  elif tuple(a_s.shape) != (m, groups):
    hint = " (pass a_s_column_major=True for the (ceil(K/gk), M') layout)" if a_s.shape[0] == groups else ""
    raise ValueError(
        f"a_s must have shape (M, ceil(K/gk)) = ({m}, {groups}) for K={k}, gk={gk}; got {tuple(a_s.shape)}{hint}")
  if tuple(b_s.shape) != (n_blocks, groups):
    raise ValueError(
        f"b_s must have shape (ceil(N/gn), ceil(K/gk)) = ({n_blocks}, {groups}) for N={n}, K={k}, "
        f"block_size={block_size}; got {tuple(b_s.shape)}")
  if bias is not None:
    _checks.array("bias", bias, OUT_DTYPES, ndim=None)
    if tuple(bias.shape) != (n,):
      raise ValueError(f"bias must have shape (N,) = ({n},), got {tuple(bias.shape)}")
  if out_rows is not None and (isinstance(out_rows, bool) or not isinstance(out_rows, numbers.Integral)
                               or not 0 < out_rows <= m):
    raise ValueError(f"out_rows must be an int in [1, M={m}] (the rows of a_q to compute), got {out_rows!r}")
  return block_size, a_s_column_major, out_dtype


def plan_for(a_q, b_q, block_size, *, out_rows: int | None = None, out_dtype=jnp.bfloat16, a_s_column_major=False,
             has_bias: bool = False, valid_rows: bool = False, implementation: str | None = None, config=None,
             interpret: bool | None = None) -> planner.GemmPlan:
  """The plan `w8a8_block_fp8_matmul` runs for operands of these shapes (arrays or `jax.ShapeDtypeStruct`s);
  valid_rows: whether the call passes a `valid_rows`."""
  m, k = a_q.shape
  p = planner.problem(out_rows or m, b_q.shape[0], k, _checks.block_size(block_size), rows=m,
                      out_dtype=_checks.float_dtype("out_dtype", out_dtype), a_s_column_major=a_s_column_major,
                      has_bias=has_bias, masked=_checks.flag("valid_rows", valid_rows))
  return planner.plan(p, implementation=implementation, config=config,
                      interpret=_checks.interpret(interpret))
