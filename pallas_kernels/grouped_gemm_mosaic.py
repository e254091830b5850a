"""Grouped block-scaled FP8 GEMM for Hopper (sm_90) in Pallas Mosaic GPU: the expert GEMMs of a mixture of experts.

Each group e (an expert) multiplies its own rows of the activations by its own weight b_q[e] (N, K) with scales
b_s[e]; the math per row is the dense kernel's (jaxfp8/kernels/gemm_mosaic.py: a fresh FP8 wgmma accumulator per
128-wide K block, promoted into a float32 accumulator with a_s[row] * b_s[e, n // 128, k // 128]). Two layouts:

  ragged: a_q (M, K), rows sorted by group, group_sizes (E,) traced: group e owns the rows
          [sum(sizes[:e]), sum(sizes[:e+1])) (negative sizes count as 0, the sum is clipped to M); rows past the
          last group come out zero.
  masked: a_q (E, T, K), masked_m (E,) traced: group e owns rows [0, masked_m[e]) of a_q[e]; the rest of a_q[e]'s
          rows come out zero.

Both become one problem: a list of *segments* (batch, group, lo, hi), the rows [lo, hi) of batch `batch` of a
(B, M_a, K) view of a_q computed with group `group`'s weight, or written as zeros when group is -1. Segments cover
every output row once. A jnp prologue cuts the segments at row-tile boundaries into *work items* (one row tile of one
segment), computed items first, then zero items, then dead padding items up to a static count, so that the kernel's
grid has a static size while routing changes never recompile. The kernel loops over (item, column tile) pairs, on
a persistent grid either up to the table's static size or (`live_grid`) up to its live items, a count read at run time
(the masked layout's table is mostly padding at decode: E times its row tiles plus one, for a few routed rows): an
empty expert owns no item and no CTA waits on it; a row tile that two experts share is computed once per expert,
each storing only its own rows, and in each of those a consumer warpgroup whose 64-row part holds none of the item's
rows runs no wgmma (with two consumers split along M, an expert boundary costs half a tile, not a whole one).

A work item's A tile is the aligned row tile holding its rows (TMA zero-fills rows past M_a), read with the (8, 128)
tiling and 128-byte swizzle the 8-bit wgmma needs. Its output rows are a run [lo, hi) that can start and end anywhere
inside the tile, and a TMA store has a static box: each 64-row sub-tile stores its run as at most one copy per power
of two (64, 32, ..., 1 rows), each predicated on a bit of the run's length. For those copies to start at any row the
epilogue buffers are unswizzled with rows of exactly 128 bytes (the alignment a TMA's shared-memory side needs).
Columns past N (a partial last column tile) read the weight's missing rows as TMA's zeros, clamp to the last block's
b_s, and are clipped from the TMA stores, so N needs only to be a multiple of 8 (16-byte output row strides).

Only the warp-specialized structure of the dense kernel is built here (producer warpgroup, 1-3 consumers; a persistent
grid or one CTA per (item, column tile)); CTA clusters are not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

import numpy as np

from . import exact_division
from ._jax_compat import store_unoptimized
from .gemm_mosaic_common import (BLOCK, SMEM_BYTES, WGMMA_M, Dim, MosaicGemmConfig, common_problems,
                                 epilogue_slot_bytes, fit_smem, kernel_grid, pad_rows_for_tma, store_subtiles,
                                 tile_loop, warp_specialized, zero_accumulators)

EPILOGUE_ROW_BYTES = 128  # one TMA-aligned shared-memory row per output row of an epilogue piece
ITEM_FIELDS = 5  # batch, group, row block, lo, hi
ITEM_LO, ITEM_HI = 3, 4
# Up to this many (item, row) pairs `ragged_items_from_rows` builds the table as one fused reduction, past it with a
# scatter
GATHERED_TABLE_MAX = 1 << 18
ZERO_GROUP = -1
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
R = np.float32(1.0 / FP8_MAX)  # scales are amax * R (docs/CONTRACT.md section 1), a multiply that rounds alike everywhere


def epi_n(out_dtype) -> int:
  """Columns per epilogue store: rows of exactly 128 bytes."""
  return EPILOGUE_ROW_BYTES // jnp.dtype(out_dtype).itemsize


def config_problems(config: MosaicGemmConfig, n: int, out_dtype) -> list[str]:
  """Why `config` cannot run this kernel on N output columns of out_dtype (empty: it can)."""
  problems = common_problems(config, n, out_dtype, smem_bytes(config, out_dtype))
  if not config.warp_specialized:
    problems.append("the grouped kernel is warp-specialized only (warp_specialized=True)")
  if config.cluster_dim is not None:
    problems.append("the grouped kernel does not build CTA clusters (cluster_dim=None)")
  if config.scales_per_column:
    problems.append(f"tile_n={config.tile_n} in sub-tiles of {config.sub_n}: the grouped kernel takes sub-tiles "
                    f"inside one {config.block_n}-column weight-scale block")
  width = epi_n(out_dtype)
  if config.sub_n % width:
    problems.append(f"sub-tiles of {config.sub_n} columns do not split into {width}-column pieces of 128-byte rows "
                    f"for {jnp.dtype(out_dtype).name} outputs")
  if config.epi_tile_n not in (None, width):
    problems.append(f"epi_tile_n must be None or {width} for {jnp.dtype(out_dtype).name} outputs (128-byte rows)")
  return problems


def silu_quant_problems(config: MosaicGemmConfig, n: int, h_dtype) -> list[str]:
  """Why `config` cannot run the gate_up kernel with the SiLU-and-mul quantizer in its epilogue (`gate_up_silu_quant`)
  on a [gate | up] weight of N = n rows, h rounded to h_dtype (empty: it can)."""
  problems = common_problems(config, n // 2, h_dtype, silu_quant_smem_bytes(config, h_dtype))
  if n % (2 * BLOCK):
    problems.append(f"N={n} must hold a gate and an up half of a multiple of {BLOCK} rows each")
  if (config.tile_m, config.tile_n, config.num_compute_wgs, config.wg_split) != (WGMMA_M, 2 * BLOCK, 2, Dim.N):
    problems.append(f"the fused epilogue pairs a gate and an up block of {BLOCK} columns in one tile: tile_m="
                    f"{WGMMA_M}, tile_n={2 * BLOCK}, two consumers split along N (wg_split=Dim.N), got tile_m="
                    f"{config.tile_m}, tile_n={config.tile_n}, num_compute_wgs={config.num_compute_wgs}, "
                    f"wg_split={config.wg_split.name}")
  if not config.warp_specialized or config.cluster_dim is not None:
    problems.append("the fused epilogue is warp-specialized without clusters")
  if (config.block_n, config.block_k) != (BLOCK, BLOCK):
    problems.append(f"the fused epilogue quantizes h in groups of {BLOCK} (block_size ({BLOCK}, {BLOCK})), got "
                    f"block_n={config.block_n}, block_k={config.block_k}")
  if config.sub_n != BLOCK:
    problems.append(f"the fused epilogue takes each consumer's {BLOCK} columns as one sub-tile (sub_tile_n=None), "
                    f"got sub_tile_n={config.sub_tile_n}")
  if jnp.dtype(h_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    problems.append(f"h is rounded to a 16-bit float (x's dtype), got {jnp.dtype(h_dtype).name}")
  return problems


def silu_quant_smem_bytes(config: MosaicGemmConfig, h_dtype) -> int:
  """The pipeline's stages, one 64-row slot of codes per consumer (128-byte rows) and the up half's exchange tile
  (swizzled: aligned to 1024 bytes)."""
  exchange = WGMMA_M * BLOCK * jnp.dtype(h_dtype).itemsize
  return config.pipeline_smem_bytes() + config.num_compute_wgs * WGMMA_M * BLOCK + exchange + 1024  # swizzle alignment


def smem_bytes(config: MosaicGemmConfig, out_dtype) -> int:
  """The pipeline's stages and this kernel's epilogue slots (two 64-row slots of 128 bytes per consumer)."""
  del out_dtype  # the slots' rows are 128 bytes whatever the dtype
  return config.pipeline_smem_bytes() + epilogue_slot_bytes(config, EPILOGUE_ROW_BYTES)


# ------------------------------------------------------------------------------------------- the work-item prologue


def _inclusive_sum(x: jax.Array) -> jax.Array:
  """cumsum of a short int32 vector as one fused masked sum over (n, n): XLA's GPU cumsum of a few hundred entries
  is a reduce-window kernel several times slower than the whole of this prologue's other ops."""
  n = x.shape[0]
  if n > 1024:
    return jnp.cumsum(x)
  upto = lax.broadcasted_iota(jnp.int32, (n, n), 1) <= lax.broadcasted_iota(jnp.int32, (n, n), 0)
  return jnp.sum(jnp.where(upto, x[None, :], 0), axis=1, dtype=x.dtype)


def ragged_segments(group_sizes: jax.Array, m: int, zero_unowned_rows: bool = True) -> tuple[jax.Array, ...]:
  """(batch, group, lo, hi) of the ragged layout: the E groups in order, then (with zero_unowned_rows) the zero rows
  past them."""
  num_groups = group_sizes.shape[0]
  sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, m)  # clipped first: the cumulative sum cannot overflow
  inclusive = _inclusive_sum(sizes)
  ends = jnp.minimum(inclusive, m)
  starts = jnp.minimum(inclusive - sizes, m)  # the previous group's end, without a concatenate kernel
  if not zero_unowned_rows:
    return jnp.zeros((num_groups,), jnp.int32), jnp.arange(num_groups, dtype=jnp.int32), starts, ends
  total = ends[-1:] if num_groups else jnp.zeros((1,), jnp.int32)
  batch = jnp.zeros((num_groups + 1,), jnp.int32)
  group = jnp.concatenate([jnp.arange(num_groups, dtype=jnp.int32), jnp.full((1,), ZERO_GROUP, jnp.int32)])
  lo = jnp.concatenate([starts, total])
  hi = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
  return batch, group, lo, hi


def masked_segments(masked_m: jax.Array, rows: int, zero_unowned_rows: bool = True) -> tuple[jax.Array, ...]:
  """(batch, group, lo, hi) of the masked layout: group e's live rows of batch e, then (with zero_unowned_rows) its
  zero rows."""
  num_groups = masked_m.shape[0]
  live = jnp.clip(masked_m.astype(jnp.int32), 0, rows)
  experts = jnp.arange(num_groups, dtype=jnp.int32)
  if not zero_unowned_rows:
    return experts, experts, jnp.zeros((num_groups,), jnp.int32), live
  batch = jnp.concatenate([experts, experts])
  group = jnp.concatenate([experts, jnp.full((num_groups,), ZERO_GROUP, jnp.int32)])
  lo = jnp.concatenate([jnp.zeros((num_groups,), jnp.int32), live])
  hi = jnp.concatenate([live, jnp.full((num_groups,), rows, jnp.int32)])
  return batch, group, lo, hi


def work_items(segments: tuple[jax.Array, ...], tile_m: int, num_items: int) -> jax.Array:
  """int32 (ITEM_FIELDS, num_items): each segment cut at the row-tile boundaries, in segment order (both layouts list
  their computed segments before their zero ones). Items past the last real one have lo == hi (nothing to do).

  A few fused XLA ops (no sort, and the segment of each item found by comparing against every segment end at once):
  at decode this prologue is a visible part of the call."""
  batch, group, lo, hi = segments
  first_block = lo // tile_m
  counts = jnp.where(hi > lo, (jnp.maximum(hi, 1) - 1) // tile_m - first_block + 1, 0)
  ends = _inclusive_sum(counts)
  index = jnp.arange(num_items, dtype=jnp.int32)
  seg = jnp.minimum(jnp.searchsorted(ends, index, side="right", method="compare_all"), batch.shape[0] - 1)
  real = index < ends[-1]
  block = first_block[seg] + index - (ends[seg] - counts[seg])
  item_lo = jnp.where(real, jnp.maximum(lo[seg], block * tile_m), 0)
  item_hi = jnp.where(real, jnp.minimum(hi[seg], (block + 1) * tile_m), 0)
  return jnp.stack([batch[seg], group[seg], jnp.where(real, block, 0), item_lo, item_hi]).astype(jnp.int32)


def live_item_count(items: jax.Array) -> jax.Array:
  """int32 (1,): the items of a work-item table with rows to write (lo < hi: computed and zero items). Every table
  lists them before its dead padding items, so they are its first this many (what `MosaicGemmConfig.live_grid`
  loops over)."""
  return jnp.sum(items[ITEM_LO] < items[ITEM_HI], dtype=jnp.int32, keepdims=True)


def ragged_num_items(m: int, num_groups: int, tile_m: int) -> int:
  """The most work items a ragged problem can have. The segments are disjoint runs of the M rows in order (a
  partition of them, or with `ragged_items_from_starts` runs with gaps between), so their (segment, row tile) pairs
  number at most the tiles of M plus one per boundary between two non-empty segments inside a tile, and there are at
  most min(E + 1, M) non-empty segments (each holds a row; E groups and the zero rows): few items at decode, however
  many experts."""
  return max(pl.cdiv(m, tile_m) + min(num_groups, m - 1), 1)


def masked_num_items(num_groups: int, rows: int, tile_m: int, zero_unowned_rows: bool = True) -> int:
  """Each expert's live rows and its zero rows split its buffer once: at most one item more than its row tiles."""
  return max(num_groups * (pl.cdiv(rows, tile_m) + int(zero_unowned_rows)), 1)


# ---------------------------------------------------------------------------------------------------------- epilogue


def _store_run(slot, out_rows_gmem, run_start, run_len, row_cap: int):
  """TMA-stores rows [run_start, run_start + run_len) of `slot` (64, epi_n) into the same rows of out_rows_gmem (a
  (64, epi_n) window of the output starting at the sub-tile's first row): one copy per set bit of run_len."""
  offset = run_start
  size = 1 << (row_cap.bit_length() - 1)
  while size:
    # (pl.when rather than the copy's predicate, which the Mosaic GPU interpreter does not implement.)
    @pl.when((run_len & size) != 0)
    def _store(offset=offset, size=size):
      plgpu.copy_smem_to_gmem(slot.at[pl.ds(offset, size)], out_rows_gmem(offset, size), commit_group=False)

    offset = offset + (run_len & size)
    size //= 2
  plgpu.commit_smem_to_gmem_group()


def _epilogue(accs, slots, out_gmem, row0, col0, lo, hi, cfg: MosaicGemmConfig):
  """Writes the rows [lo, hi) of one warpgroup's (wg_m, wg_n) tile whose top-left element is (row0, col0).

  accs: the (64, sub_n) sub-tile accumulators; slots: this warpgroup's (2, 64, epi_n) buffers; out_gmem: (M_a, N).
  """
  sub_n, width = cfg.sub_n, epi_n(out_gmem.dtype)
  row_cap = min(WGMMA_M, out_gmem.shape[0])

  def store(slot, i, j, e):
    sub_row0 = row0 + i * WGMMA_M
    run_start = jnp.clip(lo - sub_row0, 0, WGMMA_M)
    run_len = jnp.clip(hi - sub_row0, 0, WGMMA_M) - run_start
    col = col0 + j * sub_n + e * width
    _store_run(slot, lambda start, size: out_gmem.at[pl.ds(sub_row0 + start, size), pl.ds(col, width)],
               run_start, run_len, row_cap)

  store_subtiles(accs, slots, cfg, width, lambda acc, i, j: acc.astype(out_gmem.dtype), store)


# ------------------------------------------------------------------------------------------------------- the kernel


def _loop_items(live_items_gmem, num_items: int):
  """The work items the tile loop visits: the table's live ones (read at run time, `MosaicGemmConfig.live_grid`),
  else all num_items."""
  return num_items if live_items_gmem is None else live_items_gmem[0]


def _kernel(live_items_gmem, items_gmem, a_gmem, b_gmem, as_gmem, bs_gmem, out_gmem, *, cfg: MosaicGemmConfig,
            num_items: int):
  """a_gmem (B, M_a, K), b_gmem (E, N, K), as_gmem (B, K/128, M_a'), bs_gmem (E, N/128, K/128), out_gmem (B, M_o, N),
  items_gmem int32 (ITEM_FIELDS, num_items), live_items_gmem int32 (1,) `live_item_count` (None: no live_grid)."""
  n, k = b_gmem.shape[1:]
  slots_type = plgpu.SMEM((cfg.num_compute_wgs, 2, WGMMA_M, epi_n(out_gmem.dtype)), out_gmem.dtype)

  def body(compute_tile, slots, wg_idx, wg_origin):
    def tile(item, n_idx):
      batch, group, block, lo, hi = (items_gmem[f, item] for f in range(ITEM_FIELDS))
      out_batch = out_gmem.at[batch]

      def epilogue(accs, row0, col0):
        _epilogue(accs, slots, out_batch, row0, col0, lo, hi, cfg)

      @pl.when((hi > lo) & (group != ZERO_GROUP))
      def _compute():
        compute_tile(a_gmem.at[batch], b_gmem.at[group], as_gmem.at[batch], bs_gmem.at[group], block, n_idx,
                     epilogue, rows=(lo, hi) if cfg.skip_idle_consumers else None)

      # Rows no group owns: the consumers store zeros (the producer has nothing to load).
      @pl.when((hi > lo) & (group == ZERO_GROUP) & (wg_idx < cfg.num_compute_wgs))
      def _zeros():
        epilogue(zero_accumulators(cfg), block * cfg.tile_m + wg_origin[0], n_idx * cfg.tile_n + wg_origin[1])

    tile_loop(cfg, (_loop_items(live_items_gmem, num_items), pl.cdiv(n, cfg.tile_n)), tile)

  warp_specialized(cfg, (a_gmem.at[0], b_gmem.at[0], as_gmem.at[0]), slots_type, body,
                   num_k_blocks=k // cfg.block_k, num_n_blocks=pl.cdiv(n, cfg.block_n))


# ------------------------------------------------- gate_up with the SiLU-and-mul quantizer in its epilogue


def _silu_and_mul(gate, up):
  """docs/CONTRACT.md section 1 (fuse_silu_and_mul): round(round(silu(f32(gate))) * f32(up)) in gate's dtype, with
  silu(z) = z / (1 + exp(-z))."""
  dtype = gate.dtype
  g = gate.astype(jnp.float32)
  silu = g / (jnp.float32(1.0) + jnp.exp(-g))
  return (silu.astype(dtype).astype(jnp.float32) * up.astype(jnp.float32)).astype(dtype)


def _quantize_rows(v, eps: float, interpret: bool):
  """(codes, scales) of v (64, 128) float32, one quantization group per row (section 1): scale = max(amax, eps) * R,
  codes = e4m3(clip(v / scale)). Natively the division is the hardware's IEEE one and the cast saturates
  (`cvt.rn.satfinite`); interpreted, XLA would divide by a reciprocal and turn values past 464 into NaN, so the
  correctly rounded quotient and an explicit clip stand in."""
  scale = jnp.maximum(jnp.max(jnp.abs(v), axis=1), jnp.float32(eps)) * R
  scale_full = lax.broadcast_in_dim(scale, v.shape, [0])
  if interpret:
    q = jnp.clip(exact_division.divide_correctly_rounded(v, scale_full), -FP8_MAX, FP8_MAX)
  else:
    q = v / scale_full
  return q.astype(FP8), scale


def _silu_quant_epilogue(accs, wg_idx, code_slot, exchange, up_ready, up_free, q_rows, s_rows, lo, hi, row0,
                         eps: float, interpret: bool):
  """The epilogue of one 64 x (128 + 128) tile: consumer 1 holds the up block, consumer 0 the gate block of the same
  128 output columns. Each rounds its block to h's dtype (section 8); the up block goes to consumer 0 through shared
  memory, which computes SiLU(gate) * up, quantizes each row's group and stores the rows [lo, hi) of the codes
  (q_rows(start, size): a window of the codes' rows from row0) and all 64 rows' scales (s_rows: the 64 scales of the
  tile's rows in the column-major scale array; rows outside [lo, hi) belong to no other work item: see
  `gate_up_silu_quant`)."""
  (acc,) = accs
  h = acc.astype(exchange.dtype)

  @pl.when(wg_idx == 1)
  def _send_up():
    plgpu.barrier_wait(up_free)  # consumer 0 has read the previous tile's up block
    exchange[...] = h
    plgpu.commit_smem()  # every thread's part is written before the arrival
    plgpu.barrier_arrive(up_ready)

  @pl.when(wg_idx == 0)
  def _quantize():
    plgpu.barrier_wait(up_ready)
    up = plgpu.load(exchange, layout=plgpu.Layout.WGMMA)
    plgpu.commit_smem()  # every thread has read it before the exchange is released
    plgpu.barrier_arrive(up_free)
    codes, scales = _quantize_rows(_silu_and_mul(h, up).astype(jnp.float32), eps, interpret)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's code store has read the slot
    store_unoptimized(code_slot, codes)
    plgpu.commit_smem()
    run_start = jnp.clip(lo - row0, 0, WGMMA_M)
    run_len = jnp.clip(hi - row0, 0, WGMMA_M) - run_start
    _store_run(code_slot, q_rows, run_start, run_len, WGMMA_M)
    store_unoptimized(s_rows, scales)


def _gate_up_kernel(live_items_gmem, items_gmem, a_gmem, b_gmem, as_gmem, bs_gmem, q_gmem, s_gmem, *,
                    cfg: MosaicGemmConfig, num_items: int, eps: float, h_dtype, interpret: bool):
  """a_gmem (B, M_a, K), b_gmem (2E, I, K) (expert e's gate rows at 2e, its up rows at 2e + 1), as_gmem
  (B, K/128, M_a'), bs_gmem (E, 2I/128, K/128), q_gmem (B, M_o, I) fp8, s_gmem (B, I/128, M_s) float32."""
  i, k = b_gmem.shape[1:]
  slots_type = plgpu.SMEM((cfg.num_compute_wgs, WGMMA_M, BLOCK), FP8)

  def body(compute_tile, slots, wg_idx, wg_origin):
    del wg_origin  # the tile's two consumers share its rows; each holds one 128-column block

    def with_exchange(exchange, up_ready, up_free):
      # The exchange starts free: consumer 1's first wait passes on this arrival.
      pl.when(wg_idx == 0)(lambda: plgpu.barrier_arrive(up_free))

      def tile(item, n_idx):
        batch, group, block, lo, hi = (items_gmem[f, item] for f in range(ITEM_FIELDS))
        row0 = block * cfg.tile_m
        q_rows = lambda start, size: q_gmem.at[batch, pl.ds(row0 + start, size), pl.ds(n_idx * BLOCK, BLOCK)]
        s_rows = s_gmem.at[batch, n_idx, pl.ds(row0, WGMMA_M)]

        def epilogue(accs, row0_, col0):
          del row0_, col0
          _silu_quant_epilogue(accs, wg_idx, slots, exchange, up_ready, up_free, q_rows, s_rows, lo, hi, row0,
                               eps, interpret)

        @pl.when((hi > lo) & (group != ZERO_GROUP))
        def _compute():
          compute_tile(a_gmem.at[batch], b_gmem, as_gmem.at[batch], bs_gmem.at[group], block, n_idx, epilogue,
                       b_pair=group)

      tile_loop(cfg, (_loop_items(live_items_gmem, num_items), i // BLOCK), tile)
      # Consumer 1 takes the arrival that freed the exchange after the last tile: every phase of both barriers is
      # waited for once.
      pl.when(wg_idx == 1)(lambda: plgpu.barrier_wait(up_free))

    # Swizzled as a wgmma operand would be: the up block's store and load in the accumulators' layout are then free
    # of bank conflicts.
    exchange = plgpu.SMEM((WGMMA_M, BLOCK), h_dtype, transforms=(
        plgpu.TilingTransform((8, EPILOGUE_ROW_BYTES // jnp.dtype(h_dtype).itemsize)),
        plgpu.SwizzleTransform(EPILOGUE_ROW_BYTES)))
    pl.run_scoped(with_exchange, exchange, plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=1),
                  collective_axes="wg")

  warp_specialized(cfg, (a_gmem.at[0], b_gmem, as_gmem.at[0]), slots_type, body, num_k_blocks=k // BLOCK,
                   num_n_blocks=2 * i // BLOCK, paired_b=True)


def gate_up_silu_quant(
    a3: jax.Array, b_q: jax.Array, a_s3: jax.Array, b_s: jax.Array, items: jax.Array, *, out_rows: int,
    h_dtype, eps: float, config: MosaicGemmConfig, num_sms: int, interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """An MoE layer's gate_up GEMM and its SiLU-and-mul quantizer in one kernel: for each work item (`work_items`:
  rows [lo, hi) of batch b with expert e), h = h_dtype(a3[b] @ b_q[e].T) (the segment problem of
  `grouped_block_fp8_matmul` on the [gate | up] weight b_q (E, 2I, K), b_s (E, 2I/128, K/128)), then codes and
  scales of silu(h[:, :I]) * h[:, I:] (docs/CONTRACT.md section 1, group size 128, float scales, eps): h is never
  written. Returns codes (B, out_rows, I) fp8 and column-major scales (B, I/128, round_up(out_rows, 64)) float32.

  A tile of two consumers split along N computes gate block j and up block j of the same rows (a 3-D TMA box over
  the weight viewed as (2E, I, K): no relayout of the checkpoint's weight), so the quantization group of 128 outputs
  is whole in one CTA. The codes of rows outside the items are not written; scales are stored for all 64 rows of
  an item's row tile, so the table must give each row tile to one work item at most (`ragged_items_from_starts`
  with starts at multiples of 64, or the masked layout, without zero rows): the rows of a tile past its item's hi
  get scales of whatever those rows of a3 hold (read by no one)."""
  batches = a3.shape[0]
  experts, n, k = b_q.shape
  num_items = items.shape[1]
  if problems := silu_quant_problems(config, n, h_dtype):
    raise ValueError("; ".join(problems))
  i = n // 2
  scale_rows = pl.cdiv(out_rows, WGMMA_M) * WGMMA_M
  a3 = pad_rows_for_tma(a3, 1)
  b_pairs = b_q.reshape(experts * 2, i, k)  # free: splits each expert's rows into its gate and up halves

  def body(live_items_gmem, items_gmem, a_gmem, b_gmem, as_gmem, bs_gmem, q_gmem, s_gmem):
    _gate_up_kernel(live_items_gmem, items_gmem, a_gmem, b_gmem, as_gmem, bs_gmem, q_gmem, s_gmem, cfg=config,
                    num_items=num_items, eps=eps, h_dtype=jnp.dtype(h_dtype), interpret=interpret)

  out_type = (jax.ShapeDtypeStruct((batches, out_rows, i), FP8),
              jax.ShapeDtypeStruct((batches, i // BLOCK, scale_rows), jnp.float32))
  return _launch(body, out_type, config, items, (a3, b_pairs, a_s3, b_s), i // BLOCK, num_sms, interpret)


def _launch(body, out_type, config: MosaicGemmConfig, items: jax.Array, operands: tuple, n_tiles: int, num_sms: int,
            interpret: bool):
  """body(live_items_gmem, items_gmem, *operand and output refs) run over the table's items x n_tiles column tiles:
  a producer and the consumer warpgroups. With config.live_grid the table's `live_item_count` goes in first (one
  small reduction beside the table's prologue), else body gets None for it."""
  grid, grid_names = kernel_grid(config, (items.shape[1], n_tiles), num_sms)
  if config.live_grid:
    kernel_body, args = body, (live_item_count(items), items, *operands)
  else:
    kernel_body, args = (lambda *refs: body(None, *refs)), (items, *operands)
  kernel = plgpu.kernel(kernel_body, out_type=out_type, grid=grid, grid_names=grid_names,
                        num_threads=config.num_compute_wgs + 1, thread_name="wg",
                        interpret=plgpu.InterpretGPUParams() if interpret else None)
  return kernel(*args)


# ------------------------------------------------------------------------------------------------------ the launchers


def grouped_block_fp8_matmul(
    a3: jax.Array, b_q: jax.Array, a_s3: jax.Array, b_s: jax.Array, items: jax.Array, *, out_rows: int,
    out_dtype, config: MosaicGemmConfig, num_sms: int, interpret: bool = False,
) -> jax.Array:
  """The segment problem (module docstring) on a3 (B, M_a, K), a_s3 (B, K/128, M_a') column-major with M_a' >= M_a
  and M_a' % 4 == 0, b_q (E, N, K), b_s (E, N/128, K/128) and `work_items`' table: (B, out_rows, N) of out_dtype."""
  batches = a3.shape[0]
  n = b_q.shape[1]
  num_items = items.shape[1]
  out_dtype = jnp.dtype(out_dtype)
  n_iters = pl.cdiv(n, config.tile_n)
  a3 = pad_rows_for_tma(a3, 1)

  def body(live_items_gmem, items_gmem, a_gmem, b_gmem, as_gmem, bs_gmem, out_gmem):
    _kernel(live_items_gmem, items_gmem, a_gmem, b_gmem, as_gmem, bs_gmem, out_gmem, cfg=config, num_items=num_items)

  out_type = jax.ShapeDtypeStruct((batches, out_rows, n), out_dtype)
  return _launch(body, out_type, config, items, (a3, b_q, a_s3, b_s), n_iters, num_sms, interpret)


def ragged_items(group_sizes: jax.Array, m: int, tile_m: int, zero_unowned_rows: bool = True) -> jax.Array:
  """The work-item table of the ragged layout on M = m rows (`work_items`): a launch's prologue, which a caller
  running several GEMMs on one routing (an MoE layer's two) can build once and pass to each."""
  return work_items(ragged_segments(group_sizes, m, zero_unowned_rows), tile_m,
                    ragged_num_items(m, group_sizes.shape[0], tile_m))


def ragged_items_from_rows(groups: jax.Array, rows: jax.Array, within: jax.Array, num_groups: int,
                           tile_m: int, with_inverse: bool = False):
  """`ragged_items` with zero_unowned_rows=False from the routed rows themselves, for a caller that has sorted them:
  groups (R,) each row's group (outside [0, num_groups): no group's), rows (R,) its position in group order (a
  permutation of [0, R), groups ascending, rows of no group last), within (R,) its index among its group's rows.

  A row begins a work item where it begins its group or a row tile; an item's index is the count of such rows before
  it, its end the next one's start (or the last owned row). One reduction over (R, R), then one that picks each
  item's row (a scatter past GATHERED_TABLE_MAX pairs): for the few rows of a decode call, fewer kernels than the
  per-group prologue. The items are those of `ragged_items` (the
  padding ones: all fields 0). with_inverse: (the table, the row at each position: inverse[rows[j]] == j), the
  inverse summed in the same reduction (the caller's gather order, without a kernel of its own)."""
  r = groups.shape[0]
  owned = (groups >= 0) & (groups < num_groups)
  starts = owned & ((within == 0) | (rows % tile_m == 0))
  earlier = starts[None, :] & (rows[None, :] < rows[:, None])  # [i, j]: row j starts an item before row i's
  later = starts[None, :] & (rows[None, :] > rows[:, None])
  # an item's index, the next item's start and (in every row alike) the owned rows' count, as one variadic reduction:
  # one kernel, whatever the compiler's sibling fusion does
  counted = (earlier.astype(jnp.int32), jnp.where(later, rows[None, :], r),
             jnp.broadcast_to(owned[None, :], (r, r)).astype(jnp.int32))
  if with_inverse:  # [i, j]: j where row j sits at position i
    counted += (jnp.where(rows[None, :] == lax.broadcasted_iota(jnp.int32, (r, r), 0),
                          lax.broadcasted_iota(jnp.int32, (r, r), 1), 0),)
  index, next_start, live, *inverse = lax.reduce(
      counted, (np.int32(0), np.int32(r), np.int32(0), np.int32(0))[:len(counted)],
      lambda a, b: (a[0] + b[0], jnp.minimum(a[1], b[1]), *(x + y for x, y in zip(a[2:], b[2:]))), (1,))
  hi = jnp.minimum(next_start, live)
  num_items = ragged_num_items(r, num_groups, tile_m)
  fields = jnp.stack([jnp.zeros_like(rows), groups, rows // tile_m, rows, hi]).astype(jnp.int32)
  # rows that start no item: dropped. `starts` written a second way (within < 1, not == 0), so that XLA's CSE keeps
  # one copy inside each reduction: shared, it was a kernel of its own from 8 tokens of top-8 (offline count,
  # scripts/xla_gpu_kernels.py layer:qwen3_30b_a3b:8: 9 launches, 10 shared)
  at = jnp.where(owned & ((within < 1) | (rows % tile_m == 0)), index, num_items)
  if num_items * r <= GATHERED_TABLE_MAX:
    # each item is started by one row at most: one fused reduction picks it (a zero-filled table and a scatter into
    # it would be two kernels)
    hit = at[None, :] == jnp.arange(num_items, dtype=jnp.int32)[:, None]
    table = jnp.sum(jnp.where(hit[None], fields[:, None, :], 0), axis=2, dtype=jnp.int32)
  else:
    table = jnp.zeros((ITEM_FIELDS, num_items), jnp.int32).at[:, at].set(fields, mode="drop")
  return (table, inverse[0]) if with_inverse else table


def ragged_items_from_starts(starts: jax.Array, group_sizes: jax.Array, m: int, tile_m: int) -> jax.Array:
  """The work-item table of groups whose rows are [starts[e], starts[e] + group_sizes[e]) of the M = m rows, in
  group order, not necessarily packed (a caller that places each group's first row at a multiple of tile_m, so that
  no row tile holds two groups' rows); the rows between them are neither computed nor stored. Non-decreasing starts
  and runs within M are the caller's."""
  num_groups = group_sizes.shape[0]
  lo = starts.astype(jnp.int32)
  segments = (jnp.zeros((num_groups,), jnp.int32), jnp.arange(num_groups, dtype=jnp.int32), lo,
              lo + jnp.maximum(group_sizes.astype(jnp.int32), 0))
  return work_items(segments, tile_m, ragged_num_items(m, num_groups, tile_m))


def masked_items(masked_m: jax.Array, rows: int, tile_m: int, zero_unowned_rows: bool = True) -> jax.Array:
  """The work-item table of the masked layout on T = rows rows per group (`work_items`)."""
  return work_items(masked_segments(masked_m, rows, zero_unowned_rows), tile_m,
                    masked_num_items(masked_m.shape[0], rows, tile_m, zero_unowned_rows))


def ragged_block_fp8_matmul(a_q, b_q, a_s_col, b_s, group_sizes, *, out_dtype=jnp.bfloat16,
                            config: MosaicGemmConfig, num_sms: int, zero_unowned_rows: bool = True,
                            items: jax.Array | None = None, interpret: bool = False) -> jax.Array:
  """The ragged layout: a_q (M, K), a_s_col (K/128, M') column-major (M' >= M, M' % 4 == 0), b_q (E, N, K),
  b_s (E, N/128, K/128), group_sizes int32 (E,). Returns (M, N); the rows past the groups are zeros, or with
  zero_unowned_rows=False not written at all (for a caller that never reads them). items: `ragged_items` of these
  group sizes for config.tile_m (None: built here)."""
  m = a_q.shape[0]
  if items is None:
    items = ragged_items(group_sizes, m, config.tile_m, zero_unowned_rows)
  out = grouped_block_fp8_matmul(a_q[None], b_q, a_s_col[None], b_s, items, out_rows=m, out_dtype=out_dtype,
                                 config=config, num_sms=num_sms, interpret=interpret)
  return out[0]


def masked_block_fp8_matmul(a_q, b_q, a_s_col, b_s, masked_m, *, out_dtype=jnp.bfloat16,
                            config: MosaicGemmConfig, num_sms: int, zero_unowned_rows: bool = True,
                            items: jax.Array | None = None, interpret: bool = False) -> jax.Array:
  """The masked layout: a_q (E, T, K), a_s_col (E, K/128, T') column-major (T' >= T, T' % 4 == 0), b_q (E, N, K),
  b_s (E, N/128, K/128), masked_m int32 (E,). Returns (E, T, N); rows past masked_m are zeros, or with
  zero_unowned_rows=False not written. items: `masked_items` of these counts for config.tile_m (None: built here)."""
  rows = a_q.shape[1]
  if items is None:
    items = masked_items(masked_m, rows, config.tile_m, zero_unowned_rows)
  return grouped_block_fp8_matmul(a_q, b_q, a_s_col, b_s, items, out_rows=rows, out_dtype=out_dtype,
                                  config=config, num_sms=num_sms, interpret=interpret)


__all__ = ["BLOCK", "SMEM_BYTES", "WGMMA_M", "Dim", "MosaicGemmConfig", "config_problems", "fit_smem",
           "ragged_block_fp8_matmul", "masked_block_fp8_matmul", "grouped_block_fp8_matmul", "work_items",
           "ragged_items", "ragged_items_from_rows", "ragged_items_from_starts", "masked_items", "ragged_segments",
           "masked_segments", "live_item_count", "epi_n", "smem_bytes", "gate_up_silu_quant", "silu_quant_problems",
           "silu_quant_smem_bytes"]
