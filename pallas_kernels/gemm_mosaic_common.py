"""What the Mosaic GPU block-FP8 GEMMs (dense `gemm_mosaic.py`, grouped `grouped_gemm_mosaic.py`) share.

The config, the promotion math of one pipeline step, the warp-specialized pipeline set-up (a TMA producer warpgroup
plus one to three consumers, whose shared memory is allocated once for every tile a persistent CTA visits), the tile
loop (persistent in `plgpu.planar_snake` order, or one CTA per tile), the epilogue's loop over sub-tiles and its two
alternating SMEM slots, and the config's own checks. Each kernel file keeps what is its own: the dense kernel its
TMA epilogue clipped at M, CTA clusters and the one-warpgroup fallback; the grouped kernel its work-item table and its
row-run stores.

The math (DeepSeek's recipe, as in DeepGEMM): for every 128-wide K block the FP8 wgmma runs into a fresh f32
accumulator (`plgpu.ACC`), which is read into registers, multiplied by a_s (a per-row vector) times b_s (one scalar per
128 columns, or per column where a sub-tile straddles two weight-scale blocks) and added into a running f32
accumulator held in registers.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu


BLOCK = 128  # the default block size (gn, gk) of the weight scales; MosaicGemmConfig.block_n / block_k
BLOCK_SIZES = (64, 128)  # the gn and gk the kernels take
MAX_SUB_N = 128  # columns of the widest sub-tile (one wgmma and its fresh accumulator)
WGMMA_M = 64  # rows of one wgmma (and of one sub-tile)
SMEM_BYTES = 232448  # per-block shared memory on H100/H200 (227 KiB)
# Mosaic GPU describes the TMA of a swizzled (8, 128)-tiled SMEM tile as a copy from an (8, 128)-tiled view of the
# whole GMEM array, which exists only when the array's row count is a multiple of 8 or below 8.
TMA_ROW_TILE = 8
PRODUCER_REGISTERS = 40  # the TMA warpgroup issues copies only


def fp8_transforms(block_k: int) -> tuple:
  """The SMEM layout of FP8 operand tiles whose K blocks are block_k wide: a block_k-byte swizzle, so that each K
  block's wgmma starts at a swizzle boundary."""
  return plgpu.TilingTransform((8, block_k)), plgpu.SwizzleTransform(block_k)


class Dim(enum.IntEnum):
  """A matmul output dimension (the values are those `plgpu.planar_snake` expects)."""
  M = 0
  N = 1


@dataclasses.dataclass(frozen=True)
class MosaicGemmConfig:
  """Tiling and schedule of the Mosaic GPU block-FP8 GEMMs; a config that no kernel could build is refused here.

  tile_m, tile_n: the CTA output tile. tile_m a multiple of 64; tile_n a multiple of 8 up to 256. Where a sub-tile
    can straddle two weight-scale blocks (`scales_per_column`) the scale is chosen per column and N % tile_n == 0.
  max_concurrent_steps: TMA pipeline depth (stages in SMEM).
  k_blocks_per_step: K blocks (block_k wide) per pipeline step (1 or 2). With 2, each sub-tile's second wgmma
    overlaps the scaling of the first.
  warp_specialized: False: the dense kernel's simple one-warpgroup kernel (grid of tiles). True: producer + consumer
    warpgroups.
  num_compute_wgs: consumer warpgroups (1, 2 or 3; warp-specialized only). wg_split: the dimension they split the
    tile along.
  grid_minor_dim, grid_tile_width: the persistent tile order (`plgpu.planar_snake`).
  epi_tile_n: columns per epilogue TMA store; None = the most that divides the sub-tile width and fits in 128 bytes.
  persistent: warp-specialized only. False launches one CTA per tile instead of looping over tiles on num_sms CTAs
    (for the small-M configs, where several CTAs per SM can overlap their latency).
  grid_size: CTAs of the persistent grid; None = one per SM (tests set it small to exercise the tile loop).
  live_grid: grouped kernel, persistent only: the tile loop visits the work-item table's live items only (a count
    read at run time), not its static size, so that the dead padding items cost neither a CTA nor a loop step (the
    masked layout's table is mostly padding at decode). A CTA past the live tiles runs no iteration.
  cluster_dim: dense, persistent warp-specialized only: pair CTAs in a cluster of 2 along this dimension; the operand
    tile the two share (B for Dim.M, A and its scales for Dim.N) is loaded once and multicast to both by TMA.
  weight_scales_ahead: load each pipeline step's weight scales (scalar global loads) one step early and carry them,
    so that their latency hides behind a whole step. Pays in the decode schedule, where a step's wgmmas are short
    (H200, M=64: Qwen3 qkv 15.81 vs 16.48 us, dense_down 35.63 vs 36.03); costs elsewhere (M=1024 128x256 tiles
    4% slower, M=256 128x160 tiles scaled per column 1.5x), so the prefill schedules leave it off.
  skip_idle_consumers: grouped kernel: a consumer warpgroup whose part of a work item's tile holds none of its rows
    runs no wgmma (False: it computes rows it will not store, as two consumers did before the flag).
  sub_tile_n: columns of one sub-tile (one wgmma and its promotion); None: the warpgroup's columns in as few equal
    parts of at most MAX_SUB_N as there can be. A narrower sub-tile holds a smaller fresh wgmma accumulator
    (64 * sub_n / 128 registers a thread): where the compiler ignores setmaxnreg (JAX 0.12's libnvJitLink) a consumer
    must fit the launch's even share of registers. It must divide the warpgroup's columns and MAX_SUB_N, a multiple of 8.
  block_n, block_k: the problem's block size (gn, gk) (docs/CONTRACT.md §2), each 64 or 128: a weight scale per
    block_n columns and block_k K, an activation scale per row and block_k K. The backends set them from the call's
    block_size; a sub-tile wider than block_n meets two weight-scale blocks and scales per column.
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
  live_grid: bool = False
  cluster_dim: Dim | None = None
  weight_scales_ahead: bool = False
  skip_idle_consumers: bool = True
  sub_tile_n: int | None = None
  block_n: int = BLOCK
  block_k: int = BLOCK

  def __post_init__(self):
    for name in ("tile_m", "tile_n", "max_concurrent_steps", "k_blocks_per_step", "num_compute_wgs",
                 "grid_tile_width"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"MosaicGemmConfig.{name} must be a positive int, got {value!r}")
    if self.num_compute_wgs not in (1, 2, 3):
      raise ValueError(f"num_compute_wgs must be 1, 2 or 3, got {self.num_compute_wgs}")
    if self.k_blocks_per_step not in (1, 2):
      raise ValueError(f"k_blocks_per_step must be 1 or 2, got {self.k_blocks_per_step}")
    if self.tile_n % 8 or not 0 < self.tile_n <= 256:
      raise ValueError(f"tile_n must be a multiple of 8 in [8, 256], got {self.tile_n}")
    if self.tile_m % WGMMA_M or not 0 < self.tile_m <= 256:
      raise ValueError(f"tile_m must be a multiple of {WGMMA_M} in [64, 256], got {self.tile_m}")
    wg_m, wg_n = self.wg_tile
    if self.sub_tile_n is not None and (
        not isinstance(self.sub_tile_n, int) or isinstance(self.sub_tile_n, bool) or self.sub_tile_n < 8
        or self.sub_tile_n % 8 or wg_n % self.sub_tile_n or MAX_SUB_N % self.sub_tile_n):
      raise ValueError(f"sub_tile_n must be None or a multiple of 8 that divides the warpgroup's {wg_n} columns and "
                       f"{MAX_SUB_N}, got {self.sub_tile_n!r}")
    split = (f"tile_m={self.tile_m}, tile_n={self.tile_n}, num_compute_wgs={self.num_compute_wgs}, "
             f"wg_split={self.wg_split.name}")
    if wg_m % WGMMA_M or wg_m == 0:
      raise ValueError(f"{split}: each consumer warpgroup needs a multiple of {WGMMA_M} rows, got {wg_m}")
    if wg_n % 8 or wg_n == 0 or wg_n % pl.cdiv(wg_n, MAX_SUB_N) or self.sub_n % 8:
      raise ValueError(f"{split}: each consumer warpgroup needs a multiple of 8 columns that splits into equal "
                       f"sub-tiles of at most {MAX_SUB_N} columns, each a multiple of 8, got {wg_n}")
    for name in ("block_n", "block_k"):
      if getattr(self, name) not in BLOCK_SIZES:
        raise ValueError(f"MosaicGemmConfig.{name} must be one of {BLOCK_SIZES}, got {getattr(self, name)!r}")
    if self.scales_per_column and self.sub_n > self.block_n and (self.sub_n % self.block_n or
                                                                   self.tile_n % self.block_n):
      # the per-column choice takes one of two blocks: a sub-tile must not meet three
      raise ValueError(f"{split}: sub-tiles of {self.sub_n} columns wider than block_n={self.block_n} must start at "
                       f"its multiples (tile_n and the sub-tile width multiples of it)")
    if self.epi_tile_n is not None and (self.epi_tile_n not in (8, 16, 32, 64) or self.sub_n % self.epi_tile_n):
      raise ValueError(f"epi_tile_n must be 8, 16, 32 or 64 and divide the sub-tile width {self.sub_n}, "
                       f"got {self.epi_tile_n}")
    if self.grid_size is not None and (not isinstance(self.grid_size, int) or self.grid_size < 1):
      raise ValueError(f"grid_size must be None or a positive int, got {self.grid_size!r}")
    if self.cluster_dim is not None and not (self.warp_specialized and self.persistent):
      raise ValueError("cluster_dim needs warp_specialized=True and persistent=True")
    if self.live_grid and not (self.warp_specialized and self.persistent):
      raise ValueError("live_grid needs warp_specialized=True and persistent=True")

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
    """Whether a sub-tile can straddle two block_n-column weight-scale blocks, so that the weight scale is chosen per
    column: unless the sub-tile width divides block_n and tiles either divide blocks or are whole blocks."""
    aligned_tiles = self.tile_n % self.block_n == 0 or self.block_n % self.tile_n == 0
    return not (aligned_tiles and self.block_n % self.sub_n == 0)

  @property
  def sub_n(self) -> int:
    """Columns of one sub-tile (one wgmma; one b_s scalar unless `scales_per_column`): `sub_tile_n`, else the
    warpgroup's columns in as few equal parts of at most MAX_SUB_N as there can be."""
    if self.sub_tile_n is not None:
      return self.sub_tile_n
    wg_n = self.wg_tile[1]
    return wg_n // pl.cdiv(wg_n, MAX_SUB_N)

  def epi_n(self, out_dtype) -> int:
    """Columns per epilogue store for this output dtype."""
    if self.epi_tile_n:
      return self.epi_tile_n
    widest = 128 // jnp.dtype(out_dtype).itemsize
    return next(w for w in (64, 32, 16, 8) if w <= widest and self.sub_n % w == 0)

  def pipeline_smem_bytes(self) -> int:
    """Shared memory of the TMA pipeline: A tile, B tile, activation scales and (over-counted) each stage's barriers
    and alignment, plus room for the kernel's own barriers."""
    bk = self.block_k * self.k_blocks_per_step
    stage = self.tile_m * bk + self.tile_n * bk + 4 * self.k_blocks_per_step * self.tile_m + 128
    return self.max_concurrent_steps * stage + 512

  def smem_bytes(self, out_dtype) -> int:
    """Shared memory the dense kernel allocates: pipeline stages and epilogue slots (a close upper estimate)."""
    return self.pipeline_smem_bytes() + epilogue_slot_bytes(self, self.epi_n(out_dtype) * jnp.dtype(out_dtype).itemsize)


def epilogue_slot_bytes(cfg: MosaicGemmConfig, row_bytes: int) -> int:
  """Two 64-row epilogue slots of row_bytes per consumer warpgroup."""
  return cfg.num_wgs * 2 * WGMMA_M * row_bytes


def common_problems(config: MosaicGemmConfig, n: int, out_dtype, smem_bytes: int) -> list[str]:
  """What keeps a valid config from running N output columns of out_dtype in smem_bytes of shared memory."""
  problems = []
  if config.scales_per_column and n % config.tile_n:
    problems.append(f"tile_n={config.tile_n} (a width that scales per column) must divide N={n}")
  if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
    problems.append(f"out_dtype {jnp.dtype(out_dtype).name} is not bfloat16, float16 or float32")
  if smem_bytes > SMEM_BYTES:
    problems.append(f"config needs {smem_bytes} bytes of shared memory > {SMEM_BYTES}")
  return problems


def fit_smem(config: MosaicGemmConfig, k: int, smem_bytes: Callable[[MosaicGemmConfig], int]) -> MosaicGemmConfig:
  """`config` with max_concurrent_steps lowered to at most the K steps, then until it fits in shared memory."""
  steps = max(1, min(config.max_concurrent_steps, pl.cdiv(pl.cdiv(k, config.block_k), config.k_blocks_per_step)))
  config = dataclasses.replace(config, max_concurrent_steps=steps)
  while smem_bytes(config) > SMEM_BYTES and config.max_concurrent_steps > 1:
    config = dataclasses.replace(config, max_concurrent_steps=config.max_concurrent_steps - 1)
  return config


def pad_rows_for_tma(a: jax.Array, axis: int) -> jax.Array:
  """a with zero rows appended along `axis` so that the (8, 128)-tiled TMA view exists (TMA_ROW_TILE)."""
  rows = a.shape[axis]
  if rows % TMA_ROW_TILE == 0 or rows < TMA_ROW_TILE:
    return a
  pad = [(0, 0)] * a.ndim
  pad[axis] = (0, -rows % TMA_ROW_TILE)
  return jnp.pad(a, pad)


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
  first = sub_col0 // cfg.block_n
  scale = bs_gmem[jnp.minimum(first, num_n_blocks - 1), k_block]
  if not cfg.scales_per_column:
    return scale
  # A sub-tile meets at most two blocks (the config's checks): the columns before the next block's first column take
  # this block's scale.
  next_scale = bs_gmem[jnp.minimum(first + 1, num_n_blocks - 1), k_block]
  return jnp.where(col_ids < (first + 1) * cfg.block_n - sub_col0, scale, next_scale)


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
          ks = pl.ds(kb * cfg.block_k, cfg.block_k)
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


def in_specs(cfg: MosaicGemmConfig, m_idx, n_idx, b_pair=None):
  """A tile, B tile and activation scales of pipeline step k; the operands a CTA cluster shares are multicast.

  b_pair: None, or the index of a pair of weight halves in a (2 x pairs, N/2, K) view of B (`warp_specialized`'s
  paired_b): the B tile is then tile_n/2 rows of each half, one consumer warpgroup's each."""
  bk = cfg.block_k * cfg.k_blocks_per_step
  transforms = fp8_transforms(cfg.block_k)
  shared_a = ("cluster",) if cfg.cluster_dim == Dim.N else None
  shared_b = ("cluster",) if cfg.cluster_dim == Dim.M else None
  if b_pair is None:
    b_spec = plgpu.BlockSpec((cfg.tile_n, bk), lambda k: (n_idx, k), transforms=transforms,
                             collective_axes=shared_b)
  else:
    b_spec = plgpu.BlockSpec((2, cfg.tile_n // 2, bk), lambda k: (b_pair, n_idx, k), transforms=transforms)
  return [
      plgpu.BlockSpec((cfg.tile_m, bk), lambda k: (m_idx, k), transforms=transforms, collective_axes=shared_a),
      b_spec,
      plgpu.BlockSpec((cfg.k_blocks_per_step, cfg.tile_m), lambda k: (k, m_idx), collective_axes=shared_a),
  ]


# ------------------------------------------------------------------------------- the epilogue's loop over sub-tiles


def store_subtiles(accs, slots, cfg: MosaicGemmConfig, epi_n: int, finish, store):
  """Writes one warpgroup's sub-tile accumulators through its two SMEM slots, epi_n columns at a time.

  finish(acc, i, j) -> the (64, sub_n) output of sub-tile (i, j) (bias, masking, cast); store(slot_ref, i, j, e)
  issues the TMA store(s) of its e-th epi_n-column piece from slot_ref and commits them.
  """
  sub_n = cfg.sub_n
  subs_n = cfg.wg_tile[1] // sub_n
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's stores have read the slots
  slot = 0
  for idx, acc in enumerate(accs):
    i, j = divmod(idx, subs_n)
    out = finish(acc, i, j)
    for e in range(sub_n // epi_n):
      piece = out if epi_n == sub_n else out[:, e * epi_n:(e + 1) * epi_n]
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # at most one store in flight: the one reading the other slot
      slots[slot] = piece
      plgpu.commit_smem()
      store(slots.at[slot], i, j, e)
      slot = 1 - slot


def store_zero_subtiles(slots, cfg: MosaicGemmConfig, epi_n: int, out_dtype, store, slot_holds_zeros=None):
  """Writes zeros over one warpgroup's (wg_m, wg_n) part of a tile: slot 0 filled with zeros, then every piece's TMA
  store from it, none waited for (they all read the same zeros, which nothing rewrites before the next
  store_subtiles waits for them). slot_holds_zeros (traced bool; None: fill): the previous tile was zeros too, so
  slot 0 still holds them: no wait, no fill, and a run of such tiles stores at the copy engine's pace. store(slot_ref, i, j, e): as
  in store_subtiles."""
  wg_m, wg_n = cfg.wg_tile

  def fill():
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's stores have read the slots
    zeros = plgpu.layout_cast(jnp.zeros((WGMMA_M, epi_n), jnp.float32), plgpu.Layout.WGMMA)
    slots[0] = zeros.astype(out_dtype)
    plgpu.commit_smem()

  if slot_holds_zeros is None:
    fill()
  else:
    pl.when(jnp.logical_not(slot_holds_zeros))(fill)
  for i in range(wg_m // WGMMA_M):
    for j in range(wg_n // cfg.sub_n):
      for e in range(cfg.sub_n // epi_n):
        store(slots.at[0], i, j, e)


def live_rows_only(acc, live_rows, row0):
  """acc (64, sub_n) whose first row is row0, with the rows from live_rows on set to 0 (None: acc as it is)."""
  if live_rows is None:
    return acc
  rows = plgpu.broadcasted_iota(jnp.int32, acc.shape, 0, layout=plgpu.Layout.WGMMA)
  return jnp.where(rows < live_rows - row0, acc, jnp.zeros_like(acc))


# -------------------------------------------------------------------- the warp-specialized pipeline and tile loop


def warpgroup_origin(cfg: MosaicGemmConfig, wg_idx):
  """(row, column) of the consumer warpgroup's part inside the CTA tile."""
  if cfg.num_compute_wgs == 1:
    return 0, 0
  wg_m, wg_n = cfg.wg_tile
  if cfg.wg_split == Dim.M:
    return wg_idx * wg_m, 0
  return 0, wg_idx * wg_n


def _check_pairs(cfg: MosaicGemmConfig, num_n_blocks: int):
  if cfg.num_compute_wgs != 2 or cfg.wg_split != Dim.N or cfg.cluster_dim is not None or num_n_blocks % 2:
    raise ValueError(f"paired weight halves need two consumers split along N, no cluster and an even number of "
                     f"{cfg.block_n}-column blocks, got {cfg} on {num_n_blocks} blocks")


def warp_specialized(cfg: MosaicGemmConfig, operands, epilogue_slots, body, *, num_k_blocks: int,
                     num_n_blocks: int, paired_b: bool = False):
  """The warp-specialized structure both kernels run: one allocation of the TMA pipeline's stages (sized for the
  (a, b, a_s) views `operands`) and of the epilogue slots, shared by every tile the CTA computes.

  body(compute_tile, slots, wg_idx) runs in every warpgroup. compute_tile(a, b, a_s, b_s, m_idx, n_idx, epilogue,
  rows=None) runs the K loop of output tile (m_idx, n_idx) over the views a (M_a, K), b (N, K), a_s (K/128, M_a') and
  the (N/128, K/128) weight scales b_s, then epilogue(accs, row0, col0) in each consumer warpgroup, (row0, col0) being
  its part's first element; with rows = (lo, hi) (traced), only in the consumers whose part holds one of the output
  rows [lo, hi). slots: this consumer's (2, 64, epi_n) epilogue buffers.

  paired_b: B is two stacked halves of N/2 rows (gate and up), consumer w (of two split along N) computes half w's
  columns: compute_tile(..., b_pair=p) reads b as a (2 x pairs, N/2, K) view (rows 2p, 2p + 1: pair p's halves),
  n_idx counts tile_n/2-column tiles of a half, col0 is w * N/2 + n_idx * tile_n/2 (B's column: its scales')."""
  wg_m, wg_n = cfg.wg_tile
  if paired_b:
    _check_pairs(cfg, num_n_blocks)
  half_n = num_n_blocks // 2 * cfg.block_n  # with paired_b: the columns of one half

  def pipeline(mma_body, compute_context, m_idx=0, n_idx=0, b_pair=None):
    return plgpu.emit_pipeline_warp_specialized(
        mma_body,
        grid=(pl.cdiv(num_k_blocks, cfg.k_blocks_per_step),),
        memory_registers=PRODUCER_REGISTERS,
        in_specs=in_specs(cfg, m_idx, n_idx, b_pair),
        wg_axis="wg",
        num_compute_wgs=cfg.num_compute_wgs,
        max_concurrent_steps=cfg.max_concurrent_steps,
        compute_context=compute_context,
    )

  ignore = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=pipeline(ignore, ignore, b_pair=0 if paired_b else None).get_allocations(*operands),
      out_smem=epilogue_slots,
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, out_smem):
    wg_idx = lax.axis_index("wg")
    wg_row0, wg_col0 = warpgroup_origin(cfg, wg_idx)

    def compute_tile(a, b, a_s, b_s, m_idx, n_idx, epilogue, rows=None, b_pair=None):
      row0 = m_idx * cfg.tile_m + wg_row0
      # The consumer's first column in B's N, and its rows of the B tile (with paired_b: its half's box).
      col0 = wg_idx * half_n + n_idx * wg_n if paired_b else n_idx * cfg.tile_n + wg_col0
      b_rows = (lambda b_smem: b_smem.at[wg_idx]) if paired_b else (lambda b_smem: b_smem.at[pl.ds(wg_col0, wg_n)])
      # rows = (lo, hi): the tile's output rows that hold work. A consumer whose part misses them (the other expert's
      # half of a tile two experts share, the dead half past a live-row count) still paces the pipeline with the
      # others but runs no wgmma and stores nothing. Only consumers split along M can miss them: no cond else.
      split_m = cfg.num_compute_wgs > 1 and cfg.wg_split == Dim.M
      busy = (rows[0] < row0 + wg_m) & (rows[1] > row0) if rows is not None and split_m else None

      def compute_context(run_pipeline):
        accs, _ = run_pipeline(initial_carry(b_s, col0, cfg, num_k_blocks, num_n_blocks))
        if busy is None:
          epilogue(accs, row0, col0)
        else:
          pl.when(busy)(lambda: epilogue(accs, row0, col0))

      def mma_body(indices, a_smem, b_smem, as_smem, carry):
        (k_step,) = indices

        def step(carry):
          return scaled_mma_step(
              carry, a_smem.at[pl.ds(wg_row0, wg_m)], b_rows(b_smem),
              as_smem.at[:, pl.ds(wg_row0, wg_m)], b_s, k_step=k_step, col0=col0, cfg=cfg,
              num_k_blocks=num_k_blocks, num_n_blocks=num_n_blocks)

        # An idle consumer's carry is never read: it neither stores nor outlives the tile.
        return step(carry) if busy is None else lax.cond(busy, step, lambda c: c, carry)

      pipeline(mma_body, compute_context, m_idx, n_idx, b_pair)(a, b, a_s, allocations=pipeline_allocs)

    # The producer warpgroup (index num_compute_wgs) has no slots of its own; it never stores.
    slots = out_smem.at[jnp.minimum(wg_idx, cfg.num_compute_wgs - 1)]
    body(compute_tile, slots, wg_idx, (wg_row0, wg_col0))

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # every TMA store lands before the kernel exits


def tile_loop(cfg: MosaicGemmConfig, shape: tuple, tile, live_loop_rows=None):
  """Calls tile(i, j) for every (i, j) of `shape`: on a persistent grid in `plgpu.planar_snake` order (the grid is
  named "sm"), else once in the CTA of grid position ("m", "n") = (i, j). On a persistent grid shape[0] may be traced
  (a count read at run time): every warpgroup of a CTA computes the same trip count from it, so the producer and the
  consumers agree on it, and a CTA whose share is empty runs no iteration (nor any pipeline barrier).

  live_loop_rows: a traced count of the loop rows that hold live work (the rest are cheap: zeros to store). The
  persistent loop then visits those rows' tiles first and the rest after them (`live_first_order`), so that the live
  tiles spread evenly over the CTAs whatever the count, and calls tile(i, j, after_dead): whether this CTA's previous
  tile was past the live rows too (with one CTA per tile there is none: tile(i, j))."""
  if cfg.persistent:
    @plgpu.nd_loop((shape[0] * shape[1],), collective_axes="sm")
    def _tile_loop(loop_info: plgpu.NDLoopInfo):
      (lin_idx,) = loop_info.index
      if live_loop_rows is None:
        tile(*plgpu.planar_snake(lin_idx, shape, int(cfg.grid_minor_dim), cfg.grid_tile_width))
        return
      i, j = live_first_order(lin_idx, shape, live_loop_rows, int(cfg.grid_minor_dim), cfg.grid_tile_width)
      live_tiles = live_loop_rows * shape[1]
      previous = lin_idx - lax.axis_size("sm")  # this CTA's previous tile: the loop strides by the grid
      tile(i, j, (loop_info.local_index > 0) & (previous >= live_tiles))
  else:
    tile(lax.axis_index("m"), lax.axis_index("n"))


def live_first_order(lin_idx, shape: tuple[int, int], live_rows, minor_dim: int, tile_width: int):
  """(i, j) of the lin_idx-th tile of `shape` when its first `live_rows` rows (traced, within [0, rows]) come first,
  in planar-snake order among themselves, then the other rows' tiles row by row.

  In one planar-snake order over the whole shape, a persistent CTA visits tiles at a fixed stride, which can keep it
  in the same few rows all along: with half the rows live, half the CTAs then did all the work. The dead tiles last:
  placed first (their zero stores before the live tiles' loads) they measured no faster, their TMA stores taking
  the same time wherever they go."""
  cols = shape[1]
  live_tiles = live_rows * cols
  # max(., 1): planar_snake divides by the live rows; with none, its result is not used
  live_i, live_j = plgpu.planar_snake(lin_idx, (jnp.maximum(live_rows, 1), cols), minor_dim, tile_width)
  rest = lin_idx - live_tiles
  rest_i, rest_j = live_rows + lax.div(rest, jnp.int32(cols)), lax.rem(rest, jnp.int32(cols))
  is_live = lin_idx < live_tiles
  return lax.select(is_live, live_i, rest_i), lax.select(is_live, live_j, rest_j)


def kernel_grid(cfg: MosaicGemmConfig, shape: tuple[int, int], num_sms: int, per_cta: int = 1):
  """(grid, grid_names) of a kernel over `shape` tiles: at most one CTA per SM (or `cfg.grid_size`), each looping
  over tiles, or one CTA per tile (the grid is (n, m), as `tile_loop` reads it). per_cta: CTAs per loop position
  (a cluster's size)."""
  if cfg.persistent:
    return (max(min((cfg.grid_size or num_sms) // per_cta, shape[0] * shape[1]), 1),), ("sm",)
  return (shape[1], shape[0]), ("n", "m")
