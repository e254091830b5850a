"""The MoE layer's planner: the plans of its steps (jaxfp8/moe/layer.py), made once per call shape.

The layer decides little of its own: the grouped GEMM planner picks the implementation, each GEMM family quantizes
with its own kernel into the buffers that GEMM reads (scales column-major for the kernels), the layout is the
ragged one (see `LAYOUT_REASON`), and every step works on the live rows only (`LIVE_ROWS_REASON`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from jaxfp8 import _checks, _platform, grouped, quant
from jaxfp8.moe import combine, permute, sort

LIVE_ROWS_REASON = ("the slots of no local expert sort past the live rows, which the GEMMs neither compute nor store "
                    "and the SiLU-and-mul quantizer neither reads nor (past the last live block) writes; the "
                    "combine gathers each token's rows back")
PACKED_ROWS_REASON = ("packed, each expert's rows right after the previous one's (under one 64-row tile per expert a "
                      "tile holds several experts' few rows, which aligned starts would not save; the decode "
                      "schedule and the XLA GEMMs take packed rows)")
ALIGNED_ROWS_REASON = ("each expert's first row at a multiple of {align} in a buffer of {rows} rows (the persistent "
                       "schedule's {align}-row work items then never hold two experts' rows, so no row tile is "
                       "computed twice; from {align} routed rows per expert)")
FUSED_SILU_QUANT_REASON = ("in gate_up's epilogue: each 64x256 tile holds a gate and an up block of the same 128 "
                           "columns, so h is quantized where it is computed and never written (each expert's rows "
                           "start at a row tile: no tile holds two experts' rows)")
PERMUTE_IN_QUANTIZE_REASON = ("in the quantizer: the Mosaic quantizer reads each live row's token through the "
                              "expert order and writes its codes and scales in expert order (one kernel where "
                              "quantize and permute were two or three, and the tokens' codes are never written)")
# Every slot live (MoeOptions.every_id_local): past this many bytes that the fused quantize_permute reads beyond
# quantize + permute, the two run apart. The fused kernel reads a row of x per live slot; apart, each token is read
# once and its codes moved per slot: about H * (L * (s - 1) - T * (s + 1)) bytes more fused, for L live slots of T
# tokens and s bytes per element of x. H100, Qwen3-30B-A3B at 4096 tokens (42 MB more): 56.4 us fused against
# 7.4 + 37.5 apart; DeepSeek-V3 EP8's one live slot in eight: 46.9 against 31.7 + 26.6.
FUSED_PERMUTE_EXTRA_BYTES_MAX = 16 << 20
LAYOUT_REASON = ("ragged: the rows sorted by expert, one grouped GEMM per projection (the masked layout has not been "
                 "measured faster on a GPU yet)")


@dataclasses.dataclass(frozen=True)
class MoeOptions:
  """What the caller asked for, besides the arrays (hashable). Validated here."""
  implementation: str | None = None        # the grouped GEMMs'
  quant_implementation: str | None = None
  interpret: bool | None = None
  combine_implementation: str | None = None  # None: XLA's (jaxfp8/moe/combine.py)
  # None or True: the SiLU-and-mul quantizer in gate_up's epilogue wherever the plan allows it; False: a step of its
  # own (the two kernels the fused one replaces)
  silu_quant_in_gate_up: bool | None = None
  # None or True: the permute in the tokens' quantizer wherever the plan allows it; False: quantize, then permute
  permute_in_quantize: bool | None = None
  # True: the caller promises every routed id is one of these experts (a router over them on one device), so every
  # slot is a live row; the plan may then size its steps for that. Speed only: an id outside [0, E) still adds nothing.
  every_id_local: bool = False
  dispatch_implementation: str | None = None  # the decode dispatch's (jaxfp8/moe/sort.py); None: the planner's

  def __post_init__(self):
    for name in ("silu_quant_in_gate_up", "permute_in_quantize"):
      if getattr(self, name) is not None:
        object.__setattr__(self, name, _checks.flag(name, getattr(self, name)))
    object.__setattr__(self, "every_id_local", _checks.flag("every_id_local", self.every_id_local))
    _checks.one_of("implementation", self.implementation, grouped.IMPLEMENTATIONS)
    _checks.one_of("quant_implementation", self.quant_implementation, quant.IMPLEMENTATIONS)
    _checks.one_of("combine_implementation", self.combine_implementation, combine.IMPLEMENTATIONS)
    _checks.one_of("dispatch_implementation", self.dispatch_implementation, sort.IMPLEMENTATIONS)
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
  permute: permute.PermutePlan
  combine: combine.CombinePlan
  layout: str = "ragged"
  layout_reason: str = LAYOUT_REASON
  # Each expert's first row sits at a multiple of row_align in the GEMMs' buffer (1: the rows are packed).
  row_align: int = 1
  row_align_reason: str = ""
  # True: gate_up computes the SiLU-and-mul quantizer in its epilogue (quant_h is not run); why either way.
  fused_silu_quant: bool = False
  silu_quant_reason: str = ""
  # True: quant_x quantizes the live rows in expert order straight from the tokens (a gathering quantizer plan), and
  # the permute does not run; why either way.
  permute_in_quantize: bool = False
  permute_reason: str = ""
  # MoeOptions.every_id_local, as planned; not compared: plans that run the same steps share one compile
  every_id_local: bool = dataclasses.field(default=False, compare=False)
  # the dispatch's implementation (None: XLA's, the plan made without a device's choice)
  sort: sort.SortPlan | None = None

  @property
  def rows(self) -> int:
    """Rows of the grouped GEMMs' buffers: the routed rows (tokens x top_k) or an expert-parallel exchange buffer's,
    and with row_align > 1 up to row_align - 1 more per expert (each expert's rows start at a multiple of it)."""
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
        f"  rows: {LIVE_ROWS_REASON}",
        f"  dispatch: {self.sort}",
        f"  expert rows: {self.row_align_reason}",
        f"  tokens quantized: {self.quant_x}",
        f"  permute: {self.permute_reason or self.permute}",
        f"  gate_up: {self.gate_up}",
        f"  SiLU-and-mul quantized: {self.silu_quant_reason or self.quant_h}",
        f"  down: {self.down}",
        f"  combine: {self.combine}"])


def _persistent_tile_rows(*gemm_plans) -> int:
  """The row tile the Mosaic GEMM plans share where each runs the persistent (prefill) schedule; 1 otherwise."""
  configs = [p.config for p in gemm_plans]
  if any(p.implementation != "mosaic" for p in gemm_plans) or not all(c.persistent for c in configs):
    return 1
  tiles = {c.tile_m for c in configs}
  return tiles.pop() if len(tiles) == 1 else 1


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

  def gemm_plan(n, k, out_dtype, column_major, implementation, reason=None, rows=rows):
    p = grouped.problem("ragged", experts, rows, n, k, block_size, out_dtype=out_dtype,
                        a_s_column_major=column_major, zero_unowned_rows=False)
    return grouped.plan(p, implementation=implementation, interpret=interpret, device=device, reason=reason)

  chosen = gemm_plan(2 * intermediate, hidden, x_dtype, False, options.implementation)
  implementation = chosen.implementation
  gemm_plan = functools.partial(gemm_plan, reason=chosen.reason)
  column_major = implementation != "xla"  # the kernels read column-major scales; XLA needs no transpose
  gate_up = gemm_plan(2 * intermediate, hidden, x_dtype, column_major, implementation)
  down = gemm_plan(hidden, intermediate, jnp.float32, column_major, implementation)
  row_align, row_align_reason = 1, PACKED_ROWS_REASON
  align = _persistent_tile_rows(gate_up, down)
  # With fewer rows per expert than a tile, packed tiles hold several experts (each computes the tile once, as
  # aligned ones would) and alignment would only add rows.
  if align > 1 and experts > 0 and rows >= align * experts:
    # The buffer holds every expert's rows from a multiple of `align`: up to align - 1 more rows per expert that
    # holds rows (at most min(E, R) of them). The schedules are planned on that buffer.
    buffer_rows = rows + min(experts, rows) * (align - 1)
    aligned = (gemm_plan(2 * intermediate, hidden, x_dtype, column_major, implementation, rows=buffer_rows),
               gemm_plan(hidden, intermediate, jnp.float32, column_major, implementation, rows=buffer_rows))
    if _persistent_tile_rows(*aligned) == align:
      gate_up, down = aligned
      row_align, row_align_reason = align, ALIGNED_ROWS_REASON.format(align=align, rows=buffer_rows)
      rows = buffer_rows
  quant_implementation, quant_reason = quant.planner.for_gemm(implementation, device, interpret,
                                                              options.quant_implementation, "grouped GEMM")
  layout = dict(scale_layout="col" if column_major else "row", scale_tma_aligned=column_major)

  def quant_problem(m, k_in, fused, pad_rows_written, gather_divisor=0):
    return quant.problem(1, m, k_in, x_dtype, group_size=gk, eps=quant.planner.DEFAULT_EPS, fuse_silu_and_mul=fused,
                         pad_rows_written=pad_rows_written, gather_divisor=gather_divisor, **layout)

  def quant_plan(p):
    return quant.plan(p, implementation=quant_implementation, interpret=interpret, device=device,
                      reason=quant_reason, option="quant_implementation")

  quant_x = quant_plan(quant_problem(tokens, hidden, False, True))
  permute_plan = permute.plan(implementation, hidden, device, interpret)
  # the rows of the GEMMs' buffer quantized straight from their tokens (rows past the live ones read by nothing)
  gathered = quant_problem(rows, hidden, False, False, gather_divisor=top_k)
  # (the routed slots; with aligned expert rows the fused quantizer also fills the gaps: more still)
  extra = (hidden * (tokens * top_k * (x_dtype.itemsize - 1) - tokens * (x_dtype.itemsize + 1))
           if options.every_id_local else 0)
  quant_x, permute_in_quantize, permute_reason = _permute_in_quantize(quant_x, permute_plan, gathered, quant_plan,
                                                                      routed_rows is None,
                                                                      options.permute_in_quantize, extra)
  # h's rows past the live ones are read by nothing (the down GEMM neither computes nor stores them)
  quant_h = quant_plan(quant_problem(rows, 2 * intermediate, True, False))
  fused, silu_quant_reason = _silu_quant_in_gate_up(gate_up, row_align, x_dtype, quant_h,
                                                    options.silu_quant_in_gate_up)
  sort_plan = sort.plan(options.dispatch_implementation, rows, experts, _table_tile(gate_up, down, row_align,
                                                                                    routed_rows is None),
                        device, interpret)
  return MoePlan(tokens, top_k, experts, hidden, intermediate, tuple(block_size), x_dtype.name,
                 quant_x, gate_up, quant_h, down, permute_plan,
                 combine.plan(options.combine_implementation, tokens, top_k, hidden, x_dtype, device, interpret,
                              every_slot_live=options.every_id_local),
                 row_align=row_align, row_align_reason=row_align_reason, fused_silu_quant=fused,
                 silu_quant_reason=silu_quant_reason, permute_in_quantize=permute_in_quantize,
                 permute_reason=permute_reason, every_id_local=options.every_id_local, sort=sort_plan)


def _table_tile(gate_up: grouped.GroupedPlan, down: grouped.GroupedPlan, row_align: int, single_device: bool):
  """The row tile of the one work-item table both grouped GEMMs read, built from the sorted rows (what the Mosaic
  dispatch writes): the Mosaic GEMMs on packed rows of one device sharing one table; else None."""
  if not single_device or row_align != 1 or gate_up.implementation != "mosaic" or down.implementation != "mosaic":
    return None
  if gate_up.problem.empty or grouped.planner.prepared_key(gate_up) != grouped.planner.prepared_key(down):
    return None
  return gate_up.config.tile_m


def _permute_in_quantize(quant_x: quant.QuantPlan, permute_plan: permute.PermutePlan, gathered: quant.QuantProblem,
                         quant_plan, single_device: bool, asked: bool | None,
                         extra_bytes: int = 0) -> tuple[quant.QuantPlan, bool, str]:
  """(the tokens' quantizer plan, whether it also permutes, why): the gathering problem's Mosaic plan where the
  Mosaic quantizer and the Mosaic row gather both run on one device (under expert parallelism the tokens' codes
  travel, so they are quantized before the exchange) and, unless asked for, it reads at most
  FUSED_PERMUTE_EXTRA_BYTES_MAX more than the two apart (extra_bytes); else quant_x as it was."""
  if not single_device or quant_x.implementation != "mosaic" or permute_plan.implementation != "mosaic":
    return quant_x, False, ""
  if asked is False:
    return quant_x, False, f"{permute_plan} (not in the quantizer: turned off, permute_in_quantize=False)"
  if asked is None and extra_bytes > FUSED_PERMUTE_EXTRA_BYTES_MAX:
    return quant_x, False, (f"{permute_plan} (not in the quantizer: every slot is live (every_id_local), and reading "
                            f"a row of x per slot would read {extra_bytes / 2**20:.0f} MiB more than quantizing each "
                            f"token once and moving its codes, past {FUSED_PERMUTE_EXTRA_BYTES_MAX >> 20} MiB)")
  if why := quant.planner.BACKENDS["mosaic"].unsupported(gathered):
    return quant_x, False, f"{permute_plan} (not in the quantizer: {why})"
  return quant_plan(gathered), True, PERMUTE_IN_QUANTIZE_REASON


def _silu_quant_in_gate_up(gate_up: grouped.GroupedPlan, row_align: int, x_dtype, quant_h: quant.QuantPlan,
                           asked: bool | None):
  """(whether gate_up computes the SiLU-and-mul quantizer in its epilogue, why). Unless turned off; it needs each
  row tile of the buffer to hold one expert's rows (the epilogue stores a tile's scales whole) and a kernel config
  that pairs gate and up blocks. Fused, the layer measured 3-5% faster at 4096 tokens (H200: DeepSeek-V3 EP8 744 vs
  768 us, Qwen3-30B-A3B 643 vs 673; the fused gate_up 268 us where gate_up and the quantizer took 247 + 52)."""
  p = quant_h.problem
  if asked is False:
    why = "turned off (silu_quant_in_gate_up=False)"
  elif p.scale_ue8m0 or p.group_size != grouped.mosaic.BLOCK:
    why = f"the fused epilogue writes float scales of 128-column groups, not {p}"
  elif gate_up.implementation == "mosaic" and row_align != gate_up.config.tile_m:
    why = "packed expert rows (a row tile may hold two experts' rows, whose scales one tile store would mix)"
  else:
    why = grouped.planner.silu_quant_unsupported(gate_up, x_dtype)
  if why is None:
    return True, FUSED_SILU_QUANT_REASON
  return False, f"{quant_h} (not in gate_up's epilogue: {why})"
