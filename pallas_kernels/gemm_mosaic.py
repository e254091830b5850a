"""Block-scaled FP8 GEMM for Hopper (sm_90) in Pallas Mosaic GPU.

Computes docs/CONTRACT.md §2 with block_size (gn, gk) = (config.block_n, config.block_k), each 64 or 128 (128 in
the text below, where a 64-wide K block also uses a 64-byte swizzle):

    C[m, n] = out_dtype(bias[n] + sum_g a_s[m, g] * b_s[n // gn, g] * sum_{k in group g} a_q[m, k] * b_q[n, k])

The promotion math, the config and the warp-specialized pipeline set-up live in `gemm_mosaic_common.py` (shared
with the grouped kernel): every 128-wide K block's FP8 wgmma runs into a fresh f32 accumulator that is scaled by
a_s[m] * b_s[n // 128] and added into a running f32 accumulator in registers. Promoting every 128 K keeps the full
f32 precision that the tensor cores' own FP8 accumulation lacks, and applies the block scales exactly where they
change.

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
on the way out, so any M works; columns past N likewise (the weight's rows past N read as zeros, the last block's
b_s clamped, the bias padded with zeros where a sub-tile straddles N), so N only needs to be a multiple of 8 (the output's rows,
whose TMA strides are multiples of 16 bytes). K % 128 == 0 is required (the launcher rejects anything else, so
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

Live rows (`live_rows`, a traced count; warp-specialized configs): a row tile that starts at or past the count loads
nothing and runs no wgmma, its consumers store zeros; in a tile that holds the count's boundary the rows past it are
computed and then stored as 0, the bias not added there. A persistent grid visits the live row tiles first, so that
they spread evenly over its CTAs. One compiled kernel serves every count.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .gemm_mosaic_common import (BLOCK, BLOCK_SIZES, MAX_SUB_N, SMEM_BYTES, TMA_ROW_TILE, WGMMA_M, Dim,
                                 MosaicGemmConfig, common_problems, epilogue_slot_bytes, fit_smem, in_specs,
                                 initial_carry, kernel_grid, live_rows_only, pad_rows_for_tma, scaled_mma_step,
                                 store_subtiles, store_zero_subtiles, tile_loop, warp_specialized)


def _epilogue_smem(num_wgs: int, out_dtype, epi_n: int):
  """Two epilogue slots per consumer warpgroup: one is written while the other's TMA store drains. Rows of at most one
  swizzle span and no tiling, so that the TMA stores need no tiled view of the output (any M)."""
  row_bytes = epi_n * jnp.dtype(out_dtype).itemsize
  if row_bytes > 128:
    raise ValueError(f"epilogue rows of {epi_n} x {jnp.dtype(out_dtype).name} exceed 128 bytes")
  # 16-byte rows (8 columns of 16 bits) are stored unswizzled: Mosaic GPU swizzles spans of 32 bytes or more.
  transforms = (plgpu.SwizzleTransform(plgpu.find_swizzle(row_bytes * 8)),) if row_bytes >= 32 else ()
  return plgpu.SMEM((num_wgs, 2, WGMMA_M, epi_n), out_dtype, transforms=transforms)


def _epilogue(accs, slots, out_gmem, bias_gmem, live_rows, row0, col0, cfg: MosaicGemmConfig):
  """Writes one warpgroup's (wg_m, wg_n) tile whose top-left element is (row0, col0): bias (added in f32), the rows
  from live_rows on zeroed, cast, SMEM, TMA store (clipped at M and N).

  accs: the (64, sub_n) sub-tile accumulators; slots: this warpgroup's (2, 64, epi_n) epilogue buffers.
  """
  sub_n, epi_n = cfg.sub_n, cfg.epi_n(out_gmem.dtype)

  def finish(acc, i, j):
    if bias_gmem is not None:
      # A sub-tile lies wholly inside or wholly past the bias (the launcher pads it where one straddles N);
      # clamping keeps the load of one past it in bounds.
      start = jnp.minimum(col0 + j * sub_n, bias_gmem.shape[0] - sub_n)
      bias = plgpu.load(bias_gmem.at[pl.ds(start, sub_n)], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
      acc = acc + lax.broadcast_in_dim(bias.astype(jnp.float32), acc.shape, [1])
    return live_rows_only(acc, live_rows, row0 + i * WGMMA_M).astype(out_gmem.dtype)

  store_subtiles(accs, slots, cfg, epi_n, finish, _tile_store(out_gmem, row0, col0, cfg))


def _tile_store(out_gmem, row0, col0, cfg: MosaicGemmConfig):
  """store(slot, i, j, e): the TMA store of piece e of sub-tile (i, j) of the warpgroup part at (row0, col0)."""
  sub_n, epi_n = cfg.sub_n, cfg.epi_n(out_gmem.dtype)

  def store(slot, i, j, e):
    plgpu.copy_smem_to_gmem(
        slot, out_gmem.at[pl.ds(row0 + i * WGMMA_M, WGMMA_M), pl.ds(col0 + j * sub_n + e * epi_n, epi_n)])
  return store


# ----------------------------------------------------------------------------------------- kernel 1: one warpgroup


def _simple_kernel(a_gmem, b_gmem, as_gmem, bs_gmem, bias_gmem, out_gmem, out_smem, *, cfg: MosaicGemmConfig):
  k = a_gmem.shape[1]
  n = b_gmem.shape[0]
  num_k_blocks, num_n_blocks = k // cfg.block_k, pl.cdiv(n, cfg.block_n)
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
  _epilogue(accs, out_smem.at[0], out_gmem, bias_gmem, None, m_idx * cfg.tile_m, n_idx * cfg.tile_n, cfg)
  plgpu.wait_smem_to_gmem(0)


# ------------------------------------------------------------------------------- kernel 2: warp-specialized, persistent


def _ws_kernel(a_gmem, b_gmem, as_gmem, bs_gmem, bias_gmem, live_gmem, out_gmem, *, cfg: MosaicGemmConfig):
  m, n = out_gmem.shape  # a_gmem may have zero rows appended (see the module docstring)
  k = a_gmem.shape[1]
  m_iters, n_iters = pl.cdiv(m, cfg.tile_m), pl.cdiv(n, cfg.tile_n)
  # the count clipped to [0, M] here: a clip before the launch would be a kernel launch of its own
  live_rows = None if live_gmem is None else jnp.minimum(jnp.maximum(live_gmem[0], 0), m)
  slots_type = _epilogue_smem(cfg.num_compute_wgs, out_gmem.dtype, cfg.epi_n(out_gmem.dtype))

  def body(compute_tile, slots, wg_idx, wg_origin):
    def epilogue(accs, row0, col0):
      _epilogue(accs, slots, out_gmem, bias_gmem, live_rows, row0, col0, cfg)

    def tile(m_idx, n_idx, after_dead=None):
      if live_rows is None:
        compute_tile(a_gmem, b_gmem, as_gmem, bs_gmem, m_idx, n_idx, epilogue)
        return
      # Both CTAs of a cluster along M load the B tile they share: the pair computes if its first tile is live.
      first_row = (m_idx - m_idx % 2 if cfg.cluster_dim == Dim.M else m_idx) * cfg.tile_m

      @pl.when(first_row < live_rows)
      def _compute():
        compute_tile(a_gmem, b_gmem, as_gmem, bs_gmem, m_idx, n_idx, epilogue)

      @pl.when((first_row >= live_rows) & (wg_idx < cfg.num_compute_wgs))
      def _zeros():
        row0, col0 = m_idx * cfg.tile_m + wg_origin[0], n_idx * cfg.tile_n + wg_origin[1]
        store_zero_subtiles(slots, cfg, cfg.epi_n(out_gmem.dtype), out_gmem.dtype,
                            _tile_store(out_gmem, row0, col0, cfg), slot_holds_zeros=after_dead)

    # With a cluster, the loop runs over pairs of tiles; the CTAs of a cluster take the two tiles of a pair. A tile
    # past M or N (odd tile counts) loads TMA zero fill and stores nothing: harmless.
    def pair(m_idx, n_idx, *after_dead):
      if cfg.cluster_dim == Dim.M:
        m_idx = 2 * m_idx + lax.axis_index("cluster")
      elif cfg.cluster_dim == Dim.N:
        n_idx = 2 * n_idx + lax.axis_index("cluster")
      tile(m_idx, n_idx, *after_dead)

    shape = _loop_shape(cfg, m_iters, n_iters)
    live_loop_rows = None
    if live_rows is not None:  # the loop rows holding a live row (pairs of row tiles with a cluster along M)
      rows_per_loop_row = cfg.tile_m * (2 if cfg.cluster_dim == Dim.M else 1)
      live_loop_rows = lax.div(live_rows + rows_per_loop_row - 1, jnp.int32(rows_per_loop_row))  # live_rows <= M
    tile_loop(cfg, shape, pair, live_loop_rows)

  warp_specialized(cfg, (a_gmem, b_gmem, as_gmem), slots_type, body, num_k_blocks=k // cfg.block_k,
                   num_n_blocks=pl.cdiv(n, cfg.block_n))


def _loop_shape(cfg: MosaicGemmConfig, m_iters: int, n_iters: int) -> tuple[int, int]:
  """The tile loop's (rows, columns): tile pairs along the cluster's dimension."""
  if cfg.cluster_dim == Dim.M:
    return pl.cdiv(m_iters, 2), n_iters
  if cfg.cluster_dim == Dim.N:
    return m_iters, pl.cdiv(n_iters, 2)
  return m_iters, n_iters


# ------------------------------------------------------------------------------------------------------ the launcher


def tma_rows_ok(rows: int) -> bool:
  """Whether a_q with this many rows is read as it is (else the launcher copies it into a padded buffer)."""
  return rows % TMA_ROW_TILE == 0 or rows < TMA_ROW_TILE


def shape_problems(n: int, k: int, block_k: int = BLOCK) -> list[str]:
  """What this kernel cannot do about a (N, K) weight in K blocks of block_k (empty: nothing). Any M >= 1 works."""
  problems = []
  if n % 8 or n == 0:
    problems.append(f"N={n} must be a positive multiple of 8 (the output rows' TMA stride)")
  if k % block_k or k == 0:
    problems.append(f"K={k} must be a positive multiple of {block_k}")
  return problems


def config_problems(config: MosaicGemmConfig, n: int, out_dtype, *, live_rows: bool = False) -> list[str]:
  """Why `config` cannot run an output of N columns in `out_dtype` (empty: it can); live_rows: with a live-row
  count."""
  problems = common_problems(config, n, out_dtype, config.smem_bytes(out_dtype))
  if config.epi_n(out_dtype) * jnp.dtype(out_dtype).itemsize > 128:
    problems.append(f"epi_tile_n={config.epi_tile_n} gives epilogue rows over 128 bytes for {jnp.dtype(out_dtype)}")
  if live_rows and not config.warp_specialized:
    problems.append("a live-row count needs a warp-specialized config (warp_specialized=True)")
  if config.live_grid:
    problems.append("live_grid loops over a grouped kernel's work items: the dense kernel has none (live_grid=False)")
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
    live_rows: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
  """C = a_q @ b_q.T, (1, gk) activation and (gn, gk) = (config.block_n, config.block_k) weight block scales.

  a_q (M, K) e4m3fn; b_q (N, K) e4m3fn; a_s_col (K // gk, M') float32 column-major, M' >= M, M' % 4 == 0;
  b_s (ceil(N / gn), K // gk) float32; bias (N,) float32 or out_dtype. Returns (M, N) out_dtype.
  out_rows: output only the first out_rows rows (M above is then out_rows): the rows of a_q past them are padding
  (e.g. the quantizer's zero rows up to a whole 64-row tile), read as they are instead of as TMA zero fill.
  live_rows: an int32 scalar (traced or not, clipped to [0, M]): the rows from it on come out 0 and their row tiles
  are not computed.
  config: a config with no `config_problems`; num_sms: CTAs of a persistent grid (the device's SM count).
  The caller validates shapes (`shape_problems`) and dtypes; this launcher only builds the kernel.
  """
  rows_read, k = a_q.shape
  n = b_q.shape[0]
  m = out_rows or rows_read
  out_dtype = jnp.dtype(out_dtype)
  a_q = pad_rows_for_tma(a_q, 0)
  m_iters, n_iters = pl.cdiv(m, config.tile_m), pl.cdiv(n, config.tile_n)
  out_type = jax.ShapeDtypeStruct((m, n), out_dtype)
  interpret_params: Any = plgpu.InterpretGPUParams() if interpret else None
  if bias is not None and n % config.sub_n:  # a sub-tile straddles N; the epilogue loads its bias whole
    bias = jnp.pad(bias, (0, n_iters * config.tile_n - n))  # zeros past N (columns TMA does not store)
  args = (a_q, b_q, a_s_col, b_s) + ((bias,) if bias is not None else ())

  if not config.warp_specialized:
    if live_rows is not None:
      raise ValueError("a live-row count needs a warp-specialized config (warp_specialized=True)")

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
    return f(*args)

  if live_rows is not None:
    args += (jnp.asarray(live_rows).astype(jnp.int32).reshape(1),)  # clipped in the kernel

  def ws_body(a_gmem, b_gmem, as_gmem, bs_gmem, *rest):
    bias_gmem = rest[0] if bias is not None else None
    live_gmem = rest[-2] if live_rows is not None else None
    _ws_kernel(a_gmem, b_gmem, as_gmem, bs_gmem, bias_gmem, live_gmem, rest[-1], cfg=config)

  cluster_size = 1 if config.cluster_dim is None else 2
  grid, grid_names = kernel_grid(config, _loop_shape(config, m_iters, n_iters), num_sms, per_cta=cluster_size)
  cluster_kwargs = {}
  if cluster_size > 1:
    cluster_kwargs = dict(cluster=(cluster_size,), cluster_names=("cluster",))
  f = plgpu.kernel(
      ws_body,
      out_type=out_type,
      grid=grid,
      grid_names=grid_names,
      **cluster_kwargs,
      num_threads=config.num_compute_wgs + 1,
      thread_name="wg",
      interpret=interpret_params,
  )
  return f(*args)


__all__ = ["BLOCK", "BLOCK_SIZES", "MAX_SUB_N", "WGMMA_M", "SMEM_BYTES", "TMA_ROW_TILE", "Dim", "MosaicGemmConfig",
           "block_fp8_matmul", "config_problems", "shape_problems", "tma_rows_ok", "epilogue_slot_bytes", "fit_smem"]
