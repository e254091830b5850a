"""The MoE layer's forward (docs/CONTRACT.md §8) as named steps, each a function of arrays and the plan.

    dispatch    the routed slots in expert order: the order, its inverse, the group sizes, the live row count, and
                the grouped GEMMs' routing tables (built once for both)
    quantize    the tokens, once
    permute     each live row's token codes and scales gathered into expert order
    (quantize_permute: both in one kernel, the quantizer reading each live row's token through the order, where the
    plan says so)
    gate_up     the first grouped GEMM
    silu_quant  the fused SiLU-and-mul quantizer over the live rows
    (gate_up_silu_quant: both in one kernel, the quantizer in the GEMM's epilogue, where the plan says so)
    down        the second grouped GEMM (float32 out)
    combine     each token's k result rows gathered back through the inverse order and summed in slot order

Every step after `dispatch` works on the live rows only: the R = T x k routed rows have a static size (one compile
serves every routing), but the slots whose id is outside the experts (another device's expert, or none) sort last,
past `live`, and no step computes or stores them. The grouped GEMMs leave the rows past `live` unwritten
(`zero_unowned_rows=False`), the quantizer reads only the live rows (`masked_m`), and the combine selects, never
multiplies, a slot's result, so whatever those rows hold never reaches the output. Under the persistent grouped
schedule each expert's rows start at a multiple of the plan's row_align (`_aligned`): the gaps between experts are
rows of no expert too (the gather and the quantizer fill them with a copy of some token's row, the GEMMs neither
compute nor store them). The planner decides each step's implementation (`MoePlan`); the benchmark times the steps
by these names (`STEPS`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfp8 import grouped, quant
from jaxfp8.moe import combine as combine_rows
from jaxfp8.moe import permute as permute_rows
from jaxfp8.moe import sort, topk

STEPS = ("dispatch", "quantize", "permute", "gate_up", "silu_quant", "down", "combine")
GEMM_STEPS = ("gate_up", "gate_up_silu_quant", "down")
# The largest (E + 1) x R running-count table dispatch builds (int32: 256 MiB); past it a stable argsort.
COUNTING_MAX_ENTRIES = 1 << 26


class Dispatch(NamedTuple):
  """Where each routed slot goes. R slots (token-major, t * k + j), E experts; B rows of the GEMMs' buffers (R, or
  with the plan's row_align > 1 plan.rows: each expert's rows from a multiple of row_align, gaps between them)."""
  order: jax.Array        # (B,) int32: the slot at each expert-order row (by expert, stable; outside ids last; a gap
                          # row holds slot 0)
  rank: jax.Array         # (R,) int32: the expert-order row of each slot (order[rank[s]] == s)
  group_sizes: jax.Array  # (E,) int32: rows of each expert
  live: jax.Array         # () int32: the rows before the first slot of no expert (the sum of group_sizes, or with
                          # aligned rows the end of the last expert's aligned block)
  # (gate_up's, down's) grouped-GEMM routing tables (`grouped.planner.prepare`), built once for both where the two
  # plans take the same one; () when dispatched without a plan (each GEMM then builds its own).
  tables: tuple = ()
  # (L,) int32, the live count in each entry, where dispatch's reduction computed it in every row: the quantizers
  # read its first entry in place (slicing `live` out of it is a kernel of its own at decode); else None.
  live_counts: jax.Array | None = None


def with_tables(d: Dispatch, plan) -> Dispatch:
  """d with the grouped GEMMs' routing tables from the group sizes: at decode a kernel's prologue is a few small
  kernels, so the layer builds the table once when both GEMMs take the same one
  (`grouped.planner.prepared_key`)."""
  return d._replace(tables=_both_tables(plan, lambda gemm_plan: grouped.planner.prepare(d.group_sizes, gemm_plan)))


def _from_rows(key: jax.Array, rank: jax.Array, within: jax.Array, group_sizes: jax.Array, live: jax.Array,
               live_counts: jax.Array | None, plan) -> Dispatch:
  """The pairwise dispatch's tables, from the slots' keys and their index inside their expert's rows
  (`grouped.planner.prepare_from_rows`: fewer kernels than from the group sizes), and its order: the slot at each
  row, taken in gate_up's table's first reduction where that builds from the rows (one kernel fewer at decode), else
  a reduction of its own."""
  gate_up_table, order = grouped.planner.prepare_from_rows(key, rank, within, group_sizes, plan.gate_up,
                                                           with_order=True)
  tables = _both_tables(plan, lambda gemm_plan: grouped.planner.prepare_from_rows(key, rank, within, group_sizes,
                                                                                  gemm_plan), gate_up_table)
  return Dispatch(_slot_at_rows(rank) if order is None else order, rank, group_sizes, live, tables, live_counts)


def _masked_m(d: Dispatch) -> jax.Array:
  """The quantizers' valid-row vector for d's rows: its first entry the live count."""
  return d.live.reshape(1) if d.live_counts is None else d.live_counts


def _both_tables(plan, prepare, gate_up_table=None) -> tuple:
  """(gate_up's, down's) tables from prepare(gemm_plan) (gate_up's given where the caller built it): one built for
  both where the plans take the same one."""
  gate_up_table = prepare(plan.gate_up) if gate_up_table is None else gate_up_table
  same = grouped.planner.prepared_key(plan.gate_up) == grouped.planner.prepared_key(plan.down)
  return gate_up_table, gate_up_table if same else prepare(plan.down)


def dispatch(slot_ids: jax.Array, experts: int, plan=None) -> Dispatch:
  """The slots of slot_ids (any shape, int32 expert ids; an id outside [0, E) belongs to no expert here) sorted by
  expert, stable, the slots of no expert last: a counting sort, no sort kernel, in one of two forms.

  A slot's expert-order row is the number of slots that go before it: those of a lower expert (its expert's offset)
  and those of its own expert at a lower slot. With few slots (R x R within topk.PAIRWISE_MAX_COMPARES) that
  count is one fused reduction over (R, R); with more, a running count per expert (a cumulative sum over (E + 1, R):
  XLA's GPU cumsum is a scan kernel, a few times faster than the stable argsort it replaced at 4096 tokens), and past
  COUNTING_MAX_ENTRIES of those a stable argsort. The order is then one scatter of the rows (pairwise, a fused
  reduction). With the layer's plan, also the GEMMs' routing tables (`with_tables`; pairwise `_from_rows`, whose
  table's first reduction also takes the order), or where the plan's dispatch is the Mosaic kernel's, all of it in
  that kernel."""
  ids = slot_ids.reshape(-1).astype(jnp.int32)
  n = ids.shape[0]
  key = jnp.where((ids >= 0) & (ids < experts), ids, experts)
  if plan is not None and plan.sort is not None and plan.sort.implementation == "mosaic":
    # the same counts in one kernel (jaxfp8/moe/sort.py); the group sizes, read by no step at decode, are XLA's
    rank, order, live_counts, table = sort.run(ids, experts, plan.sort)
    group_sizes = jnp.sum(key[:, None] == jnp.arange(experts, dtype=jnp.int32), axis=0, dtype=jnp.int32)
    return Dispatch(order, rank, group_sizes, live_counts[0], (table, table), live_counts)
  if n * n <= topk.PAIRWISE_MAX_COMPARES:
    earlier = lax.broadcasted_iota(jnp.int32, (n, n), 1) < lax.broadcasted_iota(jnp.int32, (n, n), 0)
    same_earlier = (key[None, :] == key[:, None]) & earlier
    # each slot's row, its index among its expert's slots and (in every row alike) the live count, as one variadic
    # reduction over (R, R): one kernel, whatever the compiler's sibling fusion does
    rank, within, live_counts = _sums(((key[None, :] < key[:, None]) | same_earlier, same_earlier,
                                       jnp.broadcast_to(key[None, :] < experts, (n, n))))
    live, live_counts = (live_counts[0], live_counts) if n else (jnp.int32(0), None)
    order = None  # taken with the tables where the plan builds them from the rows (`_from_rows`)
    group_sizes = jnp.sum(key[:, None] == jnp.arange(experts, dtype=jnp.int32), axis=0, dtype=jnp.int32)
  elif (experts + 1) * n <= COUNTING_MAX_ENTRIES:
    buckets = jnp.arange(experts + 1, dtype=jnp.int32)
    running = jnp.cumsum((key[None, :] == buckets[:, None]).astype(jnp.int32), axis=1)  # (E + 1, R), inclusive
    sizes = running[:, -1]
    offsets = _exclusive_sum(sizes)  # the slots of lower experts
    within = running[key, jnp.arange(n)] - 1
    rank = offsets[key] + within
    order = _inverse(rank)
    within = None  # from the group sizes: pairwise tables over this many rows would be too large
    group_sizes = sizes[:experts]
    live = jnp.sum(key < experts, dtype=jnp.int32)
  else:
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    rank = _inverse(order)
    within = None
    group_sizes = jnp.bincount(key, length=experts + 1)[:experts].astype(jnp.int32)
    live = jnp.sum(key < experts, dtype=jnp.int32)
  if plan is not None and plan.row_align > 1:
    return _aligned(key, rank, group_sizes, plan)
  if plan is not None and within is not None:
    return _from_rows(key, rank, within, group_sizes, live, live_counts, plan)
  d = Dispatch(_slot_at_rows(rank) if order is None else order, rank, group_sizes, live)
  return d if plan is None else with_tables(d, plan)


def _slot_at_rows(rank: jax.Array) -> jax.Array:
  """The inverse of the slots' rows, as one fused reduction over (R, R) (a scatter would be a zero fill and a
  scatter kernel)."""
  n = rank.shape[0]
  return jnp.sum(jnp.where(rank[None, :] == lax.broadcasted_iota(jnp.int32, (n, n), 0),
                           lax.broadcasted_iota(jnp.int32, (n, n), 1), 0), axis=1, dtype=jnp.int32)


def _sums(masks: tuple) -> tuple:
  """The row sums (axis 1) of same-shape boolean masks, as int32, in one variadic reduction."""
  zero = np.int32(0)
  return lax.reduce(tuple(m.astype(jnp.int32) for m in masks), (zero,) * len(masks),
                    lambda a, b: tuple(x + y for x, y in zip(a, b)), (1,))


def _exclusive_sum(x: jax.Array) -> jax.Array:
  """The exclusive cumulative sum of a short int32 vector, as one fused masked sum (no scan kernel)."""
  n = x.shape[0]
  below = lax.broadcasted_iota(jnp.int32, (n, n), 1) < lax.broadcasted_iota(jnp.int32, (n, n), 0)
  return jnp.sum(jnp.where(below, x[None, :], 0), axis=1, dtype=jnp.int32)


def _aligned(key: jax.Array, packed_rank: jax.Array, group_sizes: jax.Array, plan) -> Dispatch:
  """The dispatch of `plan.row_align` > 1: each expert's rows from a multiple of the alignment in a buffer of
  plan.rows rows (the packed order's rows of each expert, shifted to its aligned start). `live` is the end of the
  last expert's aligned block: the gather and the SiLU-and-mul quantizer also fill the gaps between experts (a copy
  of some token's row, read by nothing), which the grouped GEMMs neither compute nor store."""
  align = plan.row_align
  experts = group_sizes.shape[0]
  packed_starts = _exclusive_sum(group_sizes)
  starts = _exclusive_sum((group_sizes + (align - 1)) // align * align)
  live = starts[-1] + (group_sizes[-1] + (align - 1)) // align * align
  within_key = jnp.minimum(key, experts - 1)  # slots of no expert: placed past `live` below
  rank = jnp.where(key < experts, starts[within_key] + packed_rank - packed_starts[within_key],
                   live + packed_rank - jnp.sum(group_sizes))
  order = jnp.zeros((plan.rows,), jnp.int32).at[rank].set(jnp.arange(key.shape[0], dtype=jnp.int32),
                                                         unique_indices=True)
  tables = _both_tables(plan, lambda gemm_plan: grouped.planner.prepare_from_starts(starts, group_sizes, gemm_plan))
  return Dispatch(order, rank, group_sizes, live, tables)


def _inverse(permutation: jax.Array) -> jax.Array:
  """The inverse of a permutation of [0, n): one scatter."""
  n = permutation.shape[0]
  return jnp.zeros_like(permutation).at[permutation].set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)


def quantize(x: jax.Array, plan) -> tuple[jax.Array, jax.Array]:
  """The tokens x (T, H) quantized once: codes (T', H) and scales in the plan's layout (column-major (G, T'') for
  the kernels)."""
  x_q, x_s = quant.planner.run(x[None], None, plan=plan.quant_x)
  return x_q[0], x_s[0]


def permute(x_q: jax.Array, x_s: jax.Array, slots_per_row: int, d: Dispatch, plan) -> tuple[jax.Array, jax.Array]:
  """The codes and scales of expert-order row r: those of row order[r] // slots_per_row of (x_q, x_s) (the token of
  a slot: slots_per_row = top_k; 1 where the slots are the rows). Rows from `live` on are unspecified (the Mosaic row
  gather does not write them; XLA's gathers the row of a slot of no expert there)."""
  a_q = permute_rows.gather(x_q, d.order, d.live, plan.permute, slots_per_row)
  source = d.order // slots_per_row  # every slot's row exists, so the rows past `live` need no clamp
  a_s = x_s[:, source] if plan.column_major else x_s[source]
  return a_q, a_s


def gate_up(a_q, a_s, d: Dispatch, w13_q, w13_s, plan) -> jax.Array:
  """h (B, 2I) in x's dtype: each expert's rows against its [gate | up] weight; rows of no expert unwritten."""
  return _grouped(a_q, w13_q, a_s, w13_s, d, 0, plan.gate_up)


def silu_quant(h: jax.Array, d: Dispatch, plan) -> tuple[jax.Array, jax.Array]:
  """SiLU(gate) * up of the live rows of h, quantized: codes (R', I) and scales; rows past `live` unspecified."""
  h_q, h_s = quant.planner.run(h[None], _masked_m(d), plan=plan.quant_h)
  return h_q[0], h_s[0]


def steps(plan) -> tuple[str, ...]:
  """The names of the steps `plan` runs, in order (STEPS, with the fused steps where the plan fuses)."""
  rows = ("quantize_permute",) if plan.permute_in_quantize else ("quantize", "permute")
  first_gemm = ("gate_up_silu_quant",) if plan.fused_silu_quant else ("gate_up", "silu_quant")
  return ("dispatch", *rows, *first_gemm, "down", "combine")


def quantize_permute(x: jax.Array, d: Dispatch, plan) -> tuple[jax.Array, jax.Array]:
  """quantize and permute in one kernel (plan.permute_in_quantize): the codes (B, H) and scales of expert-order row
  r < live quantized from x[order[r] // top_k]; rows from `live` on unspecified."""
  a_q, a_s = quant.planner.run(x[None], _masked_m(d), plan=plan.quant_x, source=d.order)
  return a_q[0], a_s[0]


def gate_up_silu_quant(a_q, a_s, d: Dispatch, w13_q, w13_s, plan) -> tuple[jax.Array, jax.Array]:
  """gate_up with silu_quant in its epilogue (plan.fused_silu_quant): codes (B, I) and column-major scales
  (I/G, B'), B' >= B; rows of no expert unspecified."""
  return grouped.planner.run_gate_up_silu_quant(a_q, w13_q, a_s, w13_s, d.tables[0], plan=plan.gate_up,
                                                h_dtype=plan.quant_h.problem.dtype, eps=plan.quant_h.problem.eps)


def down(h_q, h_s, d: Dispatch, w2_q, w2_s, plan) -> jax.Array:
  """y (B, H) float32: each expert's rows against its down weight; rows of no expert unwritten."""
  return _grouped(h_q, w2_q, h_s, w2_s, d, 1, plan.down)


def _grouped(a_q, w_q, a_s, w_s, d: Dispatch, which: int, gemm_plan) -> jax.Array:
  """One of the grouped GEMMs on d's routing: its table from d where dispatch built it, else the group sizes."""
  if d.tables:
    return grouped.planner.run(a_q, w_q, a_s, w_s, d.tables[which], plan=gemm_plan, prepared=True)
  return grouped.planner.run(a_q, w_q, a_s, w_s, d.group_sizes, plan=gemm_plan)


def combine(y: jax.Array, d: Dispatch, topk_weights: jax.Array, valid: jax.Array, out_dtype, plan) -> jax.Array:
  """(T, H): each token's k rows of y (expert order) read through `rank` and summed in slot order (the plan's
  combine: jaxfp8/moe/combine.py); a slot of no expert adds nothing and its row is never used."""
  t, k = topk_weights.shape
  return combine_rows.combine(y, d.rank.reshape(t, k), topk_weights, valid, out_dtype, plan.combine)


def _apart(*values):
  """The values one step hands to the next, behind an optimization barrier: XLA's GPU compiler would otherwise fuse
  neighbouring steps and fold their converts (simplify-fp-conversions: f32 -> bf16 -> f32 becomes nothing, so gate_up's
  h would reach the SiLU quantizer unrounded, and the XLA layer missed the reference by 2-3% on the H200). Each step
  then computes what it computes alone, the contract's roundings included."""
  out = lax.optimization_barrier(values)
  return out if len(out) > 1 else out[0]


def experts_on_rows(x_q, x_s, slots_per_row: int, d: Dispatch, w13_q, w13_s, w2_q, w2_s, plan) -> jax.Array:
  """permute, gate_up, silu_quant, down: y (R, H) float32 in expert order, its rows past `live` unspecified."""
  return _experts(*_apart(*permute(x_q, x_s, slots_per_row, d, plan)), d, w13_q, w13_s, w2_q, w2_s, plan)


def _experts(a_q, a_s, d: Dispatch, w13_q, w13_s, w2_q, w2_s, plan) -> jax.Array:
  """gate_up, silu_quant, down on the rows in expert order."""
  if plan.fused_silu_quant:
    h_q, h_s = _apart(*gate_up_silu_quant(a_q, a_s, d, w13_q, w13_s, plan))
  else:
    h = _apart(gate_up(a_q, a_s, d, w13_q, w13_s, plan))
    h_q, h_s = _apart(*silu_quant(h, d, plan))
  return _apart(down(h_q, h_s, d, w2_q, w2_s, plan))


def forward(x, topk_ids, topk_weights, w13_q, w13_s, w2_q, w2_s, plan) -> jax.Array:
  """docs/CONTRACT.md §8 on validated (T, H) arrays, every step above in turn. Traceable; checks nothing."""
  t, k = topk_ids.shape
  d = dispatch(topk_ids, plan.experts, plan)
  if plan.permute_in_quantize:
    y = _experts(*_apart(*quantize_permute(x, d, plan)), d, w13_q, w13_s, w2_q, w2_s, plan)
  else:
    x_q, x_s = _apart(*quantize(x, plan))
    y = experts_on_rows(x_q, x_s, k, d, w13_q, w13_s, w2_q, w2_s, plan)
  valid = (topk_ids >= 0) & (topk_ids < plan.experts)
  return combine(y, d, topk_weights, valid, x.dtype, plan)
