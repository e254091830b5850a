"""The Mosaic GPU GEMM backend (Hopper): what it runs, its schedule heuristic, and its launch.

The schedule policy (`default_config`, `prefill_candidates` and the measured speeds they weigh) lives here, not in
the kernel file: the kernel (`pallas_kernels/gemm_mosaic.py`) builds any config it is given.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxfp8 import _checks, _platform
from jaxfp8.gemm import tables

if TYPE_CHECKING:
  from pallas_kernels.gemm_mosaic import MosaicGemmConfig

KERNEL_MODULE = "pallas_kernels.gemm_mosaic"
CONFIG_CLASS = "MosaicGemmConfig"
BLOCK = 128       # DeepSeek-V3's and Qwen3's scale block, the one the schedules below were measured on
# The block sizes the default dispatch sends to this kernel (and to the grouped one); the others run when named
# (implementation="mosaic") until they are timed against the kernels the dispatch gives them. Blocks of 64 on an H100
# (benchmarks/README.md, block sizes of 64), (64, 64) / (128, 64), us, Mosaic against Triton: M=1 N=7168 K=2048
# 9.66 / 9.52 and 9.65 / 9.57, M=64 N=24576 K=7168 72.0 / 78.0 and 71.2 / 77.8, M=256..4096 1.5-2.1x faster; grouped
# against XLA's, 50-510x faster.
DEFAULT_BLOCK_SIZES = ((BLOCK, BLOCK), (64, 64), (BLOCK, 64))
WGMMA_M = 64      # rows of one wgmma: the decode row tile
# Below one decode tile of rows, the linear's quantizer pads the activations to the whole tile, which the GEMM reads
# faster than it has TMA fill the missing rows with zeros (H200: 38.6 vs 43.4 us at M=16 N=7168 K=18432, 46.3 vs
# 54.7 us at M=16 N=24576 K=7168).
DECODE_ROWS = WGMMA_M


def _kernel():
  return importlib.import_module(KERNEL_MODULE)


def config_class():
  return _kernel().MosaicGemmConfig


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _fit_smem(config: MosaicGemmConfig, out_dtype, k: int) -> MosaicGemmConfig:
  """`config` with max_concurrent_steps lowered until it fits in shared memory (and to at most the K steps)."""
  return _kernel().fit_smem(config, k, lambda c: c.smem_bytes(out_dtype))


def _balance(num_tiles: int, num_ctas: int) -> float:
  """Fraction of CTA-tile slots doing work when num_tiles are spread over num_ctas persistent CTAs."""
  return num_tiles / (cdiv(num_tiles, num_ctas) * num_ctas)


def _row_fill(m: int, tile_m: int) -> float:
  """Fraction of the row tiles' rows that are real (the rest of the last row tile is TMA zero fill)."""
  return m / (cdiv(m, tile_m) * tile_m)


# Speed per unit of work of each prefill schedule relative to 128x256 tiles on two consumer warpgroups, at equal SM
# occupancy (H200, CUPTI; the sweeps listed in benchmarks/README.md, their files in git history):
# 192x128, 3 consumer WGs, CTA pairs sharing A: 1067 vs 1131 us at equal occupancy (M=4096 N=24576 K=7168), i.e.
# 1.06; taken as 1.09 because its partly empty last waves cost less than whole ones (M=4096 N=7168 K=18432, which
# the 1.06 rates level with 128x256: 824.5 vs 846.7 us).
_SPEED_THREE_WGS = 1.09
_SPEED_128X128_K2 = 1 / 1.03  # 128x128, 2 K blocks per step (1.5% slower per FLOP at M=4096, charged 3%)
# The same where the 128x256 tiles would all run in one wave: 110.2 vs 124.2 us for 128x256 at M=512 N=7168 K=18432
# (112 wide tiles; a second run: 111.0 vs 124.9), though both fill 85% of the slots. One 128x256 tile per
# CTA leaves nothing to overlap, and each of its warpgroups waits for one wgmma before promoting it, where two K
# blocks per step keep a second wgmma running through the promotion. Every choice this moved on 132 SMs over the
# shapes.json weights was timed after (benchmarks/README.md, the one-wave sweep): 1-12% faster at all ten.
_SPEED_128X128_K2_ONE_WAVE = 1.1
_SPEED_128X128 = 0.935  # 128x128, 1 K block per step (1174 vs 1256 TFLOP/s at M=4096 N=24576 K=7168)
_SPEED_64X128 = 0.8 * _SPEED_128X128  # 64x128 split in N (an estimate no sweep has contradicted)
_SPEED_COLUMNS = 0.77 * _SPEED_128X128  # 128x160 scaled per column, vs 128x128 tiles (M=512 N=10240 K=5120)


def prefill_candidates(m: int, n: int, num_sms: int, epi_tile_n: int | None = None, *, register_split: bool = True
                       ) -> list[tuple[float, MosaicGemmConfig]]:
  """The M > 64 schedules that apply to (m, n), each with its score: measured speed times SM occupancy (full waves
  of the persistent grid, real rows of the row tiles). `default_config` takes the best.

  register_split=False (`_jax_compat.register_split_kept`): the compiler ignores setmaxnreg, so only schedules whose
  consumers fit the launch's register share: two consumer warpgroups of 64x128 (two K blocks per step, promoted in
  64-column sub-tiles: 64 + 2 x 32 accumulator registers), or of 64x64. On the H200 under JAX 0.12 (libnvJitLink)
  128x128 tiles with one K block per step ran 1198.5, 903.8 and 301.7 us at M=4096 N=24576 K=7168, M=4096 N=7168
  K=18432 and M=1024 N=24576 K=7168, their speed with ptxas (1199.1, 910.2, 301.5), where the shipped schedules
  spilled and ran 1931.0, 2162.7 and 694.0 (1051.5, 806.0, 280.2 with ptxas; scripts/jax012_ab.sh). Two K blocks in
  64-column sub-tiles then ran 1244.5, 923.6 and 309.1 us against 1255.3, 953.7 and 308.6 for one (H100, one
  process each version; 0.11.2's schedules 1057.0, 806.5, 281.2)."""
  _K = _kernel()
  n_blocks = cdiv(n, BLOCK)  # 128-column tiles, the last one partial where N % 128
  wide_tiles = cdiv(m, 128) * n_blocks  # 128x128
  fill_128 = _row_fill(m, 128)
  # 64x128 tiles split in N (twice the 128x128 tiles): where those leave SMs idle, and without the register split
  narrow = (_SPEED_64X128 * _balance(cdiv(m, 64) * n_blocks, num_sms) * _row_fill(m, 64),
            _K.MosaicGemmConfig(tile_m=64, tile_n=128, max_concurrent_steps=8, num_compute_wgs=2, wg_split=_K.Dim.N,
                                epi_tile_n=epi_tile_n))
  if not register_split:
    return [(_SPEED_128X128 * _balance(wide_tiles, num_sms) * fill_128, _K.MosaicGemmConfig(
        tile_m=128, tile_n=128, max_concurrent_steps=3, k_blocks_per_step=2, num_compute_wgs=2, wg_split=_K.Dim.M,
        epi_tile_n=16, sub_tile_n=64)), narrow]
  scored: list[tuple[float, MosaicGemmConfig]] = []
  # 128x128 tiles, one 64x128 half per consumer warpgroup (DeepGEMM's shape), two K blocks per step (each
  # warpgroup's second wgmma overlaps the promotion of its first); three stages of 2 x 32 KiB leave room for
  # 16-column epilogue stores only. Half the 128x256 tile, so fewer wasted slots where those leave many of their last
  # wave empty (M=1024 N=10240 K=5120: 87.5 vs 102.1 us). Two K blocks beat one on all three weights timed (M=256:
  # 78.9 vs 84.3 us at N=24576 K=7168, 58.8 vs 65.5 at N=7168 K=18432, 35.3 vs 39.6 at N=10240 K=5120; M=128
  # likewise), reversing an earlier single M=256 reading (87.1 vs 84.8).
  two_block_config = _K.MosaicGemmConfig(
      tile_m=128, tile_n=128, max_concurrent_steps=3, k_blocks_per_step=2, num_compute_wgs=2, wg_split=_K.Dim.M,
      epi_tile_n=16)
  two_block_occupancy = _balance(wide_tiles, num_sms) * fill_128
  wider_tiles = cdiv(m, 128) * cdiv(n, 256)  # 128x256
  wider_balance = _balance(wider_tiles, num_sms) * fill_128
  if wider_balance >= 0.8:
    # 128x256 tiles, the two consumer warpgroups side by side in N (128x128 each), on a persistent grid: the fastest
    # two-warpgroup schedule at M >= 1024 (M=4096 N=24576 K=7168: 1256 TFLOP/s vs 1174 for 128x128 tiles; N=7168
    # K=18432: 1275 vs 1163), where its tiles fill at least 80% of the SMs' slots (M=256 N=24576: 192 tiles, lost).
    scored.append((wider_balance, _K.MosaicGemmConfig(
        tile_m=128, tile_n=256, max_concurrent_steps=4, num_compute_wgs=2, wg_split=_K.Dim.N, epi_tile_n=epi_tile_n)))
    speed = _SPEED_128X128_K2_ONE_WAVE if wider_tiles <= num_sms else _SPEED_128X128_K2
    scored.append((speed * two_block_occupancy, two_block_config))
  else:
    # When the 128x128 tiles leave SMs idle too: the narrow tiles.
    scored.append((_SPEED_128X128_K2 * two_block_occupancy, two_block_config))
    scored.append(narrow)
    # 160-wide tiles (scaled per column) where 160 divides N: M=256 N=10240 K=5120 (Qwen3-32B qkv) in 128 tiles of
    # 128x160 ran 32.7 us, vs 44.9 for 320 tiles of 64x128. Other widths measured slower than 128.
    if n % 160 == 0:
      scored.append((_SPEED_COLUMNS * _balance(cdiv(m, 128) * (n // 160), num_sms) * fill_128, _K.MosaicGemmConfig(
          tile_m=128, tile_n=160, max_concurrent_steps=2, k_blocks_per_step=2, num_compute_wgs=2, wg_split=_K.Dim.M,
          epi_tile_n=epi_tile_n)))
  # Three consumer warpgroups of 64x128 on 192x128 tiles, CTA pairs that share their A tile (TMA multicast) and a
  # 16-wide tile order: the third warpgroup's wgmmas keep the tensor cores busy while the other two wait for theirs
  # and promote. Fastest wherever its 192-row tiles waste few rows (M=2048 and 4096: 1313-1368 TFLOP/s,
  # 2-8% ahead of 128x256; M=1024, where 11% of the rows are padding: 1-7% behind).
  pairs = cdiv(m, 192) * cdiv(n_blocks, 2)
  pair_fill = n_blocks / (2 * cdiv(n_blocks, 2))  # an odd tile count leaves one CTA of a pair idle
  scored.append((_SPEED_THREE_WGS * _balance(pairs, max(num_sms // 2, 1)) * _row_fill(m, 192) * pair_fill,
                 _K.MosaicGemmConfig(tile_m=192, tile_n=128, max_concurrent_steps=4, num_compute_wgs=3,
                                  cluster_dim=_K.Dim.N, grid_tile_width=16, epi_tile_n=epi_tile_n)))
  return scored


# Per device, the schedules measured fastest at given (N, K, M) where the heuristic's lost by more than 2%: data, as
# the sweeps that found them wrote it (jaxfp8/gemm/configs/, each table's "source" says how), each serving the M
# with as many 64-row tiles (`m_bucket`). A device without a table takes the heuristic, whose speeds come from the
# H200 sweeps.
MEASURED_TABLES = ("mosaic_gemm_h100.json",)  # each file says its "device" and "num_sms"


def m_bucket(m: int) -> int:
  """The rows a measured entry at m serves up to: the M with as many 64-row tiles as m. Wider buckets carried a
  schedule where it lost (H100: the 128x256 tiles measured fastest at M=4096 N=7168 K=2048, 103.4 us against 109.6,
  ran 87.0 at M=3000 where the heuristic's took 76.7)."""
  return cdiv(max(m, 1), WGMMA_M) * WGMMA_M


def measured_entry(m: int, n: int, k: int, device_kind: str | None, num_sms: int) -> tuple[str, int, dict] | None:
  """(table name, measured M, entry) of the measured table of `device_kind` for (N, K) at an M of m's bucket; a
  table serves only the SM count it was measured on (an H100 PCIe or a MIG slice has other waves)."""
  for name in MEASURED_TABLES:
    table = tables.load(name)
    if table and tables.applies(device_kind, table) and table.get("num_sms") == num_sms:
      for key, entry in table["entries"].items():
        e_n, e_k, e_m = (int(x) for x in key.split(","))
        if (e_n, e_k) == (n, k) and m_bucket(e_m) == m_bucket(m):
          return name, e_m, entry
  return None


def entry_config(entry: dict) -> MosaicGemmConfig:
  """The MosaicGemmConfig of a measured entry (Dim fields by name)."""
  _K = _kernel()
  fields = {key: (_K.Dim[value] if key in ("wg_split", "grid_minor_dim", "cluster_dim") and value is not None
                  else value) for key, value in entry["config"].items()}
  return _K.MosaicGemmConfig(**fields)


def default_config(m: int, n: int, k: int, out_dtype=jnp.bfloat16, *, num_sms: int,
                   register_split: bool = True, device_kind: str | None = None) -> MosaicGemmConfig:
  """The schedule for a_q of m rows (padding rows count: they cost what real ones do, unlike TMA's zero fill of rows
  past a_q): the device's measured entry for (N, K) at m's 64-row tiles (`measured_entry`; with the register split only:
  the entries were measured with it), else the heuristic from the H200 sweeps of the Mosaic GEMM's configs
  (benchmarks/README.md). register_split: whether the compiler keeps setmaxnreg (`prefill_candidates`; the decode
  schedules have one consumer and need no split)."""
  if register_split and (found := measured_entry(m, n, k, device_kind, num_sms)) is not None:
    return _fit_smem(entry_config(found[2]), out_dtype, k)
  _K = _kernel()
  epi_tile_n = None  # 128-byte epilogue rows: two 8 KiB slots per consumer warpgroup
  if m <= WGMMA_M:
    # Decode: a single 64-row tile (mostly TMA zero fill; the tensor cores have time to spare) and one consumer
    # warpgroup, one CTA per tile. Two K blocks per pipeline step, 4 deep: measured the fastest decode schedule at
    # M = 1..64 for N=24576 K=7168 (M=64: 47.2 us, 1.15x the weight-streaming floor, vs 50.0 us for 8 one-block
    # steps on a persistent grid) and level with it for N=7168 K=2048. 128-wide column tiles (they re-read the
    # activations from L2 half as often) when there are at least half as many of them as SMs, else 64-wide tiles for
    # twice the CTAs. Except at M <= 16, where 128-wide tiles won at every N measured (N=7168 K=18432 M=16: 45.2 us
    # vs 52.8 for 64-wide; N=7168 K=2048 M=1), though at M=64 they lost on that shape
    # (38.9 vs 36.0 us). Those small-M runs had TMA fill the rows past M, which costs more than reading real rows
    # (128-wide tiles load the A tile half as often); jaxfp8.linear hands over 64-row buffers instead, and
    # block_fp8_matmul chooses by the rows it reads, so they get the M=64 choice.
    tile_n = 128 if m <= 16 or n // 128 >= num_sms // 2 else 64
  elif m <= 2 * WGMMA_M and ((decode_ctas := cdiv(m, WGMMA_M) * cdiv(n, 128)) <= num_sms
                             or _balance(decode_ctas, num_sms) >= 0.8):
    # M = 65..128: the decode schedule over two 64-row tiles still streams the weight faster than any two-warpgroup
    # tile can compute it, where its CTAs (one per 64x128 tile) fill most of a wave (M=128: N=7168
    # K=18432, 112 CTAs: 40.2 us, the best two-warpgroup schedule 51.2; N=24576 K=7168, 384 CTAs: 56.2 vs 57.6 for
    # 128x128 tiles with two K blocks per step). N=10240 gives 160 CTAs, a second wave of 28: 25.1 us vs 20.4 for
    # those 128x128 tiles, so it goes to the scored schedules. Within one wave it wins however few its CTAs, with
    # 64-wide column tiles while those too fit one wave (H100 sweep at M=100: N=1536 K=7168 11.5 us on 64x64 tiles
    # against 21.2 for the scored schedule, N=4096 K=7168 14.9 vs 22.0; N=5120 K=8192 on 64x128 19.5 vs 24.6).
    tile_n = 64 if decode_ctas < num_sms // 2 else 128
  else:
    tile_n = None  # the scored prefill schedules
  if tile_n is None:
    candidates = prefill_candidates(m, n, num_sms, epi_tile_n, register_split=register_split)
    config = max(candidates, key=lambda sc: sc[0])[1]  # the first of equals
  else:
    config = _K.MosaicGemmConfig(
        tile_m=WGMMA_M, tile_n=tile_n, max_concurrent_steps=4, k_blocks_per_step=2, num_compute_wgs=1,
        persistent=False, epi_tile_n=epi_tile_n, weight_scales_ahead=True,
    )
  return _fit_smem(config, out_dtype, k)




# ---- the backend interface the planner asks -------------------------------------------------------------------------

def unavailable(device: _platform.Device, interpret: bool) -> str | None:
  return _platform.unavailable_reason("the Mosaic GPU GEMM", device, interpret, hopper=True, module=KERNEL_MODULE)


# With N % 128, below this many 128x128 output tiles the Triton kernel is the faster one. H200, DeepSeek-V3 at K=7168
# (us, Mosaic / Triton): N=576 M=512 (20 tiles) 20.5 / 14.7, M=1024 (40) 21.0 / 24.1; N=2112 M=256 (34) 21.0 / 19.9,
# M=512 (68) 22.7 / 31.1 (benchmarks/README.md, column tails). Few tiles leave the Mosaic schedules few CTAs: N=576
# has 5 columns of them.
COLUMN_TAIL_MIN_TILES = 40


def not_default(problem) -> str | None:
  """Why the default dispatch passes over this kernel for a problem it can run (None: it does not)."""
  if why := not_default_block_size(problem.block_size):
    return why
  if problem.n % BLOCK:
    tiles = cdiv(problem.m, 128) * cdiv(problem.n, BLOCK)
    if tiles < COLUMN_TAIL_MIN_TILES:
      return (f"N={problem.n} ends in a partial column tile and M={problem.m} makes {tiles} 128x128 tiles "
              f"(< {COLUMN_TAIL_MIN_TILES}), where the Triton kernel measured faster")
  return None


def block_size_problem(block_size) -> str | None:
  """Why the Mosaic kernels cannot take this (gn, gk) (None: they can; the kernel's BLOCK_SIZES)."""
  sizes = _kernel().BLOCK_SIZES
  if not all(b in sizes for b in block_size):
    return f"it implements block sizes of {' or '.join(map(str, sizes))}, got {tuple(block_size)}"
  return None


def not_default_block_size(block_size) -> str | None:
  """Why the default dispatch passes over the Mosaic kernels for this block size they can run (None: it does not)."""
  if tuple(block_size) not in DEFAULT_BLOCK_SIZES:
    return (f"block_size={tuple(block_size)} is not yet timed against the other kernels (run it with "
            "implementation='mosaic')")
  return None


def with_block_size(config, block_size):
  """config for a problem of this (gn, gk): its block fields set, and where its sub-tiles are wider than gn, the
  widest sub-tiles of at most gn columns that split the warpgroup's (gn itself where it does: one weight scale each,
  as the schedules had with 128-column blocks; else a width that meets at most two blocks, scaled per column). Any
  other config field is kept."""
  gn, gk = block_size
  if (config.block_n, config.block_k) == (gn, gk):
    return config
  sub_tile_n = config.sub_tile_n
  wg_n = config.wg_tile[1]
  if config.sub_n > gn:
    sub_tile_n = max(w for w in range(8, gn + 1, 8) if wg_n % w == 0 and _kernel().MAX_SUB_N % w == 0)
  return dataclasses.replace(config, block_n=gn, block_k=gk, sub_tile_n=sub_tile_n)


def unsupported(problem) -> str | None:
  if why := block_size_problem(problem.block_size):
    return why
  return "; ".join(_kernel().shape_problems(problem.n, problem.k, problem.block_size[1])) or None


def row_alignment(m: int) -> tuple[int, str]:
  """The padding of a_q's rows that this GEMM reads fastest, and why: below one decode tile, the whole tile; else a
  row count whose tiled TMA view exists, so that the launcher copies nothing."""
  if 0 < m < DECODE_ROWS:
    return DECODE_ROWS, (f"M={m} < {DECODE_ROWS}: one whole {DECODE_ROWS}-row decode tile, read faster than TMA's zero "
                         "fill of the missing rows")
  tile = _kernel().TMA_ROW_TILE
  if _kernel().tma_rows_ok(m):
    return 1, f"M={m} is read as it is (a multiple of {tile})"
  return tile, f"M={m} padded to a multiple of {tile}, the rows of the tiled TMA view of a_q (no copy of a_q)"


# With valid_rows, the row tiles past the count load nothing and run no wgmma (the kernel's live-row count).
SKIPS_DEAD_ROWS = True


@dataclasses.dataclass(frozen=True)
class LiveRowSchedules:
  """The schedules of a call with a traced live-row count: at run time the count selects the schedule a call of that
  many rows (rounded up to a whole 64-row tile) would get (`lax.switch` on a table lookup), so that a bucket with few
  live rows runs what the exact rows would. configs: the distinct schedules; table[i]: the index of the schedule of
  counts in (64 i, 64 (i + 1)] (count 0 takes table[0])."""
  configs: tuple[MosaicGemmConfig, ...]
  table: tuple[int, ...]

  def step(self, count):
    """The table index of a live-row count (a Python int or an int32 array, traced or not): a count below 1 or past
    the bucket takes the first or the last step (the kernel clips the count itself)."""
    return jnp.clip((jnp.maximum(count, 1) - 1) // WGMMA_M, 0, len(self.table) - 1)

  def ranges(self) -> list[tuple[int, int, MosaicGemmConfig]]:
    """(first count, last count, config) of each run of 64-row steps with one schedule."""
    runs: list[tuple[int, int, MosaicGemmConfig]] = []
    for i, index in enumerate(self.table):
      if runs and runs[-1][2] == self.configs[index]:
        runs[-1] = (runs[-1][0], (i + 1) * WGMMA_M, runs[-1][2])
      else:
        runs.append((i * WGMMA_M + 1, (i + 1) * WGMMA_M, self.configs[index]))
    return runs

  def __str__(self) -> str:
    return "LiveRowSchedules(" + "; ".join(f"live {lo}..{hi}: {config}" for lo, hi, config in self.ranges()) + ")"


def live_row_schedules(rows: int, n: int, k: int, out_dtype, num_sms: int, register_split: bool = True,
                       device_kind: str | None = None) -> LiveRowSchedules:
  """The default schedule of every whole number of 64-row tiles up to `rows`, each distinct one compiled once."""
  configs: list[MosaicGemmConfig] = []
  table = []
  for tiles in range(1, cdiv(rows, WGMMA_M) + 1):
    config = default_config(min(tiles * WGMMA_M, rows), n, k, out_dtype, num_sms=num_sms,
                            register_split=register_split, device_kind=device_kind)
    if config not in configs:
      configs.append(config)
    table.append(configs.index(config))
  return LiveRowSchedules(tuple(configs), tuple(table))


def register_split_kept() -> bool:
  return importlib.import_module("pallas_kernels._jax_compat").register_split_kept()


def default_config_for(problem, device: _platform.Device):
  split = register_split_kept()
  why_split = "" if split else ("; this JAX compiles Mosaic kernels without setmaxnreg (libnvJitLink), so the "
                                "schedules whose consumers fit the launch's registers")
  if problem.masked:
    schedules = live_row_schedules(problem.m, problem.n, problem.k, problem.out_dtype, device.num_sms, split,
                                   device.kind)
    return schedules, (f"valid_rows: {len(schedules.configs)} schedule(s) on {device.num_sms} SMs, the one the live "
                       "count's 64-row tiles would get chosen at run time; the row tiles past valid_rows are skipped"
                       + why_split)
  if split and (found := measured_entry(problem.rows, problem.n, problem.k, device.kind, device.num_sms)) is not None:
    name, measured_m, entry = found
    return _fit_smem(with_block_size(entry_config(entry), problem.block_size), problem.out_dtype, problem.k), (
        f"measured fastest on {device.describe()} at M={measured_m} (table {name}, taken for M in "
        f"{m_bucket(measured_m) - WGMMA_M + 1}..{m_bucket(measured_m)}): {entry['us']} us where the heuristic's "
        f"schedule took {entry['heuristic_us']}")
  config = default_config(problem.rows, problem.n, problem.k, problem.out_dtype, num_sms=device.num_sms,
                          register_split=split)
  kind = "decode" if problem.rows <= 2 * WGMMA_M and config.tile_m == WGMMA_M else "prefill"
  return with_block_size(config, problem.block_size), (
      f"the {kind} schedule for a_q of {problem.rows} rows on {device.num_sms} SMs{why_split}")


def config_problem(problem, config) -> str | None:
  config = with_block_size(config, problem.block_size)
  return "; ".join(_kernel().config_problems(config, problem.n, problem.out_dtype, live_rows=problem.masked)) or None


def _column_major_scales(a_s, problem):
  """a_s as the kernel reads it: column-major (K/128, M') with M' >= rows read and M' % 4 == 0 (TMA rows of 16
  bytes); a copy only where the caller's layout is not that already."""
  rows = problem.rows
  a_s_col = a_s if problem.a_s_column_major else a_s[:rows].T
  if a_s_col.shape[1] % 4:
    a_s_col = a_s_col[:, :rows]
    a_s_col = jnp.pad(a_s_col, ((0, 0), (0, _checks.round_up(rows, 4) - rows)), constant_values=1.0)
  return a_s_col


def launch(a_q, b_q, a_s, b_s, bias, problem, config, interpret: bool, device: _platform.Device, live_rows=None):
  interpret_kwargs = {"interpret": True} if interpret else {}
  return _kernel().block_fp8_matmul(
      a_q, b_q, _column_major_scales(a_s, problem), b_s, out_dtype=problem.out_dtype, bias=bias,
      config=with_block_size(config, problem.block_size),
      num_sms=device.num_sms, out_rows=problem.m if problem.m != problem.rows else None, live_rows=live_rows,
      **interpret_kwargs)


def launch_masked(a_q, b_q, a_s, b_s, bias, valid_rows, problem, config, interpret: bool, device: _platform.Device):
  """The first problem.m rows of C with the rows from valid_rows on zero; the row tiles past it are not computed
  and the bias is added to the live rows only, before the one cast (docs/CONTRACT.md §2). config: one config, or
  `LiveRowSchedules`, of which the count selects one."""
  if not isinstance(config, LiveRowSchedules):
    return launch(a_q, b_q, a_s, b_s, bias, problem, config, interpret, device, live_rows=valid_rows)
  branches = [lambda a_q, b_q, a_s, b_s, bias, count, c=c: launch(a_q, b_q, a_s, b_s, bias, problem, c, interpret,
                                                                  device, live_rows=count)
              for c in config.configs]
  if len(branches) == 1:
    return branches[0](a_q, b_q, a_s, b_s, bias, valid_rows)
  index = jnp.asarray(config.table, jnp.int32)[config.step(jnp.asarray(valid_rows, jnp.int32))]
  return jax.lax.switch(index, branches, a_q, b_q, a_s, b_s, bias, valid_rows)
