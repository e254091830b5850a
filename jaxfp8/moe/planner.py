"""The MoE layer's planner: the plans of its four ops (quantize the tokens, the gate_up grouped GEMM, the fused
SiLU-and-mul quantizer, the down grouped GEMM), made once per call shape, and `forward`, which runs them.

The layer decides little of its own: the grouped GEMM planner picks the implementation, each GEMM family quantizes
with its own kernel into the buffers that GEMM reads (scales column-major for the kernels), and the layout is the
ragged one (see `LAYOUT_REASON`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxfp8 import _checks, _platform, grouped, quant

LAYOUT_REASON = ("ragged: the rows sorted by expert, one grouped GEMM per projection (the masked layout has not been "
                 "measured faster on a GPU yet)")


@dataclasses.dataclass(frozen=True)
class MoeOptions:
  """What the caller asked for, besides the arrays (hashable). Validated here."""
  implementation: str | None = None        # the grouped GEMMs'
  quant_implementation: str | None = None
  interpret: bool | None = None

  def __post_init__(self):
    _checks.one_of("implementation", self.implementation, grouped.IMPLEMENTATIONS)
    _checks.one_of("quant_implementation", self.quant_implementation, quant.IMPLEMENTATIONS)
    object.__setattr__(self, "interpret", _checks.interpret(self.interpret))


@dataclasses.dataclass(frozen=True)
class MoePlan:
  """What an MoE call runs and why (`explain` returns it). `str(plan)`: one line per decision."""
  tokens: int
  top_k: int
  experts: int
  hidden: int
  intermediate: int
  block_size: tuple[int, int]
  x_dtype: str
  quant_x: quant.QuantPlan
  gate_up: grouped.GroupedPlan
  quant_h: quant.QuantPlan
  down: grouped.GroupedPlan
  layout: str = "ragged"
  layout_reason: str = LAYOUT_REASON

  @property
  def rows(self) -> int:
    """Rows of the grouped GEMMs: the routed rows (tokens x top_k), or an expert-parallel exchange buffer's."""
    return self.gate_up.problem.rows

  @property
  def column_major(self) -> bool:
    return self.gate_up.problem.a_s_column_major

  def __str__(self) -> str:
    return "\n".join([
        f"MoE layer: {self.tokens} tokens x top-{self.top_k}, grouped GEMMs on {self.rows} rows over {self.experts} "
        "experts; "
        f"H={self.hidden}, I={self.intermediate}, block_size={self.block_size}, x {self.x_dtype}",
        f"  layout: {self.layout_reason}",
        f"  tokens quantized: {self.quant_x}",
        f"  gate_up: {self.gate_up}",
        f"  SiLU-and-mul quantized: {self.quant_h}",
        f"  down: {self.down}"])


def plan(tokens: int, top_k: int, experts: int, hidden: int, intermediate: int, block_size: tuple[int, int], x_dtype,
         options: MoeOptions = MoeOptions(), device: _platform.Device | None = None,
         routed_rows: int | None = None) -> MoePlan:
  """The plans of a call on `tokens` tokens routed to `top_k` of `experts` experts; the grouped GEMMs run on
  `routed_rows` rows (default tokens x top_k; expert parallelism receives more, in its exchange buffers)."""
  device = device or _platform.device()
  interpret = _platform.resolve_interpret(options.interpret)
  x_dtype = jnp.dtype(x_dtype)
  rows = tokens * top_k if routed_rows is None else routed_rows
  gk = block_size[1]

  def gemm_plan(n, k, out_dtype, column_major, implementation, reason=None):
    p = grouped.problem("ragged", experts, rows, n, k, block_size, out_dtype=out_dtype,
                        a_s_column_major=column_major)
    return grouped.plan(p, implementation=implementation, interpret=interpret, device=device, reason=reason)

  chosen = gemm_plan(2 * intermediate, hidden, x_dtype, False, options.implementation)
  implementation = chosen.implementation
  gemm_plan = functools.partial(gemm_plan, reason=chosen.reason)
  column_major = implementation != "xla"  # the kernels read column-major scales; XLA needs no transpose
  gate_up = gemm_plan(2 * intermediate, hidden, x_dtype, column_major, implementation)
  down = gemm_plan(hidden, intermediate, jnp.float32, column_major, implementation)
  quant_implementation, quant_reason = quant.planner.for_gemm(implementation, device, interpret,
                                                              options.quant_implementation, "grouped GEMM")
  layout = dict(scale_layout="col" if column_major else "row", scale_tma_aligned=column_major)

  def quant_plan(m, k_in, fused):
    p = quant.problem(1, m, k_in, x_dtype, group_size=gk, eps=quant.planner.DEFAULT_EPS, fuse_silu_and_mul=fused, **layout)
    return quant.plan(p, implementation=quant_implementation, interpret=interpret, device=device,
                      reason=quant_reason, option="quant_implementation")

  return MoePlan(tokens, top_k, experts, hidden, intermediate, tuple(block_size), x_dtype.name,
                 quant_plan(tokens, hidden, False), gate_up, quant_plan(rows, 2 * intermediate, True), down)


def sort_by_expert(topk_ids: jax.Array, experts: int) -> tuple[jax.Array, jax.Array]:
  """(order, group_sizes): the routed rows (token-major slots) in expert order (stable), slots whose id is outside
  [0, E) last; group_sizes int32 (E,) counts only the others."""
  ids = topk_ids.reshape(-1).astype(jnp.int32)
  key = jnp.where((ids >= 0) & (ids < experts), ids, experts)
  order = jnp.argsort(key, stable=True)
  group_sizes = jnp.bincount(key, length=experts + 1)[:experts].astype(jnp.int32)
  return order, group_sizes


def unsort(y: jax.Array, order: jax.Array) -> jax.Array:
  """The rows of y (in `order`'s expert order) back in slot order."""
  return jnp.zeros_like(y).at[order].set(y, unique_indices=True)


def experts_on_rows(x_q, x_s, row_tokens, order, group_sizes, w13_q, w13_s, w2_q, w2_s, plan: MoePlan):
  """The expert MLPs on routed rows: row r (in `order`'s expert order) is token row_tokens[r] of the quantized
  tokens (x_q, x_s in the plan's scale layout). Returns y (R, H) float32, 0 for rows no expert owns."""
  a_q = x_q[row_tokens[order]]
  a_s = x_s[:, row_tokens[order]] if plan.column_major else x_s[row_tokens[order]]
  h = grouped.planner.run(a_q, w13_q, a_s, w13_s, group_sizes, plan=plan.gate_up)
  h_q, h_s = quant.planner.run(h[None], None, plan=plan.quant_h)
  return grouped.planner.run(h_q[0], w2_q, h_s[0], w2_s, group_sizes, plan=plan.down)


def combine(y_slots: jax.Array, topk_weights: jax.Array, valid: jax.Array, out_dtype) -> jax.Array:
  """out[t] = sum over slots j, in order, of float32(w[t, j]) * y[t, j] (float32), cast once. y_slots (T, k, H);
  a slot not `valid` (its id outside the experts) adds nothing, whatever its weight (inf or NaN included)."""
  weights = jnp.where(valid, topk_weights.astype(jnp.float32), 0.0)
  acc = jnp.zeros(y_slots.shape[::2], jnp.float32)
  for j in range(y_slots.shape[1]):
    acc = acc + weights[:, j, None] * y_slots[:, j]
  return acc.astype(out_dtype)


def forward(x, topk_ids, topk_weights, w13_q, w13_s, w2_q, w2_s, plan: MoePlan) -> jax.Array:
  """docs/CONTRACT.md §8 on validated (T, H) arrays: sort the slots by expert, quantize the tokens once and gather
  their rows, the two grouped GEMMs around the fused SiLU-and-mul quantizer, then the weighted sum back in token
  order. Traceable; checks nothing."""
  t, k = topk_ids.shape
  order, group_sizes = sort_by_expert(topk_ids, plan.experts)
  x_q, x_s = quant.planner.run(x[None], None, plan=plan.quant_x)
  row_tokens = jnp.arange(t * k, dtype=jnp.int32) // k
  y = experts_on_rows(x_q[0], x_s[0], row_tokens, order, group_sizes, w13_q, w13_s, w2_q, w2_s, plan)
  y_slots = unsort(y, order).reshape(t, k, -1)
  valid = (topk_ids >= 0) & (topk_ids < plan.experts)
  return combine(y_slots, topk_weights, valid, x.dtype)
