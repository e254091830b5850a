"""The Mosaic GPU grouped-GEMM backend (Hopper): what it runs, its schedule heuristic, and its launch.

The kernel (pallas_kernels/grouped_gemm_mosaic.py) builds any config it is given; the choice lives here
(`default_config`, each rule with the H200 measurement behind it), by the rows one expert sees: with few, the dense
GEMM's decode schedule (jaxfp8/gemm/mosaic.py: the weights stream once, spread over many CTAs, a CTA per work item
and column tile; `live_grid`, a knob: one CTA per SM looping over the table's live items only); with more (ragged:
from 16 rows per expert, or from half a row at K <= 1024, unless its tiles would leave most of a last wave idle;
masked: above one 64-row tile of capacity) a persistent schedule, 64x256 tiles on two consumer warpgroups side by
side for the ragged layout (64-row work items waste little where an expert's rows end inside a tile), 128x128 tiles
split along M for the masked layout and for N of an odd number of 128-column blocks.
"""

from __future__ import annotations

import importlib
import math

import jax.numpy as jnp

from jaxfp8 import _checks, _platform
from jaxfp8.gemm import mosaic as dense

KERNEL_MODULE = "pallas_kernels.grouped_gemm_mosaic"
TABLE_KERNEL_MODULE = "pallas_kernels.ragged_items_mosaic"
CONFIG_CLASS = "MosaicGemmConfig"
# Whether a ragged call of up to the table kernel's MAX_ROWS rows, given group sizes, builds its work-item table in
# one Mosaic kernel (pallas_kernels/ragged_items_mosaic.py) instead of XLA's three or four prologue kernels. H100,
# `scripts/ab_grouped_table.py` (XLA's prologue, first / last run, against the kernel, us) at R = 8 and 64: faster at
# all ten points, e.g. Qwen3-30B-A3B gate_up 14.50 / 14.24 vs 13.54 and 64.98 / 65.09 vs 64.02, DeepSeek-V3 EP8
# gate_up 76.93 / 77.14 vs 74.62, Qwen3-235B EP8 gate_up 37.92 / 37.90 vs 35.97.
TABLE_KERNEL_BY_DEFAULT = True
BLOCK = dense.BLOCK
WGMMA_M = dense.WGMMA_M


def _kernel():
  return importlib.import_module(KERNEL_MODULE)


def config_class():
  return _kernel().MosaicGemmConfig


def rows_per_group(problem) -> float:
  """The rows one group sees on average (balanced routing): the schedule's row count."""
  if problem.layout == "masked":
    return problem.rows
  return problem.rows / max(problem.groups, 1)


# Rows per expert from which the persistent 64x256 schedule runs (`default_config`); below it, and where its tiles
# would fill under PERSISTENT_MIN_WAVE_FILL of their last wave, the decode schedule.
PERSISTENT_MIN_ROWS_PER_GROUP = 16
PERSISTENT_MIN_WAVE_FILL = 0.8
# K up to which the persistent schedule runs from PERSISTENT_SHORT_K_MIN_ROWS rows per expert: with a few K blocks
# a CTA per (item, column tile) spends more on its start than on its loads.
PERSISTENT_SHORT_K = 1024
PERSISTENT_SHORT_K_MIN_ROWS = 0.5


# Whether each layout's decode schedule runs on a persistent grid of one CTA per SM looping over the work-item table's
# live items (`MosaicGemmConfig.live_grid`) rather than one CTA per (item, column tile) of the table's static size.
# Masked: on, its table holds E x (row tiles + 1) items whatever the routing, mostly dead at decode (H100, one
# process, 8 / 64 / 256 routed rows, us per-tile vs live: Qwen3-30B-A3B gate_up 40.4 / 78.8 / 189.8 vs 34.9 / 89.3 /
# 155.3, down 44.9 / 69.4 / 116.6 vs 31.4 / 63.7 / 96.3; DeepSeek-V3 EP8 gate_up 87.7 / 359.1 / 404.4 vs 95.5 / 325.2
# / 355.0, down 54.0 / 170.3 / 181.8 vs 62.9 / 181.9 / 191.7: 1683 us summed vs 1797, losing where K or N is long).
# Ragged: off, its table is built from the routed rows (H100, Qwen3 gate_up at 8 rows 14.7 per-tile vs 16.4 live).
DECODE_LIVE_GRID = {"masked": True, "ragged": False}


def persistent_wave_fill(problem, num_sms: int) -> float:
  """The share of the persistent 64x256 schedule's last wave of tiles that is busy, from the expected work items of a
  ragged problem under balanced routing: an expert's run of r rows at a random offset touches about r / 64 + 1 row
  tiles."""
  rpg = rows_per_group(problem)
  live_groups = min(problem.groups, max(problem.rows, 1))
  tiles = live_groups * (rpg / WGMMA_M + 1) * -(-problem.n // (2 * BLOCK))
  if tiles <= 0:  # an empty problem (no group, no column): nothing runs
    return 1.0
  waves = tiles / num_sms
  return waves / math.ceil(waves)


def default_config(problem, num_sms: int):
  """(the schedule for `problem`, why), fitted to shared memory. The persistent 64x256 schedule: two consumers side
  by side along N, so that a work item is one 64-row tile and an expert boundary inside a tile costs 64 rows
  computed twice (a 128-row tile split along M costs an idle consumer that still paces the other's pipeline). One K
  block per step: each consumer holds one wgmma accumulator beside the running one, which fits the launch's
  registers where JAX 0.12 drops setmaxnreg (dense.register_split_kept).

  Measured on the H200 (balanced routing; benchmarks/grouped_schedules_h200.tgz): above 64 rows
  per expert it beat 128x128 tiles split along M at 11 of 12 points (DeepSeek-V3 EP8 gate_up at 4096 / 16384 routed
  rows 385.5 / 998.9 us vs 467.0 / 1054.8; Qwen3-30B-A3B gate_up at 32768 274.1 vs 299.8) and was level at 1024 rows
  per expert (DeepSeek-V3 gate_up 1919.4 vs 1889.1, down 1005.9 vs 1022.9). Against the decode schedule it won from
  16 rows per expert (DeepSeek-V3 gate_up at 512 rows 233.9 vs 253.6, 2048 307.3 vs 382.3), lost below (8 rows:
  243.6 vs 238.3), lost where its tiles left most of a last wave idle (Qwen3-235B EP8 gate_up at 32 rows per expert:
  288 tiles on 132 SMs, 71.7 vs 65.2) and won at K=768 from half a row per expert (Qwen3-30B-A3B down at 64 / 256
  rows: 33.5 / 55.7 vs 35.2 / 67.5)."""
  K = _kernel()
  rpg = rows_per_group(problem)
  fill = persistent_wave_fill(problem, num_sms)
  if problem.layout == "masked":
    # T rows a group is a capacity, not the rows routed (a decode batch fills a few of them): the decode schedule up
    # to one 64-row tile of it.
    persistent = rpg > WGMMA_M
    why = f"{rpg:g} rows of capacity per group (masked layout)"
  elif problem.n % (2 * BLOCK):
    persistent = rpg > WGMMA_M
    why = (f"{rpg:g} rows per group; N={problem.n} is an odd number of 128-column blocks: "
           + ("128x128 tiles on two consumers split along M" if persistent else "the decode schedule"))
  elif problem.k <= PERSISTENT_SHORT_K and rpg >= PERSISTENT_SHORT_K_MIN_ROWS:
    persistent = True
    why = (f"{rpg:g} rows per group at K={problem.k} <= {PERSISTENT_SHORT_K}: persistent 64x256 tiles (a CTA per "
           "tile would spend more on its start than on its few K blocks)")
  elif rpg >= PERSISTENT_MIN_ROWS_PER_GROUP and fill >= PERSISTENT_MIN_WAVE_FILL:
    persistent = True
    why = f"{rpg:g} rows per group: persistent 64x256 tiles (their last wave {fill:.0%} full)"
  else:
    persistent = False
    why = (f"the decode schedule for {rpg:g} rows per group ("
           + (f"< {PERSISTENT_MIN_ROWS_PER_GROUP}" if rpg < PERSISTENT_MIN_ROWS_PER_GROUP else
              f"the persistent tiles would fill {fill:.0%} of their last wave")
           + ")")
  if not persistent:
    live_grid = DECODE_LIVE_GRID[problem.layout]
    if live_grid:
      why += ("; a persistent grid over the table's live items only (its dead padding items, most of a masked table "
              "at decode, cost no CTA)")
    config = K.MosaicGemmConfig(tile_m=WGMMA_M, tile_n=128, max_concurrent_steps=4, k_blocks_per_step=2,
                                num_compute_wgs=1, persistent=live_grid, live_grid=live_grid,
                                weight_scales_ahead=True)
  elif problem.n % (2 * BLOCK) == 0 and problem.layout == "ragged":
    config = K.MosaicGemmConfig(tile_m=WGMMA_M, tile_n=2 * BLOCK, max_concurrent_steps=4, k_blocks_per_step=1,
                                num_compute_wgs=2, wg_split=K.Dim.N, grid_minor_dim=K.Dim.M, grid_tile_width=8)
  else:
    config = K.MosaicGemmConfig(tile_m=128, tile_n=128, max_concurrent_steps=4, k_blocks_per_step=1,
                                num_compute_wgs=2, grid_minor_dim=K.Dim.M, grid_tile_width=8)
  return fit_smem(config, problem.out_dtype, problem.k), why


def fit_smem(config, out_dtype, k: int):
  """`config` with max_concurrent_steps lowered until it fits in shared memory (and to at most the K steps)."""
  K = _kernel()
  return K.fit_smem(config, k, lambda c: K.smem_bytes(c, out_dtype))


# ---- the backend interface the planner asks -------------------------------------------------------------------------

def unavailable(device: _platform.Device, interpret: bool) -> str | None:
  return _platform.unavailable_reason("the Mosaic GPU grouped GEMM", device, interpret, hopper=True,
                                      module=KERNEL_MODULE)


def unsupported(problem) -> str | None:
  if why := dense.block_size_problem(problem.block_size):
    return why
  problems = []
  if problem.n % 8:
    problems.append(f"N={problem.n} must be a multiple of 8 (the output rows' TMA stride)")
  if problem.k % problem.block_size[1]:
    problems.append(f"K={problem.k} must be a multiple of {problem.block_size[1]}")
  return "; ".join(problems) or None


def not_default(problem) -> str | None:
  """Why the default dispatch passes over this kernel for a problem it can run (None: it does not)."""
  return dense.not_default_block_size(problem.block_size)


def default_config_for(problem, device: _platform.Device):
  config, why = default_config(problem, device.num_sms)
  kind = "prefill" if config.persistent and not config.live_grid else "decode"
  if table_kernel_config(problem, config):
    why += f"; its work-item table from the group sizes in one Mosaic kernel (M <= {WGMMA_M} rows)"
  return dense.with_block_size(config, problem.block_size), f"the {kind} schedule on {device.num_sms} SMs: {why}"


def config_problem(problem, config) -> str | None:
  config = dense.with_block_size(config, problem.block_size)
  return "; ".join(_kernel().config_problems(config, problem.n, problem.out_dtype)) or None


def _column_major(a_s, rows: int, column_major: bool):
  """a_s as the kernel reads it: (..., K/128, R') column-major with R' >= rows and R' % 4 == 0."""
  a_s_col = a_s if column_major else jnp.swapaxes(a_s[..., :rows, :], -1, -2)
  if a_s_col.shape[-1] % 4:
    a_s_col = a_s_col[..., :rows]
    pad = [(0, 0)] * (a_s_col.ndim - 1) + [(0, _checks.round_up(rows, 4) - rows)]
    a_s_col = jnp.pad(a_s_col, pad, constant_values=1.0)
  return a_s_col


def items_key(problem, config):
  """What the work-item table of a call depends on besides its counts: calls with equal keys can share one."""
  return ("mosaic", problem.layout, problem.groups, problem.rows, problem.zero_unowned_rows, config.tile_m)


def table_kernel_config(problem, config):
  """The table kernel's config where it builds this call's table (`TABLE_KERNEL_BY_DEFAULT`, a ragged call it
  takes), else None."""
  if not TABLE_KERNEL_BY_DEFAULT or problem.layout != "ragged":
    return None
  T = importlib.import_module(TABLE_KERNEL_MODULE)
  table_config = T.RaggedItemsConfig(config.tile_m, problem.zero_unowned_rows)
  width = table_columns(problem.rows, problem.groups, config.tile_m)
  return None if T.problems(problem.rows, problem.groups, table_config, width) else table_config


def table_columns(rows: int, groups: int, tile_m: int) -> int:
  """The width of a ragged table a Mosaic kernel writes (the table kernel's, the MoE decode dispatch's): the items
  rounded up to whole 16-byte rows (the extra ones empty, which the grouped GEMM skips)."""
  return -(-_kernel().ragged_num_items(rows, groups, tile_m) // 4) * 4


def _table_by_kernel(counts, problem, config, interpret: bool):
  """The table kernel's table of `counts` where it builds this call's (`table_kernel_config`), else None."""
  table_config = table_kernel_config(problem, config)
  if table_config is None:
    return None
  return importlib.import_module(TABLE_KERNEL_MODULE).ragged_items(
      counts, m=problem.rows, num_items=table_columns(problem.rows, problem.groups, config.tile_m),
      config=table_config, interpret=interpret)


def prepare(counts, problem, config, interpret: bool = False):
  """The work-item table of `counts` (the launch's prologue, `items_key`)."""
  K = _kernel()
  if (table := _table_by_kernel(counts, problem, config, interpret)) is not None:
    return table
  if problem.layout == "ragged":
    return K.ragged_items(counts, problem.rows, config.tile_m, problem.zero_unowned_rows)
  return K.masked_items(counts, problem.rows, config.tile_m, problem.zero_unowned_rows)


def prepare_from_rows(groups, rows, within, group_sizes, problem, config, with_order: bool = False):
  """`prepare` from the sorted rows themselves (`ragged_items_from_rows`), where it builds the same table: the ragged
  layout leaving the rows no group owns unwritten. with_order: (the table, the row at each position from the same
  reduction, or None where the table came from the group sizes)."""
  if problem.layout == "ragged" and not problem.zero_unowned_rows:
    return _kernel().ragged_items_from_rows(groups, rows, within, problem.groups, config.tile_m,
                                            with_inverse=with_order)
  table = prepare(group_sizes, problem, config)
  return (table, None) if with_order else table


def prepare_from_starts(starts, group_sizes, problem, config):
  """The table of a ragged call whose groups' rows start at `starts` (not packed: `ragged_items_from_starts`)."""
  return _kernel().ragged_items_from_starts(starts, group_sizes, problem.rows, config.tile_m)


def launch(a_q, b_q, a_s, b_s, counts, problem, config, interpret: bool, device: _platform.Device,
           prepared: bool = False):
  """prepared: counts is `prepare`'s table for this problem and config, not the group sizes or masked_m."""
  K = _kernel()
  f = K.ragged_block_fp8_matmul if problem.layout == "ragged" else K.masked_block_fp8_matmul
  items = counts if prepared else _table_by_kernel(counts, problem, config, interpret)
  return f(a_q, b_q, _column_major(a_s, problem.rows, problem.a_s_column_major), b_s, None if prepared else counts,
           out_dtype=problem.out_dtype, config=dense.with_block_size(config, problem.block_size),
           num_sms=device.num_sms, zero_unowned_rows=problem.zero_unowned_rows, items=items, interpret=interpret)


# ---- gate_up with the SiLU-and-mul quantizer in its epilogue (the MoE layer's) ---------------------------------------

def silu_quant_unsupported(problem, config, h_dtype) -> str | None:
  """Why this gate_up problem and config cannot take the SiLU-and-mul quantizer into their epilogue (None: they
  can): the ragged layout leaving the rows no group owns unwritten, and the 64x256 tile whose two consumers hold a
  gate and an up block of the same 128 columns."""
  problems = []
  if problem.layout != "ragged" or problem.zero_unowned_rows:
    problems.append(f"the fused epilogue takes the ragged layout without zero rows, got {problem.layout} with "
                    f"zero_unowned_rows={problem.zero_unowned_rows}")
  problems += _kernel().silu_quant_problems(silu_quant_fit(config, h_dtype, problem.k), problem.n, h_dtype)
  return "; ".join(problems) or None


def silu_quant_fit(config, h_dtype, k: int):
  K = _kernel()
  return K.fit_smem(config, k, lambda c: K.silu_quant_smem_bytes(c, h_dtype))


def launch_gate_up_silu_quant(a_q, b_q, a_s, b_s, items, problem, config, h_dtype, eps: float, interpret: bool,
                              device: _platform.Device):
  """(codes (M, I) fp8, column-major scales (I/128, round_up(M, 64)) float32) of SiLU(gate) * up of each row's h,
  from a `prepare_from_starts` table whose groups start at multiples of the row tile."""
  q, s = _kernel().gate_up_silu_quant(
      a_q[None], b_q, _column_major(a_s, problem.rows, problem.a_s_column_major)[None], b_s, items,
      out_rows=problem.rows, h_dtype=h_dtype, eps=eps, config=silu_quant_fit(config, h_dtype, problem.k),
      num_sms=device.num_sms, interpret=interpret)
  return q[0], s[0]
