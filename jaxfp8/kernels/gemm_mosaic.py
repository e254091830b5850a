"""Block-scaled FP8 GEMM for Hopper (sm_90) in Pallas Mosaic GPU.

Computes docs/CONTRACT.md §2 with block_size (128, 128):

    C[m, n] = out_dtype(bias[n] + sum_g a_s[m, g] * b_s[n // 128, g] * sum_{k in group g} a_q[m, k] * b_q[n, k])

The recipe (DeepSeek's, as in DeepGEMM): for every 128-wide K block the FP8 wgmma runs into a fresh f32 accumulator
(`plgpu.ACC`), which is read into registers, multiplied by a_s (a per-row vector) times b_s (one scalar per 128
columns) and added into a running f32 accumulator held in registers. Promoting every 128 K keeps the full f32 precision
that the tensor cores' own FP8 accumulation lacks, and applies the block scales exactly where they change.

Operands in shared memory: 8-bit wgmma operands must both be K-major, so A tiles are (rows, 128 * k_blocks_per_step)
slices of a_q and B tiles (cols, 128 * k_blocks_per_step) slices of the (N, K) weight, passed to wgmma as `b.T`; both
use TilingTransform((8, 128)) + SwizzleTransform(128). The activation scales are column-major (K // 128, M'), so the
scales of a row tile for one K block are a contiguous run that TMA brings into SMEM with the tiles. b_s is read as
scalars from global memory (a few bytes per step; TMA cannot copy less than 16 bytes).

Two kernels share the math:
  - `warp_specialized=False`: one warpgroup, `plgpu.emit_pipeline`, one CTA per output tile: the simple structure,
    kept as a fallback and a baseline for measurements.
  - `warp_specialized=True`: a TMA producer warpgroup plus one to three consumer warpgroups
    (`plgpu.emit_pipeline_warp_specialized`), a persistent grid (`plgpu.nd_loop` over at most one CTA per SM, tiles
    visited in `plgpu.planar_snake` order for L2 reuse) and a TMA epilogue through SMEM with the bias fused.
    Large M runs three consumer warpgroups of 64x128 on 192x128 tiles, in CTA pairs that share their A tile: while
    one warpgroup waits for its wgmma and promotes, the other two keep the tensor cores busy, and each holds only a
    64x128 running accumulator plus one fresh one (128 of its 152 registers, no spills).

Each consumer warpgroup owns a (wg_m, wg_n) part of the CTA tile, processed as 64-row "sub-tiles" of at most 128
columns. When the tile width divides 128 or is a multiple of it, a sub-tile never straddles a 128-column weight-scale
block, so its b_s is one scalar. Other widths (multiples of 8, e.g. 80 columns so that N=10240 makes 128 tiles for
132 SMs; a config option, not a default) give sub-tiles that may straddle one block boundary: each column then takes
the b_s of its own block, selected from the two blocks' scalars, and N must be a multiple of the tile width. The
running accumulator costs wg_m * wg_n / 128 registers per thread and each fresh accumulator 64 * sub_n / 128 more, so
wg_m * wg_n <= 128 * 128 keeps everything in registers (ptxas spills beyond that; the result stays correct).
With k_blocks_per_step = 2 a sub-tile issues the wgmmas of both K blocks before scaling the first, so the second
runs on the tensor cores while the first is scaled.

Rows past M (a partial last row tile, or M < tile_m in decode) are zero-filled by TMA on the way in and clipped by TMA
on the way out, so any M works; N % 128 == 0 and K % 128 == 0 are required (the launcher rejects anything else, so
callers fall back to the portable kernel). One wrinkle: Mosaic GPU describes the TMA of a swizzled (8, 128)-tiled SMEM
tile as a copy from an (8, 128)-tiled view of the whole GMEM array, which exists only when M % 8 == 0 or M < 8. For
other M the launcher pads a_q with zero rows up to a multiple of 8 (one extra XLA copy of a_q: quantize with
row_alignment=8 to avoid it). The output needs no such care: the epilogue's SMEM buffers are swizzled but untiled
(64 rows x 128 bytes), whose TMA stores clip at any M.

Small M (decode, M <= 64): the output has a single row tile and the tensor cores have time to spare, so the wgmma
simply runs 64 rows; what matters is streaming the weight at HBM speed. The rows past M are best real rows: TMA's zero
fill of a tile's missing rows is slow (H200: M=16 N=7168 K=18432 43.4 us as is, 38.6 us with a_q padded to 64 rows),
so callers pass the quantizer's 64-row buffers with `out_rows=M` (jaxfp8.linear does). Swapping A and B (the weight
on the wgmma M side) would not read fewer bytes, and would need a transposed epilogue. The small-M configs use a
64-row tile, one consumer warpgroup, column tiles narrow enough to spread the weight over the SMs, two K blocks per
pipeline step, one CTA per tile, and each step's weight scales loaded a step early (their load latency would
otherwise stall a step whose wgmmas are short). (Widths that balance N over all 132 SMs, e.g. 128 tiles of 80 columns for
N=10240, measured no faster than 80 tiles of 128: the weight stream, not the SM count, sets the time.) The same
schedule serves M = 65..128 as two row tiles where its CTAs fill most of a wave (`default_config`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu


BLOCK = 128  # the contract's block size (gn, gk), fixed for this kernel
WGMMA_M = 64  # rows of one wgmma (and of one sub-tile)
SMEM_BYTES = 232448  # per-block shared memory on H100/H200 (227 KiB)
_FP8_TRANSFORMS = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))


class Dim(enum.IntEnum):
  """A matmul output dimension (the values are those `plgpu.planar_snake` expects)."""
  M = 0
  N = 1


@dataclasses.dataclass(frozen=True)
class MosaicGemmConfig:
  """Tiling and schedule of the Mosaic GPU block-FP8 GEMM.

  tile_m, tile_n: the CTA output tile. tile_m a multiple of 64; tile_n a multiple of 8 up to 256. A tile_n that
    neither divides 128 nor is a multiple of it scales per column (`scales_per_column`) and needs N % tile_n == 0.
  max_concurrent_steps: TMA pipeline depth (stages in SMEM).
  k_blocks_per_step: 128-wide K blocks per pipeline step (1 or 2). With 2, each sub-tile's second wgmma overlaps the
    scaling of the first.
  warp_specialized: False: the simple one-warpgroup kernel (grid of tiles). True: producer + consumer warpgroups on a
    persistent grid.
  num_compute_wgs: consumer warpgroups (1, 2 or 3; warp-specialized only). wg_split: the dimension they split the
    tile along.
  grid_minor_dim, grid_tile_width: the persistent tile order (`plgpu.planar_snake`).
  epi_tile_n: columns per epilogue TMA store; None = the most that divides the sub-tile width and fits in 128 bytes
    (64 for 16-bit outputs and 32 for float32 at the usual widths), 128 bytes being the limit (the epilogue buffers
    are rows of at most one 128-byte swizzle span).
  persistent: warp-specialized only. False launches one CTA per tile instead of looping over tiles on num_sms CTAs
    (for the small-M configs, where several CTAs per SM can overlap their latency).
  grid_size: CTAs of the persistent grid; None = one per SM (tests set it small to exercise the tile loop).
  cluster_dim: persistent warp-specialized only: pair CTAs in a cluster of 2 along this dimension; the operand
    tile the two share (B for Dim.M, A and its scales for Dim.N) is loaded once and multicast to both by TMA,
    halving its L2 traffic.
  weight_scales_ahead: load each pipeline step's weight scales (scalar global loads) one step early and carry them,
    so that their latency hides behind a whole step. Pays in the decode schedule, where a step's wgmmas are short
    (H200, M=64: Qwen3 qkv 15.81 vs 16.48 us, dense_down 35.63 vs 36.03); costs elsewhere (M=1024 128x256 tiles
    4% slower, M=256 128x160 tiles scaled per column 1.5x), so the prefill schedules leave it off.
  """
  tile_m: int = 128
  tile_n: int = 128
  max_concurrent_steps: int = 4
  k_blocks_per_step: int = 1
  warp_specialized: bool = True
  num_compute_wgs: int = 2
  wg_split: Dim = Dim.M
  grid_minor_dim: Dim = Dim.M
  grid_tile_width: int = 8
  epi_tile_n: int | None = None
  persistent: bool = True
  grid_size: int | None = None
  cluster_dim: Dim | None = None
  weight_scales_ahead: bool = False

  @property
  def num_wgs(self) -> int:
    return self.num_compute_wgs if self.warp_specialized else 1

  @property
  def wg_tile(self) -> tuple[int, int]:
    """(rows, cols) of the CTA tile that one consumer warpgroup computes."""
    if self.num_wgs == 1:
      return self.tile_m, self.tile_n
    if self.wg_split == Dim.M:
      return self.tile_m // self.num_wgs, self.tile_n
    return self.tile_m, self.tile_n // self.num_wgs

  @property
  def scales_per_column(self) -> bool:
    """Whether a sub-tile can straddle a 128-column weight-scale block (tile_n neither divides 128 nor is a multiple
    of it), so that the weight scale is chosen per column."""
    return self.tile_n % BLOCK != 0 and BLOCK % self.tile_n != 0

  @property
  def sub_n(self) -> int:
    """Columns of one sub-tile (one wgmma; one b_s scalar unless `scales_per_column`): the warpgroup's columns in
    as few equal parts of at most 128 as there can be."""
    wg_n = self.wg_tile[1]
    return wg_n // pl.cdiv(wg_n, BLOCK)

  def epi_n(self, out_dtype) -> int:
    """Columns per epilogue store for this output dtype."""
    if self.epi_tile_n:
      return self.epi_tile_n
    widest = 128 // jnp.dtype(out_dtype).itemsize
    return next(w for w in (64, 32, 16, 8) if w <= widest and self.sub_n % w == 0)

  def validate(self) -> None:
    """Raises ValueError for a config this kernel cannot build."""
    if self.num_compute_wgs not in (1, 2, 3):
      raise ValueError(f"num_compute_wgs must be 1, 2 or 3, got {self.num_compute_wgs}")
    if self.k_blocks_per_step not in (1, 2):
      raise ValueError(f"k_blocks_per_step must be 1 or 2, got {self.k_blocks_per_step}")
    if self.tile_n % 8 or not 0 < self.tile_n <= 256:
      raise ValueError(f"tile_n must be a multiple of 8 in [8, 256], got {self.tile_n}")
    if self.tile_m % WGMMA_M or not 0 < self.tile_m <= 256:
      raise ValueError(f"tile_m must be a multiple of {WGMMA_M} in [64, 256], got {self.tile_m}")
    wg_m, wg_n = self.wg_tile
    if wg_m % WGMMA_M or wg_m == 0:
      raise ValueError(f"each consumer warpgroup needs a multiple of {WGMMA_M} rows; config gives {wg_m}")
    if wg_n % 8 or wg_n == 0 or wg_n % pl.cdiv(wg_n, BLOCK) or self.sub_n % 8:
      raise ValueError(f"each consumer warpgroup needs a multiple of 8 columns that splits into equal sub-tiles of "
                       f"at most {BLOCK} columns, each a multiple of 8; config gives {wg_n}")
    if self.epi_tile_n is not None and (self.epi_tile_n not in (8, 16, 32, 64) or self.sub_n % self.epi_tile_n):
      raise ValueError(f"epi_tile_n must be 8, 16, 32 or 64 and divide the sub-tile width {self.sub_n}, "
                       f"got {self.epi_tile_n}")
    if self.max_concurrent_steps < 1:
      raise ValueError(f"max_concurrent_steps must be >= 1, got {self.max_concurrent_steps}")
    if self.grid_tile_width < 1:
      raise ValueError(f"grid_tile_width must be >= 1, got {self.grid_tile_width}")
    if self.grid_size is not None and self.grid_size < 1:
      raise ValueError(f"grid_size must be >= 1, got {self.grid_size}")
    if self.cluster_dim is not None and not (self.warp_specialized and self.persistent):
      raise ValueError("cluster_dim needs warp_specialized=True and persistent=True")

  def smem_bytes(self, out_dtype) -> int:
    """Shared memory the kernel allocates: pipeline stages, epilogue buffers, barriers (a close upper estimate)."""
    bk = BLOCK * self.k_blocks_per_step
    # A tile, B tile, activation scales, and (over-counted) the stage's barriers and alignment.
    stage = self.tile_m * bk + self.tile_n * bk + 4 * self.k_blocks_per_step * self.tile_m + 128
    epilogue = self.num_wgs * 2 * WGMMA_M * self.epi_n(out_dtype) * jnp.dtype(out_dtype).itemsize
    return self.max_concurrent_steps * stage + epilogue + 512


# ------------------------------------------------------------------------------------------------ the math, per step


def zero_accumulators(cfg: MosaicGemmConfig) -> tuple[jax.Array, ...]:
  wg_m, wg_n = cfg.wg_tile
  zeros = plgpu.layout_cast(jnp.zeros((WGMMA_M, cfg.sub_n), jnp.float32), plgpu.Layout.WGMMA)
  return tuple(zeros for _ in range((wg_m // WGMMA_M) * (wg_n // cfg.sub_n)))


def _weight_scales(bs_gmem, col_ids, k_block, sub_col0, cfg: MosaicGemmConfig, num_n_blocks: int):
  """The weight scales of the sub-tile whose first column is sub_col0, for one K block: a scalar, or with
  `cfg.scales_per_column` a (sub_n,) vector (column layout) taking each column's scale from the block it lies in.

  Clamped indices only occur for blocks past N, whose outputs are clipped (or, per column, never selected).
  """
  first = sub_col0 // BLOCK
  scale = bs_gmem[jnp.minimum(first, num_n_blocks - 1), k_block]
  if not cfg.scales_per_column:
    return scale
  # A sub-tile of at most 128 columns meets at most two blocks: the columns before the next block's first column
  # take this block's scale.
  next_scale = bs_gmem[jnp.minimum(first + 1, num_n_blocks - 1), k_block]
  return jnp.where(col_ids < (first + 1) * BLOCK - sub_col0, scale, next_scale)


def _step_weight_scales(bs_gmem, k_step, col0, cfg: MosaicGemmConfig, num_k_blocks: int, num_n_blocks: int):
  """The weight scales of pipeline step k_step, one per (K block, sub-tile) (`_weight_scales`). A K block past K
  (clamped; also the prefetch one step past the last) has zero partials (TMA zero fill)."""
  col_ids = None
  if cfg.scales_per_column:
    col_ids = plgpu.broadcasted_iota(jnp.int32, (cfg.sub_n,), 0, layout=plgpu.Layout.WGMMA.reduce(0))
  kbps, subs_n = cfg.k_blocks_per_step, cfg.wg_tile[1] // cfg.sub_n
  return tuple(
      _weight_scales(bs_gmem, col_ids, jnp.minimum(k_step * kbps + kb, num_k_blocks - 1), col0 + j * cfg.sub_n,
                     cfg, num_n_blocks)
      for kb in range(kbps) for j in range(subs_n))


def initial_carry(bs_gmem, col0, cfg: MosaicGemmConfig, num_k_blocks: int, num_n_blocks: int):
  """The pipeline's carry before step 0: zero accumulators, and step 0's weight scales with
  `cfg.weight_scales_ahead` (else nothing)."""
  ahead = _step_weight_scales(bs_gmem, 0, col0, cfg, num_k_blocks, num_n_blocks) if cfg.weight_scales_ahead else ()
  return zero_accumulators(cfg), ahead


def scaled_mma_step(
    carry, a_smem, b_smem, as_smem, bs_gmem, *, k_step, col0, cfg: MosaicGemmConfig, num_k_blocks: int,
    num_n_blocks: int,
):
  """One pipeline step of one consumer warpgroup: accs[i, j] += sum over the step's K blocks of scaled partials.

  carry: (accs, this step's weight scales if `cfg.weight_scales_ahead` else ()); returns the next step's.
  a_smem: (wg_m, bk) rows of this warpgroup; b_smem: (wg_n, bk) columns of this warpgroup; as_smem: (kbps, wg_m)
  activation scales; bs_gmem: the (N // 128, K // 128) weight scales; col0: the warpgroup's first output column;
  k_step: the pipeline step.
  """
  accs, b_scales = carry
  wg_m, wg_n = cfg.wg_tile
  sub_n, kbps = cfg.sub_n, cfg.k_blocks_per_step
  subs_m, subs_n = wg_m // WGMMA_M, wg_n // sub_n
  # Scalars first: their global-memory latency hides behind the wgmmas (or, loaded a step ahead, behind a step).
  if cfg.weight_scales_ahead:
    next_b_scales = _step_weight_scales(bs_gmem, k_step + 1, col0, cfg, num_k_blocks, num_n_blocks)
  else:
    b_scales, next_b_scales = _step_weight_scales(bs_gmem, k_step, col0, cfg, num_k_blocks, num_n_blocks), ()
  new_accs = list(accs)
  for i in range(subs_m):
    rows = pl.ds(i * WGMMA_M, WGMMA_M)
    row_scales = [
        plgpu.load(as_smem.at[kb, rows], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False) for kb in range(kbps)
    ]
    for j in range(subs_n):
      cols = pl.ds(j * sub_n, sub_n)

      def issue_and_scale(*fresh_refs, i=i, j=j, rows=rows, cols=cols, row_scales=row_scales):
        for kb, fresh in enumerate(fresh_refs):
          ks = pl.ds(kb * BLOCK, BLOCK)
          plgpu.wgmma(fresh, a_smem.at[rows, ks], b_smem.at[cols, ks].T)
        acc = new_accs[i * subs_n + j]
        for kb, fresh in enumerate(fresh_refs):
          # Wait only for this K block's wgmma: the later ones keep the tensor cores busy meanwhile.
          partial = plgpu.wgmma_accumulator_load(fresh, wait_n=kbps - 1 - kb)
          shape = (WGMMA_M, sub_n)
          if cfg.scales_per_column:
            scale = (lax.broadcast_in_dim(row_scales[kb], shape, [0])
                     * lax.broadcast_in_dim(b_scales[kb * subs_n + j], shape, [1]))
          else:
            scale = lax.broadcast_in_dim(row_scales[kb] * b_scales[kb * subs_n + j], shape, [0])
          acc = acc + partial * scale
        return acc

      new_accs[i * subs_n + j] = pl.run_scoped(
          issue_and_scale, *(plgpu.ACC((WGMMA_M, sub_n), jnp.float32) for _ in range(kbps))
      )
  return tuple(new_accs), next_b_scales


def _finish_subtile(acc, bias_gmem, col0, n: int, out_dtype, sub_n: int):
  """bias (added in f32) and the output cast of one (64, sub_n) sub-tile whose first column is col0."""
  if bias_gmem is not None:
    # A sub-tile lies wholly inside or wholly past N (N % 128 == 0, and N % tile_n == 0 for the widths that scale per
    # column); clamping keeps the load of one past N in bounds.
    start = jnp.minimum(col0, n - sub_n)
    bias = plgpu.load(bias_gmem.at[pl.ds(start, sub_n)], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
    acc = acc + lax.broadcast_in_dim(bias.astype(jnp.float32), acc.shape, [1])
  return acc.astype(out_dtype)


def _epilogue_smem(num_wgs: int, out_dtype, epi_n: int):
  """Two epilogue slots per consumer warpgroup: one is written while the other's TMA store drains. Rows of at most one
  swizzle span and no tiling, so that the TMA stores need no tiled view of the output (any M)."""
  row_bytes = epi_n * jnp.dtype(out_dtype).itemsize
  if row_bytes > 128:
    raise ValueError(f"epilogue rows of {epi_n} x {jnp.dtype(out_dtype).name} exceed 128 bytes")
  # 16-byte rows (8 columns of 16 bits) are stored unswizzled: Mosaic GPU swizzles spans of 32 bytes or more.
  transforms = (plgpu.SwizzleTransform(plgpu.find_swizzle(row_bytes * 8)),) if row_bytes >= 32 else ()
  return plgpu.SMEM((num_wgs, 2, WGMMA_M, epi_n), out_dtype, transforms=transforms)


def _epilogue(accs, slots, out_gmem, bias_gmem, row0, col0, cfg: MosaicGemmConfig):
  """Writes one warpgroup's (wg_m, wg_n) tile whose top-left element is (row0, col0): bias, cast, SMEM, TMA store.

  accs: the (64, sub_n) sub-tile accumulators; slots: this warpgroup's (2, 64, epi_n) epilogue buffers.
  """
  n = out_gmem.shape[1]
  out_dtype = out_gmem.dtype
  sub_n, epi_n = cfg.sub_n, cfg.epi_n(out_dtype)
  subs_n = cfg.wg_tile[1] // sub_n
  # The previous tile's TMA stores must have read the slots before we overwrite them.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  slot = 0
  for idx, acc in enumerate(accs):
    i, j = divmod(idx, subs_n)
    out = _finish_subtile(acc, bias_gmem, col0 + j * sub_n, n, out_dtype, sub_n)
    for e in range(sub_n // epi_n):
      piece = out if epi_n == sub_n else out[:, e * epi_n:(e + 1) * epi_n]
      # At most one store in flight: the one reading the other slot.
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      slots[slot] = piece
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(
          slots.at[slot],
          out_gmem.at[pl.ds(row0 + i * WGMMA_M, WGMMA_M), pl.ds(col0 + j * sub_n + e * epi_n, epi_n)],
      )
      slot = 1 - slot


def in_specs(cfg: MosaicGemmConfig, m_idx, n_idx):
  """A tile, B tile and activation scales of pipeline step k; the operands a CTA cluster shares are multicast."""
  bk = BLOCK * cfg.k_blocks_per_step
  shared_a = ("cluster",) if cfg.cluster_dim == Dim.N else None
  shared_b = ("cluster",) if cfg.cluster_dim == Dim.M else None
  return [
      plgpu.BlockSpec((cfg.tile_m, bk), lambda k: (m_idx, k), transforms=_FP8_TRANSFORMS, collective_axes=shared_a),
      plgpu.BlockSpec((cfg.tile_n, bk), lambda k: (n_idx, k), transforms=_FP8_TRANSFORMS, collective_axes=shared_b),
      plgpu.BlockSpec((cfg.k_blocks_per_step, cfg.tile_m), lambda k: (k, m_idx), collective_axes=shared_a),
  ]


# ----------------------------------------------------------------------------------------- kernel 1: one warpgroup


def _simple_kernel(a_gmem, b_gmem, as_gmem, bs_gmem, bias_gmem, out_gmem, out_smem, *, cfg: MosaicGemmConfig):
  k = a_gmem.shape[1]
  n = b_gmem.shape[0]
  num_k_blocks, num_n_blocks = k // BLOCK, n // BLOCK
  n_idx = lax.axis_index("n")
  m_idx = lax.axis_index("m")

  col0 = n_idx * cfg.tile_n

  def step(indices, a_smem, b_smem, as_smem, carry):
    (k_step,) = indices
    return scaled_mma_step(
        carry, a_smem, b_smem, as_smem, bs_gmem, k_step=k_step, col0=col0, cfg=cfg, num_k_blocks=num_k_blocks,
        num_n_blocks=num_n_blocks,
    )

  accs, _ = plgpu.emit_pipeline(
      step,
      grid=(pl.cdiv(num_k_blocks, cfg.k_blocks_per_step),),
      in_specs=in_specs(cfg, m_idx, n_idx),
      max_concurrent_steps=cfg.max_concurrent_steps,
      init_carry=initial_carry(bs_gmem, col0, cfg, num_k_blocks, num_n_blocks),
  )(a_gmem, b_gmem, as_gmem)
  _epilogue(accs, out_smem.at[0], out_gmem, bias_gmem, m_idx * cfg.tile_m, n_idx * cfg.tile_n, cfg)
  plgpu.wait_smem_to_gmem(0)


# ------------------------------------------------------------------------------- kernel 2: warp-specialized, persistent


def _ws_kernel(a_gmem, b_gmem, as_gmem, bs_gmem, bias_gmem, out_gmem, *, cfg: MosaicGemmConfig):
  m, n = out_gmem.shape  # a_gmem may have zero rows appended (see the module docstring)
  k = a_gmem.shape[1]
  num_k_blocks, num_n_blocks = k // BLOCK, n // BLOCK
  m_iters, n_iters = pl.cdiv(m, cfg.tile_m), pl.cdiv(n, cfg.tile_n)
  wg_m, wg_n = cfg.wg_tile

  def get_pipeline(body, compute_context, m_idx=0, n_idx=0):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(pl.cdiv(num_k_blocks, cfg.k_blocks_per_step),),
        memory_registers=40,
        in_specs=in_specs(cfg, m_idx, n_idx),
        wg_axis="wg",
        num_compute_wgs=cfg.num_compute_wgs,
        max_concurrent_steps=cfg.max_concurrent_steps,
        compute_context=compute_context,
    )

  ignore = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem, as_gmem),
      out_smem=_epilogue_smem(cfg.num_compute_wgs, out_gmem.dtype, cfg.epi_n(out_gmem.dtype)),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, out_smem):
    wg_idx = lax.axis_index("wg")

    def tile(m_idx, n_idx):
      if cfg.wg_split == Dim.M or cfg.num_compute_wgs == 1:
        wg_row0, wg_col0 = wg_idx * wg_m if cfg.num_compute_wgs > 1 else 0, 0
      else:
        wg_row0, wg_col0 = 0, wg_idx * wg_n
      row0 = m_idx * cfg.tile_m + wg_row0
      col0 = n_idx * cfg.tile_n + wg_col0

      def compute_context(run_pipeline):
        accs, _ = run_pipeline(initial_carry(bs_gmem, col0, cfg, num_k_blocks, num_n_blocks))
        _epilogue(accs, out_smem.at[wg_idx], out_gmem, bias_gmem, row0, col0, cfg)

      def mma_body(indices, a_smem, b_smem, as_smem, carry):
        (k_step,) = indices
        return scaled_mma_step(
            carry,
            a_smem.at[pl.ds(wg_row0, wg_m)],
            b_smem.at[pl.ds(wg_col0, wg_n)],
            as_smem.at[:, pl.ds(wg_row0, wg_m)],
            bs_gmem,
            k_step=k_step,
            col0=col0,
            cfg=cfg,
            num_k_blocks=num_k_blocks,
            num_n_blocks=num_n_blocks,
        )

      get_pipeline(mma_body, compute_context, m_idx, n_idx)(a_gmem, b_gmem, as_gmem, allocations=pipeline_allocs)

    if cfg.persistent:
      # With a cluster, the loop runs over pairs of tiles; the CTAs of a cluster take the two tiles of a pair.
      m_pairs = pl.cdiv(m_iters, 2) if cfg.cluster_dim == Dim.M else m_iters
      n_pairs = pl.cdiv(n_iters, 2) if cfg.cluster_dim == Dim.N else n_iters

      @plgpu.nd_loop((m_pairs * n_pairs,), collective_axes="sm")
      def _tile_loop(loop_info: plgpu.NDLoopInfo):
        (lin_idx,) = loop_info.index
        m_idx, n_idx = plgpu.planar_snake(lin_idx, (m_pairs, n_pairs), int(cfg.grid_minor_dim), cfg.grid_tile_width)
        # A tile past M or N (odd tile counts) loads TMA zero fill and stores nothing: harmless.
        if cfg.cluster_dim == Dim.M:
          m_idx = 2 * m_idx + lax.axis_index("cluster")
        elif cfg.cluster_dim == Dim.N:
          n_idx = 2 * n_idx + lax.axis_index("cluster")
        tile(m_idx, n_idx)
    else:
      tile(lax.axis_index("m"), lax.axis_index("n"))

  # Every TMA store must land before the kernel exits.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


# ------------------------------------------------------------------------------------------------------ the launcher


# Mosaic GPU describes the TMA of a swizzled (8, 128)-tiled SMEM tile as a copy from an (8, 128)-tiled view of the
# whole GMEM array, which exists only when the array's row count is a multiple of 8 or below 8.
TMA_ROW_TILE = 8


def tma_rows_ok(rows: int) -> bool:
  """Whether a_q with this many rows is read as it is (else the launcher copies it into a padded buffer)."""
  return rows % TMA_ROW_TILE == 0 or rows < TMA_ROW_TILE


def shape_problems(n: int, k: int) -> list[str]:
  """What this kernel cannot do about a (N, K) weight (empty: nothing). Any M >= 1 works."""
  problems = []
  if n % BLOCK or n == 0:
    problems.append(f"N={n} must be a positive multiple of {BLOCK}")
  if k % BLOCK or k == 0:
    problems.append(f"K={k} must be a positive multiple of {BLOCK}")
  return problems


def config_problems(config: MosaicGemmConfig, n: int, out_dtype) -> list[str]:
  """Why `config` cannot run an output of N columns in `out_dtype` (empty: it can)."""
  try:
    config.validate()
  except ValueError as e:
    return [str(e)]
  problems = []
  if config.scales_per_column and n % config.tile_n:
    problems.append(f"tile_n={config.tile_n} (a width that scales per column) must divide N={n}")
  if config.epi_n(out_dtype) * jnp.dtype(out_dtype).itemsize > 128:
    problems.append(f"epi_tile_n={config.epi_tile_n} gives epilogue rows over 128 bytes for {jnp.dtype(out_dtype)}")
  if (smem := config.smem_bytes(out_dtype)) > SMEM_BYTES:
    problems.append(f"config needs {smem} bytes of shared memory > {SMEM_BYTES}")
  return problems


def block_fp8_matmul(
    a_q: jax.Array,
    b_q: jax.Array,
    a_s_col: jax.Array,
    b_s: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    bias: jax.Array | None = None,
    config: MosaicGemmConfig,
    num_sms: int,
    out_rows: int | None = None,
    interpret: bool = False,
) -> jax.Array:
  """C = a_q @ b_q.T with (1, 128) activation and (128, 128) weight block scales; see the module docstring.

  a_q (M, K) e4m3fn; b_q (N, K) e4m3fn; a_s_col (K // 128, M') float32 column-major, M' >= M, M' % 4 == 0;
  b_s (N // 128, K // 128) float32; bias (N,) float32 or out_dtype. Returns (M, N) out_dtype.
  out_rows: output only the first out_rows rows (M above is then out_rows): the rows of a_q past them are padding
  (e.g. the quantizer's zero rows up to a whole 64-row tile), read as they are instead of as TMA zero fill.
  config: a config with no `config_problems`; num_sms: CTAs of a persistent grid (the device's SM count).
  The caller validates shapes (`shape_problems`) and dtypes; this launcher only builds the kernel.
  """
  rows_read, k = a_q.shape
  n = b_q.shape[0]
  m = out_rows or rows_read
  out_dtype = jnp.dtype(out_dtype)
  if not tma_rows_ok(rows_read):
    # Zero rows, never stored, make the tiled TMA view of a_q exist (TMA_ROW_TILE).
    a_q = jnp.pad(a_q, ((0, -rows_read % TMA_ROW_TILE), (0, 0)))
  m_iters, n_iters = pl.cdiv(m, config.tile_m), pl.cdiv(n, config.tile_n)
  out_type = jax.ShapeDtypeStruct((m, n), out_dtype)
  interpret_params: Any = plgpu.InterpretGPUParams() if interpret else None

  if not config.warp_specialized:
    def body(a_gmem, b_gmem, as_gmem, bs_gmem, *rest):
      bias_gmem = rest[0] if bias is not None else None
      out_gmem, out_smem = rest[-2:]
      _simple_kernel(a_gmem, b_gmem, as_gmem, bs_gmem, bias_gmem, out_gmem, out_smem, cfg=config)

    f = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(n_iters, m_iters),
        grid_names=("n", "m"),
        scratch_types=[_epilogue_smem(1, out_dtype, config.epi_n(out_dtype))],
        interpret=interpret_params,
    )
  else:
    def body(a_gmem, b_gmem, as_gmem, bs_gmem, *rest):
      bias_gmem = rest[0] if bias is not None else None
      _ws_kernel(a_gmem, b_gmem, as_gmem, bs_gmem, bias_gmem, rest[-1], cfg=config)

    cluster_kwargs = {}
    if config.persistent:
      cluster_size = 1 if config.cluster_dim is None else 2
      num_pairs = (pl.cdiv(m_iters, 2) * n_iters if config.cluster_dim == Dim.M else
                   m_iters * pl.cdiv(n_iters, 2) if config.cluster_dim == Dim.N else m_iters * n_iters)
      num_clusters = min((config.grid_size or num_sms) // cluster_size, num_pairs)
      grid, grid_names = (max(num_clusters, 1),), ("sm",)
      if cluster_size > 1:
        cluster_kwargs = dict(cluster=(cluster_size,), cluster_names=("cluster",))
    else:
      grid, grid_names = (n_iters, m_iters), ("n", "m")
    f = plgpu.kernel(
        body,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        **cluster_kwargs,
        num_threads=config.num_compute_wgs + 1,
        thread_name="wg",
        interpret=interpret_params,
    )
  args = (a_q, b_q, a_s_col, b_s) + ((bias,) if bias is not None else ())
  return f(*args)
